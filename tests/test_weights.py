"""Weights outside the library (tvmfuse.export.weights, tvmfuse.frontend.onnx_io): ONNX external data, the tensor-cache export,
loading it (tvmfuse.load, plain TVM), bad input, and a model over protobuf's 2 GB limit (slow)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnx_models
from conftest import ROOT
from tvmfuse.cli.tune import main
from tvmfuse.errors import TvmfuseError
from tvmfuse.export.runtime import load
from tvmfuse.verify import onnxruntime_outputs

TUNE = os.path.join(ROOT, "scripts", "tune.py")


def tiny_external(folder, name="tiny", k=64, n=96) -> str:
    """MatMul -> LayerNorm -> Gelu, every initializer external data in `folder`/weights/NAME.data."""
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array((rng.standard_normal((k, n)) / 8).astype("float32"), "w"),
             onnx.numpy_helper.from_array(rng.standard_normal(n).astype("float32"), "g"),
             onnx.numpy_helper.from_array(rng.standard_normal(n).astype("float32"), "b")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
             helper.make_node("LayerNormalization", ["mm", "g", "b"], ["ln"], axis=-1, epsilon=1e-5),
             helper.make_node("Gelu", ["ln"], ["y"])]
    model = onnx_models._model(nodes, [onnx_models._f32("x", [4, k])], [onnx_models._f32("y", [4, n])], inits)
    os.makedirs(os.path.join(folder, "weights"), exist_ok=True)
    path = os.path.join(folder, f"{name}.onnx")
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"weights/{name}.data", size_threshold=0)
    return path


def _tune(model, out, cwd, *extra):
    return subprocess.run([sys.executable, TUNE, "--target", "llvm", "--trials", "0", str(model), "--out", str(out),
                           "--logs", str(out) + "-logs", "--schedules", "none", *extra],
                          capture_output=True, text=True, cwd=cwd, timeout=900,
                          env={**os.environ, "PYTHONPATH": ROOT})


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """The tiny external-data model built from another folder (external data is read beside the model)."""
    tmp = tmp_path_factory.mktemp("ext")
    model = tiny_external(str(tmp / "model"))
    (tmp / "elsewhere").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp / "elsewhere")
    try:
        assert main([model, "--target", "llvm", "--trials", "0", "--out", str(tmp / "out"), "--logs",
                     str(tmp / "logs"), "--schedules", "none"]) == 0
    finally:
        os.chdir(cwd)
    return model, tmp / "out" / "tiny-llvm"


def test_external_data_in_a_sub_folder_builds_verifies_and_loads(tiny_export, tmp_path, monkeypatch):
    model, export = tiny_export
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["format"] == 2 and manifest["verification"]["status"] == "passed"
    stored = manifest["weights"]
    assert stored["storage"] == "tvm-tensor-cache" and stored["encoding"] == "raw"
    assert stored["count"] == 1 and stored["nbytes"] == 64 * 96 * 4  # w; the LayerNorm's 96-float g, b stay inline
    assert sorted(os.listdir(export / "weights")) == sorted(stored["files"])
    assert manifest["build"]["wall_s"] > 0 and manifest["build"]["peak_rss_bytes"] > 0
    assert manifest["build"]["weights_bytes"] == (64 * 96 + 2 * 96) * 4
    monkeypatch.chdir(tmp_path)  # loading does not depend on the cwd either
    x = np.random.default_rng(1).standard_normal((4, 64)).astype("float32")
    np.testing.assert_allclose(load(str(export))(x)[0], onnxruntime_outputs(model, {"x": x})[0], atol=1e-4, rtol=1e-4)


def test_weights_stay_out_of_the_library(tiny_export, tmp_path):
    """The same graph with inline weights embeds them: its library is larger by about the weights' bytes."""
    _, export = tiny_export
    inline = onnx.load(tiny_external(str(tmp_path / "m")))  # loads the external data back in
    onnx.save(inline, tmp_path / "inline.onnx")
    assert main([str(tmp_path / "inline.onnx"), "--target", "llvm", "--trials", "0", "--out", str(tmp_path / "out"),
                 "--logs", str(tmp_path / "logs"), "--schedules", "none"]) == 0
    embedded = tmp_path / "out" / "inline-llvm"
    assert json.loads((embedded / "manifest.json").read_text())["weights"] == {"storage": "embedded"}
    assert not (embedded / "weights").exists()
    grown = os.path.getsize(embedded / "model.so") - os.path.getsize(export / "model.so")
    assert grown >= 64 * 96 * 4 * 0.9, grown
    totals = [json.loads((e / "manifest.json").read_text())["fusion"] for e in (export, embedded)]
    assert totals[0] == totals[1]  # the report's stock lowering (weights as stand-in params) counts the same


def test_weights_switch_puts_them_outside_or_inside_whatever_the_model_is(tiny_export, tmp_path):
    """--weights external: an inline model's weights go to weights/ (the same library as the external-data build's);
    --weights library: an external-data model's go into model.so. Both verify and load to onnxruntime's numbers."""
    model, export = tiny_export
    inline = onnx.load(tiny_external(str(tmp_path / "m")))
    onnx.save(inline, tmp_path / "inline.onnx")
    x = np.random.default_rng(2).standard_normal((4, 64)).astype("float32")
    want = onnxruntime_outputs(model, {"x": x})[0]
    for source, placement, storage in ((tmp_path / "inline.onnx", "external", "tvm-tensor-cache"),
                                       (model, "library", "embedded")):
        out = tmp_path / placement
        assert main([str(source), "--target", "llvm", "--trials", "0", "--out", str(out), "--logs",
                     str(tmp_path / "logs"), "--schedules", "none", "--weights", placement]) == 0
        built = next(out.glob("*-llvm"))
        manifest = json.loads((built / "manifest.json").read_text())
        assert manifest["weights"]["storage"] == storage and manifest["verification"]["status"] == "passed"
        assert (built / "weights").exists() == (placement == "external")
        np.testing.assert_allclose(load(str(built))(x)[0], want, atol=1e-4, rtol=1e-4)
    assert os.path.getsize(tmp_path / "external" / "inline-llvm" / "model.so") == os.path.getsize(export / "model.so")


def test_weights_in_the_library_over_its_limit_is_one_error_line_and_nothing_written(tmp_path):
    """A library's constants must stay under 2 GiB: --weights library refuses a model whose weights reach it before
    building anything (the limit lowered here below the tiny model's 25 KB)."""
    model = tiny_external(str(tmp_path / "m"))
    script = ("import sys; from tvmfuse.export import weights; weights.LIBRARY_MAX_BYTES = 16384; "
              "from tvmfuse.cli.tune import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", script, "--target", "llvm", "--trials", "0", model, "--out",
                           str(tmp_path / "out"), "--logs", str(tmp_path / "logs"), "--weights", "library"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2, done.stdout + done.stderr
    assert _errors(done.stderr) == [
        "error: --weights library: the model's weights are 0.0 MiB, and a library's constants must stay under 0 MiB "
        "(they do not link above it, TVM issue #10882); use --weights auto or external"], done.stderr
    assert not (tmp_path / "out" / "tiny-llvm").exists()


def test_weights_placement_is_checked_from_the_command_line_and_a_jobs_file(tmp_path):
    from tvmfuse.errors import JobError  # pylint: disable=import-outside-toplevel
    from tvmfuse.export.weights import outside  # pylint: disable=import-outside-toplevel
    from tvmfuse.jobs import load_jobs  # pylint: disable=import-outside-toplevel

    assert [outside(False, 10, p) for p in ("auto", "external", "library")] == [False, True, False]
    assert [outside(True, 10, p) for p in ("auto", "external", "library")] == [True, True, False]
    assert outside(False, 1 << 30) and not outside(False, (1 << 30) - 1)
    with pytest.raises(TvmfuseError, match=r"--weights library: the model's weights are 3,072.0 MiB, and a library's "
                                           r"constants must stay under 2,048 MiB"):
        outside(True, 3 << 30, "library")
    jobs = tmp_path / "jobs.toml"
    jobs.write_text('weights = "external"\n[[model]]\npath = "a.onnx"\n[[model]]\npath = "b.onnx"\n'
                    'weights = "library"\n')
    assert [j.weights for j in load_jobs(str(jobs))] == ["external", "library"]
    assert [j.weights for j in load_jobs(str(jobs), weights="library")] == ["external", "library"]
    jobs.write_text('[[model]]\npath = "a.onnx"\nweights = "outside"\n')
    with pytest.raises(JobError, match=r"jobs.toml: model #1: weights 'outside': expected one of auto, external, "
                                       r"library"):
        load_jobs(str(jobs))
    bad = _tune("m.onnx", tmp_path / "o", tmp_path, "--weights", "outside")
    assert bad.returncode == 2 and "invalid choice: 'outside'" in bad.stderr


def test_plain_tvm_recipe_in_the_readme_loads_the_weights(tiny_export, tmp_path, monkeypatch):
    """The README's nothing-but-TVM recipe for an export with weights/, run as written (folder and input set)."""
    model, export = tiny_export
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"With nothing but TVM, weights outside.*?```python\n(.*?)```", readme, re.S)
    assert block, "README: no plain-TVM recipe for weights outside the library"
    x = np.random.default_rng(2).standard_normal((4, 64)).astype("float32")
    monkeypatch.chdir(tmp_path)
    scope = {"x": x}
    code = block.group(1).replace('"out/big-llvm"', repr(str(export)))
    exec(compile(code, "README.md", "exec"), scope)  # pylint: disable=exec-used
    np.testing.assert_allclose(scope["y"].numpy(), onnxruntime_outputs(model, {"x": x})[0], atol=1e-4, rtol=1e-4)


def test_changed_weight_shard_is_refused_at_load(tiny_export, tmp_path):
    _, export = tiny_export
    copy = tmp_path / "copy"
    shutil.copytree(export, copy)
    shard = copy / "weights" / "params_shard_0.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(TvmfuseError, match=r"params_shard_0.bin: sha256 does not match manifest.json"):
        load(str(copy))
    shard.unlink()
    with pytest.raises(TvmfuseError, match=r"params_shard_0.bin: missing"):
        load(str(copy))


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_external_data_is_one_error_line(tmp_path, damage):
    model = tiny_external(str(tmp_path / "m"))
    data = tmp_path / "m" / "weights" / "tiny.data"
    if damage == "missing":
        data.unlink()
    else:
        data.write_bytes(data.read_bytes()[:1000])
    proc = _tune(model, tmp_path / "out", str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = _errors(proc.stderr)
    want = "weights/tiny.data (initializer w) is missing" if damage == "missing" else "weights/tiny.data is truncated"
    assert len(errors) == 1 and want in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")  # nothing half-written


def test_too_little_memory_for_the_reference_skips_verification(tmp_path, monkeypatch):
    model = tiny_external(str(tmp_path / "m"))
    monkeypatch.setenv("TVMFUSE_AVAILABLE_MEMORY", str(1 << 20))
    assert main([model, "--target", "llvm", "--trials", "0", "--out", str(tmp_path / "out"), "--logs",
                 str(tmp_path / "logs"), "--schedules", "none"]) == 0
    verification = json.loads((tmp_path / "out" / "tiny-llvm" / "manifest.json").read_text())["verification"]
    assert verification["status"] == "skipped" and "too little free memory" in verification["reason"]


def big_chain(folder, layers: int = 9, dim: int = 8192, rows: int = 4) -> tuple[str, int]:
    """y = x @ W0 @ W1 ... (fp32 [dim, dim] each; 9 x 8192^2 x 4 B = 2.4 GB): the weights written to
    `folder`/big.onnx.data one at a time (4 KiB-aligned), the graph to big.onnx. Returns (path, weight bytes)."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    inits, nodes, offset = [], [], 0
    with open(os.path.join(folder, "big.onnx.data"), "wb") as f:
        for i in range(layers):
            w = rng.standard_normal((dim, dim), dtype=np.float32)
            w *= np.float32(1 / np.sqrt(dim))
            offset = (offset + 4095) // 4096 * 4096
            f.seek(offset)
            w.tofile(f)
            t = TensorProto(name=f"w{i}", dims=[dim, dim], data_type=TensorProto.FLOAT,
                            data_location=TensorProto.EXTERNAL)
            for key, value in (("location", "big.onnx.data"), ("offset", str(offset)), ("length", str(w.nbytes))):
                t.external_data.add(key=key, value=value)
            inits.append(t)
            offset += w.nbytes
            del w
            nodes.append(helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", f"w{i}"],
                                          ["y" if i == layers - 1 else f"h{i + 1}"]))
    graph = helper.make_graph(nodes, "big", [onnx_models._f32("x", [rows, dim])], [onnx_models._f32("y", [rows, dim])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    path = os.path.join(folder, "big.onnx")
    onnx.save_model(model, path)  # the graph only: its initializers already point at big.onnx.data
    return path, layers * dim * dim * 4


@pytest.mark.slow
def test_model_over_2gb_builds_verifies_and_exports_with_weights_outside(tmp_path):
    """9 x [8192, 8192] fp32 MatMuls (2.4 GB of external data): over protobuf's 2 GB limit. Built in a subprocess
    (its own peak RSS, in the manifest): verified against onnxruntime, model.so under 50 MB, peak RSS under 3x
    the weights' bytes."""
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if free < 8 << 30:
        pytest.skip(f"needs ~8 GB of free memory ({free / 2**30:.1f} GB free)")
    path, weight_bytes = big_chain(str(tmp_path / "m"), rows=1)
    assert weight_bytes > 2 << 30
    proc = _tune(path, tmp_path / "out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    export = tmp_path / "out" / "big-llvm"
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "passed", manifest["verification"]
    assert os.path.getsize(export / "model.so") < 50 << 20
    stored = manifest["weights"]
    assert stored["storage"] == "tvm-tensor-cache" and stored["nbytes"] == weight_bytes and stored["count"] == 9
    assert sum(os.path.getsize(export / "weights" / f) for f in stored["files"]) >= weight_bytes
    build = manifest["build"]
    assert build["weights_bytes"] == weight_bytes
    assert build["peak_rss_bytes"] < 3 * weight_bytes, build
    assert manifest["verification"]["reference_peak_rss_bytes"] > weight_bytes  # its fp32 copy: in a child
    assert re.search(r"build big: [\d.]+ s wall, peak RSS \d+ MiB", proc.stdout), proc.stdout[-2000:]
    print(f"build: {build['wall_s']} s wall, peak RSS {build['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"({build['peak_rss_bytes'] / weight_bytes:.2f}x the weights)")


def test_big_model_in_fp16_reads_its_matmul_weights_in_fp16_and_verifies(tmp_path):
    """A model whose weights go outside, built in fp16: the MatMul weight is read as fp16 (its param stays fp32 in
    the graph), the LayerNorm's stay fp32; prepare binds the fp16 tensor as it is (no fp32 copy folded back);
    the job verifies against onnxruntime run in a child process, and the export stores the weight in fp16."""
    from tvmfuse import pipeline  # noqa: PLC0415
    from tvmfuse.jobs import Job  # noqa: PLC0415
    from tvmfuse.prepare import prepare_module  # noqa: PLC0415

    model = tiny_external(str(tmp_path / "m"))
    imported = pipeline.frontend_phase(Job("tiny", model, {}, 0, "fp16"))
    main_fn = imported.mod["main"]
    n_in = int(main_fn.attrs["num_input"])
    assert [str(p.ty.dtype) for p in main_fn.params[n_in:]] == ["float32"] * 3
    assert [str(t.dtype) for t in imported.params] == ["float16", "float32", "float32"]
    w16 = imported.params[0].numpy()
    w = onnx.numpy_helper.to_array(onnx.load(model).graph.initializer[0], base_dir=str(tmp_path / "m"))
    np.testing.assert_array_equal(w16, w.astype("float16"))
    bound = prepare_module(imported, "fp16", one_copy=True)
    consts = [c for c in _constants(bound["main"]) if c.ndim == 2]
    assert len(consts) == 1 and consts[0].dtype == "float16"
    np.testing.assert_array_equal(consts[0].numpy(), w16.T)  # the [N, K] layout of the very fp16 values read
    assert "R.astype(metadata" not in bound["main"].script()  # no cast of a weight left (or folded into fp32)
    assert pipeline.frontend_phase(Job("tiny", model, {}, 0, "fp32")).params[0].dtype == "float32"

    assert main([model, "--target", "llvm", "--trials", "0", "--dtype", "fp16", "--out", str(tmp_path / "out"),
                 "--logs", str(tmp_path / "logs"), "--schedules", "none"]) == 0
    manifest = json.loads((tmp_path / "out" / "tiny-llvm" / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "passed"
    assert manifest["verification"]["reference_peak_rss_bytes"] > 0  # onnxruntime ran in a child process
    assert manifest["weights"]["nbytes"] == 64 * 96 * 2


def test_buckets_with_weights_outside_share_one_copy(tmp_path):
    """A symbolic-batch MatMul whose weight is external data, with --buckets batch=4: the bucket function and
    main_generic take the same stored weight (one tensor in weights/, not in model.so), and the loaded export
    matches onnxruntime at the bucket's size and at another, each through its own function."""
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array((rng.standard_normal((64, 96)) / 8).astype("float32"), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "dyn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 96])], [w])
    path, export, manifest = _build_external(graph, tmp_path, "--buckets", "batch=4")
    assert manifest["verification"]["status"] == "passed"
    assert manifest["weights"]["count"] == 1 and manifest["weights"]["nbytes"] == 64 * 96 * 4
    model = load(str(export))
    called: list[str] = []
    model.vm.set_instrument(lambda _f, name, before, *_: called.append(name) if before else None)
    for batch, function in ((4, "main_batch4"), (3, "main_generic")):
        x = rng.standard_normal((batch, 64)).astype("float32")
        called.clear()
        np.testing.assert_allclose(model(x)[0], onnxruntime_outputs(path, {"x": x})[0], atol=1e-4, rtol=1e-4)
        assert function in called, (batch, called)


def test_bf16_model_with_external_data_builds_in_bf16(tmp_path):
    """A model stored in bf16 whose weight is external data: read as bf16 (no fp32 copy), built with --dtype bf16,
    verified against the fp32 copy of the model, and the stored weight is the file's bf16 bits."""
    import ml_dtypes  # noqa: PLC0415

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 96)) / 8).astype(ml_dtypes.bfloat16)
    init = helper.make_tensor("w", TensorProto.BFLOAT16, [64, 96], w.view(np.uint16).tobytes(), raw=True)
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
             helper.make_node("MatMul", ["xb", "w"], ["yb"]),
             helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "b", [onnx_models._f32("x", [4, 64])], [onnx_models._f32("y", [4, 96])], [init])
    _, export, manifest = _build_external(graph, tmp_path, "--dtype", "bf16")
    assert manifest["verification"]["status"] == "passed"
    assert manifest["weights"]["nbytes"] == 64 * 96 * 2
    (stored,) = load(str(export)).weights
    assert str(stored.dtype) == "bfloat16"
    assert sorted(stored.numpy().view(np.uint16).ravel()) == sorted(w.view(np.uint16).ravel())  # (any layout)


def _build_external(graph, tmp_path, *flags):
    """Save `graph` as tmp_path/m/NAME.onnx with every initializer external data, build it (llvm, --trials 0,
    `flags`); returns (model path, export folder, manifest)."""
    path = str(tmp_path / "m" / f"{graph.name}.onnx")
    os.makedirs(tmp_path / "m")
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10), path,
                    save_as_external_data=True, location=f"{graph.name}.data", size_threshold=0)
    assert main([path, "--target", "llvm", "--trials", "0", "--out", str(tmp_path / "out"), "--logs",
                 str(tmp_path / "logs"), "--schedules", "none", *flags]) == 0
    export = tmp_path / "out" / f"{graph.name}-llvm"
    return path, export, json.loads((export / "manifest.json").read_text())


def _constants(func) -> list:
    import tvm  # noqa: PLC0415

    found = []
    tvm.relax.analysis.post_order_visit(func, lambda e: found.append(e.value)
                                        if isinstance(e, tvm.ir.GenericConst) else None)
    return found


def test_plan_reads_external_data_beside_the_model(tmp_path, monkeypatch, capsys):
    from tvmfuse.cli.plan import main as plan_main  # pylint: disable=import-outside-toplevel

    model = tiny_external(str(tmp_path / "m"))
    monkeypatch.chdir(tmp_path)  # not the model's folder
    assert plan_main([model, "--target", "llvm", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["kept"] == 2
