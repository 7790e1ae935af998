"""The command line: every argument parser lives here and only calls the library. `python -m tvmfuse COMMAND`
dispatches through COMMANDS; `scripts/tune.py` is `tune`."""

from __future__ import annotations

import importlib
import sys

#: command -> "module" defining `main(argv) -> int`, or "module:function"
COMMANDS = {
    "tune": "tvmfuse.cli.tune",
    "plan": "tvmfuse.cli.plan",
    "schedules": "tvmfuse.cli.schedules",
    "serve": "tvmfuse.cli.serve:serve_main",
    "queue": "tvmfuse.cli.serve:queue_main",
    "generate": "tvmfuse.cli.generate",
}


def main(argv: list[str] | None = None) -> int:
    """Run one command (`argv[0]`) with the rest of `argv`; usage and exit 2 for an unknown one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m tvmfuse {" + ",".join(sorted(COMMANDS)) + "} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, _, function = COMMANDS[argv[0]].partition(":")
    return getattr(importlib.import_module(module), function or "main")(argv[1:])
