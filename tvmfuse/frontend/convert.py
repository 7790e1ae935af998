"""Robust ONNX -> Relax import: graph pre-processing plus tvmfuse's converter overrides for TVM's frontend."""

from __future__ import annotations

import warnings

import onnx
import tvm

from tvmfuse.errors import ModelError
from tvmfuse.frontend.convert_map import unsupported_ops
from tvmfuse.frontend.graph_importer import import_graph
from tvmfuse.frontend.preprocess import holds_bf16, inline_small_initializers, ort_fold, pin_input_dims

__all__ = ["from_onnx", "unsupported_ops"]


def from_onnx(model: onnx.ModelProto, shape_dict: dict[str, list[int | str]] | None = None,
              keep_params_in_input: bool = True, folder: str | None = None,
              weight_dtype: str | None = None) -> tvm.IRModule:
    """Drop-in for `tvm.relax.frontend.onnx.from_onnx`: dims in `shape_dict` are specialised, the rest stay symbolic.
    `folder`: where the model's external data files are (the model file's folder; None: the current directory);
    `weight_dtype`: read the matmul weights in it (`graph_importer.import_graph`)."""
    missing = unsupported_ops(model)
    if missing:
        op, name = missing[0]
        more = f" ({len(missing) - 1} more unsupported nodes)" if len(missing) > 1 else ""
        raise ModelError(f"cannot import ONNX op {op} (node {name!r}): no Relax converter for it{more}")
    pinned = folded = pin_input_dims(model, shape_dict)
    if not holds_bf16(pinned):  # (a bf16 model: onnxruntime cannot open it; its exporter folded it already)
        try:
            folded = ort_fold(pinned, folder)
        except Exception as exc:  # noqa: BLE001 - folding is an optimisation; convert the unfolded graph instead
            warnings.warn(f"onnxruntime constant folding skipped: {str(exc).strip().splitlines()[0][:200]}")
    # The pinned dims are now in the graph inputs themselves (TVM's shape_dict takes no symbolic names).
    return import_graph(inline_small_initializers(folded, folder), None, keep_params_in_input, folder, weight_dtype)
