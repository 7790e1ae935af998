"""The embedded default job's model: both starting patterns fire, and it is valid ONNX."""

from tvmfuse.frontend.default_model import make_tiny_block
from tvmfuse.fuse.fusion import lower
from tvmfuse.frontend.importer import import_model


def test_tiny_block_holds_both_patterns():
    imp = import_model(make_tiny_block())
    fused = lower(imp.mod, imp.params)
    assert sorted(fused.kernel_patterns.values()) == [
        "tvmfuse.layer_norm_gelu", "tvmfuse.matmul_bias", "tvmfuse.matmul_bias", "tvmfuse.rms_norm_residual"]
    assert len(fused.kernels()) == 4
    assert [o.name for o in imp.outputs] == ["y", "h"]
