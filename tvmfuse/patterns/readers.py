"""Facts the checks read off a match: shapes, dtypes, dims, scalar constants, axes."""

from __future__ import annotations

import re

import tvm
from tvm import relax
from tvm.relax.transform import PatternCheckContext

Const = tvm.ir.GenericConst  # relax.Constant in older TVM


def leaf_args(call: relax.Call):
    """The Var and Constant arguments of a call, tuple fields included."""
    for arg in call.args:
        if isinstance(arg, relax.Tuple):
            yield from (f for f in arg.fields if isinstance(f, (relax.Var, Const)))
        elif isinstance(arg, (relax.Var, Const)):
            yield arg


def shape_of(expr) -> list | None:
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    return None if shape is None else list(shape)


def dtype_of(expr) -> str | None:
    return getattr(getattr(expr, "ty", None), "dtype", None)


def ndim(expr) -> int:
    shape = shape_of(expr)
    return -1 if shape is None else len(shape)


def dim_str(d) -> str:
    """A dim as text: "64" for constants (not "T.int64(64)"), the expression for symbolic ones, its constants
    plain too ("past + 1", as the cost model evaluates it, for a bucket's past + seq at seq = 1)."""
    value = getattr(d, "value", None)
    return str(value) if isinstance(value, int) else re.sub(r"T\.u?int(?:8|16|32|64)\((-?\d+)\)", r"\1", str(d))


def same_dim(a, b) -> bool:
    """Two PrimExprs known equal (ints, or the same symbolic expression)."""
    return dim_str(a) == dim_str(b)


def scalar(expr) -> float | None:
    """The value of a scalar (or one-element) constant, else None."""
    if not isinstance(expr, Const):
        return None
    value = expr.value.numpy()
    return float(value.reshape(-1)[0]) if value.size == 1 else None


#: relative rounding error of a constant stored in a dtype (half its epsilon): a bf16 0.044715 is 0.0446777
ROUNDING = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def constants(ctx: PatternCheckContext) -> list[tuple[float, str]]:
    """All scalar constants read by the matched bindings, each with its dtype."""
    out = []
    for call in ctx.matched_bindings.values():
        for arg in leaf_args(call):
            value = scalar(arg)
            if value is not None:
                out.append((value, str(arg.value.dtype)))
    return out


def has_constants(ctx: PatternCheckContext, wanted: list[tuple[float, ...]], tol: float = 1e-3) -> str | None:
    """None when, for every group of alternatives, one value appears (within `tol`, or the rounding error of
    the constant's dtype if larger); else what is missing."""
    got = constants(ctx)
    for alts in wanted:
        if not any(abs(g - a) <= max(tol, ROUNDING.get(dt, 0.0)) * max(1.0, abs(a)) for g, dt in got for a in alts):
            return f"constant {alts[0]:.6g} not found (constants: {', '.join(f'{g:.6g}' for g, _ in got)})"
    return None


def last_axis(axis, rank: int) -> bool:
    values = [int(a) for a in (axis if isinstance(axis, (list, tuple)) or hasattr(axis, "__len__") else [axis])]
    return values in ([-1], [rank - 1])


def as_int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
