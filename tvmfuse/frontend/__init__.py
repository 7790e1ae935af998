"""Frontend stage: an ONNX file (or the embedded default model) becomes a Relax module with detached weights,
through tvmfuse's converter (TVM's ONNX importer with overrides for what exporters emit)."""

from tvmfuse.frontend.default_model import NAME as DEFAULT_MODEL
from tvmfuse.frontend.default_model import make_tiny_block
from tvmfuse.frontend.importer import Imported, TensorInfo, import_model, load_onnx

__all__ = ["DEFAULT_MODEL", "Imported", "TensorInfo", "import_model", "load_onnx", "make_tiny_block"]
