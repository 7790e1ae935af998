"""Converter overrides for ONNX ops that take shape-valued inputs (Reshape, Expand, ConstantOfShape, Range, Slice)."""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _tvm

from .values import const_array, resolve, scalar


class Range(_tvm.Range):
    """Integer Range whose bounds are constants or symbolic dims becomes one `R.arange` with a symbolic length
    (TVM's converter computes the length with tensor ops and invents a fresh dim, which breaks later broadcasts)."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        bounds = [scalar(bb, x) for x in inputs[:3]]
        dtype = str(inputs[0].ty.dtype) if hasattr(inputs[0].ty, "dtype") else ""
        if "int" in dtype and all(b is not None for b in bounds) and not isinstance(bounds[2], tvm_expr_types()):
            start, limit, delta = bounds
            if delta != 0:
                return relax.op.arange(start, limit, delta, dtype)
        return super()._impl_v12(bb, inputs, attr, params)


class Gather(_tvm.Gather):
    """Gather of constant 1-D indices from a shape stays a shape (TVM materialises a tensor and loses the dims)."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, indices = resolve(bb, inputs[0]), const_array(bb, inputs[1])
        if isinstance(data, relax.ShapeExpr) and indices is not None and indices.ndim == 1:
            values = list(data.values)
            return relax.ShapeExpr([values[int(i)] for i in indices])
        return super()._impl_v13(bb, inputs, attr, params)


def tvm_expr_types():
    """Types that mean "symbolic" (a step must be a known constant for a static length formula)."""
    import tvm  # noqa: PLC0415

    return (tvm.ir.Expr,)


OVERRIDES: dict[str, type] = {"Range": Range, "Gather": Gather}
