"""Shared fixtures: the tests folder on sys.path, GPU tests skipped cleanly without a GPU."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
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
