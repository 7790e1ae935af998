"""Activation sub-patterns, as ops and as ONNX exporters decompose them, and their constant checks. A constant
may be a scalar cast to the compute dtype (`astype(const)`, mixed precision): `builders.const`."""

from __future__ import annotations

import math

from tvm.relax.dpl import DFPattern, is_op

from tvmfuse.patterns.builders import cast, const, upcast
from tvmfuse.patterns.readers import has_constants


def _mul(a, b) -> DFPattern:
    return is_op("relax.multiply")(a, b)


def _add(a, b) -> DFPattern:
    return is_op("relax.add")(a, b)


def gelu_erf(x: DFPattern) -> DFPattern:
    """gelu(x) or 0.5*x*(1+erf(x/sqrt2)) in either association, x/sqrt2 as divide or multiply."""
    erf = is_op("relax.erf")(is_op("relax.divide")(x, const()) | _mul(x, const()))
    one_plus = _add(erf, const())
    return (is_op("relax.nn.gelu")(x) | _mul(_mul(x, one_plus), const())
            | _mul(_mul(x, const()), one_plus))


def gelu_tanh(x: DFPattern) -> DFPattern:
    """gelu_tanh(x) or 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))), x^3 as power or two multiplies. In bf16
    the power computes in fp32 between casts (tvmfuse.precision)."""
    cube = cast(is_op("relax.power")(upcast(x), const())) | _mul(_mul(x, x), x)
    inner = _add(x, _mul(cube, const()))
    th = is_op("relax.tanh")(_mul(inner, const()))
    one_plus = _add(th, const())
    return (is_op("relax.nn.gelu_tanh")(x) | _mul(_mul(x, one_plus), const())
            | _mul(_mul(x, const()), one_plus))


def silu(x: DFPattern) -> DFPattern:
    return is_op("relax.nn.silu")(x) | _mul(x, is_op("relax.sigmoid")(x))


def relu(x: DFPattern) -> DFPattern:
    return is_op("relax.nn.relu")(x) | is_op("relax.maximum")(x, const())


def tanh(x: DFPattern) -> DFPattern:
    return is_op("relax.tanh")(x)


def _decomposed(ctx, op: str) -> bool:
    return not any(getattr(c.op, "name", "") == op for c in ctx.matched_bindings.values())


def gelu_erf_problem(ctx) -> str | None:
    """Why a matched erf-GELU is not GELU (wrong constants), or None."""
    if not _decomposed(ctx, "relax.nn.gelu"):
        return None
    return has_constants(ctx, [(0.5,), (math.sqrt(2), 1 / math.sqrt(2)), (1.0,)])


def gelu_tanh_problem(ctx) -> str | None:
    if not _decomposed(ctx, "relax.nn.gelu_tanh"):
        return None
    return has_constants(ctx, [(0.5,), (0.044715,), (math.sqrt(2 / math.pi),), (1.0,)])


def relu_problem(ctx) -> str | None:
    if not _decomposed(ctx, "relax.nn.relu"):
        return None
    return has_constants(ctx, [(0.0,)])
