"""Everything CPU-side for one (model, case) of bench/models.py: ONNX export, the product build, and the TVM builds
to compare with. Runs in a worker process (no GPU needed with --trials 0) or in-process; returns a JSON-able dict."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time


@contextlib.contextmanager
def spying(modules: dict, seen: dict):
    """Watch {module: names}: the prepare stage's to_compute_dtype (keep the first result: the module after import,
    binding and precision), the pipeline's compile_module (keep the first input: the scheduled module of the
    export) and tune (time it)."""
    names = [(m, n) for m, ns in modules.items() for n in ns]
    orig = {(m, n): getattr(m, n) for m, n in names}

    def wrap(name, fn):
        def spy(*a, **k):
            t = time.time()
            try:
                out = fn(*a, **k)
            finally:
                seen[f"{name}_s"] = seen.get(f"{name}_s", 0.0) + time.time() - t
            seen.setdefault(name, a[0] if name == "compile_module" else out)
            return out
        return spy
    for m, n in names:
        setattr(m, n, wrap(n, orig[m, n]))
    try:
        yield seen
    finally:
        for m, n in names:
            setattr(m, n, orig[m, n])


DEPENDENT_LAUNCH = "dependent_launch"  # a name `without_templates` takes for the kernels' dependent launch
GENERIC_WAITS = "generic_waits"  # one for the generic kernels' waits (the TIRx kernels keep theirs)
EARLY_WEIGHTS = "early_weights"  # one for the GEMMs' weight loads before their wait (off by default: see models.py)
SMALLM_RING = "smallm_ring"  # one for the small-M GEMMs' weight ring (off by default: see models.py)
SMALLM_BULK = "smallm_bulk"  # one for that ring filled by bulk copies (off by default: not measured in a model)
SMALLM_M1 = "smallm_m1"  # one for M = 1 GEMMs on the small-M kernel (on by default; off: the GEMV schedule)
WGMMA_WAITS = "wgmma_waits"  # one for the wgmma GEMMs' dependent launch (off by default: after the one before)
MERGE_SIBLINGS = "merge_siblings"  # one for every sibling group merged (off by default: the estimate decides)
SPLIT_READS = "split_reads"  # one for the attention reading Q, K and V where a split would cut them (on by default)
UNTUNED = "untuned"  # the case built again with --trials 0 (its own empty tuning database, the schedules library)
SWITCHES = (DEPENDENT_LAUNCH, GENERIC_WAITS, EARLY_WEIGHTS, SMALLM_RING, SMALLM_BULK, SMALLM_M1, WGMMA_WAITS,
            MERGE_SIBLINGS, SPLIT_READS, UNTUNED)


def off_by_default() -> dict[str, tuple[str, str]]:
    """The kernel switches that are off by default, NAME -> (environment switch, its value when on): `--before NAME`
    turns one on for the measured build (bench/models.py), `without_templates` off for the before build."""
    from tvmfuse.kernels.dependent_launch import EARLY_WEIGHTS_SWITCH, WGMMA_SWITCH
    from tvmfuse.kernels.hopper.mma_smallm import BULK_SWITCH, RING_SWITCH
    from tvmfuse.kernels.hopper.select import MERGE_SWITCH

    return {EARLY_WEIGHTS: (EARLY_WEIGHTS_SWITCH, "1"), SMALLM_RING: (RING_SWITCH, "4"),
            SMALLM_BULK: (BULK_SWITCH, "4"),
            MERGE_SIBLINGS: (MERGE_SWITCH, "1"), WGMMA_WAITS: (WGMMA_SWITCH, "1")}


def on_by_default() -> dict[str, str]:
    """The kernel switches that are on by default, NAME -> environment switch: `without_templates` sets it to 0 for
    the before build (`--before NAME`: with it, as built by default, and without)."""
    from tvmfuse.kernels.hopper.mma_smallm import M1_SWITCH
    from tvmfuse.kernels.split_reads import SWITCH

    return {SMALLM_M1: M1_SWITCH, SPLIT_READS: SWITCH}


def unknown_names(names) -> list[str]:
    """The names `without_templates` does not know (neither a template of the table nor one of SWITCHES)."""
    from tvmfuse.kernels.table import TABLE

    known = {t.name for entry in TABLE.values() for t in entry.templates} | set(SWITCHES)
    return [n for n in names if n not in known]


@contextlib.contextmanager
def without_templates(names: tuple[str, ...]):
    """The template table without the templates `names` (by Template.name) while the block runs: the build falls back to
    the next template or the generic kernel, as a target without them would (a before/after pair in one run:
    `bench/models.py --without-templates attention_prefill_wgmma`). DEPENDENT_LAUNCH among them: the kernels are built
    without programmatic dependent launch (`bench/models.py --before dependent_launch`: with and without it from one
    export); GENERIC_WAITS: only the TIRx kernels wait (where the dependent launch pays); EARLY_WEIGHTS: no GEMM loads
    its weights before its wait (`bench/models.py --before early_weights` turns them on for the other build);
    SMALLM_RING: no small-M GEMM takes a weight ring (`--before smallm_ring`), SMALLM_BULK nor one of bulk copies
    (`--before smallm_bulk`); SMALLM_M1: M = 1 GEMMs keep the GEMV
    schedule (`--before smallm_m1`); WGMMA_WAITS: the wgmma GEMMs launch after the kernel before them, as by default
    (`--before wgmma_waits` launches them dependent in the other build); MERGE_SIBLINGS: sibling projections merge
    only where the estimate says so (`--before merge_siblings`); SPLIT_READS: every split launched (`--before
    split_reads`)."""
    from tvmfuse.build import dependent_launch as launch_pass
    from tvmfuse.kernels.dependent_launch import dependent_launch_off, switched_off
    from tvmfuse.kernels.table import TABLE

    saved, generic = dict(TABLE), launch_pass.GENERIC_WAITS
    for key, entry in saved.items():
        TABLE[key] = dataclasses.replace(entry, templates=tuple(t for t in entry.templates if t.name not in names))
    launch_pass.GENERIC_WAITS = generic and GENERIC_WAITS not in names
    try:
        with dependent_launch_off(DEPENDENT_LAUNCH in names), contextlib.ExitStack() as switches:
            for name, (switch, _) in off_by_default().items():
                switches.enter_context(switched_off(switch, name in names))
            for name, switch in on_by_default().items():
                switches.enter_context(switched_off(switch, name in names))
            yield
    finally:
        TABLE.update(saved)
        launch_pass.GENERIC_WAITS = generic


def case_dir(name: str, case: str, dtype: str) -> str:
    """The work folder (and job name) of one build: `llama-prefill_512` for fp16 and fp32 (the names before bf16
    rows existed), `llama-prefill_512-bf16` for bf16."""
    return f"{name}-{case}" + ("-bf16" if dtype == "bfloat16" else "")


def _main_dtypes(mod) -> list[str]:
    return [str(p.ty.dtype) for p in mod["main"].params]


def _export(executable, path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    executable.export_library(path)
    return path


def prepare(name: str, case: str, opts: dict, dtypes: list[str]) -> dict:
    """Export the case to ONNX once and build it in each of `dtypes` (`build`): {dtype: build info}; the dtypes
    share the export (the same fp32 file: half the CPU time of a two-dtype run)."""
    import torch

    from bench import hf_models as hm

    torch.set_grad_enabled(False)
    t0 = time.time()
    model = hm.build(name, opts["smoke"])
    s = hm.shapes(name, case, model, opts["smoke"])
    feeds = hm.inputs(name, model, s)
    path = os.path.join(opts["work"], f"{name}-{case}-onnx", f"{name}_{case}.onnx")
    hm.export(hm.wrap(model, case), feeds, path)
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    del model
    export_s = round(time.time() - t0, 1)
    try:
        return {d: build(name, case, dict(opts, dtype=d), path, {"param_checksum": checksum, "export_s": export_s})
                for d in dtypes}
    finally:
        os.remove(path)  # ONNX files of these models are 0.4-0.8 GB each


def build(name: str, case: str, opts: dict, path: str, exported: dict) -> dict:
    """Run the product (`pipeline.run_job`) on the exported `path` in `opts["dtype"]`, and write the libraries to
    measure: tvmfuse (run_job's export), tvmfuse + CUDA graph (`opts["graph"]`), the product without the templates
    `opts["before"]` names (`tvmfuse_before`: with a CUDA graph where tvmfuse_cuda_graph has one), TVM default
    (`opts["default"]`)."""
    from tvmfuse.build import compile_module
    from tvmfuse.fuse.fusion import launches, lower
    from tvmfuse.spaces import apply_default_schedules
    from tvmfuse.targets import resolve_target

    t0 = time.time()
    info: dict = {"model": name, "case": case, "dtype": opts["dtype"], **exported}
    folder = os.path.join(opts["work"], case_dir(name, case, opts["dtype"]))
    target = resolve_target(opts["target"])
    tv, mod, seen = _product(name, case, opts, path, folder, target, tuple(opts.get("without_templates", ())))
    info["tvmfuse"] = tv
    if opts["graph"]:
        info["tvmfuse_cuda_graph"] = _graph_build(mod, target, tv, os.path.join(folder, "cuda_graph.so"))
    if opts.get("before"):  # the same export built again without these templates: the "before" of the pair
        left_out = tuple(opts.get("without_templates", ())) + tuple(n for n in opts["before"] if n != UNTUNED)
        before_opts = opts if UNTUNED not in opts["before"] else dict(  # --trials 0, as a user's build without tuning
            opts, trials=0, logs=os.path.join(folder, "before", "logs"))
        before, before_mod, _ = _product(name, case, before_opts, path, os.path.join(folder, "before"), target,
                                         left_out)
        if opts["graph"]:  # measure its CUDA-graph library, as tvmfuse_cuda_graph (compiled as it was built)
            with without_templates(left_out):
                graph = _graph_build(before_mod, target, before, os.path.join(folder, "before", "cuda_graph.so"))
            before.update(library=graph["library"], graph_captures=graph["graph_captures"])
            before.pop("export", None)
        info["tvmfuse_before"] = dict(before, without_templates=list(left_out),
                                      changed_kernels=changed_kernels(tv, before))
    if opts["default"]:  # stock TVM on run_job's own import and precision conversion: no patterns, dlight
        if "to_compute_dtype" not in seen:
            raise RuntimeError("run_job no longer calls prepare.to_compute_dtype: bench/model_builds.py needs updating")
        t = time.time()
        stock = lower(seen["to_compute_dtype"], patterns=[])
        scheduled = apply_default_schedules(stock.mod, target, stock=True)
        info["tvm_default"] = {
            "library": _export(compile_module(scheduled, target), os.path.join(folder, "tvm_default.so")),
            "main_dtypes": _main_dtypes(scheduled), "kernels": len(stock.kernels()), "launches": launches(stock.mod),
            "build_s": round(time.time() - t, 1), "same_import_as": "tvmfuse (run_job's precision output)"}
    info["prepare_s"] = round(time.time() - t0, 1)
    return info


def changed_kernels(after: dict, before: dict) -> list[str]:
    """The kernels of two product builds (their manifests' `schedules`) whose schedule or kernel differ, or that one
    of them lacks: what a tuned build changed against an untuned one (`--before untuned`)."""
    a, b = after.get("schedules", {}), before.get("schedules", {})
    pick = lambda s: s and (s["schedule"], s.get("kernel"))  # noqa: E731
    return sorted(k for k in set(a) | set(b) if pick(a.get(k)) != pick(b.get(k)))


def _product(name: str, case: str, opts: dict, path: str, folder: str, target, left_out: tuple) -> tuple:
    """One `pipeline.run_job` build without the templates `left_out`: (its row's build info, the module it compiled,
    what the spies saw). Its tuning database is `opts["logs"]`, else the work folder's `logs`."""
    from tvmfuse import pipeline, prepare
    from tvmfuse.build import compile_module
    from tvmfuse.fuse.fusion import called_prim_funcs, launches
    from tvmfuse.jobs import Job

    extra = {"io_dtype": opts["dtype"]} if "io_dtype" in {f.name for f in dataclasses.fields(Job)} else {}
    job = Job(case_dir(name, case, opts["dtype"]), path, {}, opts["trials"], opts["dtype"], **extra)
    lines: list[str] = []
    t = time.time()
    with spying({prepare: ("to_compute_dtype",), pipeline: ("compile_module", "tune")}, {}) as seen, \
            without_templates(left_out):
        result = pipeline.run_job(job, target, os.path.join(folder, "export"),
                                  opts.get("logs") or os.path.join(opts["work"], "logs"), say=lines.append)
    if "compile_module" not in seen:
        raise RuntimeError(f"run_job built nothing: {result.error}\n" + "\n".join(lines[-20:]))
    mod = seen["compile_module"]
    manifest = result.details if result.ok else {}
    tv = {"build_s": round(time.time() - t, 1), "tune_s": round(seen.get("tune_s", 0.0), 1),
          "trials": opts["trials"], "job_io_dtype": extra.get("io_dtype", "Job has no io_dtype: fp32 interface"),
          "run_job_ok": result.ok, "run_job_error": result.error, "verification_vs_onnxruntime": result.verification,
          "kernels": len(called_prim_funcs(mod)), "launches": launches(mod), "fused": result.fused,
          "tuned": result.tuned, "main_dtypes": _main_dtypes(mod),
          "patterns": dict(collections.Counter(k["pattern"] for k in manifest.get("kernels", []))),
          "schedules": {k["name"]: {"schedule": k["schedule"], "trials": k["trials"], "best_us": k["best_us"],
                                    "kernel": k.get("kernel")} for k in manifest.get("kernels", [])},
          "templates": [ln.split("] ", 1)[-1] for ln in lines if ": template " in ln or ": generic" in ln
                        or ": wgmma " in ln or ": mma.sync small-M " in ln]}
    if result.ok:
        tv["export"] = result.output
    else:  # measure what it built anyway; the row says why run_job failed
        tv["library"] = _export(compile_module(mod, target), os.path.join(folder, "tvmfuse.so"))
    return tv, mod, seen


def _graph_build(mod, target, tv: dict, path: str) -> dict:
    """`mod` compiled with CUDA graphs to `path`: the CUDA-graph contender's build info."""
    from tvmfuse.build import compile_module

    t = time.time()
    ex = compile_module(mod, target, cuda_graph=True)
    return {"library": _export(ex, path), "main_dtypes": tv["main_dtypes"],
            "graph_captures": ex.as_text().count("call  vm.builtin.cuda_graph.run_or_capture"),
            "build_s": round(time.time() - t, 1),
            "product": {k: tv[k] for k in PRODUCT_KEYS if k in tv}}  # the run_job build it compiles again


#: what the CUDA-graph contender's row repeats of the product build it compiles (its tuning and kernel choices)
PRODUCT_KEYS = ("build_s", "tune_s", "trials", "tuned", "kernels", "launches", "verification_vs_onnxruntime",
                "templates", "schedules")

