"""tvmfuse.kernels.row_kernel: fused row reductions (LayerNorm(+GELU), RMSNorm(+residual)) become one TIRx kernel
holding each row in registers; what it refuses, its CUDA source, its registers, and (GPU) its numbers."""

import re
import shutil
import sys
from pathlib import Path

import ml_dtypes  # noqa: F401  (numpy's "bfloat16" dtype)
import numpy as np
import onnx_models
import pytest
import tvm
from onnx import helper
from tvm import relax, tirx

from tvmfuse.fuse.fusion import lower

from tvmfuse.prepare import bind_params
from tvmfuse.frontend.importer import import_model
from tvmfuse.kernels.hopper.row_analysis import analyze_rows
from tvmfuse.kernels.hopper.row_kernel import (
    RowKnobs,
    default_knobs,
    row_kernel,
    row_kernel_from_fused,
)
from tvmfuse.kernels.hopper.wgmma_gemm import TIRX_ATTR
from tvmfuse.prepare.precision import to_compute_dtype

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.rowk import ptxas_usage

H100 = tvm.target.Target("nvidia/nvidia-h100")


def _layer_norm(rows, hidden):
    rng = np.random.default_rng(4)
    return onnx_models._model(
        [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)],
        [onnx_models._f32("x", [rows, hidden])], [onnx_models._f32("y", [rows, hidden])],
        [onnx_models._const("g", 1 + 0.1 * rng.standard_normal(hidden).astype("float32")),
         onnx_models._const("b", 0.1 * rng.standard_normal(hidden).astype("float32"))])


def _rms_norm(rows, hidden):
    """y = x / sqrt(mean(x * x) + eps) * w (no residual)."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rt"]),
             helper.make_node("Div", ["x", "rt"], ["n"]), helper.make_node("Mul", ["n", "w"], ["y"])]
    return onnx_models._model(nodes, [onnx_models._f32("x", [rows, hidden])], [onnx_models._f32("y", [rows, hidden])],
                              [onnx_models._const("axes", np.array([-1])), onnx_models._const("eps", np.float32(1e-6)),
                               onnx_models._const("w", rng.standard_normal(hidden).astype("float32"))])


MODELS = {"ln_gelu": lambda r, h: onnx_models.layer_norm_gelu(rows=r, hidden=h), "ln": _layer_norm, "rms": _rms_norm,
          "rms_res": lambda r, h: onnx_models.rms_norm_residual(rows=r, hidden=h),
          "ln_gelu_dyn": lambda r, h: onnx_models.layer_norm_gelu(hidden=h, dyn=True),
          "proj": lambda r, h: onnx_models.projection(rows=r, k=h, n=512)}


def _fused(model: str, rows: int = 64, hidden: int = 1024, dtype: str = "fp16") -> tirx.PrimFunc:
    """The model's one fused kernel (the PrimFunc with a reduction) as tvmfuse lowers it, fp16 in and out."""
    imp = import_model(MODELS[model](rows, hidden))
    mod = to_compute_dtype(bind_params(imp.mod, imp.params), dtype, dtype if dtype != "fp32" else None)
    funcs = [f for f in lower(mod).mod.functions.values() if isinstance(f, tirx.PrimFunc)
             and ("T.init()" in f.script())]
    assert len(funcs) == 1, len(funcs)
    return funcs[0]


@pytest.mark.parametrize("model,inputs,outputs,sums", [
    ("ln_gelu", ["x"], 1, 2),  # sum of x, then of (x - mean)^2 (TVM's layer_norm: two sums, fp32)
    ("ln", ["x"], 1, 2),
    ("rms", ["x"], 1, 1),
    ("rms_res", ["x", "r"], 2, 1)])  # h = x + r is an output the norm reads back
def test_analysis_accepts_row_norms(model, inputs, outputs, sums):
    info, why = analyze_rows(_fused(model))
    assert why == "" and (info["r"], info["h"]) == (64, 1024)
    assert [b.name for b in info["inputs"]] == inputs and len(info["outputs"]) == outputs
    assert info["n_red"] == sums and info["steps"][-1]["kind"] == "row"


def test_rows_over_several_leading_dims():
    """[2, 32, 1024]: 64 rows, read contiguously (LayerNorm+GELU built in Relax, fp16)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 32, 1024), "float16"))
    g, b = (relax.Var(n, relax.TensorType((1024,), "float16")) for n in ("g", "b"))
    with bb.function("main", [x, g, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.gelu(relax.op.nn.layer_norm(x, g, b, axes=[-1])))
        bb.emit_func_output(out)
    (fused,) = [f for f in lower(bb.get()).mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    info, why = analyze_rows(fused)
    assert why == "" and (info["rows"], info["r"], info["h"]) == ([2, 32], 64, 1024)
    assert "x_ptr[" in _cuda(row_kernel_from_fused(fused, "main")[0])


def test_analysis_accepts_fp32():
    info, why = analyze_rows(_fused("ln_gelu", dtype="fp32"))
    assert why == "" and info["n_red"] == 2


@pytest.mark.parametrize("model,rows,hidden,reason", [
    ("ln_gelu", 64, 1000, "not a multiple of 256"),
    ("ln_gelu_dyn", 0, 1024, "symbolic shapes"),
    ("ln_gelu", 1, 1024, "a single row"),
    ("proj", 64, 256, "other indices")])  # a matmul: its reduction reads x[i, k] and W[k, j]
def test_analysis_refuses(model, rows, hidden, reason):
    got, why = row_kernel_from_fused(_fused(model, rows, hidden), "main")
    assert got is None and reason in why, why


def test_a_kernel_with_a_scalar_parameter_is_refused_with_a_reason_not_a_failure():
    """A size passed in as a scalar (a decoder step's arange over the symbolic past): refused as such; it was an
    AttributeError from the buffer checks, recorded as a failure of the Hopper kernels on every such kernel."""
    from tvmfuse.isolation import collecting
    from tvmfuse.kernels.hopper.select import apply_hopper_kernels
    from tvmfuse.targets import resolve_target

    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def arange(n: T.int64, out: T.handle):
        o = T.match_buffer(out, (n,), "int64")
        for i in range(n):
            with T.sblock("o"):
                vi = T.axis.spatial(n, i)
                o[vi] = vi

    assert row_kernel_from_fused(arange, "arange") == (None, "scalar parameters")
    mod = tvm.IRModule({"arange": arange})
    with collecting() as failures:
        assert apply_hopper_kernels(mod, resolve_target("cuda"), print) is mod  # no kernel replaced
    assert failures.items == []


def test_analysis_refuses_kernels_without_a_sum():
    """The casts of an fp16 model's fp32 interface: elementwise kernels."""
    imp = import_model(onnx_models.layer_norm_gelu(rows=64, hidden=1024))
    funcs = [f for f in lower(to_compute_dtype(bind_params(imp.mod, imp.params), "fp16")).mod.functions.values()
             if isinstance(f, tirx.PrimFunc) and "T.init()" not in f.script()]
    assert funcs and all("no reduction block" in analyze_rows(f)[1] for f in funcs)


def test_default_knobs():
    info, _ = analyze_rows(_fused("ln_gelu", 8192, 4096))
    assert default_knobs(info) == RowKnobs(warps_per_row=4, rows_per_cta=1)
    info, _ = analyze_rows(_fused("ln_gelu", 64, 768))
    assert default_knobs(info) == RowKnobs(warps_per_row=1, rows_per_cta=4)
    info, _ = analyze_rows(_fused("ln_gelu", 6, 1024))
    assert default_knobs(info) == RowKnobs(warps_per_row=1, rows_per_cta=2)  # a divisor of the rows


def _cuda(func) -> str:
    ex = tvm.compile(tvm.IRModule({"main": func}), target=H100, tir_pipeline="tirx")
    return ex.mod.imports[0].inspect_source("cuda")


@pytest.mark.parametrize("model,knobs", [("ln_gelu", None), ("ln_gelu", RowKnobs(2, 4)), ("ln", RowKnobs(4, 2)),
                                         ("rms", None), ("rms_res", RowKnobs(2, 2))])
def test_kernel_compiles_with_vector_loads_and_shuffles(model, knobs):
    fused = _fused(model)
    if knobs is None:
        func, why = row_kernel_from_fused(fused, "main")
        assert func is not None, why
    else:
        func = row_kernel(analyze_rows(fused)[0], knobs, "main")
    assert func.attrs[TIRX_ATTR] == "row"
    assert [str(p.name) for p in func.params] == [str(p.name) for p in fused.params]
    src = _cuda(func)
    assert src.count("__global__") == 2  # declaration + definition: one kernel
    assert "uint4 v = __ldg(reinterpret_cast<const uint4*>(p))" in src  # 16-byte loads of 8 fp16
    assert "*reinterpret_cast<uint4*>(p) = v" in src  # 16-byte stores
    assert "__shfl_xor_sync" in src
    assert ("tvm_builtin_cuda_cta_sync" in src) == ((knobs or RowKnobs(1, 8)).warps_per_row > 1)
    if model == "ln_gelu":
        assert "erff(" in src  # erf GELU stays erf


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_default_kernel_registers_without_spills():
    """LayerNorm+GELU at 8192 x 4096 fp16 with the default knobs (ptxas for sm_90a)."""
    func, _ = row_kernel_from_fused(_fused("ln_gelu", 8192, 4096), "main")
    src = _cuda(func)
    usage = ptxas_usage(src)
    assert usage["spill_bytes"] == 0 and usage["regs"] <= 128, usage
    assert re.search(r"__launch_bounds__\(128\)", src)  # 4 warps: one row


def _run(model, knobs, rows=64, hidden=1024, dtype="fp16"):
    fused = _fused(model, rows, hidden, dtype)
    info, why = analyze_rows(fused)
    assert info is not None, why
    func = row_kernel(info, knobs, "main") if knobs else row_kernel_from_fused(fused, "main")[0]
    lib = tvm.compile(tvm.IRModule({"main": func}), target=H100, tir_pipeline="tirx").mod
    rng = np.random.default_rng(0)
    dev = tvm.cuda(0)
    arrays = {}  # rows N(0, 1), per-column parameters 1 + N(0, 0.1) (gamma, weight; beta too), scalars (eps) 1e-5
    for p in fused.params:
        shape = [int(d) for d in p.shape]
        value = rng.standard_normal(shape) if len(shape) > 1 else 1 + 0.1 * rng.standard_normal(shape) if shape \
            else np.array(1e-5)
        arrays[str(p.name)] = value.astype(str(p.dtype))
    args = [tvm.runtime.tensor(np.zeros_like(a) if any(o.same_as(p) for o in info["outputs"]) else a, dev)
            for p, a in zip(fused.params, arrays.values())]
    lib["main"](*args)
    return arrays, {str(p.name): a.numpy() for p, a in zip(fused.params, args)}, info


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [None, RowKnobs(1, 8), RowKnobs(2, 4), RowKnobs(4, 1)])
def test_gpu_layer_norm_gelu_matches_numpy(knobs):
    from math import erf

    arrays, got, info = _run("ln_gelu", knobs)
    x, g, b = (a.astype("float32") for a in list(arrays.values())[:3])
    ln = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
    ref = ln * 0.5 * (1 + np.vectorize(erf)(ln / np.sqrt(2)))
    out = got[info["outputs"][0].name].astype("float32")
    np.testing.assert_allclose(out, ref, atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_rms_norm_residual_matches_numpy():
    arrays, got, info = _run("rms_res", RowKnobs(2, 4))
    x, r, eps, w = (a.astype("float32") for a in list(arrays.values())[:4])
    h = (x + r).astype("float16").astype("float32")
    ref = h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * w
    y_name, h_name = [b.name for b in info["outputs"][::-1]]
    np.testing.assert_allclose(got[h_name].astype("float32"), h, atol=2e-2)
    np.testing.assert_allclose(got[y_name].astype("float32"), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("model,bf16_inputs", [("ln_gelu", ["x"]), ("ln", []), ("rms", ["x"]), ("rms_res", ["x", "r"])])
def test_analysis_accepts_bf16_row_norms(model, bf16_inputs):
    """--dtype bf16: the norms read bf16 rows (LayerNorm's own input fp32: it computes in fp32 between casts),
    their parameters fp32, and write bf16."""
    info, why = analyze_rows(_fused(model, dtype="bf16"))
    assert why == "" and (info["r"], info["h"]) == (64, 1024), why
    assert [b.name for b in info["inputs"] if str(b.dtype) == "bfloat16"] == bf16_inputs
    assert {str(b.dtype) for b in info["outputs"]} == {"bfloat16"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("model,knobs", [("ln_gelu", None), ("ln", RowKnobs(4, 2)), ("rms", None),
                                         ("rms_res", RowKnobs(2, 2))])
def test_bf16_kernel_moves_8_bf16_per_16_bytes_and_compiles_for_sm_90a(model, knobs):
    fused = _fused(model, dtype="bf16")
    func = row_kernel(analyze_rows(fused)[0], knobs, "main") if knobs else row_kernel_from_fused(fused, "main")[0]
    src = _cuda(func)
    kernel = src.split("__global__")[-1]
    assert src.count("__global__") == 2 and "#include <cuda_bf16.h>" in src
    assert "tvmfuse_st8_bf16_" in kernel and "half" not in kernel and "__half22float2" not in src
    assert "*reinterpret_cast<uint4*>(p) = v" in src  # 16-byte stores of 8 bf16
    if model != "ln":  # bf16 rows in: one 16-byte load of 8 bf16, widened to fp32 two at a time
        assert "tvmfuse_ld8_bf16_32(" in kernel and "__bfloat1622float2(reinterpret_cast<const nv_bfloat162*>" in src
    if model == "rms_res":  # h = x + r: its bf16 output rounded from fp32 pairs
        assert "__floats2bfloat162_rn(" in src
    with H100:
        assert len(tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")) > 1000


def test_row_analysis_names_a_dtype_it_refuses():
    """float64 rows: the reason names the dtype and the ones the kernel takes."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 1024), "float64"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.divide(x, relax.op.sum(x, axis=[-1], keepdims=True)))
        bb.emit_func_output(out)
    (fused,) = [f for f in lower(bb.get()).mod.functions.values() if isinstance(f, tirx.PrimFunc) and "T.init()" in f.script()]
    got, why = row_kernel_from_fused(fused, "main")
    assert got is None and "dtype float64 (float16, bfloat16 or float32 only)" in why, why


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [None, RowKnobs(1, 8), RowKnobs(2, 4), RowKnobs(4, 1)])
def test_gpu_bf16_layer_norm_gelu_matches_numpy(knobs):
    """bf16 rows in and out, fp32 gamma/beta and sums; the GELU after the bf16 rounding in bf16 as the graph has it
    (the llvm build of the same fused kernel is within 0.14 of these tolerances)."""
    from math import erf

    arrays, got, info = _run("ln_gelu", knobs, dtype="bf16")
    assert str(arrays["x"].dtype) == "bfloat16"
    x, g, b = (a.astype("float32") for a in list(arrays.values())[:3])
    ln = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
    ref = ln * 0.5 * (1 + np.vectorize(erf)(ln / np.sqrt(2)))
    out = got[info["outputs"][0].name]
    assert str(out.dtype) == "bfloat16"
    np.testing.assert_allclose(out.astype("float32"), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_bf16_rms_norm_residual_matches_numpy():
    arrays, got, info = _run("rms_res", RowKnobs(2, 4), dtype="bf16")
    x, r, eps, w = (a.astype("float32") for a in list(arrays.values())[:4])
    h = (x + r).astype("bfloat16").astype("float32")  # the residual sum rounded to bf16 once
    ref = h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * w
    y_name, h_name = [b.name for b in info["outputs"][::-1]]
    np.testing.assert_allclose(got[h_name].astype("float32"), h, atol=2e-2)
    np.testing.assert_allclose(got[y_name].astype("float32"), ref, atol=3e-2, rtol=2e-2)
