"""`python -m tvmfuse COMMAND ...`: dispatch to the module that owns each command."""

from __future__ import annotations

import importlib
import sys

#: command -> module defining `main(argv) -> int` (argument parsing lives there, the work in the library)
COMMANDS = {
    "tune": "tvmfuse.cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m tvmfuse {" + ",".join(sorted(COMMANDS)) + "} ...", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
