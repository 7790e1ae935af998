"""Legalization overrides for LegalizeOps: integer powers become products (TVM's CUDA `pow` is NaN for negative bases)."""

from __future__ import annotations

from tvm import relax, te, topi

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


LEGALIZE = {"relax.power": legalize_power}
