"""Converter overrides for ONNX ops that take shape-valued inputs or make symbolic dims (Reshape, Expand,
ConstantOfShape, Range, Gather, Slice, and the arithmetic ops where a symbolic dim meets a constant array or two
dims TVM cannot prove equal)."""

from __future__ import annotations

import functools
import operator

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _tvm
from tvm.sym import Analyzer

from tvmfuse.frontend.values import const_array, int_list, resolve, scalar


class Range(_tvm.Range):
    """Integer Range whose bounds are constants or symbolic dims becomes one `R.arange` with a symbolic length
    (TVM's converter computes the length with tensor ops and invents a fresh dim, which breaks later broadcasts)."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        start, limit, delta = (scalar(bb, x) for x in inputs[:3])
        dtype = str(getattr(inputs[0].ty, "dtype", ""))
        if "int" in dtype and start is not None and limit is not None and isinstance(delta, int) and delta != 0:
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


class Reshape(_tvm.Reshape):
    """Reshape of a scalar dim (e.g. `1 + seq`) stays a shape; a runtime-tensor target shape goes through
    `tensor_to_shape` (TVM requires the data to be a tensor and the target to be a constant or a shape)."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, target = inputs[0], const_array(bb, inputs[1])
        value = scalar(bb, data) if isinstance(getattr(data, "ty", None), tvm.ir.PrimType) else None
        if value is not None and target is not None and target.size <= 1:
            if target.size == 0:
                return data
            return relax.ShapeExpr([value])
        new_shape = inputs[1]
        if target is None and isinstance(getattr(new_shape, "ty", None), relax.TensorType):
            length = new_shape.ty.shape[0] if new_shape.ty.shape is not None else None
            if length is None or not isinstance(length, tvm.tirx.IntImm) or attr.get("allowzero", 0):
                raise ValueError("target shape is a run-time tensor of unknown length (or allowzero=1)")
            shape = _tvm._tensor_to_shape_expr(bb, new_shape, int(length), "reshape_dim")
            if isinstance(data, relax.ShapeExpr):
                data = bb.normalize(relax.op.shape_to_tensor(data))
            return relax.op.reshape(data, shape)
        dims = int_list(bb, new_shape) if target is None and not attr.get("allowzero", 0) else None
        data_dims = getattr(getattr(data, "ty", None), "shape", None)
        if dims is not None and isinstance(data_dims, relax.ShapeExpr) and dims.count(-1) == 1 and 0 not in dims:
            inferred = _minus_one(list(data_dims.values), dims)
            if inferred is not None:
                return relax.op.reshape(data, relax.ShapeExpr([inferred if d == -1 else d for d in dims]))
        return super()._impl_v13(bb, inputs, attr, params)


def _minus_one(data_dims: list, dims: list):
    """A reshape target's -1 as the product of the data dims that the target's other dims do not take, each
    provably equal to one of them: [batch, 32, past + seq, 128] -> [-1, past + seq, 128] gives batch * 32 (TVM
    infers the quotient `batch * (past + seq) * 4096 // (past * 128 + seq * 128)`, which host codegen failed to
    simplify: "Binding of variable rmod ... conflicts with previous binding"); None when they do not cancel."""
    analyzer = Analyzer()
    rest = list(data_dims)
    for dim in dims:
        if isinstance(dim, int) and dim == -1:
            continue
        same = next((i for i, d in enumerate(rest) if analyzer.can_prove_equal(d, dim)), None)
        if same is None:
            return None
        rest.pop(same)
    return analyzer.simplify(functools.reduce(operator.mul, rest, tvm.tirx.IntImm("int64", 1)))


class ConstantOfShape(_tvm.ConstantOfShape):
    """The fill value is a one-element tensor: use it as a scalar, so a rank-0 target shape works
    (TVM broadcasts the 1-D value and fails with "ndim 1 while the target shape has ndim 0")."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        value = attr.get("value")
        array = _tvm.get_numpy(value).reshape(()) if value is not None else np.zeros((), "float32")
        dims = int_list(bb, inputs[0])
        if dims is not None:
            if all(isinstance(d, int) for d in dims):
                return relax.const(np.full(dims, array, array.dtype), str(array.dtype))
            return relax.op.full(relax.ShapeExpr(dims), relax.const(array, str(array.dtype)), str(array.dtype))
        shape = bb.normalize(relax.op.tensor_to_shape(inputs[0]))
        return relax.op.full(shape, relax.const(array, str(array.dtype)), str(array.dtype))


class Expand(_tvm.Expand):
    """Expand of a tensor whose dims are unknown at import: when no target dim is 1 the output shape is the
    target itself, so `broadcast_to` it (TVM reads the data dims and crashes with "'NoneType' is not iterable")."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, dims = inputs[0], int_list(bb, inputs[1])
        if isinstance(data.ty, relax.TensorType) and data.ty.shape is None:
            ones = dims is None or any(isinstance(d, int) and d == 1 for d in dims)
            if ones or data.ty.ndim < 0 or data.ty.ndim > len(dims):
                raise ValueError("input dims are unknown at import and the target shape has 1s (or is unknown): "
                                 "the output shape cannot be derived; fix the input shapes")
            return relax.op.broadcast_to(data, relax.ShapeExpr(dims))
        return super()._impl_v13(bb, inputs, attr, params)


#: Slice ends at or above this are "to the end" (exporters write INT64_MAX, some INT32_MAX)
SLICE_TO_END = (1 << 31) - 1


class Slice(_tvm.Slice):
    """A Slice whose start is symbolic and whose end means "to the end" (OPT's `positions[:, past:]` exported with
    end INT64_MAX): the end becomes the axis's dim. TVM's converter assumes symbolic bounds are in range and made
    the length `INT64_MAX - past` (the dims were lost after it, or a Reshape overflowed int64)."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        ends = const_array(bb, inputs[2]) if len(inputs) > 2 else None
        dims = getattr(getattr(inputs[0], "ty", None), "shape", None)
        if ends is not None and ends.ndim == 1 and (ends >= SLICE_TO_END).any() and dims is not None:
            axes = const_array(bb, inputs[3]) if len(inputs) > 3 and inputs[3] is not None else np.arange(len(ends))
            if axes is not None and len(axes) == len(ends):
                values = list(dims.values)
                ends = relax.ShapeExpr([values[int(a)] if e >= SLICE_TO_END else int(e) for a, e in zip(axes, ends)])
                inputs = [inputs[0], inputs[1], ends] + [inputs[i] if i < len(inputs) else None for i in (3, 4)]
        return super()._impl_v13(bb, inputs, attr, params)


def check_dim_meets_array(inputs) -> bool:
    """Whether a binary op's inputs are a symbolic scalar (a dim, e.g. the cache's past length) and a constant
    array (rank 1 or more): `past + arange(seq)` once seq is fixed (`--shape seq=8`), which TVM's converter folds
    in numpy into an array of PrimExprs and then fails on (`can only convert an array of size 1 to a Python
    scalar`), or at seq 1 folds into a scalar, one rank short (OPT's positions: an Unsqueeze after it failed)."""
    dim = any(tvm.ir.is_prim_expr(x) and not isinstance(x, tvm.tirx.IntImm | tvm.tirx.FloatImm) for x in inputs)
    return dim and any(isinstance(x, tvm.ir.GenericConst) and x.value.numpy().ndim > 0 for x in inputs)


def _dim_as_tensor(x, dtype: str):
    """A symbolic dim as a one-element tensor of `dtype` (it broadcasts against the array); other inputs as they
    are."""
    if not tvm.ir.is_prim_expr(x) or isinstance(x, tvm.ir.GenericConst):
        return x
    tensor = relax.op.shape_to_tensor(relax.ShapeExpr([x]))  # int64
    return tensor if dtype == "int64" else relax.op.astype(tensor, dtype)


def broadcast_dims(types: list, ndim: int) -> list | None:
    """The dims of an elementwise op's output over inputs of these tensor types, where TVM cannot prove two of
    them equal: a dim of 1 takes the other; of two symbolic dims, ONNX's rule makes them equal unless one is 1 at
    run time, so a static dim wins, else a plain one (`seq` over `total - past`: OPT's positions against its
    embeddings). None unless every input is a tensor of known dims."""
    if not types or not all(isinstance(t, relax.TensorType) and t.shape is not None for t in types):
        return None
    shapes = [list(t.shape.values) for t in types]
    if any(len(s) > ndim for s in shapes):
        return None
    one = tvm.tirx.IntImm("int64", 1)
    dims = []
    for column in zip(*[[one] * (ndim - len(s)) + s for s in shapes]):
        wider = [d for d in column if not (isinstance(d, tvm.tirx.IntImm) and int(d) == 1)]
        static = [d for d in wider if isinstance(d, tvm.tirx.IntImm)]
        plain = [d for d in wider if isinstance(d, tvm.tirx.Var)]
        dims.append((static or plain or wider or [column[0]])[0])
    return dims


def _broadcast_inputs(bb: relax.BlockBuilder, inputs: list) -> list | None:
    """The inputs, each whose dims differ from `broadcast_dims` (and are not 1) cast to them (a MatchCast, checked
    when the model runs), or None when that cannot be decided."""
    types = [getattr(x, "ty", None) for x in inputs]
    ndim = max((t.ndim for t in types if isinstance(t, relax.TensorType)), default=0)
    dims = broadcast_dims(types, ndim)
    if dims is None:
        return None
    analyzer, out = Analyzer(), []
    for x, ty in zip(inputs, types):
        have = list(ty.shape.values)
        want = [h if (isinstance(h, tvm.tirx.IntImm) and int(h) == 1) or analyzer.can_prove_equal(h, w) else w
                for h, w in zip(have, dims[ndim - len(have):])]
        same = all(a.same_as(b) for a, b in zip(want, have))
        out.append(x if same else bb.match_cast(x, relax.TensorType(want, ty.dtype)))
    return out


def _binary_with_dims(base: type) -> type:
    """`base` (one of TVM's BinaryBase converters) that computes a symbolic dim with a constant array as tensors
    (`check_dim_meets_array`), defers to TVM otherwise, and where TVM's output has lost its dims (two symbolic
    dims it cannot prove equal) casts the inputs to `broadcast_dims` and applies the op again."""

    def base_impl(cls, bb, inputs, attr, params):
        if check_dim_meets_array(inputs):
            dtype = next(str(x.value.dtype) for x in inputs if isinstance(x, tvm.ir.GenericConst))
            return base.relax_op(*(_dim_as_tensor(x, dtype) for x in inputs))
        out = base.base_impl.__func__(cls, bb, inputs, attr, params)
        if not isinstance(out, relax.Call):
            return out
        out = bb.normalize(out)  # its type (the importer's own normalize of it then has nothing left to do)
        if isinstance(out.ty, relax.TensorType) and out.ty.shape is None:
            aligned = _broadcast_inputs(bb, inputs)
            return base.relax_op(*aligned) if aligned is not None else out
        return out

    return type(base.__name__, (base,), {"__doc__": _binary_with_dims.__doc__, "base_impl": classmethod(base_impl)})


#: the arithmetic ops a position computation uses (`past + arange(seq)`, and its kin)
DIM_ARITHMETIC = ("Add", "Sub", "Mul", "Div")

OVERRIDES: dict[str, type] = {
    "Range": Range, "Gather": Gather, "Reshape": Reshape, "ConstantOfShape": ConstantOfShape, "Expand": Expand,
    "Slice": Slice, **{op: _binary_with_dims(getattr(_tvm, op)) for op in DIM_ARITHMETIC},
}
