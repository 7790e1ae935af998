#!/usr/bin/env python3
"""Batch front door: import, fuse, tune, verify and export each ONNX model (see --help)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tvmfuse.cli.tune import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
