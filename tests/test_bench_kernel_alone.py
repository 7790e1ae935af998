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


def test_a_kernel_no_call_names_is_one_error_line(capsys):
    """Found before any timing: one `error:` line and exit status 2 (a tiny VM here, no export)."""
    import numpy as np
    import tvm
    from tvm import relax

    from bench.kernel_alone import capture

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(x, x))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())
    arg = tvm.runtime.tensor(np.ones(4, "float32"))
    name, _, args = capture(vm, lambda: vm["main"](arg), "add")
    assert "add" in name and np.array_equal(args[0].numpy(), np.ones(4))
    with pytest.raises(SystemExit) as stop:
        capture(vm, lambda: vm["main"](arg), "no_such_kernel")
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == "error: no kernel whose name holds 'no_such_kernel' ran"
