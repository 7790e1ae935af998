"""bench/kernel_alone.py on CPU (--smoke: tiny BERT, llvm): the kernel found by name, timed on the model's
arguments and on random ones, and the arguments' statistics written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *extra):
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernel_alone.py"), "--smoke", "--out",
                           str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--iters", "5", *extra],
                          capture_output=True, text=True, timeout=600, check=False)


def test_smoke_times_the_named_kernel_on_the_models_and_on_random_arguments(tmp_path):
    pytest.importorskip("transformers")
    done = _run(tmp_path, "--kernel", "matmul_relax_add")
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads((tmp_path / "out" / "kernel_alone.json").read_text())["rows"]
    assert "matmul_relax_add" in row["kernel"] and row["dtype"] == "fp32"
    assert row["model_args_us"] > 0 and row["random_args_us"] > 0
    floats = [a for a in row["args"] if "std" in a]
    assert len(floats) >= 3 and all(a["std"] > 0 for a in floats[:2])  # the input and the weight vary


def test_a_kernel_no_call_names_is_one_error_line(tmp_path):
    pytest.importorskip("transformers")
    done = _run(tmp_path, "--kernel", "no_such_kernel")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == \
        "error: no kernel whose name holds 'no_such_kernel' ran"
