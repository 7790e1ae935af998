"""tvmfuse: fuse transformer operators and tune the fused kernels with Apache TVM."""

__version__ = "0.1.0"

from . import inspect_cache as _inspect_cache

_inspect_cache.install()


def load(path: str, device=None):
    """Load an export (`<out>/<model>-<target>/`): checks the manifest's sha256, returns a callable model."""
    from .runtime import load as _load  # pylint: disable=import-outside-toplevel

    return _load(path, device)
