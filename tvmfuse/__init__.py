"""tvmfuse: fuse transformer operators and tune the fused kernels with Apache TVM."""

from tvmfuse import inspect_cache as _inspect_cache
from tvmfuse.version import __version__

__all__ = ["__version__", "load"]

_inspect_cache.install()


def load(path: str, device=None):
    """Load an export (`<out>/<model>-<target>/`): checks the manifest's sha256, returns a callable model."""
    from tvmfuse.export.runtime import load as _load  # pylint: disable=import-outside-toplevel

    return _load(path, device)
