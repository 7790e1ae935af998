"""examples/cpp with weights outside the library: `run_model MODEL.so --weights DIR` matches tvmfuse.load."""

from __future__ import annotations

import subprocess

import numpy as np

from test_cpp_example import _parse, build_runner
from test_weights import tiny_external
from tvmfuse.cli.tune import main
from tvmfuse.export.runtime import load
from tvmfuse.verify import onnxruntime_outputs


def test_cpp_example_loads_the_weights_of_an_external_data_export(tmp_path):
    build = build_runner(tmp_path)

    model = tiny_external(str(tmp_path / "m"))
    assert main([model, "--target", "llvm", "--trials", "0", "--out", str(tmp_path / "out"), "--logs",
                 str(tmp_path / "logs"), "--schedules", "none"]) == 0
    export = tmp_path / "out" / "tiny-llvm"
    x = np.random.default_rng(0).standard_normal((4, 64)).astype("<f4")
    x.tofile(tmp_path / "x.bin")
    run = subprocess.run([str(build / "run_model"), str(export / "model.so"), "--weights", str(export / "weights"),
                          str(tmp_path / "x.bin"), "4,64"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    (got,) = _parse(run.stdout)
    want = load(str(export))(x)[0]
    assert got["shape"] == want.shape
    np.testing.assert_allclose(got["first"], want.ravel()[:8], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["sum"], want.astype(np.float64).sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["first"], onnxruntime_outputs(model, {"x": x})[0].ravel()[:8], rtol=1e-4, atol=1e-4)
    # without --weights, main is short of its weight parameters: one clear error
    bare = subprocess.run([str(build / "run_model"), str(export / "model.so"), str(tmp_path / "x.bin"), "4,64"],
                          capture_output=True, text=True, timeout=60)
    assert bare.returncode == 1 and "error:" in bare.stderr and "weight0" in bare.stderr
