"""examples/cpp: build run_model with the system compiler, run it on an llvm export, compare with Python."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest

import onnx_models
from tvmfuse.cli.tune import main
from tvmfuse.export.runtime import load
from tvmfuse.verify.outputs import onnxruntime_outputs

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "cpp")


def build_runner(tmp_path):
    """`make` examples/cpp in a copy under `tmp_path` (skips without the TVM headers and runtime, or a compiler);
    returns the build folder holding `run_model`."""
    tvm_dir, ffi_dir = _package_dir("tvm"), _package_dir("tvm_ffi")
    header = os.path.join(ffi_dir or "", "include", "tvm", "ffi", "extra", "module.h")
    runtime = os.path.join(tvm_dir or "", "lib", "libtvm_runtime.so")
    if not os.path.exists(header) or not os.path.exists(runtime):
        pytest.skip(f"TVM C++ headers or runtime library not found ({header}, {runtime})")
    if not shutil.which("make") or not shutil.which(os.environ.get("CXX", "g++")):
        pytest.skip("no make or C++ compiler on PATH")
    build = tmp_path / "build"
    shutil.copytree(EXAMPLE, build, ignore=shutil.ignore_patterns("run_model"))
    done = subprocess.run(["make", f"PYTHON={sys.executable}"], cwd=build, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return build


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else None


def _parse(stdout: str) -> list[dict]:
    outputs = []
    for m in re.finditer(r"output (\d+) shape \[([\d, ]*)\] dtype float32\nfirst([^\n]*)\nsum (\S+) abs_sum (\S+)",
                         stdout):
        outputs.append({"shape": tuple(int(d) for d in m.group(2).split(",")),
                        "first": np.array([float(v) for v in m.group(3).split()]),
                        "sum": float(m.group(4)), "abs_sum": float(m.group(5))})
    return outputs


def test_cpp_example_matches_python_vm_and_onnxruntime(tmp_path):
    build = build_runner(tmp_path)
    assert subprocess.run([str(build / "run_model")], capture_output=True, timeout=30).returncode == 2  # usage
    bad = subprocess.run([str(build / "run_model"), "m.so", "--device", "tpu"], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and bad.stderr == "error: --device tpu: cpu or cuda\n", bad.stderr

    model = onnx_models.rms_norm_residual(rows=4, hidden=32)  # two inputs, two outputs (a tuple)
    onnx.save(model, tmp_path / "rms.onnx")
    assert main([str(tmp_path / "rms.onnx"), "--target", "llvm", "--trials", "0", "--out", str(tmp_path / "out"),
                 "--logs", str(tmp_path / "logs"), "--schedules", "none"]) == 0
    export = tmp_path / "out" / "rms-llvm"

    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 32)).astype("<f4"), "r": rng.standard_normal((4, 32)).astype("<f4")}
    args = [str(build / "run_model"), str(export / "model.so")]
    for name, array in feeds.items():
        array.tofile(tmp_path / f"{name}.bin")
        args += [str(tmp_path / f"{name}.bin"), ",".join(map(str, array.shape))]
    run = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    got = _parse(run.stdout)

    python_vm = load(str(export))(**feeds)
    reference = onnxruntime_outputs(model, feeds)
    assert len(got) == len(python_vm) == len(reference) == 2
    for cpp, vm_out, ort_out in zip(got, python_vm, reference):
        assert cpp["shape"] == vm_out.shape
        np.testing.assert_allclose(cpp["first"], vm_out.ravel()[:8], rtol=1e-6, atol=1e-6)  # printed with %.9g
        np.testing.assert_allclose(cpp["sum"], vm_out.astype(np.float64).sum(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cpp["abs_sum"], np.abs(vm_out.astype(np.float64)).sum(), rtol=1e-6)
        np.testing.assert_allclose(cpp["first"], ort_out.ravel()[:8], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(cpp["sum"], ort_out.astype(np.float64).sum(), rtol=1e-4, atol=1e-3)



def _cpp_generate(build, export, ids: list[int], new_tokens: int, *extra: str) -> subprocess.CompletedProcess:
    """examples/cpp/generate on `export` with the numbers of its manifest's kv_cache."""
    layout = load(str(export)).manifest["kv_cache"]
    site = layout["caches"][0]
    args = [str(build / "generate"), str(export / "model.so"), "--caches", str(len(layout["caches"])),
            "--capacity", str(layout["capacity"]), "--kv-heads", str(site["kv_heads"]), "--head-dim",
            str(site["head_dim"]), "--ids", ",".join(map(str, ids)), "--new-tokens", str(new_tokens), *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def _rows(stdout: str) -> list[list[int]]:
    return [[int(t) for t in line.split()[1:]] for line in stdout.splitlines() if line.startswith("tokens")]


def test_cpp_generate_matches_python_generate(tmp_path):
    """examples/cpp/generate: the in-place KV cache step driven from C++ (caches allocated once, prefill at
    past_len 0, then one token a step, the next by the export's greedy_tokens, read on the host a window of steps
    at a time) gives the tokens of
    `tvmfuse.load(...).generate`: an fp32 export with embedded weights, and an fp16 one whose weights are outside
    the library (the tensor cache, --weights) at batch 2 (fp16 caches)."""
    pytest.importorskip("transformers")
    import hf_export  # pylint: disable=import-outside-toplevel

    build = build_runner(tmp_path)
    path, out = hf_export.export_with_cache("llama", str(tmp_path)), tmp_path / "out"
    assert main([path, "--target", "llvm", "--trials", "0", "--schedules", "none", "--out", str(out),
                 "--logs", str(out / "logs"), "--max-seq", "24"]) == 0
    export = out / "llama_kv-llvm"
    done = _cpp_generate(build, export, [5, 7, 11, 13], 20)  # a window of 16 steps' ids, then one of 4
    assert done.returncode == 0, done.stderr
    assert "sampler: greedy_tokens" in done.stderr  # the export's sampler, as tvmfuse's generate uses it
    want = load(str(export)).generate(np.array([[5, 7, 11, 13]]), 20).tokens
    assert _rows(done.stdout) == want.tolist()
    too_long = _cpp_generate(build, export, [5, 7, 11, 13], 30)
    assert too_long.returncode == 2 and too_long.stderr.startswith("error:")

    outside = tmp_path / "outside"  # the same step with its weights as external data: outside the library too
    os.makedirs(outside)
    onnx.save_model(onnx.load(path), str(outside / "llama_kv.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="llama_kv.onnx.data", size_threshold=0)
    out16 = tmp_path / "out16"
    assert main([str(outside / "llama_kv.onnx"), "--target", "llvm", "--trials", "0", "--schedules", "none",
                 "--dtype", "fp16", "--out", str(out16), "--logs", str(out16 / "logs"), "--max-seq", "24"]) == 0
    export = out16 / "llama_kv-llvm"
    model = load(str(export))
    assert model.manifest["weights"]["storage"] == "tvm-tensor-cache" and model.manifest["kv_cache"]["dtype"] == "float16"
    done = _cpp_generate(build, export, [5, 7, 11, 13], 8, "--dtype", "float16", "--batch", "2",
                         "--weights", str(export / "weights"))
    assert done.returncode == 0, done.stderr
    want = model.generate(np.array([[5, 7, 11, 13]] * 2), 8).tokens
    assert _rows(done.stdout) == want.tolist()
    bad = _cpp_generate(build, export, [5, 7], 4, "--dtype", "float8")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --dtype float8")


@pytest.mark.gpu
def test_cpp_examples_run_a_cuda_export_on_the_gpu(tmp_path):
    """--device cuda: run_model copies its inputs to the GPU and the outputs back, and generate keeps its caches
    there, reading each step's ids on the host: the same outputs as tvmfuse.load on the same export (an fp16 decoder
    step, its caches fp16)."""
    pytest.importorskip("transformers")
    import hf_export  # pylint: disable=import-outside-toplevel

    build = build_runner(tmp_path)
    model = onnx_models.rms_norm_residual(rows=4, hidden=32)
    onnx.save(model, tmp_path / "rms.onnx")
    assert main([str(tmp_path / "rms.onnx"), "--target", "cuda", "--trials", "0", "--out", str(tmp_path / "out"),
                 "--logs", str(tmp_path / "logs"), "--schedules", "none"]) == 0
    export = next((tmp_path / "out").glob("rms-cuda*"))
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 32)).astype("<f4"), "r": np.ones((4, 32), "<f4")}
    args = [str(build / "run_model"), str(export / "model.so"), "--device", "cuda"]
    for name, array in feeds.items():
        array.tofile(tmp_path / f"{name}.bin")
        args += [str(tmp_path / f"{name}.bin"), ",".join(map(str, array.shape))]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for cpp, want in zip(_parse(run.stdout), load(str(export))(**feeds)):
        np.testing.assert_allclose(cpp["first"], want.ravel()[:8], rtol=1e-5, atol=1e-5)

    path, out = hf_export.export_with_cache("llama", str(tmp_path)), tmp_path / "gen"
    assert main([path, "--target", "cuda", "--trials", "0", "--schedules", "none", "--dtype", "fp16",
                 "--out", str(out), "--logs", str(out / "logs"), "--max-seq", "24"]) == 0
    export = next(out.glob("llama_kv-cuda*"))
    done = _cpp_generate(build, export, [5, 7, 11, 13], 8, "--dtype", "float16", "--batch", "2", "--device", "cuda")
    assert done.returncode == 0, done.stderr
    want = load(str(export)).generate(np.array([[5, 7, 11, 13]] * 2), 8).tokens
    assert _rows(done.stdout) == want.tolist()
