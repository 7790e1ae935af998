"""User-facing errors: each one is a single clear line and exit code 2."""


class TvmfuseError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""

    exit_code = 2


class ModelError(TvmfuseError):
    """The ONNX file is missing, unreadable, or uses something tvmfuse cannot import."""


class JobError(TvmfuseError):
    """A jobs file or command-line job description is invalid."""


class VerificationError(TvmfuseError):
    """The built module's outputs are outside the dtype's tolerance of onnxruntime's."""

    def __init__(self, message: str, low_lookups: bool = False, errors: str = ""):
        super().__init__(message)
        self.low_lookups = low_lookups  # the build had fp16/bf16 embedding lookups (rebuilding without may pass)
        self.errors = errors or message.splitlines()[0]  # what was off: "max abs err X, max rel err Y"
