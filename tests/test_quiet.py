"""tvmfuse.quiet: TVM's C++ log lines stay out of the command line's stderr unless --verbose, and out of
tvmfuse.load's; errors pass."""

import subprocess
import sys
import textwrap

from tvmfuse.quiet import is_native_log

NATIVE = [
    "[23:12:01] /workspace/tvm/src/runtime/vm/executable.cc:137: Warning: Scope Saving: 12 functions",
    "[23:12:01] /workspace/tvm/src/runtime/vm/executable.cc:210: Scope Loaded: 12 functions",
    "Warning: Scope Saving:",
    "Scope Loaded: constant pool",
]
KEPT = [
    "error: m.onnx: no such file",
    "[23:12:01] /workspace/tvm/src/runtime/logging.cc:42: Check failed: x == y",
    "[tiny-block] 4 kernels, 4 fused by pattern",
    "Traceback (most recent call last):",
]


def test_native_log_lines_are_recognised_and_errors_are_not():
    assert [is_native_log(line) for line in NATIVE] == [True] * len(NATIVE)
    assert [is_native_log(line) for line in KEPT] == [False] * len(KEPT)


def _run(enabled: bool) -> str:
    """A child that writes every line above straight to file descriptor 2 (as C++ does) inside the filter."""
    code = textwrap.dedent(f"""
        import os, sys
        from tvmfuse.quiet import quiet_native_logs
        with quiet_native_logs({enabled}):
            for line in {NATIVE + KEPT!r}:
                os.write(2, (line + "\\n").encode())
            print("from python", file=sys.stderr)
        print("after", file=sys.stderr)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stderr


def test_the_filter_drops_native_lines_written_to_the_descriptor():
    assert _run(True).splitlines() == KEPT + ["from python", "after"]


def test_verbose_keeps_everything():
    assert _run(False).splitlines() == NATIVE + KEPT + ["from python", "after"]
