"""scripts/tune.py end to end: tuned, verified exports; one clear error and exit code 2 for bad input."""

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest

import onnx_models
from conftest import ROOT
from tvmfuse.cli.tune import main

TUNE = os.path.join(ROOT, "scripts", "tune.py")


def _tune(*args, cwd=None):
    return subprocess.run([sys.executable, TUNE, *args], capture_output=True, text=True, cwd=cwd, timeout=900)


@pytest.fixture(scope="module")
def rms_export(tmp_path_factory):
    """One tuned export of the RMSNorm+residual model (4 trials), shared by the tests below: the script's main in
    this process, its output captured as a process's would be (test_bad_input_process_exit_code_is_2 runs
    scripts/tune.py as a process; a second interpreter importing the whole stack added ~20 s of CPU here)."""
    tmp = tmp_path_factory.mktemp("rms")
    model = tmp / "rms.onnx"
    onnx.save(onnx_models.rms_norm_residual(rows=8, hidden=64), model)
    args = ["--target", "llvm", str(model), "--trials", "4", "--out", str(tmp / "out"), "--logs", str(tmp / "logs")]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    proc = subprocess.CompletedProcess([TUNE, *args], code, out.getvalue(), err.getvalue())
    return proc, tmp / "out" / "rms-llvm", model


def test_tuned_export_has_one_rms_kernel_and_passes_verification(rms_export):
    proc, folder, _ = rms_export
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [(k["pattern"], k["schedule"]) for k in manifest["kernels"]] == [("tvmfuse.rms_norm_residual", "tuned")]
    assert manifest["kernels"][0]["trials"] >= 4 and manifest["kernels"][0]["best_us"] > 0
    assert manifest["verification"]["status"] == "passed"
    assert manifest["verification"]["max_abs_err"] < 1e-4
    assert [o["name"] for o in manifest["outputs"]] == ["y", "h"]
    assert "1 of 1 jobs succeeded" in proc.stdout and "4/4 trials" in proc.stdout


def test_export_loads_in_a_new_process_with_only_tvm(rms_export, tmp_path):
    _, folder, model = rms_export
    rng = np.random.default_rng(7)
    x, r = (rng.standard_normal((8, 64)).astype("float32") for _ in range(2))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "r.npy", r)
    script = textwrap.dedent(f"""
        import sys, numpy as np, tvm
        from tvm import relax
        assert "tvmfuse" not in sys.modules
        vm = relax.VirtualMachine(tvm.runtime.load_module({str(folder / 'model.so')!r}), tvm.cpu())
        x, r = np.load({str(tmp_path / 'x.npy')!r}), np.load({str(tmp_path / 'r.npy')!r})
        y, h = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(r))
        np.save({str(tmp_path / 'y.npy')!r}, y.numpy()); np.save({str(tmp_path / 'h.npy')!r}, h.numpy())
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel

    want_y, want_h = ort.InferenceSession(str(model)).run(None, {"x": x, "r": r})
    assert np.abs(np.load(tmp_path / "y.npy") - want_y).max() < 1e-4
    assert np.abs(np.load(tmp_path / "h.npy") - want_h).max() < 1e-4


def test_tvmfuse_load_checks_sha256(rms_export, tmp_path):
    import shutil  # pylint: disable=import-outside-toplevel

    import tvmfuse  # pylint: disable=import-outside-toplevel
    from tvmfuse.errors import TvmfuseError  # pylint: disable=import-outside-toplevel

    _, folder, _ = rms_export
    model = tvmfuse.load(str(folder))
    y, h = model(x=np.ones((8, 64), "float32"), r=np.zeros((8, 64), "float32"))
    assert y.shape == (8, 64) and np.allclose(h, 1.0)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    with open(copy / "model.so", "ab") as f:
        f.write(b"tampered")
    with pytest.raises(TvmfuseError, match="sha256 does not match"):
        tvmfuse.load(str(copy))


def _bad_inputs(tmp):
    good = tmp / "good.onnx"
    onnx.save(onnx_models.layer_norm_gelu(), good)
    (tmp / "empty.onnx").write_bytes(b"")
    (tmp / "trunc.onnx").write_bytes(good.read_bytes()[:200])
    (tmp / "notonnx.onnx").write_text("hello\n" * 50)
    onnx.save(onnx_models.with_op("NoSuchOp"), tmp / "unknownop.onnx")
    (tmp / "typo.toml").write_text('[[model]]\npath = "good.onnx"\ntrails = 4\n')
    (tmp / "escape.toml").write_text('[[model]]\nname = "../../etc/x"\npath = "good.onnx"\n')
    (tmp / "tol.toml").write_text('[[model]]\npath = "good.onnx"\ntolerance = [0.01, -1]\n')
    return {
        "missing": ([str(tmp / "missing.onnx")], "no such file"),
        "empty": ([str(tmp / "empty.onnx")], "empty file"),
        "truncated": ([str(tmp / "trunc.onnx")], "trunc.onnx"),
        "not onnx": ([str(tmp / "notonnx.onnx")], "notonnx.onnx"),
        "unknown op": ([str(tmp / "unknownop.onnx")], "operator NoSuchOp (node mystery_node) is not supported"),
        "jobs typo": (["--jobs", str(tmp / "typo.toml")], "unknown key 'trails' (did you mean 'trials'?)"),
        "path traversal": (["--jobs", str(tmp / "escape.toml")], "invalid model or job name '../../etc/x'"),
        "bad shape": ([str(good), "--shape", "x=abc"], "expected NAME=DIMS"),
        "bad batch": ([str(good), "--batch", "0"], "--batch must be >= 1"),
        "io dtype not the compute dtype": ([str(good), "--dtype", "bf16", "--io-dtype", "fp16"],
                                           "--io-dtype float16 does not fit compute dtype bfloat16"),
        "io dtype fp16 on fp32": ([str(good), "--io-dtype", "fp16"],
                                  "--io-dtype float16 does not fit compute dtype float32"),
        "io dtype unknown": ([str(good), "--io-dtype", "fp8"], "--io-dtype 'fp8' is not supported"),
        "tolerance one value": ([str(good), "--tolerance", "0.01"],
                                "--tolerance '0.01': expected ATOL,RTOL (two numbers), e.g. --tolerance 0.02,0.02"),
        "tolerance not numbers": ([str(good), "--tolerance", "a,b"], "--tolerance 'a,b': expected ATOL,RTOL"),
        "tolerance negative": ([str(good), "--tolerance=-1,0"], "--tolerance '-1,0': atol -1 must be a finite number"),
        "tolerance nan": ([str(good), "--tolerance", "0.01,nan"], "rtol nan must be a finite number >= 0"),
        "tolerance in jobs file": (["--jobs", str(tmp / "tol.toml")],
                                   "model #1: tolerance [0.01, -1]: rtol -1 must be a finite number >= 0"),
    }


def test_bad_inputs_exit_2_with_one_line_and_nothing_written(tmp_path, capsys):
    from checks import assert_bad_inputs_exit_2

    assert_bad_inputs_exit_2(_bad_inputs(tmp_path), tmp_path, capsys)


def test_bad_input_process_exit_code_is_2(tmp_path):
    proc = _tune("--target", "llvm", str(tmp_path / "nope.onnx"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[0] == f"error: {tmp_path / 'nope.onnx'}: no such file"
    assert "Traceback" not in proc.stderr


def test_one_failing_job_does_not_lose_the_others(tmp_path):
    onnx.save(onnx_models.layer_norm_gelu(), tmp_path / "good.onnx")
    (tmp_path / "bad.onnx").write_bytes(b"")
    code = main(["--target", "llvm", "--trials", "0", "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l"),
                 str(tmp_path / "bad.onnx"), str(tmp_path / "good.onnx")])
    assert code == 2
    manifest = json.loads((tmp_path / "o" / "good-llvm" / "manifest.json").read_text())
    assert [k["pattern"] for k in manifest["kernels"]] == ["tvmfuse.layer_norm_gelu"]
    assert not (tmp_path / "o" / "bad-llvm").exists()


def test_a_model_onnxruntime_cannot_load_is_one_error_line_not_an_internal_error(tmp_path, capsys, monkeypatch):
    """A model of a newer ONNX IR version than the installed onnxruntime reads (IR 14 under onnxruntime's 13, as
    the GPU box had) cannot be verified: the job says so in one line naming onnxruntime and the IR version, exit 2,
    nothing exported."""
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail  # pylint: disable=import-outside-toplevel

    def refuse(source, *args, **kwargs):
        raise Fail(f"[ONNXRuntimeError] : 1 : FAIL : Load model from {source} failed: Unsupported model IR "
                   "version: 10, max supported IR version: 9")

    onnx.save(onnx_models.layer_norm_gelu(), tmp_path / "m.onnx")
    monkeypatch.setattr(ort, "InferenceSession", refuse)
    code = main(["--target", "llvm", "--trials", "0", "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l"),
                 str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "internal error" not in errors[0], err
    assert (f"m.onnx: onnxruntime {ort.__version__}, which verification runs it on, cannot load it (ONNX IR version "
            "10; a newer onnxruntime may): [ONNXRuntimeError]") in errors[0]
    assert errors[0].endswith("Unsupported model IR version: 10, max supported IR version: 9")
    assert not (tmp_path / "o" / "m-llvm").exists()


def test_an_unlowerable_operator_is_one_error_naming_it_and_its_onnx_node(tmp_path, capsys):
    """Pow of (b, n) and (b, m), dims TVM cannot prove equal (the import aligns only Add, Sub, Mul and Div): the
    operator cannot be lowered; one `error:` line naming it and its ONNX node, exit 2 (not a VM codegen crash)."""
    from onnx import TensorProto, helper  # pylint: disable=import-outside-toplevel

    graph = helper.make_graph([helper.make_node("Pow", ["x", "y"], ["z"], name="the_pow")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "n"]),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "m"])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["b", "n"])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10),
              tmp_path / "pow.onnx")
    code = main([str(tmp_path / "pow.onnx"), "--target", "llvm", "--trials", "0", "--out", str(tmp_path / "o"),
                 "--logs", str(tmp_path / "l"), "--schedules", "none"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "relax.power" in lines[0] and "ONNX node 'the_pow' (Pow)" in lines[0], err
    assert "CodeGenVM" not in err and not (tmp_path / "o" / "pow-llvm").exists()


def test_shapes_the_model_cannot_run_are_one_error_line_naming_its_node(tmp_path, capsys):
    """--shape seq=20 on a model of 16 learned positions: onnxruntime, which verification runs it on, cannot (its
    position Gather runs past the table's end; it was an internal error with onnxruntime's log line before it): one
    error line naming the node, what onnxruntime said and the inputs' shapes, exit 2, nothing exported."""
    onnx.save(onnx_models.learned_positions(positions=16), tmp_path / "pos.onnx")
    code = main(["--target", "llvm", "--trials", "0", "--shape", "seq=20", "--shape", "batch=1",
                 "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l"), str(tmp_path / "pos.onnx")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: onnxruntime cannot run the model on these "
                                                             "inputs (ids 1x20): its "), err
    # (onnxruntime's optimizer turns the position Gather into a slice: the Add after it is what fails)
    assert "Add node" in err[0] and "16 by 20" in err[0] and "onnxruntime_src" not in err[0], err
    assert not (tmp_path / "o" / "pos-llvm").exists()


@pytest.mark.parametrize("message,said", [
    ("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code returned while running Gather node. "
     "Name:'/model/transformer/wpe/Gather' Status Message: indices element out of data bounds, idx=128 must be "
     "within the inclusive range [-128,127]",
     "its Gather node '/model/transformer/wpe/Gather': indices element out of data bounds, idx=128 must be within "
     "the inclusive range [-128,127] (an index past the end of a table: a sequence longer than the model's "
     "positions?)"),
    ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Add node. Name:'' Status Message: "
     "/onnxruntime_src/onnxruntime/core/providers/cpu/math/element_wise_ops.h:583 void onnxruntime::"
     "BroadcastIterator::Append(ptrdiff_t, ptrdiff_t) axis == 1 || axis == largest was false. Attempting to "
     "broadcast an axis by a dimension other than 1. 16 by 20\n",
     "its Add node '': axis == 1 || axis == largest was false. Attempting to broadcast an axis by a dimension other "
     "than 1. 16 by 20 (a dim the model fixes, such as its positions, smaller than the input's?)"),
    ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : something else", "something else"),
])
def test_onnxruntime_run_errors_become_one_line(message, said):
    """onnxruntime's GPT-2 position overflow (unoptimized: the Gather), the same optimized (the Add), any other."""
    from tvmfuse.frontend.onnx_io import ort_run_error  # pylint: disable=import-outside-toplevel

    feeds = {"input_ids": np.zeros((4, 200), "int64"), "t": np.zeros((), "float32")}
    assert ort_run_error(message, feeds) == f"onnxruntime cannot run the model on these inputs (input_ids 4x200, " \
                                            f"t scalar): {said}"


def test_symbolic_dims_build_with_default_schedules(tmp_path, capsys):
    onnx.save(onnx_models.layer_norm_gelu(dyn=True), tmp_path / "dyn.onnx")
    code = main(["--target", "llvm", "--trials", "4", "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l"),
                 str(tmp_path / "dyn.onnx")])
    assert code == 0
    assert "symbolic dims batch kept symbolic" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "o" / "dyn-llvm" / "manifest.json").read_text())
    assert manifest["inputs"][0]["shape"] == ["batch", 64]
    assert [k["schedule"] for k in manifest["kernels"]] == ["default"]
    assert manifest["verification"]["status"] == "passed"


def test_cuda_target_without_gpu_needs_trials_0(tmp_path, capsys):
    import tvm  # pylint: disable=import-outside-toplevel

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU")
    onnx.save(onnx_models.layer_norm_gelu(rows=64, hidden=256), tmp_path / "m.onnx")
    base = ["--target", "cuda", "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l"), str(tmp_path / "m.onnx")]
    assert main(base) == 2
    assert "no cuda device on this machine" in capsys.readouterr().err
    assert main(base + ["--trials", "0"]) == 0
    manifest = json.loads((tmp_path / "o" / "m-cuda-sm_90a" / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "skipped" and manifest["target"]["arch"] == "sm_90a"
    assert manifest["cuda_graph"] is False and manifest["dependent_launch"] is True  # sm_90a: on by default
    # --cuda-graph on the embedded block: the exported library replays captured launch sequences
    assert main(base[:-1] + ["--trials", "0", "--cuda-graph"]) == 0
    export = tmp_path / "o" / "tiny-block-cuda-sm_90a"
    assert json.loads((export / "manifest.json").read_text())["cuda_graph"] is True
    assert b"vm.builtin.cuda_graph.run_or_capture" in (export / "model.so").read_bytes()


def test_tolerance_reaches_every_job_and_a_jobs_file_overrides_it(tmp_path):
    from tvmfuse.cli.tune import collect_jobs, parser

    (tmp_path / "jobs.toml").write_text('[[model]]\npath = "a.onnx"\n[[model]]\npath = "b.onnx"\n'
                                        'tolerance = [0.5, 0]\n')
    args = parser().parse_args(["--target", "llvm", "m.onnx", "--jobs", str(tmp_path / "jobs.toml"),
                                "--tolerance", "0.02,0.03"])
    assert [(j.name, j.tolerance) for j in collect_jobs(args)] == [("m", (0.02, 0.03)), ("a", (0.02, 0.03)),
                                                                   ("b", (0.5, 0.0))]
    assert collect_jobs(parser().parse_args(["--target", "llvm"]))[0].tolerance is None  # the dtype defaults


def test_no_dependent_launch_builds_kernels_that_neither_wait_nor_are_launched_dependent(tmp_path, monkeypatch):
    """On by default for sm_90a (the manifest says so, the library's kernels wait); --no-dependent-launch turns it
    off for that job only, and leaves the environment as it was; TVMFUSE_DEPENDENT_LAUNCH=0 turns it off for every
    job (what `bench/models.py --before dependent_launch` builds with)."""
    from tvmfuse.kernels.dependent_launch import SWITCH

    onnx.save(onnx_models.layer_norm_gelu(rows=64, hidden=256), tmp_path / "m.onnx")
    for switch, extra, out, on in (("1", [], "on", True), ("1", ["--no-dependent-launch"], "off", False),
                                   ("0", [], "env-off", False)):
        monkeypatch.setenv(SWITCH, switch)
        assert main(["--target", "cuda", "--trials", "0", "--out", str(tmp_path / out), "--logs",
                     str(tmp_path / "l"), str(tmp_path / "m.onnx")] + extra) == 0
        export = tmp_path / out / "m-cuda-sm_90a"
        assert json.loads((export / "manifest.json").read_text())["dependent_launch"] is on
        library = (export / "model.so").read_bytes()  # the CUDA source and the launch tags are in it
        assert (b"griddepcontrol" in library, b"use_programtic_dependent_launch" in library) == (on, on)
        assert os.environ[SWITCH] == switch


def test_user_tolerance_is_used_and_reported_in_the_manifest(tmp_path):
    onnx.save(onnx_models.layer_norm_gelu(), tmp_path / "m.onnx")
    code = main(["--target", "llvm", "--trials", "0", "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l"),
                 str(tmp_path / "m.onnx"), "--tolerance", "0.5,0.25"])
    assert code == 0
    check = json.loads((tmp_path / "o" / "m-llvm" / "manifest.json").read_text())["verification"]
    assert check["status"] == "passed"
    assert check["tolerance"] == {"float32": {"atol": 0.5, "rtol": 0.25, "set_by": "user"}}


@pytest.mark.parametrize("extra, applied", [
    ([], "tolerance atol=0.0001 rtol=0.0001 for float32 outputs"),
    (["--tolerance", "0.001,0"], "tolerance atol=0.001 rtol=0 (user-set) for float32 outputs"),
])
def test_failed_verification_says_the_tolerance_and_how_to_change_it(tmp_path, monkeypatch, capsys, extra, applied):
    from tvmfuse import pipeline
    from tvmfuse.verify.outputs import Verification

    real = pipeline.compare_at_dims

    def failing(*args, **kwargs):  # the real comparison (so the real tolerance), reported as an fp16 layer's miss
        return [(d, Verification(0.0142, 50.6, False, c.tolerance)) for d, c in real(*args, **kwargs)]
    monkeypatch.setattr(pipeline, "compare_at_dims", failing)
    onnx.save(onnx_models.layer_norm_gelu(), tmp_path / "m.onnx")
    code = main(["--target", "llvm", "--trials", "0", "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l"),
                 str(tmp_path / "m.onnx"), *extra])
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [(f"error: m: verification against onnxruntime FAILED (max abs err 0.0142, max rel err 50.6; "
                    f"{applied}: pass --tolerance ATOL,RTOL or set `tolerance` in the jobs file if the model needs "
                    "more)")]
    assert not (tmp_path / "o" / "m-llvm").exists()


def test_an_export_loads_without_tvms_per_constant_scope_lines(rms_export):
    """An executable a VirtualMachine has run logs a 'Scope Loaded:' warning per constant wherever it is loaded
    once exported (TVM records an empty memory scope per constant in it: tests/test_build_library.py's control);
    the export is the library linked before verification ran it, so plain TVM and tvmfuse.load both load it
    silently, and it runs."""
    _, folder, _ = rms_export
    lib = str(folder / "model.so")
    plain = f"import tvm; from tvm import relax; relax.VirtualMachine(tvm.runtime.load_module({lib!r}), tvm.cpu())"
    ours = (f"import numpy as np, tvmfuse; m = tvmfuse.load({str(folder)!r}); "
            "print(m(x=np.ones((8, 64), 'float32'), r=np.zeros((8, 64), 'float32'))[1].sum())")
    runs = {name: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
            for name, code in (("plain", plain), ("ours", ours))}
    assert "Scope Loaded:" not in runs["plain"].stderr, runs["plain"].stderr[-500:]
    assert "Scope Loaded:" not in runs["ours"].stderr, runs["ours"].stderr[-500:]
    assert float(runs["ours"].stdout.strip()) == 8 * 64
