"""Helpers that read static or symbolic values (ints, PrimExprs, shapes) out of Relax expressions at import time."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax


def resolve(bb: relax.BlockBuilder, expr):
    """Follow variable bindings made in `bb` back to the bound value (e.g. a ShapeExpr or a PrimExpr)."""
    seen = 0
    while isinstance(expr, relax.Var) and seen < 64:
        bound = bb.lookup_binding(expr)
        if bound is None:
            break
        expr, seen = bound, seen + 1
    return expr


def const_array(bb: relax.BlockBuilder, expr) -> np.ndarray | None:
    """The numpy value of a (possibly bound) constant, else None."""
    expr = resolve(bb, expr)
    if isinstance(expr, tvm.ir.GenericConst):
        return expr.value.numpy()
    return None


def scalar(bb: relax.BlockBuilder, expr):
    """A Python number or an integer PrimExpr for a scalar-valued input (constant, PrimValue, 1-element shape),
    or None when the value is only known at run time."""
    expr = resolve(bb, expr)
    array = const_array(bb, expr)
    if array is not None:
        return array.reshape(()).item() if array.size == 1 else None
    if isinstance(expr, relax.ShapeExpr) and len(expr.values) == 1:
        return _int(expr.values[0])
    if tvm.ir.is_prim_expr(expr) and not isinstance(expr, relax.DataflowVar):
        ty = expr.ty
        if isinstance(ty, tvm.ir.PrimType) and "int" in str(ty.dtype):
            return _int(expr)
    return None


def int_list(bb: relax.BlockBuilder, expr) -> list | None:
    """A list of ints / PrimExprs for a 1-D shape-like input (constant, ShapeExpr), else None."""
    expr = resolve(bb, expr)
    array = const_array(bb, expr)
    if array is not None:
        return [int(v) for v in array.reshape(-1)] if array.ndim <= 1 and array.dtype.kind in "iu" else None
    if isinstance(expr, relax.ShapeExpr):
        return [_int(v) for v in expr.values]
    if isinstance(expr.ty, relax.ShapeType) and expr.ty.values is not None:
        return [_int(v) for v in expr.ty.values]
    return None


def _int(value):
    """A Python int for an integer immediate, the PrimExpr itself otherwise."""
    return int(value.value) if isinstance(value, tvm.tirx.IntImm) else value
