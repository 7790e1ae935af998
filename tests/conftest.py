"""Shared fixtures: the tests folder on sys.path, GPU tests skipped cleanly without a GPU."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import tvmfuse  # noqa: E402,F401  pylint: disable=unused-import,wrong-import-position  (installs inspect_cache)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_cuda() -> bool:
    try:
        import tvm  # pylint: disable=import-outside-toplevel

        return bool(tvm.cuda(0).exist)
    except Exception:  # pylint: disable=broad-except
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llvm():
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    return resolve_target("llvm")


@pytest.fixture(scope="session")
def hf_exports(tmp_path_factory):
    """hf_exports(model, exporter='legacy', dtype='float32') -> the path of a tiny HF export (tests/hf_export.py;
    dtype 'bfloat16': exported in bf16), each made once per test session."""
    hf_export = pytest.importorskip("hf_export")
    folder, cache = tmp_path_factory.mktemp("hf"), {}

    def get(name: str, exporter: str = "legacy", dtype: str = "float32") -> str:
        if (name, exporter, dtype) not in cache:
            if exporter == "dynamo":
                pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript (dev extra)")
            cache[(name, exporter, dtype)] = hf_export.export(name, exporter, str(folder), dtype=dtype)
        return cache[(name, exporter, dtype)]
    return get


@pytest.fixture(scope="session")
def tuned_rms(tmp_path_factory, llvm):
    """One 4-trial tune of the RMSNorm+residual kernel (16 x 64) on llvm, shared by test_tune and test_baseline:
    (fused module, progress per kernel, the trial counts on_progress saw, the work dir)."""
    import onnx_models  # pylint: disable=import-outside-toplevel
    from tvmfuse.fuse.fusion import lower  # pylint: disable=import-outside-toplevel
    from tvmfuse.frontend.importer import import_model  # pylint: disable=import-outside-toplevel
    from tvmfuse.tune.search import tune  # pylint: disable=import-outside-toplevel

    imp = import_model(onnx_models.rms_norm_residual(rows=16, hidden=64))
    fused = lower(imp.mod, imp.params)
    work, seen = str(tmp_path_factory.mktemp("tuned_rms")), []
    progress = tune(fused.mod, llvm, work, trials_per_task=4, on_progress=lambda t: seen.append(t.trials))
    return fused, progress, seen, work
