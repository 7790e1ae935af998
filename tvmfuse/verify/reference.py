"""The model onnxruntime checks a build against: the ONNX model itself, or for a model stored in bf16 an fp32 copy.

onnxruntime's CPU provider has no bf16 kernels for most ops (MatMul, Add: "Could not find an implementation"), and
a bf16 reference would carry bf16's own rounding anyway. `fp32_copy` upcasts the model: bf16 initializers,
constants and tensor attributes become fp32 (exactly: every bf16 value is an fp32 value), casts and dtype
attributes to bf16 become casts to fp32, and the graph's bf16 inputs, outputs and value infos become fp32. The
reference is then the model's own computation in fp32 on its bf16 weights, and the build is checked with bf16's
tolerance.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

BF16 = TensorProto.BFLOAT16
#: integer attributes that name a dtype (Cast's `to`; `dtype` of EyeLike, RandomNormal, ...)
DTYPE_ATTRIBUTES = ("to", "dtype")


def stores_bf16(model: onnx.ModelProto) -> bool:
    """Whether the model has bf16 initializers or graph inputs/outputs (it was exported in bf16)."""
    graph = model.graph
    return (any(t.data_type == BF16 for t in graph.initializer)
            or any(v.type.tensor_type.elem_type == BF16 for v in list(graph.input) + list(graph.output)))


def fp32_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` computing in fp32 where it computed in bf16 (see the module doc). External data must be
    loaded (`onnx.load(path)` does)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _upcast_graph(out.graph)
    return out


def _upcast_tensor(tensor: TensorProto) -> None:
    if tensor.data_type != BF16:
        return
    values = numpy_helper.to_array(tensor).astype(np.float32)
    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))


def _upcast_value(value: onnx.ValueInfoProto) -> None:
    if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type == BF16:
        value.type.tensor_type.elem_type = TensorProto.FLOAT


def _upcast_graph(graph: onnx.GraphProto) -> None:
    for tensor in graph.initializer:
        _upcast_tensor(tensor)
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        _upcast_value(value)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                _upcast_tensor(attr.t)
            elif attr.type == onnx.AttributeProto.INT and attr.name in DTYPE_ATTRIBUTES and attr.i == BF16:
                attr.i = TensorProto.FLOAT
            elif attr.type == onnx.AttributeProto.GRAPH:
                _upcast_graph(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _upcast_graph(sub)


def reference_model(model: onnx.ModelProto | str, imported: onnx.ModelProto) -> tuple[onnx.ModelProto | str, str]:
    """(what onnxruntime runs, what the manifest calls it): `model` (a proto or its path) as it is, or its fp32 copy
    where `imported` (the proto the frontend read) stores bf16."""
    if not stores_bf16(imported):
        return model, "onnxruntime"
    full = onnx.load(model) if isinstance(model, str) else model
    return fp32_copy(full), "onnxruntime on an fp32 copy of the bf16 model"
