"""Fuse stage: pattern groups become one PrimFunc each; everything else gets TVM's normal fusion."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx

from .patterns import collect_rejections, fusion_patterns, stop_collecting

DEFAULT_FUSION = "default fusion"


@dataclass
class Fused:
    """The lowered module (Relax main calling PrimFuncs) and which pattern made each PrimFunc."""

    mod: tvm.IRModule
    kernel_patterns: dict[str, str]
    rejections: list[tuple[str, str, str]] = field(default_factory=list)

    def kernels(self) -> list[str]:
        """PrimFuncs the Relax `main` calls, in call order (what runs on the device)."""
        return called_prim_funcs(self.mod)

    def pattern_of(self, kernel: str) -> str:
        return self.kernel_patterns.get(kernel, DEFAULT_FUSION)


def lower(mod: tvm.IRModule, params: list | None = None, patterns: list | None = None) -> Fused:
    """Bind weights, fuse by pattern, legalize, fuse the rest, and merge each group into one PrimFunc."""
    if params:
        main = mod["main"]
        n_in = int(main.attrs["num_input"])
        names = [p.name for p in main.params[n_in:]]
        mod = relax.transform.BindParams("main", dict(zip(names, params)))(mod)
    patterns = fusion_patterns() if patterns is None else patterns
    rejections, token = collect_rejections()
    try:
        mod = relax.transform.FuseOpsByPattern(patterns, bind_constants=False, annotate_codegen=False)(mod)
    finally:
        stop_collecting(token)
    composite = {gv.name_hint: str(fn.attrs["Composite"]) for gv, fn in mod.functions.items()
                 if isinstance(fn, relax.Function) and fn.attrs and "Composite" in fn.attrs}
    mod = tvm.transform.Sequential([
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ])(mod)
    kernels = set(called_prim_funcs(mod))
    return Fused(mod, {k: v for k, v in composite.items() if k in kernels}, list(dict.fromkeys(rejections)))


def called_prim_funcs(mod: tvm.IRModule) -> list[str]:
    """Names of the PrimFuncs reached by call_tir from `main`, in order of first call."""
    return list(_kernel_calls(mod))


def symbolic_kernels(mod: tvm.IRModule) -> set[str]:
    """Kernels called with any symbolic dimension: MetaSchedule cannot tune them."""
    return {name for name, calls in _kernel_calls(mod).items()
            if not all(_is_static(a.ty) for call in calls for a in list(call.args[1]) + [call])}


def _is_static(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return all(_is_static(f) for f in ty.fields)
    shape = getattr(ty, "shape", None)
    return shape is None or all(isinstance(d, tirx.IntImm) for d in shape)


def _kernel_calls(mod: tvm.IRModule) -> dict[str, list[relax.Call]]:
    prim = {gv.name_hint for gv, fn in mod.functions.items() if isinstance(fn, tirx.PrimFunc)}
    calls: dict[str, list[relax.Call]] = {}

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.args and isinstance(expr.args[0], relax.GlobalVar) \
                and expr.args[0].name_hint in prim:
            calls.setdefault(expr.args[0].name_hint, []).append(expr)

    relax.analysis.post_order_visit(mod["main"], visit)
    return calls
