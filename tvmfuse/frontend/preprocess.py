"""ONNX-level preparation: pin user-fixed input dims, fold constants, inline the initializers that are not weights."""

from __future__ import annotations

import os
import tempfile

import onnx

from tvmfuse.frontend.onnx_io import has_external_data, is_external, materialize


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


def ort_fold(model: onnx.ModelProto, folder: str | None = None) -> onnx.ModelProto:
    """Constant-fold with onnxruntime's basic offline optimizer (standard ONNX ops; symbolic dims stay symbolic).
    Initializers stored as external data are graph inputs while it folds (`without_external_weights`): the graph
    handed to onnxruntime is small however large the weights, and they come back unread, as they were."""
    import onnxruntime as ort  # noqa: PLC0415


    if has_external_data(model):
        skeleton, weights = without_external_weights(model)
        return with_weights(ort_fold(skeleton), weights)

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


def holds_bf16(model: onnx.ModelProto) -> bool:
    """Whether the graph has bfloat16 initializers or inputs: onnxruntime's CPU provider has no bf16 kernels for
    most ops, so it cannot even open the graph to fold it (a model stored in bf16)."""
    graph = model.graph
    return (any(init.data_type == onnx.TensorProto.BFLOAT16 for init in graph.initializer)
            or any(i.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 for i in graph.input))


def _is_weight(init: onnx.TensorProto) -> bool:
    floating = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    size = 1
    for dim in init.dims:
        size *= dim
    return init.data_type in floating and size > 1


def without_external_weights(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """A copy of `model` whose external-data initializers are graph inputs instead, and those initializers."""

    out = onnx.ModelProto()
    out.CopyFrom(model)
    weights = [init for init in out.graph.initializer if is_external(init)]
    names = {w.name for w in weights}
    kept = [init for init in out.graph.initializer if init.name not in names]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    declared = {i.name for i in out.graph.input}
    out.graph.input.extend(onnx.helper.make_tensor_value_info(w.name, w.data_type, list(w.dims))
                           for w in weights if w.name not in declared)
    return out, weights


def with_weights(model: onnx.ModelProto, weights: list[onnx.TensorProto]) -> onnx.ModelProto:
    """`model` with `weights` (from `without_external_weights`) initializers again, no longer graph inputs."""
    names = {w.name for w in weights}
    kept = [i for i in model.graph.input if i.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.graph.initializer.extend(weights)
    return model


def inline_small_initializers(model: onnx.ModelProto, folder: str | None = None) -> onnx.ModelProto:
    """Turn integer/bool and scalar initializers into Constant nodes, so that with `keep_params_in_input`
    only real weights become function parameters and shape arithmetic stays foldable at import (an external
    one's values are read from `folder` for that)."""

    graph = model.graph
    keep = [init for init in graph.initializer if _is_weight(init)]
    inline = [materialize(init, folder or ".") if is_external(init) else init
              for init in graph.initializer if not _is_weight(init)]
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
