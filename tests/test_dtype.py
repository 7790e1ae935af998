"""Mixed precision (--dtype fp16/bf16): what ToMixedPrecision does to the module, pattern matches, end to end."""

from __future__ import annotations

import json
import re
import os
import warnings

import numpy as np
import onnx
import onnx_models
import pytest
import test_patterns
import tvm
from tvm import relax

from tvmfuse.build.compile import build
from tvmfuse.cli.tune import main
from tvmfuse.frontend.default_model import make_tiny_block
from tvmfuse.errors import JobError
from tvmfuse.fuse.fusion import lower
from tvmfuse.prepare import bind_params
from tvmfuse.frontend.importer import import_model
from tvmfuse.verify import random_inputs
from tvmfuse.jobs import load_jobs
from tvmfuse.prepare.dtypes import parse_dtype
from tvmfuse.prepare.precision import to_compute_dtype
from tvmfuse.targets import device_for
from tvmfuse.verify.outputs import compare, onnxruntime_outputs, run_vm


def _export(tmp_path, model: onnx.ModelProto, name: str, dtype: str, io_dtype: str = "fp32") -> dict:
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    out = tmp_path / f"out-{dtype}-{io_dtype}"
    rc = main([str(path), "--target", "llvm", "--trials", "0", "--dtype", dtype, "--out", str(out),
               "--logs", str(tmp_path / "logs"), "--schedules", "none", "--io-dtype", io_dtype])
    assert rc == 0
    with open(out / f"{name}-llvm" / "manifest.json", encoding="utf-8") as f:
        return json.load(f)


def _pattern_kernels(manifest: dict) -> list[str]:
    return sorted(k["pattern"] for k in manifest["kernels"] if k["pattern"] != "default fusion")


def _ops(mod) -> list[tuple[str, str]]:
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append((e.op.name, str(e.ty.dtype)))
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def test_parse_dtype():
    assert [parse_dtype(t) for t in ("fp32", "FP16", "float16", "bf16", "bfloat16")] == \
        ["float32", "float16", "float16", "bfloat16", "bfloat16"]
    with pytest.raises(JobError, match="'int8' is not supported: use fp32, fp16 or bf16"):
        parse_dtype("int8")


def test_bad_dtype_is_one_error_exit_2(tmp_path, capsys):
    assert main(["--target", "llvm", "--dtype", "fp8", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --dtype 'fp8' is not supported: use fp32, fp16 or bf16"]
    assert not os.listdir(tmp_path)


def test_jobs_file_dtype(tmp_path):
    jobs = tmp_path / "jobs.toml"
    jobs.write_text('dtype = "fp16"\n[[model]]\npath = "a.onnx"\n[[model]]\npath = "b.onnx"\ndtype = "bf16"\n')
    assert [j.dtype for j in load_jobs(str(jobs))] == ["float16", "bfloat16"]
    assert load_jobs(str(jobs), dtype="float32")[0].dtype == "float16"  # the file's top level wins, as for trials
    jobs.write_text('[[model]]\npath = "a.onnx"\ndtype = "fp8"\n')
    with pytest.raises(JobError, match=r"model #1: dtype 'fp8' is not supported"):
        load_jobs(str(jobs))


def test_compute_dtype_tolerance():
    want = np.zeros(8, "float32")
    assert not compare([want + 5e-3], [want]).ok
    assert compare([want + 5e-3], [want], compute_dtype="float16").ok
    assert not compare([want + 3e-2], [want], compute_dtype="float16").ok
    assert compare([want + 3e-2], [want], compute_dtype="bfloat16").ok
    assert compare([want], [want], compute_dtype="float32").tolerance["float32"] == {"atol": 1e-4, "rtol": 1e-4}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_signature_stays_fp32_and_reductions_accumulate_in_fp32(dtype):
    imported = import_model(make_tiny_block(seq=4, hidden=16, ffn=32))
    mod = to_compute_dtype(bind_params(imported.mod, imported.params), dtype)
    main_fn = mod["main"]
    assert [str(p.ty.dtype) for p in main_fn.params] == ["float32"]
    assert [str(f.dtype) for f in main_fn.ret_ty.fields] == ["float32", "float32"]
    ops = _ops(mod)
    assert {d for op, d in ops if op == "relax.matmul"} == {"float32"}  # fp32 accumulation and result
    assert {d for op, d in ops if op == "relax.mean"} == {"float32"}
    assert ("relax.nn.gelu", dtype) in ops and ("relax.add", dtype) in ops
    assert ("relax.nn.layer_norm", dtype if dtype == "float16" else "float32") in ops


def test_layer_norm_gelu_fp16_end_to_end(tmp_path):
    model = onnx_models.layer_norm_gelu(rows=4, hidden=32)
    fp32, fp16 = _export(tmp_path, model, "lngelu", "fp32"), _export(tmp_path, model, "lngelu", "fp16")
    assert _pattern_kernels(fp16) == _pattern_kernels(fp32) == ["tvmfuse.layer_norm_gelu"]
    assert fp16["precision"]["compute_dtype"] == "float16" and fp16["precision"]["interface_dtype"] == "float32"
    assert fp16["precision"]["ops_in_compute_dtype"] == 2  # layer_norm and gelu
    assert fp16["inputs"][0]["dtype"] == fp16["outputs"][0]["dtype"] == "float32"
    check = fp16["verification"]
    assert check["status"] == "passed" and check["tolerance"]["float32"] == {"atol": 1e-2, "rtol": 1e-2}
    assert check["max_abs_err"] > 1e-5  # it really computed in fp16


def test_fp16_with_a_symbolic_input_builds_and_matches(tmp_path):
    """A symbolic input dim with --dtype fp16 (TVM's ToMixedPrecision stopped on it: tvmfuse.precision leaves such
    inputs fp32 and lets the matmul's cast take them to fp16); verified against onnxruntime at the given shape."""
    model = onnx_models.layer_norm_gelu(dyn=True)
    path = tmp_path / "dyn.onnx"
    onnx.save(model, path)
    out = tmp_path / "out"
    assert main([str(path), "--target", "llvm", "--trials", "0", "--dtype", "fp16", "--out", str(out),
                 "--logs", str(tmp_path / "logs"), "--schedules", "none"]) == 0
    manifest = json.loads((out / "dyn-llvm" / "manifest.json").read_text())
    assert manifest["inputs"][0]["shape"] == ["batch", 64] and manifest["precision"]["compute_dtype"] == "float16"
    assert manifest["verification"]["status"] == "passed"


def test_rms_norm_residual_fp16_builds_and_matches(tmp_path):
    manifest = _export(tmp_path, onnx_models.rms_norm_residual(rows=4, hidden=32), "rms", "fp16")
    assert manifest["verification"]["status"] == "passed"
    assert manifest["precision"]["ops_in_compute_dtype"] == 2  # the residual add and the square


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rms_norm_residual_fp16_keeps_its_pattern(dtype):
    """ToMixedPrecision squares in fp16, casts the square up (mean(astype(h*h))) and casts h up separately for
    the divide (and again for the h output): the pattern takes those casts."""
    imported = import_model(onnx_models.rms_norm_residual(rows=4, hidden=32))
    bound = bind_params(imported.mod, imported.params)
    assert sorted(lower(to_compute_dtype(bound, dtype)).kernel_patterns.values()) == \
        sorted(lower(bound).kernel_patterns.values()) == ["tvmfuse.rms_norm_residual"]


# ---- the patterns take the casts mixed precision puts around fp32 ops --------------------------------

def _rms_norm(rows=4, hidden=32, leak=None) -> onnx.ModelProto:
    """y = x / sqrt(mean(x*x) + eps) * w, no residual: h is the model input (its fp16 cast feeds the square)."""
    rng = np.random.default_rng(3)
    nodes = [onnx.helper.make_node("Mul", ["x", "x"], ["x_sq"]),
             onnx.helper.make_node("ReduceMean", ["x_sq", "axes"], ["ms"], keepdims=1),
             onnx.helper.make_node("Add", ["ms", "eps"], ["ms_eps"]),
             onnx.helper.make_node("Sqrt", ["ms_eps"], ["rms"]),
             onnx.helper.make_node("Div", ["x", "rms"], ["x_norm"]),
             onnx.helper.make_node("Mul", ["x_norm", "w"], ["y"])]
    f32 = onnx.TensorProto.FLOAT
    outs = [onnx.helper.make_tensor_value_info("y", f32, [rows, hidden])]
    if leak:
        shape = [rows, 1] if leak in ("ms", "rms") else [rows, hidden]
        outs.append(onnx.helper.make_tensor_value_info(leak, f32, shape))
    graph = onnx.helper.make_graph(
        nodes, "rms", [onnx.helper.make_tensor_value_info("x", f32, [rows, hidden])], outs,
        [onnx.helper.make_tensor("axes", onnx.TensorProto.INT64, [1], [-1]),
         onnx.helper.make_tensor("eps", f32, [], [1e-6]),
         onnx.helper.make_tensor("w", f32, [hidden], rng.standard_normal(hidden).astype(np.float32))])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20)], ir_version=10)
    onnx.checker.check_model(model)
    return model


CAST_CASES = {  # pattern -> (builder taking leak=, intermediate to leak, where ToMixedPrecision puts the casts)
    "tvmfuse.matmul_bias_gelu": (lambda leak=None: test_patterns.matmul_bias("gelu", m=4, k=16, n=32, leak=leak),
                                 "h", "add(astype(matmul), bias)"),
    "tvmfuse.matmul_bias_relu": (lambda leak=None: test_patterns.matmul_bias("relu", m=4, k=16, n=32, leak=leak),
                                 "mm", "add(astype(matmul), bias)"),
    # decomposed: its scalar constants were astype(const) (FoldConstant leaves 0-d casts; precision folds them);
    # bf16: the power computes in fp32 between casts, the constants are bf16-rounded (0.0446777)
    "tvmfuse.matmul_bias_gelu_tanh": (lambda leak=None: test_patterns.matmul_bias("gelu_tanh", m=4, k=16, n=32,
                                                                                  leak=leak),
                                      "a2", "add(astype(matmul), bias), bf16: astype(power(astype(x), 3))"),
    "tvmfuse.matmul_gelu_tanh": (lambda leak=None: test_patterns.matmul_act("gelu_tanh", leak=leak), "mm",
                                 "reshape(astype(matmul))"),
    "tvmfuse.matmul_silu": (lambda leak=None: test_patterns.matmul_act("silu", leak=leak), "h", "astype(matmul)"),
    "tvmfuse.swiglu": (lambda leak=None: test_patterns.swiglu(leak=leak), "g", "silu(astype(mm)) * astype(mm)"),
    "tvmfuse.skip_layer_norm_bias": (lambda leak=None: test_patterns.skip_layer_norm(True, leak=leak), "xb",
                                     "add(astype(x + b), r)"),
    "tvmfuse.attention": (lambda leak=None: test_patterns.attention(leak=leak), "p",
                          "astype(astype(matmul)) + mask, softmax in fp32, matmul(astype(p), v) -> astype"),
    "tvmfuse.attention/dynamo": (lambda leak=None: test_patterns.attention_dynamo(leak=leak), "kt",
                                 "q * half, k * half (0-d casts folded), where(isnan) in fp32"),
    "tvmfuse.matmul_bias": (lambda leak=None: test_patterns.matmul_bias(None, m=4, k=16, n=32, leak=leak),
                            "mm", "add(astype(matmul), bias)"),
    "tvmfuse.rms_norm_residual": (lambda leak=None: onnx_models.rms_norm_residual(rows=4, hidden=32, leak=leak),
                                  "ms", "mean(astype(h*h)), divide(astype(h), ..)"),
    "tvmfuse.rms_norm": (lambda leak=None: _rms_norm(leak=leak), "rms", "mean(astype(h*h)), divide(astype(h), ..)"),
    "tvmfuse.layer_norm_gelu": (lambda leak=None: onnx_models.layer_norm_gelu(rows=4, hidden=32,
                                                                              ln_also_output=bool(leak)),
                                "ln", "bf16: gelu(astype(layer_norm(astype(x))))"),
}


def _mixed(model: onnx.ModelProto, dtype: str):
    imported = import_model(model)
    return imported, to_compute_dtype(bind_params(imported.mod, imported.params), dtype)


def _has_cast(mod) -> bool:
    return any(op == "relax.astype" for op, _ in _ops(mod))


MIXED = [(p, d) for p in sorted(CAST_CASES) for d in ("float16", "bfloat16")]


@pytest.mark.parametrize("pattern,dtype", MIXED)
def test_pattern_takes_mixed_precision_casts_and_matches_onnxruntime(pattern, dtype, llvm):
    model = CAST_CASES[pattern][0]()
    imported, mod = _mixed(model, dtype)
    fused = lower(mod)
    assert sorted(fused.kernel_patterns.values()) == [pattern.split("/")[0]], (fused.kernels(), fused.rejections)
    (kernel,) = fused.kernel_patterns
    group = [fn for gv, fn in fused.mod.functions.items() if gv.name_hint == kernel][0].script()
    # the fused kernel computes in the low dtype (its fp32 parts between casts), not in fp32 around casts
    assert dtype in group
    ex, _ = build(fused.mod, llvm)
    feeds = random_inputs(imported.inputs)
    got = run_vm(relax.VirtualMachine(ex, device_for(llvm)), device_for(llvm), list(feeds.values()))
    check = compare(got, onnxruntime_outputs(model, feeds), compute_dtype=dtype)
    assert check.ok, check.as_dict()
    assert check.max_abs_err > 1e-6  # it really computed in the low dtype


@pytest.mark.parametrize("pattern,dtype", MIXED)
def test_intermediate_used_outside_still_blocks_the_pattern_in_mixed_precision(pattern, dtype):
    make, leak, _ = CAST_CASES[pattern]
    _, mod = _mixed(make(leak=leak), dtype)
    assert _has_cast(mod)
    fused = lower(mod)
    pattern = pattern.split("/")[0]
    assert pattern not in fused.kernel_patterns.values()
    reasons = [why for p, _, why in fused.rejections if p == pattern]
    assert any("used outside the match" in why for why in reasons), fused.rejections
    assert all("used outside the match" in why or "the kernel ends at the cast" in why for why in reasons)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tiny_block_keeps_its_fp32_pattern_kernels(dtype):
    """ToMixedPrecision reuses binding names; they are made unique, or candidates falsely overlap."""
    imported = import_model(make_tiny_block(seq=4, hidden=16, ffn=32))
    bound = bind_params(imported.mod, imported.params)
    assert sorted(lower(to_compute_dtype(bound, dtype)).kernel_patterns.values()) == \
        sorted(lower(bound).kernel_patterns.values())


@pytest.mark.parametrize("dtype,tol", [("fp16", 1e-2), ("bf16", 8e-2)])
def test_tiny_block_mixed_precision_end_to_end(tmp_path, dtype, tol):
    manifest = _export(tmp_path, make_tiny_block(seq=4, hidden=32, ffn=64), "blk", dtype)
    check = manifest["verification"]
    assert check["status"] == "passed" and check["tolerance"]["float32"] == {"atol": tol, "rtol": tol}
    assert manifest["precision"]["accumulation"] == "float32"


def _skip_layer_norm_matmul(bias: bool, ln_also_output: bool = False, rows=4, hidden=32, n=48) -> onnx.ModelProto:
    """out = LayerNorm((x [+ b]) + r) @ W, the sum s a second output (GPT-2's and BERT's block); the LayerNorm
    output y also an output when `ln_also_output` (a use of the fp32 value besides the cast to the matmul)."""
    tp, rng = test_patterns, np.random.default_rng(3)
    nodes = ([tp._n("Add", ["x", "b"], "xb"), tp._n("Add", ["xb", "r"], "s")] if bias
             else [tp._n("Add", ["x", "r"], "s")])
    nodes += [tp._n("LayerNormalization", ["s", "g", "beta"], "y", axis=-1, epsilon=1e-5),
              tp._n("MatMul", ["y", "W"], "out")]
    outs = [tp._t("out", [rows, n]), tp._t("s", [rows, hidden])] + ([tp._t("y", [rows, hidden])] if ln_also_output
                                                                     else [])
    return tp._model(nodes, [tp._t("x", [rows, hidden]), tp._t("r", [rows, hidden])], outs,
                     [tp._c("g", rng.standard_normal(hidden)), tp._c("beta", rng.standard_normal(hidden)),
                      tp._c("W", rng.standard_normal((hidden, n)) * 0.2)]
                     + ([tp._c("b", rng.standard_normal(hidden))] if bias else []))


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_skip_layer_norm_kernel_ends_at_the_cast_to_the_next_matmul(bias, llvm):
    """bf16: layer_norm computes in fp32 between casts; the skip-LayerNorm kernel takes the cast down to bf16
    for the next matmul (no cast kernel between them: its fp32 output never goes to memory) and matches
    onnxruntime."""
    name = "tvmfuse.skip_layer_norm_bias" if bias else "tvmfuse.skip_layer_norm"
    model = _skip_layer_norm_matmul(bias)
    imported, mod = _mixed(model, "bfloat16")
    fused = lower(mod)
    (kernel,) = [k for k, p in fused.kernel_patterns.items() if p == name]
    assert _call_dtypes(fused.mod["main"], kernel) == ["bfloat16", "bfloat16"]  # y and the sum, both bf16
    ex, _ = build(fused.mod, llvm)
    feeds = random_inputs(imported.inputs)
    got = run_vm(relax.VirtualMachine(ex, device_for(llvm)), device_for(llvm), list(feeds.values()))
    check = compare(got, onnxruntime_outputs(model, feeds), compute_dtype="bfloat16")
    assert check.ok, check.as_dict()


def _call_dtypes(main_fn, kernel: str) -> list[str]:
    """The dtypes of what the (first) call of `kernel` in main returns."""
    found = []
    relax.analysis.post_order_visit(main_fn, lambda e: found.append(e.ty) if isinstance(e, relax.Call)
                                    and isinstance(getattr(e, "args", [None])[0], tvm.ir.GlobalVar)
                                    and e.args[0].name_hint == kernel else None)
    ty = found[0]
    return [str(f.dtype) for f in ty.fields] if hasattr(ty, "fields") else [str(ty.dtype)]


def test_bf16_skip_layer_norm_without_its_cast_when_the_fp32_value_is_used_elsewhere():
    """Negative: the LayerNorm's fp32 output is also returned as it is, so the cast-taking match would leak an
    intermediate; the kernel ends at the layer_norm (its fp32 value) and the cast stays outside."""
    bb, bf16 = relax.BlockBuilder(), "bfloat16"
    x, r = (relax.Var(n, relax.TensorType((4, 32), bf16)) for n in ("x", "r"))
    g, beta = (relax.const(np.ones(32, np.float32)) for _ in range(2))
    with bb.function("main", [x, r]):
        with bb.dataflow():
            s = bb.emit(relax.op.add(x, r))
            ln = bb.emit(relax.op.nn.layer_norm(relax.op.astype(s, "float32"), g, beta, axes=[-1]))
            y = bb.emit(relax.op.astype(ln, bf16))
            out = bb.emit_output(relax.Tuple([y, s, ln]))
        bb.emit_func_output(out)
    fused = lower(bb.get())
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.skip_layer_norm"], fused.rejections
    (kernel,) = fused.kernel_patterns
    assert sorted(_call_dtypes(fused.mod["main"], kernel)) == ["bfloat16", "float32"]  # the sum; y still fp32
    assert any("used outside the match" in why for p, _, why in fused.rejections
               if p == "tvmfuse.skip_layer_norm"), fused.rejections


# ---- io_dtype: the module's float inputs and outputs in the compute dtype ------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_io_dtype_drops_the_interface_casts(dtype):
    """fp32 interface: cast in, LayerNorm+GELU, cast out (3 kernels); io_dtype = the compute dtype: 1 kernel,
    and main takes and returns the compute dtype."""
    imported = import_model(onnx_models.layer_norm_gelu(rows=4, hidden=32))
    bound = bind_params(imported.mod, imported.params)
    fp32_io, low_io = lower(to_compute_dtype(bound, dtype)), lower(to_compute_dtype(bound, dtype, io_dtype=dtype))
    assert len(fp32_io.kernels()) == 3 and len(low_io.kernels()) == 1
    assert list(low_io.kernel_patterns.values()) == ["tvmfuse.layer_norm_gelu"]
    main_fn = to_compute_dtype(bound, dtype, io_dtype=dtype)["main"]
    assert [str(p.ty.dtype) for p in main_fn.params] == [dtype] and str(main_fn.ret_ty.dtype) == dtype
    with pytest.raises(JobError, match="io_dtype float16 does not fit compute dtype"):
        to_compute_dtype(bound, "bfloat16" if dtype == "float16" else "float32", io_dtype="float16")


def test_io_dtype_takes_the_output_cast_of_an_fp32_norm_into_its_kernel():
    """Tiny block, fp16 interface: the input's and the residual output's casts go; the RMSNorm output (computed
    in fp32) is cast to fp16 inside the RMSNorm kernel (the pattern's trailing cast); the pattern kernels stay."""
    imported = import_model(make_tiny_block(seq=4, hidden=16, ffn=32))
    bound = bind_params(imported.mod, imported.params)
    fp32_io, low_io = lower(to_compute_dtype(bound, "float16")), lower(to_compute_dtype(bound, "float16", "float16"))
    assert len(low_io.kernels()) == len(fp32_io.kernels()) - 2 == 4
    assert sorted(low_io.kernel_patterns.values()) == sorted(fp32_io.kernel_patterns.values())


@pytest.mark.parametrize("dtype,tol", [("fp16", 1e-2), ("bf16", 8e-2)])
def test_io_dtype_end_to_end(tmp_path, dtype, tol):
    """--io-dtype: the export has 2 kernels fewer, verifies against onnxruntime (fed the same values in fp32)
    within the compute dtype's tolerance, and its manifest says the interface dtype."""
    model = onnx_models.layer_norm_gelu(rows=4, hidden=32)
    fp32_io, low_io = _export(tmp_path, model, "lng", dtype), _export(tmp_path, model, "lng", dtype, dtype)
    assert len(low_io["kernels"]) == len(fp32_io["kernels"]) - 2
    assert low_io["precision"]["interface_dtype"] == parse_dtype(dtype) != fp32_io["precision"]["interface_dtype"]
    assert [t["dtype"] for t in low_io["inputs"] + low_io["outputs"]] == [parse_dtype(dtype)] * 2
    assert [t["dtype"] for t in fp32_io["inputs"] + fp32_io["outputs"]] == ["float32"] * 2
    check = low_io["verification"]
    assert check["status"] == "passed" and check["tolerance"]["float32"] == {"atol": tol, "rtol": tol}
    assert check["max_abs_err"] > 1e-5  # it really computed in the low dtype


# ---- tiny HF exports: the same fusion groups in fp16/bf16 as in fp32 ------------------------------------

@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_hf_exports_keep_their_fp32_fusions_in_fp16_and_bf16(name, exporter, hf_exports):
    """After ToMixedPrecision (casts around the fp32 matmul results, softmax and norms; bf16 power and layer_norm
    in fp32 between casts), every fp32 fusion group is found again: attention, SwiGLU, MatMul+act, skip-LN..."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    from collections import Counter

    from tvmfuse.decide.decision import decide
    from tvmfuse.frontend.importer import load_onnx

    imported = import_model(load_onnx(hf_exports(name, exporter)), {"batch": [1], "seq": [16]})
    bound = bind_params(imported.mod, imported.params)
    groups = {}
    for dtype in ("float32", "float16", "bfloat16"):
        mod = to_compute_dtype(bound, dtype)
        fused = lower(mod, plan=decide(mod))
        calls = []  # every call of a pattern-fused kernel (identical kernels are one function)
        relax.analysis.post_order_visit(fused.mod["main"], lambda e: calls.append(
            fused.kernel_patterns.get(e.args[0].name_hint)) if isinstance(e, relax.Call)
            and isinstance(getattr(e, "args", [None])[0], tvm.ir.GlobalVar) else None)
        groups[dtype] = Counter(c for c in calls if c)
    assert groups["float32"]["tvmfuse.attention"] >= 1
    # fp16 and bf16: the residual stream is low from the embedding lookup on, and the decision may then put a
    # projection's bias into its GEMM (matmul_bias) instead of into the skip-LayerNorm after it
    # (skip_layer_norm_bias): as many kernels, the same fusions otherwise
    same = ("tvmfuse.skip_layer_norm_bias", "tvmfuse.matmul_bias", "tvmfuse.skip_layer_norm")
    for low in ("float16", "bfloat16"):
        moved = groups["float32"]["tvmfuse.skip_layer_norm_bias"] - groups[low]["tvmfuse.skip_layer_norm_bias"]
        assert moved >= 0 and groups[low]["tvmfuse.matmul_bias"] == groups["float32"]["tvmfuse.matmul_bias"] + moved
        assert groups[low]["tvmfuse.skip_layer_norm"] == groups["float32"]["tvmfuse.skip_layer_norm"] + moved
        assert {k: v for k, v in groups[low].items() if k not in same} == \
            {k: v for k, v in groups["float32"].items() if k not in same}, groups


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_power_computes_in_fp32_and_feeds_the_mean_directly(dtype):
    """RMSNorm's mean(x**2): the square is taken in fp32 and the mean reads it without a round trip through the
    compute dtype (fp16 overflows past 256 -> inf; torch's RMSNorm upcasts, the fp32 export had dropped that)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Pow", ["h", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "ax"], ["ms"], keepdims=1), helper.make_node("Add", ["h", "ms"], ["y"])]
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [8, 8], np.eye(8, dtype="float32").ravel().tolist()),
             helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]), helper.make_tensor("ax", TensorProto.INT64, [1], [-1])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], inits)
    imp = import_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    mod = to_compute_dtype(bind_params(imp.mod, imp.params), dtype)
    found = {}

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            found.setdefault(expr.op.name, []).append(expr)
    relax.analysis.post_order_visit(mod["main"], visit)
    assert [str(c.ty.dtype) for c in found["relax.power"]] == ["float32"]
    assert [str(c.args[0].ty.dtype) for c in found["relax.mean"]] == ["float32"]
    assert dtype in {str(c.ty.dtype) for c in found["relax.matmul"] + found["relax.astype"]}  # the rest is low
    x = np.full((2, 8), 300.0, "float32")  # 300**2 = 90000 > 65504: an fp16 square would be inf
    vm = relax.VirtualMachine(tvm.compile(lower(mod, patterns=[]).mod, target="llvm"), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    assert np.isfinite(got).all() and abs(float(got[0, 0]) - 90300.0) / 90300.0 < 1e-2


def _embedding(vocab=32, hidden=16, rows=6) -> onnx.ModelProto:
    """y = LayerNorm(E[ids] + r) @ W: an embedding lookup from a constant table feeding the residual stream."""
    from onnx import TensorProto, helper
    rng = np.random.default_rng(3)
    init = [helper.make_tensor(n, TensorProto.FLOAT, a.shape, a.ravel()) for n, a in
            (("E", rng.standard_normal((vocab, hidden)).astype(np.float32)),
             ("g", np.ones(hidden, np.float32)), ("beta", np.zeros(hidden, np.float32)),
             ("W", (rng.standard_normal((hidden, hidden)) * 0.2).astype(np.float32)))]
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"]), helper.make_node("Add", ["e", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "beta"], ["n"], axis=-1),
             helper.make_node("MatMul", ["n", "W"], ["y"])]
    graph = helper.make_graph(nodes, "emb", [helper.make_tensor_value_info("ids", TensorProto.INT64, [rows]),
                                              helper.make_tensor_value_info("r", TensorProto.FLOAT, [rows, hidden])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, hidden])], init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_embedding_lookups_make_the_residual_stream_low_unless_turned_off(dtype):
    from tvmfuse.prepare.precision import has_low_lookups, precision_info
    imp = import_model(_embedding())
    bound = bind_params(imp.mod, imp.params)
    low = to_compute_dtype(bound, dtype)
    assert has_low_lookups(low) and ("relax.add", dtype) in _ops(low)
    assert precision_info(low, dtype)["residual_stream"] == dtype
    high = to_compute_dtype(bound, dtype, low_lookups=False)
    assert not has_low_lookups(high) and ("relax.add", "float32") in _ops(high)


def test_failed_verification_with_low_lookups_builds_again_with_them_in_fp32(tmp_path, monkeypatch, capsys):
    """A build whose fp16 residual stream misses the tolerance is built again with fp32 lookups, and says so."""
    from tvmfuse import pipeline
    from tvmfuse.verify.outputs import Verification
    real, calls = pipeline.compare_at_dims, []

    def first_fails(*args, **kwargs):
        checks = real(*args, **kwargs)
        calls.append(checks)
        if len(calls) == 1:  # as if the fp16 stream had missed the tolerance
            return [(d, Verification(0.5, 0.5, False, c.tolerance)) for d, c in checks]
        return checks
    monkeypatch.setattr(pipeline, "compare_at_dims", first_fails)
    manifest = _export(tmp_path, _embedding(), "emb", "fp16")
    assert len(calls) == 2 and manifest["verification"]["status"] == "passed"
    assert "building again with the embedding lookups in fp32" in capsys.readouterr().out
    assert manifest["precision"]["residual_stream"].startswith("as the ops above")


def test_fp16_embedding_export_passes_with_an_fp16_residual_stream(tmp_path):
    manifest = _export(tmp_path, _embedding(), "emb", "fp16")
    assert manifest["verification"]["status"] == "passed" and manifest["precision"]["residual_stream"] == "float16"


# ---- models stored in bf16 (exported after model.to(torch.bfloat16)) ---------------------------------------

LEGACY_BF16 = pytest.mark.xfail(raises=RuntimeError, strict=True, reason="torch 2.13's legacy exporter cannot export "
                                "a bf16 model: 'ScalarType ComplexDouble is an unexpected tensor scalar type'")


def _onnx_bf16_initializers(path) -> set[bytes]:
    """The bytes of every bf16 initializer of two or more dimensions, as stored and transposed (the layout stage
    stores [K, N] weights [N, K])."""
    from onnx import numpy_helper

    found = set()
    for t in onnx.load(path).graph.initializer:
        if t.data_type == onnx.TensorProto.BFLOAT16 and len(t.dims) >= 2:
            a = numpy_helper.to_array(t)
            found |= {a.tobytes(), np.ascontiguousarray(a.T).tobytes()}
    return found


@pytest.mark.parametrize("exporter", [pytest.param("legacy", marks=LEGACY_BF16), "dynamo"])
def test_bf16_export_keeps_its_bf16_weights_with_fp32_accumulation(exporter, hf_exports):
    """No round trip through fp32: every weight the prepared module holds is one of the model's bf16 initializers,
    bit for bit (no fp32 copy of any 2-D weight exists), and each matmul accumulates in fp32."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    from tvmfuse.frontend.importer import load_onnx
    from tvmfuse.prepare import prepare_module
    from tvmfuse.prepare.precision import precision_info, weight_dtypes

    path = hf_exports("llama", exporter, "bfloat16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        imported = import_model(load_onnx(path))
    # onnxruntime cannot open a bf16 graph: the import does not try to fold it, so it has nothing to warn about
    assert not [str(w.message) for w in caught if "constant folding" in str(w.message)]
    prepared = prepare_module(imported, "bf16")
    weights = []
    relax.analysis.post_order_visit(prepared["main"], lambda e: weights.append(e.value.numpy()) if isinstance(
        e, tvm.ir.GenericConst) and len(e.value.shape) >= 2 and str(e.value.dtype).startswith(("float", "bfloat"))
        else None)
    assert weights and weight_dtypes(prepared) == {"bfloat16"}
    stored = _onnx_bf16_initializers(path)
    assert all(w.tobytes() in stored for w in weights)
    matmuls = []
    relax.analysis.post_order_visit(prepared["main"], lambda e: matmuls.append(str(e.ty.dtype)) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.matmul" else None)
    assert matmuls and set(matmuls) == {"float32"}  # astype(matmul(a, b, out_dtype=float32), bfloat16)
    info = precision_info(prepared, "bf16")
    assert info["stored_dtype"] == "bfloat16" and info["pass"].startswith("none: the model is stored in bfloat16")
    assert [str(p.ty.dtype) for p in prepared["main"].params] == ["int64", "int64"]
    assert str(prepared["main"].ret_ty.dtype) == "float32"  # the float interface is float32, as for fp32 models


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_bf16_export_builds_and_verifies_against_its_fp32_copy(name, hf_exports, tmp_path):
    """--dtype bf16 on llvm: the build passes against onnxruntime on an fp32 copy of the model (onnxruntime's CPU
    provider runs no bf16 MatMul) at bf16's tolerance, and the manifest says bf16 throughout."""
    pytest.importorskip("onnxscript")
    manifest = _export(tmp_path, onnx.load(hf_exports(name, "dynamo", "bfloat16")), f"{name}_bf16", "bf16")
    check = manifest["verification"]
    assert check["status"] == "passed" and check["tolerance"]["float32"] == {"atol": 8e-2, "rtol": 8e-2}
    assert check["reference"] == "onnxruntime on an fp32 copy of the bf16 model"
    assert 0 < check["max_abs_err"] < 8e-2  # it computed in bf16, and within bf16's tolerance
    precision = manifest["precision"]
    assert precision["compute_dtype"] == precision["stored_dtype"] == "bfloat16"
    assert precision["weights_dtype"] == ["bfloat16"] and precision["residual_stream"] == "bfloat16 (as stored)"
    assert [t["dtype"] for t in manifest["outputs"]] == ["float32"]
    assert re.search(r"(?<!b)float16|fp16", json.dumps(manifest)) is None  # nothing says fp16


def test_fp32_copy_of_a_bf16_model_upcasts_weights_casts_and_io():
    from onnx import TensorProto, helper, numpy_helper
    import ml_dtypes

    from tvmfuse.verify.reference import fp32_copy, stores_bf16

    w = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
         helper.make_node("MatMul", ["xb", "w"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [1, 3])], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert stores_bf16(model)
    copy = fp32_copy(model)
    assert not stores_bf16(copy) and stores_bf16(model)  # the original is untouched
    assert copy.graph.node[0].attribute[0].i == TensorProto.FLOAT
    assert copy.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    np.testing.assert_array_equal(numpy_helper.to_array(copy.graph.initializer[0]), w.astype(np.float32))
    out = onnxruntime_outputs(copy, {"x": np.ones((1, 2), np.float32)})[0]
    np.testing.assert_array_equal(out, [[3.0, 5.0, 7.0]])


def test_bf16_model_with_fp16_dtype_is_refused(hf_exports):
    pytest.importorskip("onnxscript")
    from tvmfuse.frontend.importer import load_onnx
    from tvmfuse.prepare import prepare_module

    imported = import_model(load_onnx(hf_exports("gpt2", "dynamo", "bfloat16")))
    with pytest.raises(JobError, match="the model stores bfloat16 weights; --dtype float16 would round them"):
        prepare_module(imported, "fp16")


def test_bf16_needs_a_cuda_arch_with_native_bf16():
    """The CUDA target keeps its arch (sm_90a), for which TVM's BF16 legalization passes leave bf16 alone; an arch
    without bf16 (or none: TVM picks sm_50) is refused rather than emulated in fp32."""
    from tvmfuse.errors import TvmfuseError
    from tvmfuse.targets import check_compute_dtype, resolve_target

    cuda = resolve_target("cuda")
    assert str(cuda.attrs["arch"]) == "sm_90a"
    version = tvm.support.nvcc.get_target_compute_version(cuda)
    assert tvm.get_global_func("tvm.support.nvcc.supports_bf16")(version)
    check_compute_dtype(cuda, "bfloat16")
    check_compute_dtype(resolve_target('{"kind": "cuda", "arch": "sm_80"}'), "bfloat16")
    check_compute_dtype(resolve_target('{"kind": "cuda", "arch": "sm_75"}'), "float16")
    with pytest.raises(TvmfuseError, match="--dtype bf16 needs a CUDA arch of sm_80 or newer, the target's is sm_75"):
        check_compute_dtype(resolve_target('{"kind": "cuda", "arch": "sm_75"}'), "bfloat16")


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_bf16_export_fuses_attention_as_its_fp32_export(name, hf_exports):
    """sdpa's NaN guard `where(isnan(p), 0, p)` around the fp32 softmax is written as ToMixedPrecision leaves it
    (the guard in fp32, one cast to bf16 after it), so the attention pattern takes a bf16 export's attention
    as it takes the fp32 export's, and the norms fuse alike: Llama's RMSNorms too, whose bf16 result feeds matmuls
    that accumulate in fp32 (no casts: the norm's kernel ends at its own result)."""
    pytest.importorskip("onnxscript")
    from collections import Counter

    from tvmfuse.decide.decision import decide
    from tvmfuse.frontend.importer import load_onnx

    groups = {}
    for dtype, stored in (("float32", "float32"), ("bfloat16", "bfloat16")):
        imported = import_model(load_onnx(hf_exports(name, "dynamo", stored)), {"batch": [1], "seq": [16]})
        mod = to_compute_dtype(bind_params(imported.mod, imported.params), dtype)
        fused = lower(mod, plan=decide(mod))
        calls = []
        relax.analysis.post_order_visit(fused.mod["main"], lambda e: calls.append(
            fused.kernel_patterns.get(e.args[0].name_hint)) if isinstance(e, relax.Call)
            and isinstance(getattr(e, "args", [None])[0], tvm.ir.GlobalVar) else None)
        groups[dtype] = Counter(c for c in calls if c)
    assert groups["bfloat16"]["tvmfuse.attention"] == groups["float32"]["tvmfuse.attention"] == 2, groups
    norms = {dtype: sum(n for pattern, n in g.items() if "norm" in pattern) for dtype, g in groups.items()}
    assert norms["bfloat16"] == norms["float32"] == 5, groups  # 2 layers x 2 + the final norm


def test_bf16_llama_rounds_where_the_bf16_emulation_says(hf_exports):
    """bench/fp16_error.py's BF16_BUILD (docs/precision.md, "bf16 accuracy") describes the bf16 build of an fp32
    Llama export: the embedding lookup and both residual sums bf16, the logits (the head's accumulator) fp32, every
    matmul weight bf16, each norm output rounded to bf16 before its GEMM, the rotary tables bf16 constants. If
    this changes, the emulation's table changes with it."""
    from tvmfuse.frontend.importer import load_onnx

    imported = import_model(load_onnx(hf_exports("llama")), {"batch": [1], "seq": [16]})
    mod = to_compute_dtype(bind_params(imported.mod, imported.params), "bfloat16")
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    dt = lambda e: str(getattr(e.ty, "dtype", ""))  # noqa: E731
    takes = [c for c in calls if c.op.name == "relax.take" and "float" in dt(c)]  # not the mask's bool one
    assert takes and all(dt(c) == "bfloat16" for c in takes)  # the embedding lookup is bf16
    adds = [c for c in calls if c.op.name == "relax.add" and len(c.ty.shape) == 3
            and all(len(getattr(a.ty, "shape", [])) == 3 for a in c.args)]
    assert len(adds) >= 2 and len(adds) % 2 == 0 and all(dt(c) == "bfloat16" for c in adds)  # 2 residual sums a layer
    matmuls = [c for c in calls if c.op.name == "relax.matmul"]
    assert matmuls and all(str(c.attrs.out_dtype) == "float32" for c in matmuls)
    assert {dt(c.args[0]) for c in matmuls} == {"bfloat16"}
    assert dt(mod["main"].body.body) == "float32" and not any(  # the logits: the head's fp32 result itself
        c.op.name == "relax.astype" and c.args[0].same_as(mod["main"].body.body) for c in calls)
    tables = [a for c in calls if c.op.name == "relax.multiply" and len(c.ty.shape) == 4
              for a in c.args if isinstance(a, tvm.ir.GenericConst) and len(a.ty.shape) == 4]
    assert tables and all(dt(t) == "bfloat16" for t in tables)  # cos/sin
