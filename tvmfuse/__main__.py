"""`python -m tvmfuse COMMAND ...` (see tvmfuse.cli)."""

import sys

from tvmfuse.cli import main

if __name__ == "__main__":
    sys.exit(main())
