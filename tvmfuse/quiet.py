"""Keep TVM's C++ log lines (`[hh:mm:ss] file.cc:123: Warning: ...`, the VM's "Scope Saving:" / "Scope Loaded:"
chatter, one line per constant of a library exported after a VM ran it, as tvmfuse's own exports did before
`build.library`) out of the user's stderr: the command line's unless `--verbose`, and
`tvmfuse.load`'s while it loads a library; everything else written to stderr, errors included, passes through."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

#: a line TVM's native logging wrote: `[time] path/file.cc:line: ...`, or the VM executable's scope messages
NATIVE_LOG = re.compile(r"^(\[\d{2}:\d{2}:\d{2}\] \S+\.(cc|cpp|h):\d+: |(Warning: )?Scope (Saving|Loaded):)")
#: native lines that still reach the user
KEEP = re.compile(r"Error|error:|Check failed|Fatal")


def is_native_log(line: str) -> bool:
    """Whether `line` is TVM native log chatter (not an error) that the command line hides."""
    return bool(NATIVE_LOG.match(line)) and not KEEP.search(line)


@contextlib.contextmanager
def quiet_native_logs(enabled: bool = True, fd: int = 2):
    """While active, file descriptor `fd` (stderr) goes through a filter that drops `is_native_log` lines; C++
    writes to the descriptor directly, so the filter sits below Python's `sys.stderr`."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    out = os.dup(saved)  # the pump's own copy: `saved` is closed when the filter ends, the pump may run on
    read, write = os.pipe()
    os.dup2(write, fd)
    os.close(write)

    def pump() -> None:
        with os.fdopen(read, "rb") as src, os.fdopen(out, "wb", buffering=0) as dst:
            for line in src:
                if not is_native_log(line.decode("utf-8", errors="replace")):
                    dst.write(line)

    thread = threading.Thread(target=pump, name="tvmfuse-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, fd)  # closes the pipe's write end here: the pump ends once child processes let go of it too
        os.close(saved)
        thread.join(timeout=2)
