"""User-facing errors: each one is a single clear line and exit code 2."""


class TvmfuseError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""

    exit_code = 2


class ModelError(TvmfuseError):
    """The ONNX file is missing, unreadable, or uses something tvmfuse cannot import."""


class JobError(TvmfuseError):
    """A jobs file or command-line job description is invalid."""
