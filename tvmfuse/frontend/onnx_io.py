"""ONNX files whose weights are external data (`model.onnx` + `model.onnx.data`), read without ever holding the whole
model in one protobuf message (protobuf cannot serialize one over 2 GB).

The graph is loaded without its external data; each external initializer is checked against its file (present,
long enough) and read from there, relative to the model's own folder, when the importer needs its values.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto

from tvmfuse.errors import ModelError

EXTERNAL = TensorProto.EXTERNAL


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.HasField("data_location") and tensor.data_location == EXTERNAL


def external_initializers(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in model.graph.initializer if is_external(t)]


def has_external_data(model: onnx.ModelProto) -> bool:
    return any(is_external(t) for t in model.graph.initializer)


def _info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of the tensor's values (from dims and dtype; raw or external data alike)."""
    count = 1
    for d in tensor.dims:
        count *= d
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def weights_nbytes(model: onnx.ModelProto) -> int:
    """Bytes of every initializer (the model's weights), without reading them."""
    return sum(tensor_nbytes(t) for t in model.graph.initializer)


def _location(tensor: onnx.TensorProto, folder: str, source: str) -> tuple[str, int, int]:
    """(file, offset, length) of an external initializer, the file relative to `folder` (the model's folder)."""
    info = _info(tensor)
    where = info.get("location", "")
    if not where or os.path.isabs(where) or os.path.normpath(where).startswith(".."):
        raise ModelError(f"{source}: initializer {tensor.name}: external data location {where!r} is not a "
                         "path inside the model's folder")
    offset = int(info.get("offset", 0) or 0)
    length = int(info["length"]) if info.get("length") else tensor_nbytes(tensor)
    return os.path.join(folder, where), offset, length


def check_external_data(model: onnx.ModelProto, folder: str, source: str) -> None:
    """Every external initializer's file exists and holds its bytes (offset + length); else one ModelError."""
    sizes: dict[str, int] = {}
    for tensor in external_initializers(model):
        path, offset, length = _location(tensor, folder, source)
        if path not in sizes:
            if not os.path.isfile(path):
                raise ModelError(f"{source}: external data file {os.path.relpath(path, folder)} (initializer "
                                 f"{tensor.name}) is missing; it must lie beside the model as its location says")
            sizes[path] = os.path.getsize(path)
        if length != tensor_nbytes(tensor):
            raise ModelError(f"{source}: initializer {tensor.name}: external data length {length} bytes, its "
                             f"shape and dtype need {tensor_nbytes(tensor)}")
        if offset + length > sizes[path]:
            raise ModelError(f"{source}: external data file {os.path.relpath(path, folder)} is truncated: "
                             f"{sizes[path]} bytes, initializer {tensor.name} needs bytes {offset}..{offset + length}")


def read_external(tensor: onnx.TensorProto, folder: str, source: str = "model") -> np.ndarray:
    """The values of an external initializer, read from its file (one copy in memory; the proto stays empty)."""
    path, offset, length = _location(tensor, folder, source)
    if tensor.data_type in (TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2):
        raise ModelError(f"{source}: initializer {tensor.name}: external {TensorProto.DataType.Name(tensor.data_type)} "
                         "weights are not supported yet")
    bf16 = tensor.data_type == TensorProto.BFLOAT16  # read as its 16-bit words, then viewed as ml_dtypes' bfloat16
    dtype = np.dtype("<u2") if bf16 else np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
    count = length // dtype.itemsize
    with open(path, "rb") as f:
        f.seek(offset)
        array = np.fromfile(f, dtype=dtype, count=count)
    if array.size != count:
        raise ModelError(f"{source}: external data file {path} is truncated (initializer {tensor.name})")
    array = array.astype(dtype.newbyteorder("="), copy=False).reshape(tuple(tensor.dims))
    if bf16:
        import ml_dtypes  # pylint: disable=import-outside-toplevel

        return array.view(ml_dtypes.bfloat16)
    return array


def cast_array(array: np.ndarray, dtype: str) -> np.ndarray:
    """`array` in `dtype` ("bfloat16": ml_dtypes' bfloat16, which TVM tensors take)."""
    if dtype == "bfloat16":
        import ml_dtypes  # pylint: disable=import-outside-toplevel

        return array.astype(ml_dtypes.bfloat16)
    return array.astype(dtype)


def materialize(tensor: onnx.TensorProto, folder: str, source: str = "model") -> onnx.TensorProto:
    """A copy of an external initializer with its values inline (for small tensors that become Constant nodes)."""
    out = onnx.TensorProto()
    out.CopyFrom(tensor)
    out.raw_data = read_external(tensor, folder, source).astype(
        np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")).tobytes()
    del out.external_data[:]
    out.data_location = TensorProto.DEFAULT
    return out


def ort_session(model: onnx.ModelProto | str, options=None, low_memory: bool = False):
    """An onnxruntime CPU session: from the file when given a path (its external data read from the model's
    folder, nothing serialized), from the serialized proto otherwise. `low_memory`: no pre-packed copies of the
    weights (MatMul's packed B doubled a big model's weights)."""
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel

    from onnxruntime.capi import onnxruntime_pybind11_state as state  # pylint: disable=import-outside-toplevel

    opts = options or ort.SessionOptions()
    if low_memory:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    source = model if isinstance(model, str) else model.SerializeToString()
    try:
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    except (state.Fail, state.InvalidGraph, state.InvalidProtobuf, state.NotImplemented) as err:
        # (a model of a newer ONNX IR version than this onnxruntime reads, or an operator it lacks: verification
        # needs onnxruntime to run the model, so the job stops here with one line, not an internal error)
        proto = onnx.load(model, load_external_data=False) if isinstance(model, str) else model
        name = model if isinstance(model, str) else proto.graph.name or "the model"
        raise ModelError(f"{name}: onnxruntime {ort.__version__}, which verification runs it on, cannot load it "
                         f"(ONNX IR version {proto.ir_version}; a newer onnxruntime may): "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def ort_run(session, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """`session.run` on `feeds`; where onnxruntime rejects them (the shapes the job asked for are ones the model
    cannot run: a sequence longer than its position table), one ModelError line naming the node and the inputs'
    shapes, not an internal error."""
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel

    from onnxruntime.capi import onnxruntime_pybind11_state as state  # pylint: disable=import-outside-toplevel

    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # fatal only: its own log line of the failure would come before ours
    try:
        return session.run(None, feeds, quiet)
    except (state.Fail, state.InvalidArgument, state.RuntimeException) as err:
        raise ModelError(ort_run_error(str(err), feeds)) from None


def ort_run_error(message: str, feeds: dict[str, np.ndarray]) -> str:
    """The line for onnxruntime's run-time `message` on `feeds`: its node, what it said, the inputs' shapes."""
    import re  # pylint: disable=import-outside-toplevel

    shapes = ", ".join(f"{k} {'x'.join(map(str, v.shape)) or 'scalar'}" for k, v in feeds.items())
    found = re.search(r"running (\w+) node\. Name:'([^']*)' Status Message: (.*)", message)
    what = found[3] if found else (message.strip().splitlines() or ["no message"])[0].split(" : ")[-1]
    what = re.sub(r"^/\S+:\d+ [^(]*\([^)]*\) ", "", what.strip())  # onnxruntime's source line and function
    said = f"its {found[1]} node {found[2]!r}: {what}" if found else what
    hint = (" (an index past the end of a table: a sequence longer than the model's positions?)"
            if "out of data bounds" in what else " (a dim the model fixes, such as its positions, smaller than the "
            "input's?)" if "broadcast" in what else "")
    return f"onnxruntime cannot run the model on these inputs ({shapes}): {said}{hint}"
