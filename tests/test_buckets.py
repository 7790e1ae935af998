"""--buckets: static, tuned copies of main for named sizes, the generic path for the rest, one module."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnx_models
from checks import assert_bad_inputs_exit_2
from tvmfuse.fuse.buckets import bucket_shapes, function_name, verification_dims
from tvmfuse.cli.tune import main
from tvmfuse.jobs import load_jobs, parse_buckets


FUNCTIONS = {"main_generic", "main_batch8", "main_seq4_batch1", "main_seq16_batch1"}


def _ort(model_path, feeds):
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel

    return ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _check_runs(folder, model_path, cases):
    """Each (input shape, function): the loaded export matches onnxruntime there, and `main` called that function."""
    import tvmfuse  # pylint: disable=import-outside-toplevel

    model = tvmfuse.load(str(folder))
    called: list[str] = []
    model.vm.set_instrument(lambda _f, name, before, *_: called.append(name) if before else None)
    for shape, function in cases:
        x = np.random.default_rng(sum(shape)).standard_normal(shape).astype("float32")
        called.clear()
        (y,) = model(x=x)
        assert np.abs(y - _ort(model_path, {"x": x})[0]).max() < 1e-4, shape
        assert function in called and not (FUNCTIONS - {function}) & set(called), (shape, called)


def _two_dim_model() -> onnx.ModelProto:
    """y = Gelu(LayerNorm(x)) over x[batch, seq, 16]: two symbolic dims."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1, epsilon=1e-5),
             helper.make_node("Gelu", ["ln"], ["y"])]
    inits = [helper.make_tensor(n, TensorProto.FLOAT, [16], rng.standard_normal(16).astype(np.float32).tolist())
             for n in ("g", "b")]
    graph = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


@pytest.fixture(scope="module")
def bucket_export(tmp_path_factory):
    """layer_norm_gelu with a symbolic `batch`, built with the bucket batch=8 and 2 trials per kernel."""
    tmp = tmp_path_factory.mktemp("buckets")
    onnx.save(onnx_models.layer_norm_gelu(dyn=True), tmp / "dyn.onnx")
    code = main(["--target", "llvm", "--trials", "2", "--out", str(tmp / "o"), "--logs", str(tmp / "l"),
                 str(tmp / "dyn.onnx"), "--buckets", "batch=8"])
    return code, tmp / "o" / "dyn-llvm", tmp / "dyn.onnx"


def test_bucket_kernels_are_static_and_tuned_the_generic_path_default(bucket_export):
    code, folder, _ = bucket_export
    assert code == 0
    manifest = json.loads((folder / "manifest.json").read_text())
    buckets = manifest["buckets"]
    assert buckets["dims"] == ["batch"]
    assert [(f["function"], f["shape"]) for f in buckets["functions"]] == [("main_batch8", {"batch": 8})]
    kinds = {k["name"]: k for k in manifest["kernels"]}
    generic = buckets["generic"]["kernels"]
    assert buckets["generic"]["function"] == "main_generic" and len(generic) == 1
    assert kinds[generic[0]]["schedule"] == "default" and kinds[generic[0]]["trials"] == 0
    for function in buckets["functions"]:
        (kernel,) = function["kernels"]
        assert kernel.endswith("_" + function["function"][len("main_"):]) and function["tuned"] == 1
        assert kinds[kernel]["schedule"] == "tuned" and kinds[kernel]["trials"] >= 2
        assert kinds[kernel]["pattern"] == "tvmfuse.layer_norm_gelu"
    assert manifest["inputs"][0]["shape"] == ["batch", 64]  # the interface stays symbolic
    verification = manifest["verification"]
    assert verification["status"] == "passed" and verification["dims"] == [{"batch": 8}, {"batch": 2}]


def test_one_module_matches_onnxruntime_at_bucket_and_other_sizes(bucket_export):
    import tvm  # pylint: disable=import-outside-toplevel

    _, folder, model_path = bucket_export
    _check_runs(folder, model_path, [((8, 64), "main_batch8"), ((5, 64), "main_generic"), ((1, 64), "main_generic")])
    vm = tvm.relax.VirtualMachine(tvm.runtime.load_module(str(folder / "model.so")), tvm.cpu())
    x = tvm.runtime.tensor(np.ones((8, 64), "float32"))  # each function is exported too
    assert np.allclose(vm["main_batch8"](x).numpy(), vm["main_generic"](x).numpy(), atol=1e-5)


def test_two_bucketed_dims_build_the_cross_product(tmp_path, capsys):
    onnx.save(_two_dim_model(), tmp_path / "two.onnx")
    code = main(["--target", "llvm", "--trials", "0", "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l"),
                 str(tmp_path / "two.onnx"), "--buckets", "seq=4,16", "--buckets", "batch=1"])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "o" / "two-llvm" / "manifest.json").read_text())
    assert [f["function"] for f in manifest["buckets"]["functions"]] == ["main_seq4_batch1", "main_seq16_batch1"]
    assert manifest["verification"]["dims"] == [{"batch": 1, "seq": 4}, {"batch": 2, "seq": 2}]
    _check_runs(tmp_path / "o" / "two-llvm", tmp_path / "two.onnx",
                [((1, 16, 16), "main_seq16_batch1"), ((1, 4, 16), "main_seq4_batch1"),
                 ((3, 16, 16), "main_generic"), ((1, 5, 16), "main_generic")])


def test_bad_buckets_exit_2_with_one_line_and_nothing_written(tmp_path, capsys):
    onnx.save(onnx_models.layer_norm_gelu(dyn=True), tmp_path / "dyn.onnx")
    cases = {
        "unknown dim": (["--buckets", "seq=1,128"], "no symbolic dim of that name (its symbolic dims: batch)"),
        "zero": (["--buckets", "batch=0,128"], "bucket values must be positive integers, not '0'"),
        "not an int": (["--buckets", "batch=1,x"], "bucket values must be positive integers, not 'x'"),
        "negative": (["--buckets", "batch=-4"], "bucket values must be positive integers, not '-4'"),
        "no values": (["--buckets", "batch"], "expected DIM=V1,V2,..."),
        "twice": (["--buckets", "batch=1", "--buckets", "batch=2"], "--buckets batch is given twice"),
        "fixed too": (["--buckets", "batch=1,2", "--shape", "batch=4"], "batch is fixed by --shape"),
        "input fixed": (["--buckets", "batch=1,2", "--shape", "x=4,64"], "batch is fixed by --shape"),
    }
    assert_bad_inputs_exit_2(cases, tmp_path, capsys, extra=[str(tmp_path / "dyn.onnx")])


def test_jobs_file_buckets(tmp_path):
    onnx.save(onnx_models.layer_norm_gelu(dyn=True), tmp_path / "dyn.onnx")
    (tmp_path / "jobs.toml").write_text('[[model]]\npath = "dyn.onnx"\nbuckets = { batch = [8, 2, 8] }\n'
                                        '[[model]]\npath = "dyn.onnx"\nname = "one"\nbuckets = { batch = 4 }\n')
    assert [j.buckets for j in load_jobs(str(tmp_path / "jobs.toml"))] == [{"batch": [2, 8]}, {"batch": [4]}]
    (tmp_path / "bad.toml").write_text('[[model]]\npath = "dyn.onnx"\nbuckets = { batch = [1, 0] }\n')
    with pytest.raises(Exception, match=r"model #1: buckets batch: bucket values must be positive integers, not 0"):
        load_jobs(str(tmp_path / "bad.toml"))
    (tmp_path / "bad2.toml").write_text('[[model]]\npath = "dyn.onnx"\nbuckets = [1, 2]\n')
    with pytest.raises(Exception, match="'buckets' must map symbolic dims to lists of positive ints"):
        load_jobs(str(tmp_path / "bad2.toml"))


def test_shapes_names_and_verification_dims():
    assert parse_buckets(["seq=128, 1,128", "batch=1"]) == {"seq": [1, 128], "batch": [1]}
    assert bucket_shapes({"seq": [1, 128], "batch": [1, 4]}) == [
        {"seq": 1, "batch": 1}, {"seq": 1, "batch": 4}, {"seq": 128, "batch": 1}, {"seq": 128, "batch": 4}]
    assert function_name({"batch": 1, "seq": 128}) == "main_batch1_seq128"
    assert function_name({"unk-1": 2}) == "main_unk_12"
    assert verification_dims(["batch", "seq"], {}) == [{"batch": 4, "seq": 4}]
    assert verification_dims(["batch", "seq"], {"seq": [1, 2, 3, 128]}) == [{"batch": 4, "seq": 1},
                                                                          {"batch": 4, "seq": 4}]
