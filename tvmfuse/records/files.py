"""Record files: append JSON lines under a lock and fsync them; read them back, skipping corrupt lines."""

from __future__ import annotations

import fcntl
import json
import os
from typing import Callable, Iterable


def append_lines(path: str, lines: Iterable[dict]) -> None:
    """Append JSON lines under an exclusive flock, then fsync; repair a torn last line first."""
    data = "".join(json.dumps(obj, separators=(",", ":")) + "\n" for obj in lines).encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # a crash mid-write left a partial line: never glue a record onto it
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock


def read_lines(path: str, warn: Callable[[str], None]) -> Iterable[tuple[int, dict]]:
    """(line number, object) for every parseable line; one warning per corrupt or truncated line."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # never read a half-written batch of another process
        raw = f.read()
    for number, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except (ValueError, UnicodeDecodeError) as err:
            warn(f"{path}:{number}: skipped corrupt or truncated line ({type(err).__name__}: {str(err)[:60]})")
