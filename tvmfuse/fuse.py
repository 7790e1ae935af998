"""Fuse stage: pattern groups become one PrimFunc each; everything else gets TVM's normal fusion."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx

from .decide import Plan, decide
from .patterns import Recorder, fusion_patterns, start, stop

DEFAULT_FUSION = "default fusion"


@dataclass
class Fused:
    """The lowered module (Relax main calling PrimFuncs) and which pattern made each PrimFunc."""

    mod: tvm.IRModule
    kernel_patterns: dict[str, str]
    rejections: list[tuple[str, str, str]] = field(default_factory=list)
    plan: Plan | None = None
    kernel_candidates: dict[str, str] = field(default_factory=dict)  # kernel -> "pattern@root"

    def kernels(self) -> list[str]:
        """PrimFuncs the Relax `main` calls, in call order (what runs on the device)."""
        return called_prim_funcs(self.mod)

    def pattern_of(self, kernel: str) -> str:
        return self.kernel_patterns.get(kernel, DEFAULT_FUSION)


def bind_params(mod: tvm.IRModule, params: list | None) -> tvm.IRModule:
    """Bind the detached weights back as constants (kept out of fused functions: bind_constants=False)."""
    if not params:
        return mod
    main = mod["main"]
    names = [p.name for p in main.params[int(main.attrs["num_input"]):]]
    return relax.transform.BindParams("main", dict(zip(names, params)))(mod)


def lower(mod: tvm.IRModule, params: list | None = None, patterns: list | None = None,
          plan: Plan | None = None, target=None) -> Fused:
    """Fuse the candidates the decide stage kept (deciding here when no plan is given), legalize,
    fuse the rest with TVM's FuseOps, and merge each group into one PrimFunc. `patterns=[]`: stock TVM."""
    mod = bind_params(mod, params)
    patterns = fusion_patterns() if patterns is None else patterns
    if plan is None and patterns:
        plan = decide(mod, target, patterns=patterns)
    rec = Recorder(chosen=plan.chosen() if plan is not None else None)
    token = start(rec)
    try:
        mod = relax.transform.FuseOpsByPattern(patterns, bind_constants=False, annotate_codegen=False)(mod)
    finally:
        stop(token)
    composite, candidate = {}, {}
    for gv, fn in mod.functions.items():
        if isinstance(fn, relax.Function) and fn.attrs and "Composite" in fn.attrs:
            composite[gv.name_hint] = str(fn.attrs["Composite"])
            if "tvmfuse.candidate" in fn.attrs:
                candidate[gv.name_hint] = str(fn.attrs["tvmfuse.candidate"])
    mod = tvm.transform.Sequential([
        inline_shape_params,
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ])(mod)
    kernels = set(called_prim_funcs(mod))
    rejections = ([(c.match.pattern, c.match.root, c.reason) for c in plan.candidates if c.decision != "kept"]
                  if plan is not None else list(dict.fromkeys(rec.rejections)))
    return Fused(mod, {k: v for k, v in composite.items() if k in kernels}, rejections, plan,
                 {k: v for k, v in candidate.items() if k in kernels})


@tvm.transform.module_pass(opt_level=0, name="InlineShapeParams")
def inline_shape_params(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
    """A reshape's target shape lifted into a fused function's params (FuseOpsByPattern does that) is put
    back inline: its type fixes its value, and LegalizeOps needs a literal shape. The param stays, unused."""
    for gv, fn in list(mod.functions.items()):
        if not (isinstance(fn, relax.Function) and fn.attrs and "Composite" in fn.attrs):
            continue
        shapes = {p: relax.ShapeExpr(p.ty.values) for p in fn.params
                  if isinstance(p.ty, relax.ShapeType) and p.ty.values is not None}
        if shapes:
            mod[gv] = _Inline(shapes).visit_expr(fn)
    return mod


@relax.expr_functor.mutator
class _Inline(relax.PyExprMutator):
    def __init__(self, shapes):
        super().__init__()
        self.shapes = shapes

    def visit_var_(self, var):  # pylint: disable=arguments-renamed
        return self.shapes.get(var, var)


def launches(mod: tvm.IRModule) -> int:
    """Kernel launches per run of `main`: call_tir sites left once reshapes become views (as the build does)."""
    viewed = relax.transform.RewriteDataflowReshape()(mod)
    return sum(len(calls) for calls in _kernel_calls(viewed).values())


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
