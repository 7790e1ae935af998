"""Legalization overrides for LegalizeOps: integer powers become products (TVM's CUDA `pow` is NaN for negative bases), last-axis concatenations pick their part per 16-byte vector."""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx, topi

#: largest integer exponent written as a product
MAX_PRODUCT_EXPONENT = 4


def _integer_exponent(expr) -> int | None:
    value = getattr(expr, "value", None)  # a constant (tvm.ir.GenericConst in TVM 0.27)
    if value is None or not hasattr(value, "numpy") or value.numpy().size != 1:
        return None
    y = float(value.numpy().reshape(()))
    return int(y) if y.is_integer() and 1 <= y <= MAX_PRODUCT_EXPONENT else None


def legalize_power(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """`power(x, n)` for a constant integer n in 1..4 as x*x*...; anything else as TVM's own `topi.power`.

    CUDA builds use --use_fast_math, where powf(x, 3) is exp2(3*log2(x)): NaN for every x < 0 (GPT-2's tanh-GELU
    cube and RMSNorm's square gave NaN/inf on the H200; llvm's exact pow hid it). A product is exact and cheaper."""
    n = _integer_exponent(call.args[1])
    if n is None:  # e.g. the exponent is a parameter of a fused composite function (its value unknown here)
        return bb.call_te(_signed_power, call.args[0], call.args[1])

    def product(x: te.Tensor) -> te.Tensor:
        def body(*idx):
            value = x(*idx)
            for _ in range(n - 1):
                value = value * x(*idx)
            return value
        return te.compute(x.shape, body, name="T_power")

    return bb.call_te(product, call.args[0])


def _signed_power(x: te.Tensor, y: te.Tensor) -> te.Tensor:
    """pow(|x|, y), negated where x < 0 and y is an odd integer: what pow gives for integer y, without handing a
    negative base to fast-math powf (exp2(y*log2 x) = NaN). A non-integer y of a negative x (NaN in pow) is not
    meaningful either way. Exponents that broadcast other than as a scalar keep TVM's pow."""
    if len(y.shape) and [int(d) for d in y.shape] != [int(d) for d in x.shape]:
        return topi.power(x, y)

    def body(*idx):
        y_val = (y(*idx) if len(y.shape) else y()).astype("float32")
        value = te.power(te.abs(x(*idx)), y_val.astype(x.dtype))
        odd = y_val - te.floor(y_val * 0.5) * 2.0 == 1.0
        return te.if_then_else(te.all(x(*idx) < te.const(0, x.dtype), odd), -value, value)

    return te.compute(x.shape, body, name="T_power")


VECTOR_BYTES = 16  # the injective CUDA schedule's vector (tvmfuse.spaces.elementwise)


def legalize_concat(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """A concatenation on the last axis whose parts have static widths, each a multiple of g = 16 bytes of the dtype
    (8 fp16 lanes), picks its part by `j < end` (part by part from the first); anything else as TVM's.

    TVM's (topi.concatenate) picks by `start <= j`. For Llama's rotary embedding, concat(-x[..., 64:], x[..., :64]),
    the vectorized CUDA schedule has j = (bx*2048 + tx*8 + lane) % 128, and TVM's simplifier (StmtSimplify, just
    before VectorizeLoop) makes `64 <= j` into `64 <= tx % 16 * 8 + lane`: it depends on the lane, so VectorizeLoop
    ran the 8 lanes as a loop of 2-byte accesses (9-10 µs instead of ~2.5 on the H200). It makes `j < 64` into
    `tx % 16 < 8`, one choice per vector: 16-byte loads and stores. (A `j // g < end // g` condition is already
    `j < end` in the PrimFunc TE makes.) Any end a multiple of the vector width gives the same; others could not
    be decided per vector anyway, and keep TVM's form."""
    widths = _last_axis_widths(call)
    bits = tvm.runtime.DataType(call.ty.dtype).bits if widths else 0
    lanes = VECTOR_BYTES * 8 // bits if bits and (VECTOR_BYTES * 8) % bits == 0 else 0
    if not lanes or not any(widths) or any(w % lanes for w in widths):
        return tvm.ir.Op.get("relax.concat").get_attr("FLegalize")(bb, call)
    fields = [f for f, w in zip(_concat_fields(bb, call), widths) if w]  # zero-width parts are never picked
    return bb.call_te(lambda *parts: _concat_last_axis(parts, [w for w in widths if w]), *fields,
                      primfunc_name_hint="concatenate")


def _last_axis_widths(call: relax.Call) -> list[int] | None:
    """Each part's static extent on the concatenation axis, or None unless that axis is the last one."""
    ndim, axis = call.ty.ndim, call.attrs.axis
    if axis is None or ndim <= 0 or int(axis) % ndim != ndim - 1:
        return None
    shapes = [getattr(f, "shape", None) for f in call.args[0].ty.fields]
    if not shapes or not all(isinstance(s, relax.ShapeExpr) and isinstance(s.values[-1], tirx.IntImm)
                             for s in shapes):
        return None
    return [int(s.values[-1]) for s in shapes]


def _concat_fields(bb: relax.BlockBuilder, call: relax.Call) -> list[relax.Expr]:
    """The tensors concatenated (as TVM's legalization finds them): the bound tuple's fields, else its items."""
    t = call.args[0]
    while isinstance(t, relax.Var) and isinstance(bb.lookup_binding(t), (relax.Tuple, relax.Var)):
        t = bb.lookup_binding(t)
    if isinstance(t, relax.Tuple):
        return list(t.fields)
    return [bb.emit(relax.TupleGetItem(t, i)) for i in range(len(call.args[0].ty.fields))]


def _concat_last_axis(parts, widths: list[int]) -> te.Tensor:
    """concat(parts, axis=-1) as `j < end_0 ? part_0 : j < end_1 ? part_1 : ... : part_last`."""
    ends = [sum(widths[:k + 1]) for k in range(len(widths))]

    def body(*idx):
        *outer, j = idx
        value = parts[-1](*outer, j - ends[-2] if len(parts) > 1 else j)
        for k in range(len(parts) - 2, -1, -1):
            value = te.if_then_else(j < ends[k], parts[k](*outer, j - ends[k - 1] if k else j), value)
        return value

    return te.compute(list(parts[0].shape[:-1]) + [ends[-1]], body, name="T_concat")


LEGALIZE = {"relax.power": legalize_power, "relax.concat": legalize_concat}
