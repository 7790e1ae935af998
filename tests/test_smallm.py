"""tvmfuse.spaces.smallm: the small-M (decode batch) matmul default schedule on CUDA."""

import re
import shutil

import numpy as np
import pytest
import tvm
from checks import cuda_sources
from tvm import relax, tirx

from tvmfuse.spaces.defaults import SmallBatchMatmul, default_rule
from tvmfuse.build import compile_module
from tvmfuse.spaces import apply_default_schedules
from tvmfuse.fuse.fusion import lower
from tvmfuse.spaces import smallm
from tvmfuse.targets import resolve_target


def _projection(rows, k, n, batch=1, transposed=True, dtype="float16", w_dtype=None):
    """y = x @ W^T + b in `dtype` (fp16 or bf16; W in `w_dtype`, default `dtype`) with fp32 accumulation, W stored
    [N, K] (as the layout stage leaves it) or [K, N]."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, rows, k), dtype))
    w = relax.Var("w", relax.TensorType((n, k) if transposed else (k, n), w_dtype or dtype))
    b = relax.Var("b", relax.TensorType((n,), dtype))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(w)) if transposed else w
            mm = bb.emit(relax.op.astype(bb.emit(relax.op.matmul(x, wt, out_dtype="float32")), dtype))
            out = bb.emit_output(relax.op.add(mm, b))
        bb.emit_func_output(out)
    return lower(bb.get()).mod


def _kernel(mod):
    (fn,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return fn


@pytest.mark.parametrize("rows,batch,expected", [(16, 1, True), (1, 16, True), (4, 1, True), (32, 1, True),
                                                 (1, 1, False), (64, 1, False), (3, 1, False)])
def test_small_m_rule_takes_decode_batches_only(rows, batch, expected):
    cuda = resolve_target("cuda")
    rule, _ = default_rule(_kernel(_projection(rows, 512, 256, batch)), cuda)
    assert isinstance(rule, SmallBatchMatmul) is expected, type(rule).__name__


def test_small_m_needs_the_n_by_k_weight():
    """With W read as [K, N] (no layout stage) K is not innermost: the schedule does not apply."""
    assert smallm.default_schedule(_kernel(_projection(16, 512, 256, transposed=False))) is None


def test_small_m_kernel_is_one_launch_with_vector_loads_and_fp32_sums():
    cuda = resolve_target("cuda")
    mod = _projection(16, 4096, 4096)
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
    assert src.count("__global__") == 2  # declaration + definition: one kernel
    assert "half4" in src  # 8-byte (4 x fp16) loads of x and W
    assert "float " in src and "__syncthreads" in src  # fp32 partial sums meeting in shared memory


def test_bf16_small_m_kernel_widens_bf16_loads_to_fp32_sums():
    """bf16 x bf16 -> fp32 at decode batch 16: the same one-launch kernel, bf16 vector loads (nv_bfloat16 x 4),
    fp32 partial sums; it compiles with nvcc for sm_90a."""
    cuda = resolve_target("cuda")
    mod = _projection(16, 4096, 4096, dtype="bfloat16")
    rule, _ = default_rule(_kernel(mod), cuda)
    assert isinstance(rule, SmallBatchMatmul), type(rule).__name__
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
    assert src.count("__global__") == 2
    assert "nv_bfloat16* __restrict__ w_ptr" in src and "nv_bfloat164" in src  # bf16 weight, 8-byte loads
    assert re.search(r"\bhalf\b", src) is None  # no fp16 type anywhere: nothing went through fp16
    assert "float matmul_intermediate_rf" in src.replace("alignas(64) ", "")  # the partial sums are fp32
    if shutil.which("nvcc") is not None:
        with cuda:
            ptx = bytes(tvm.support.nvcc.compile_cuda(src, target_format="ptx", compiler="nvcc")).decode()
        assert ".target sm_90a" in ptx and "cvt.f32.bf16" in ptx  # native bf16 -> fp32 widening, no emulation


@pytest.mark.parametrize("x_dtype,w_dtype", [("float16", "bfloat16"), ("bfloat16", "float16")])
def test_small_m_refuses_mixed_fp16_bf16_operands(x_dtype, w_dtype):
    """A matmul of fp16 by bf16 is no model's: the small-M rule leaves it to dlight rather than pick a conversion."""
    fn = _kernel(_projection(16, 512, 256, dtype=x_dtype, w_dtype=w_dtype))
    assert smallm.default_schedule(fn) is None and not smallm.applies(fn)
    rule, _ = default_rule(fn, resolve_target("cuda"))
    assert not isinstance(rule, SmallBatchMatmul)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
@pytest.mark.parametrize("rows,batch", [(16, 1), (1, 16), (4, 1), (32, 1)])
def test_gpu_bf16_small_m_matches_numpy(rows, batch):
    """bf16 inputs, fp32 accumulation, one bf16 rounding of the output: within 1e-2 + 1e-2 |want| of the fp32
    product of the same bf16 values (one rounding is at most 2^-8 relative; the fp32 sums' order adds ~1e-6)."""
    import ml_dtypes

    cuda, dev, rng = resolve_target("cuda"), tvm.cuda(0), np.random.default_rng(0)
    k, n = 1024, 768
    x = rng.standard_normal((batch, rows, k)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((n, k)) * 0.03).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    mod = _projection(rows, k, n, batch, dtype="bfloat16")
    if rows > 1:
        assert isinstance(default_rule(_kernel(mod), cuda)[0], SmallBatchMatmul)
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(mod, cuda), cuda), dev)
    out = vm["main"](*[tvm.runtime.tensor(a, dev) for a in (x, w, b)])
    assert out.dtype == "bfloat16"
    got = out.numpy().astype("float32")
    want = x.astype("float32") @ w.astype("float32").T + b.astype("float32")
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
@pytest.mark.parametrize("rows,batch", [(16, 1), (1, 16), (4, 1), (32, 1)])
def test_gpu_small_m_matches_numpy(rows, batch):
    cuda, dev, rng = resolve_target("cuda"), tvm.cuda(0), np.random.default_rng(0)
    k, n = 1024, 768
    x = rng.standard_normal((batch, rows, k)).astype("float16")
    w = (rng.standard_normal((n, k)) * 0.03).astype("float16")
    b = rng.standard_normal(n).astype("float16")
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(_projection(rows, k, n, batch), cuda), cuda), dev)
    got = vm["main"](*[tvm.runtime.tensor(a, dev) for a in (x, w, b)]).numpy().astype("float32")
    want = x.astype("float32") @ w.astype("float32").T + b.astype("float32")
    assert np.abs(got - want).max() < 2e-2


def test_tuning_space_samples_the_small_m_knobs():
    """`--trials` explores the small-M schedule's knobs (beside the split-K CUDA-core sketch): every sample either
    passes MetaSchedule's CUDA postprocs and compiles, or is rejected by them (shared memory over the limit)."""
    import itertools

    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    from tvmfuse.spaces import space_for

    h100 = tvm.target.Target("nvidia/nvidia-h100")
    fn = _kernel(_projection(16, 512, 256))
    ctx = ms.TuneContext(mod=tvm.IRModule({"main": fn}), target=h100, space_generator=space_for(fn, h100),
                         search_strategy="replay-trace")
    sketches = ctx.generate_design_space()
    assert len(sketches) == 2  # the CUDA-core GEMV sketch and the small-M one
    trace = sketches[1].trace
    picks = [i for i in trace.insts if i.kind.name == "SampleCategorical"]
    assert [list(map(int, i.attrs[0])) for i in picks] == [[2, 4, 8], [2, 4, 8], [4, 8]]  # tn, warps, vec
    compiled = 0
    for combo in itertools.product(*[range(len(i.attrs[0])) for i in picks]):
        for inst, choice in zip(picks, combo):
            trace = trace.with_decision(inst, choice, remove_postproc=True)
        sch = s_tir.Schedule(tvm.IRModule({"main": fn}))
        trace.apply_to_schedule(sch, remove_postproc=True)
        if all([p.apply(sch) for p in ctx.space_generator.postprocs]):
            tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=h100)
            compiled += 1
    assert compiled >= 12  # 6 of 18 need more than 48 KB of shared memory for the lanes' partial sums
