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
    if n is None:
        return bb.call_te(topi.power, call.args[0], call.args[1])

    def product(x: te.Tensor) -> te.Tensor:
        def body(*idx):
            value = x(*idx)
            for _ in range(n - 1):
                value = value * x(*idx)
            return value
        return te.compute(x.shape, body, name="T_power")

    return bb.call_te(product, call.args[0])


LEGALIZE = {"relax.power": legalize_power}
