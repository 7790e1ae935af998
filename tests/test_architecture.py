"""The package's shape: no import cycles among tvmfuse's modules (imports inside functions included), each stage
imports only earlier stages (never the pipeline or the CLI), and tvmfuse/ holds at most a dozen flat modules."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tvmfuse")

#: the stages in data-flow order; a module may import its own package, any earlier one and the shared modules
ORDER = ["frontend", "prepare", "patterns", "decide", "fuse", "kernels", "spaces", "tune", "build", "verify",
         "export", "jobs", "pipeline", "cli"]
#: used by every stage; import no stage
SHARED = {"errors", "targets", "version", "inspect_cache", "isolation", "records", "quiet"}
ENTRY = {"", "__main__"}  # `tvmfuse` itself (tvmfuse.load) and `python -m tvmfuse`: they may import anything


def _modules() -> dict[str, str]:
    mods = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = "tvmfuse." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the tvmfuse modules it imports anywhere in its body (functions too), each import resolved to the
    module it names (`from pkg import sub` -> pkg.sub when sub is a module, else pkg)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target.startswith("tvmfuse") and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _stage(mod: str) -> str:
    return mod.split(".")[1] if "." in mod else ""


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], f"import cycles (imports inside functions counted): {found}"


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import():
    graph = import_graph()
    graph["tvmfuse.frontend.importer"] = graph["tvmfuse.frontend.importer"] | {"tvmfuse.pipeline"}
    assert any("tvmfuse.pipeline" in c and "tvmfuse.frontend.importer" in c for c in cycles(graph))


def test_each_stage_imports_only_earlier_stages():
    wrong = []
    for mod, deps in import_graph().items():
        stage = _stage(mod)
        if stage in ENTRY:
            continue
        for dep in deps:
            other = _stage(dep)
            if not other or other == stage or other in SHARED:
                continue
            if stage in SHARED or stage not in ORDER or other not in ORDER or ORDER.index(other) > ORDER.index(stage):
                wrong.append(f"{mod} -> {dep}")
    assert wrong == [], "imports of a later stage (or from a shared module into a stage): " + "; ".join(sorted(wrong))


def test_every_package_is_a_known_stage():
    packages = {d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))}
    flat = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py") and f != "__init__.py"}
    assert packages | flat <= set(ORDER) | SHARED | {"__main__"}, sorted((packages | flat) - set(ORDER) - SHARED)
    assert len(flat) + 1 <= 12, f"{len(flat) + 1} flat modules in tvmfuse/: {sorted(flat)}"


@pytest.mark.parametrize("package", sorted(set(ORDER) - {"jobs", "pipeline"}))
def test_each_stage_package_says_what_it_does(package):
    path = os.path.join(ROOT, package, "__init__.py")
    doc = ast.get_docstring(ast.parse(open(path, encoding="utf-8").read()))
    assert doc and len(doc) > 40, f"tvmfuse/{package}/__init__.py needs a docstring saying what the stage does"


def test_no_package_hides_a_submodule_behind_a_name():
    """`from .x import x` in a package's __init__ rebinds `pkg.x` to the function: `import pkg.x as m` then gets
    the function, and monkeypatching the module misses (kernels.substitute was one)."""
    hidden = []
    for folder, dirs, files in os.walk(ROOT):
        if "__init__.py" not in files:
            continue
        subs = {f[:-3] for f in files if f.endswith(".py")} | {d for d in dirs if os.path.isfile(
            os.path.join(folder, d, "__init__.py"))}
        tree = ast.parse(open(os.path.join(folder, "__init__.py"), encoding="utf-8").read())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    name = alias.asname or alias.name
                    if name in subs and not node.module.endswith("." + name):
                        hidden.append(f"{os.path.relpath(folder, ROOT)}: {name} (from {node.module})")
    assert hidden == [], hidden
