"""onnxruntime's reference outputs computed in a child process, so a big model's fp32 reference copy of the weights
never adds to the build process's memory (and an out-of-memory kill takes the child, not the build).

    python -m tvmfuse.verify.child_reference MODEL.onnx FEEDS.npz OUTPUTS.npz
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile

import numpy as np

from tvmfuse.errors import TvmfuseError


def reference_in_child(path: str, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], int]:
    """onnxruntime's outputs for the model file `path` on `feeds`, computed by a child process, and the largest
    peak RSS (bytes) of this process's children so far."""
    with tempfile.TemporaryDirectory(prefix="tvmfuse-reference-") as tmp:
        feeds_file, outputs_file = os.path.join(tmp, "feeds.npz"), os.path.join(tmp, "outputs.npz")
        np.savez(feeds_file, **feeds)
        proc = subprocess.run([sys.executable, "-m", "tvmfuse.verify.child_reference", path, feeds_file, outputs_file],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            if proc.returncode == TvmfuseError.exit_code:  # the child's own one-line error (onnxruntime cannot load
                # the model, or run it on these inputs)
                raise TvmfuseError(last)
            killed = " (killed: out of memory?)" if proc.returncode in (-9, 137) else ""
            raise TvmfuseError(f"{path}: the onnxruntime reference failed{killed}: {last}")
        with np.load(outputs_file) as data:
            outputs = [data[f"out{i}"] for i in range(len(data.files))]
    return outputs, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def main(argv: list[str]) -> int:
    from tvmfuse.frontend import onnx_io  # pylint: disable=import-outside-toplevel

    path, feeds_file, outputs_file = argv
    with np.load(feeds_file) as data:
        feeds = {k: data[k] for k in data.files}
    try:
        session = onnx_io.ort_session(path, low_memory=True)
        outputs = onnx_io.ort_run(session, feeds)
    except TvmfuseError as err:  # one line, and the exit code that tells the parent it is one
        print(err, file=sys.stderr)
        return err.exit_code
    np.savez(outputs_file, **{f"out{i}": o for i, o in enumerate(outputs)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
