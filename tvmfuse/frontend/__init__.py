"""Robust ONNX -> Relax import: graph pre-processing plus tvmfuse's converter overrides for TVM's frontend."""

from __future__ import annotations

import onnx
import tvm

from .convert_map import unsupported_ops
from .importer import import_graph
from .preprocess import inline_small_initializers, ort_fold, pin_input_dims

__all__ = ["from_onnx", "unsupported_ops"]


def from_onnx(model: onnx.ModelProto, shape_dict: dict[str, list[int | str]] | None = None,
              keep_params_in_input: bool = True) -> tvm.IRModule:
    """Drop-in for `tvm.relax.frontend.onnx.from_onnx`: dims in `shape_dict` are specialised, the rest stay symbolic."""
    prepared = inline_small_initializers(ort_fold(pin_input_dims(model, shape_dict)))
    return import_graph(prepared, shape_dict, keep_params_in_input)
