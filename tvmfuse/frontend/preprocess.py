"""ONNX-level preparation: pin user-fixed input dims, fold constants, inline the initializers that are not weights."""

from __future__ import annotations

import os
import tempfile

import onnx


def pin_input_dims(model: onnx.ModelProto, shape_dict: dict | None) -> onnx.ModelProto:
    """A copy of `model` whose graph inputs named in `shape_dict` carry those dims (int: fixed, str: symbolic)."""
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    for inp in model_copy.graph.input:
        if not shape_dict or inp.name not in shape_dict:
            continue
        dims = inp.type.tensor_type.shape.dim
        want = list(shape_dict[inp.name])
        if len(dims) != len(want):
            from tvmfuse.errors import ModelError  # noqa: PLC0415

            raise ModelError(f"shape for input {inp.name!r} has {len(want)} dims, the model has {len(dims)}")
        for dim, value in zip(dims, want):
            dim.Clear()
            if isinstance(value, str):
                dim.dim_param = value
            else:
                dim.dim_value = int(value)
    return model_copy


def ort_fold(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant-fold with onnxruntime's basic offline optimizer (standard ONNX ops; symbolic dims stay symbolic)."""
    import onnxruntime as ort  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "folded.onnx")
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.optimized_model_filepath = out
        opts.log_severity_level = 3
        # ConstantSharing would merge equal weights (e.g. freshly initialised LayerNorm gains) into one parameter.
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"],
                             disabled_optimizers=["ConstantSharing"])
        return onnx.load(out)


def _is_weight(init: onnx.TensorProto) -> bool:
    floating = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    size = 1
    for dim in init.dims:
        size *= dim
    return init.data_type in floating and size > 1


def inline_small_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """Turn integer/bool and scalar initializers into Constant nodes, so that with `keep_params_in_input`
    only real weights become function parameters and shape arithmetic stays foldable at import."""
    graph = model.graph
    keep = [init for init in graph.initializer if _is_weight(init)]
    inline = [init for init in graph.initializer if not _is_weight(init)]
    if not inline:
        return model
    names = {init.name for init in inline}
    consts = [onnx.helper.make_node("Constant", [], [init.name], value=init, name=f"{init.name}__const")
              for init in inline]
    kept_inputs = [inp for inp in graph.input if inp.name not in names]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    del graph.input[:]
    graph.input.extend(kept_inputs)
    nodes = consts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return model
