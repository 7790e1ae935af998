"""`python -m tvmfuse COMMAND ...`: dispatch to the module that owns each command."""

from __future__ import annotations

import importlib
import sys

#: command -> "module" defining `main(argv) -> int`, or "module:function" (argument parsing lives there)
COMMANDS = {
    "tune": "tvmfuse.cli",
    "plan": "tvmfuse.report",
    "schedules": "tvmfuse.schedules_cli",
    "serve": "tvmfuse.remote:serve_main",
    "queue": "tvmfuse.remote:queue_main",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m tvmfuse {" + ",".join(sorted(COMMANDS)) + "} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, _, function = COMMANDS[argv[0]].partition(":")
    return getattr(importlib.import_module(module), function or "main")(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
