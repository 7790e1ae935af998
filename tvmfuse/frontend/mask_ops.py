"""Converter overrides for the comparisons exporters emit in mask and expand idioms (Equal with a shape operand)."""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _tvm

from tvmfuse.frontend.values import const_array, resolve


class Equal(_tvm.Equal):
    """Equal of a shape and a run-time tensor compares the shape as an int64 tensor (TVM passes the shape itself
    to `R.equal`: "Arguments to binary operators must be either R.Tensor or R.Prim")."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        lhs, rhs = (resolve(bb, x) for x in inputs[:2])
        static = [isinstance(x, relax.ShapeExpr) or const_array(bb, x) is not None for x in (lhs, rhs)]
        if all(static):
            return super()._impl_v13(bb, [lhs, rhs], attr, params)
        operands = [bb.normalize(relax.op.shape_to_tensor(x)) if isinstance(x.ty, relax.ShapeType) else y
                    for x, y in zip((lhs, rhs), inputs[:2])]
        return relax.op.equal(*operands)


OVERRIDES: dict[str, type] = {"Equal": Equal}
