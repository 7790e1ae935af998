"""Interface stage of mixed precision: the dtype of `main`'s float inputs and outputs (float32, or the compute dtype
with the cast round trips that leaves cancelled)."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

FLOAT32, FLOAT16, BFLOAT16 = "float32", "float16", "bfloat16"


def is_cast(expr) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.astype"


def _dtype(expr) -> str:
    return str(getattr(expr.ty, "dtype", ""))


def fp32_interface(mod: tvm.IRModule, names: list[str], low: str = FLOAT16) -> tvm.IRModule:
    """Give `main` float32 params again: each `low` (fp16, or bf16 for a model stored in bf16) param named in
    `names` becomes a cast of a new fp32 param, bound first."""
    main = mod["main"]
    params, casts = [], []
    for p in main.params:
        if p.name in names and str(p.ty.dtype) == low:
            outer = relax.Var(p.name, relax.TensorType(p.ty.shape, FLOAT32))
            params.append(outer)
            casts.append(relax.VarBinding(p, relax.BlockBuilder().normalize(relax.op.astype(outer, low))))
        else:
            params.append(p)
    if not casts:
        return mod
    body = main.body
    first = body.blocks[0] if body.blocks else None
    if isinstance(first, relax.DataflowBlock):
        blocks = [relax.DataflowBlock(casts + list(first.bindings))] + list(body.blocks[1:])
    else:
        blocks = [relax.DataflowBlock(casts)] + list(body.blocks)
    out = mod.clone()
    out["main"] = relax.Function(params, relax.SeqExpr(blocks, body.body), main.ret_ty, main.is_pure, main.attrs)
    return out


def low_interface(mod: tvm.IRModule, io_dtype: str, from_dtype: str = FLOAT32, inputs: bool = True) -> tvm.IRModule:
    """`main` with its `from_dtype` (float32) inputs and outputs in `io_dtype`: each such input becomes a cast of a
    new input, each such output a cast to `io_dtype`, and the exact round trips these make with the existing casts
    cancel. `inputs=False`: the outputs only (a bf16-stored model's bf16 outputs made float32)."""
    main = mod["main"]
    n_in = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else len(main.params)
    params, pre, post = [], [], []
    for i, p in enumerate(main.params):
        if inputs and i < n_in and _dtype(p) == from_dtype:
            low = relax.Var(p.name, relax.TensorType(p.ty.shape, io_dtype))
            pre.append(relax.VarBinding(p, relax.BlockBuilder().normalize(relax.op.astype(low, from_dtype))))
            p = low
        params.append(p)

    def bind(name, value, ty):
        var = relax.Var(name, ty)
        post.append(relax.VarBinding(var, relax.BlockBuilder().normalize(value)))
        return var

    def cast_out(expr):
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([cast_out(f) for f in expr.fields])
        if isinstance(expr, relax.Var) and isinstance(expr.ty, relax.TupleType):
            return relax.Tuple([cast_out(bind(f"{expr.name}_{i}", relax.TupleGetItem(expr, i), t))
                                for i, t in enumerate(expr.ty.fields)])
        if isinstance(expr, relax.Var) and _dtype(expr) == from_dtype:
            return bind(expr.name, relax.op.astype(expr, io_dtype), relax.TensorType(expr.ty.shape, io_dtype))
        return expr

    ret = relax.BlockBuilder().normalize(cast_out(main.body.body))
    blocks = list(main.body.blocks) or [relax.DataflowBlock([])]
    first, last = blocks[0], blocks[-1]
    blocks[0] = relax.DataflowBlock(pre + list(first.bindings)) if isinstance(first, relax.DataflowBlock) else first
    if not isinstance(first, relax.DataflowBlock) and pre:
        blocks.insert(0, relax.DataflowBlock(pre))
    last = blocks[-1]
    blocks[-1] = relax.DataflowBlock(list(last.bindings) + post) if isinstance(last, relax.DataflowBlock) else last
    if not isinstance(last, relax.DataflowBlock) and post:
        blocks.append(relax.BindingBlock(post))
    out = mod.clone()
    out["main"] = relax.Function(params, relax.SeqExpr(blocks, ret), ret.ty, main.is_pure, main.attrs)
    out = relax.transform.CanonicalizeBindings()(out)  # gv[i] of a known tuple -> the field, for the cancelling
    out["main"] = _CancelRoundTrips(out).visit_expr(out["main"])
    return out


def cancel_constant_round_trips(mod: tvm.IRModule) -> tvm.IRModule:
    """`main` with astype(astype(c: d, float32), d) -> c for constants c (weights read in the compute dtype, bound
    through a cast to fp32, cast back by the precision pass): no fp32 copy of them is ever made."""
    out = mod.clone()
    out["main"] = _CancelRoundTrips(out, constants_only=True).visit_expr(out["main"])
    return relax.transform.DeadCodeElimination(["main"])(out)  # the dead casts to fp32: FoldConstant would run them


@mutator
class _CancelRoundTrips(PyExprMutator):
    """astype(astype(x: d, float32), d) -> x for d float16/bfloat16 (exact: every d value is a float32 value)."""

    def __init__(self, mod=None, constants_only: bool = False):
        super().__init__(mod)
        self.constants_only = constants_only

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not is_cast(call) or str(call.attrs.dtype) not in (FLOAT16, BFLOAT16):
            return call
        inner = call.args[0]
        inner = self.lookup_binding(inner) if isinstance(inner, relax.Var) else inner
        if is_cast(inner) and _dtype(inner) == FLOAT32 and _dtype(inner.args[0]) == str(call.attrs.dtype) \
                and (not self.constants_only or isinstance(inner.args[0], tvm.ir.GenericConst)):
            return inner.args[0]
        return call
