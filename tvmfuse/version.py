"""The package version (read by the manifest and `tvmfuse.__version__`)."""

__version__ = "0.1.0"
