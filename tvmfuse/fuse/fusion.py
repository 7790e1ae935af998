"""Fuse stage: pattern groups become one PrimFunc each; everything else gets TVM's normal fusion."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, tirx

from tvmfuse.decide.decision import Plan, decide
from tvmfuse.prepare import bind_params
from tvmfuse.prepare.names import unique_binding_names
from tvmfuse.fuse.legalize import LEGALIZE, one_kernel_splits
from tvmfuse.fuse.opmath_groups import OPMATH_EPILOGUES, opmath_composites
from tvmfuse.fuse.scalar_params import inline_scalar_params
from tvmfuse.fuse.substitute import Substitute
from tvmfuse.fuse.views import rewrite_dataflow_reshape
from tvmfuse.patterns import Recorder, fusion_patterns, start, stop
from tvmfuse.patterns.attention import batched_transpose_source
from tvmfuse.frontend.lowering_check import check_lowered

DEFAULT_FUSION = "default fusion"


@dataclass
class Fused:
    """The lowered module (Relax main calling PrimFuncs) and which pattern made each PrimFunc."""

    mod: tvm.IRModule
    kernel_patterns: dict[str, str]
    rejections: list[tuple[str, str, str]] = field(default_factory=list)
    plan: Plan | None = None
    candidate_kernels: dict[str, str] = field(default_factory=dict)  # "pattern@root" -> kernel (shared ones too)
    kernel_choices: dict[str, str] = field(default_factory=dict)  # kernel -> the kernel stage's choice (its log line)

    def kernels(self) -> list[str]:
        """PrimFuncs the Relax `main` calls, in call order (what runs on the device)."""
        return called_prim_funcs(self.mod)

    def pattern_of(self, kernel: str) -> str:
        return self.kernel_patterns.get(kernel, DEFAULT_FUSION)

    def launches(self) -> int:
        """Kernel launches per run of `main` (see `launches`)."""
        return launches(self.mod)


def lower(mod: tvm.IRModule, params: list | None = None, patterns: list | None = None,
          plan: Plan | None = None, target=None) -> Fused:
    """Fuse the candidates the decide stage kept (deciding here when no plan is given), legalize,
    fuse the rest with TVM's FuseOps, and merge each group into one PrimFunc. `patterns=[]`: stock TVM."""
    mod = unique_binding_names(bind_params(mod, params))  # the names the plan knows candidates by (as decide)
    patterns = fusion_patterns() if patterns is None else patterns
    if plan is None and patterns:
        plan = decide(mod, target, patterns=patterns)
    rec = Recorder(chosen=plan.chosen() if plan is not None else None).reading(mod)  # the bindings decide read
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
    mod = inline_scalar_params(mod, OPMATH_EPILOGUES)  # the epilogues' 0-d constants (GELU's) as literals
    mod = opmath_composites(mod)  # fp16/bf16 groups that compute in fp32 between their loads and their store
    mod = one_kernel_splits(mod)  # a split whose part a fused group reads: one kernel writes every part
    mod = tvm.transform.Sequential([
        inline_shape_params,
        simplify_transposes,
        relax.transform.LegalizeOps(customize_legalize_map=LEGALIZE),
        relax.transform.AnnotateTIROpPattern(),
        opaque_scalar_kernels,
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ])(mod)
    check_lowered(mod)  # an operator left here would fail VM codegen: name it and its ONNX node now
    mod, alias = dedup_prim_funcs(mod)
    kernels = set(called_prim_funcs(mod))
    rejections = ([(c.match.pattern, c.match.root, c.reason) for c in plan.candidates if c.decision != "kept"]
                  if plan is not None else list(dict.fromkeys(rec.rejections)))
    return Fused(mod, {k: v for k, v in composite.items() if k in kernels}, rejections, plan,
                 {v: alias.get(k, k) for k, v in candidate.items() if alias.get(k, k) in kernels})


def dedup_prim_funcs(mod: tvm.IRModule) -> tuple[tvm.IRModule, dict[str, str]]:
    """Structurally equal PrimFuncs (the same fused group in every layer) become one: each call goes to the
    first one called, the copies are dropped. Returns the module and {dropped name: kept name}."""
    prims = {gv.name_hint: gv for gv, fn in mod.functions.items() if isinstance(fn, tirx.PrimFunc)}
    order = called_prim_funcs(mod) + sorted(set(prims) - set(called_prim_funcs(mod)))
    kept: dict[int, list] = {}
    alias: dict[relax.GlobalVar, relax.GlobalVar] = {}
    for name in order:
        gv, fn = prims[name], mod[prims[name]]
        same = kept.setdefault(tvm_ffi.structural_hash(fn), [])
        first = next((k for k in same if tvm_ffi.structural_equal(mod[k], fn)), None)
        if first is None:
            same.append(gv)
        else:
            alias[gv] = first
    if not alias:
        return mod, {}
    out = tvm.IRModule({gv: fn for gv, fn in mod.functions.items() if gv not in alias}, attrs=mod.attrs,
                       global_infos=mod.global_infos)
    for gv, fn in list(out.functions.items()):
        if isinstance(fn, relax.Function):
            out[gv] = Substitute(alias).visit_expr(fn)
    return out, {gv.name_hint: k.name_hint for gv, k in alias.items()}


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
            mod[gv] = Substitute(shapes).visit_expr(fn)
    return mod


@tvm.transform.module_pass(opt_level=0, name="OpaqueScalarKernels")
def opaque_scalar_kernels(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
    """A legalized kernel taking a scalar (an R.prim_value such as a KV cache's past length) is kept out of
    FuseOps' groups: FuseTIR would define that scalar's variable twice (RenewDefs' check fails)."""
    for gv, fn in list(mod.functions.items()):
        if isinstance(fn, tirx.PrimFunc) and any(isinstance(p.ty, tvm.ir.PrimType) for p in fn.params):
            mod[gv] = fn.with_attr("op_pattern", 8)  # kOpaque
    return mod


@tvm.transform.module_pass(opt_level=0, name="SimplifyTransposes")
def simplify_transposes(mod: tvm.IRModule, _ctx=None) -> tvm.IRModule:
    """Inside pattern groups, reshape -> [B*H,S,D] -> permute -> reshape back (dynamo's K^T) becomes one 4-D
    permute: the same values, and no flattened symbolic index for TVM's simplifier to grind through."""
    for gv, fn in list(mod.functions.items()):
        if isinstance(fn, relax.Function) and fn.attrs and "Composite" in fn.attrs:
            calls = {b.var: b.value for blk in fn.body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)}
            new = _Transposes(calls.get).visit_expr(fn)
            if not new.same_as(fn):
                mod[gv] = relax.analysis.remove_all_unused(new)
    return mod


@relax.expr_functor.mutator
class _Transposes(relax.PyExprMutator):
    def __init__(self, bound):
        super().__init__()
        self.bound = bound

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        x = batched_transpose_source(call, self.bound)
        return relax.op.permute_dims(self.visit_expr(x), [0, 1, 3, 2]) if x is not None else super().visit_call_(call)


def launches(mod: tvm.IRModule) -> int:
    """Kernel launches per run of `main`: call_tir sites left once reshapes become views (as the build does)."""
    return sum(len(calls) for calls in _kernel_calls(rewrite_dataflow_reshape(mod)).values())


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


def kernel_calls(mod: tvm.IRModule, function: str = "main") -> dict[str, int]:
    """{kernel: how many times `function` calls it}."""
    return {name: len(calls) for name, calls in _kernel_calls(mod, function).items()}


def _kernel_calls(mod: tvm.IRModule, function: str = "main") -> dict[str, list[relax.Call]]:
    prim = {gv.name_hint for gv, fn in mod.functions.items() if isinstance(fn, tirx.PrimFunc)}
    calls: dict[str, list[relax.Call]] = {}

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.args and isinstance(expr.args[0], relax.GlobalVar) \
                and expr.args[0].name_hint in prim:
            calls.setdefault(expr.args[0].name_hint, []).append(expr)

    relax.analysis.post_order_visit(mod[function], visit)
    return calls
