"""tvmfuse.spaces.smallm: the small-M (decode batch) matmul default schedule on CUDA."""

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


def _projection(rows, k, n, batch=1, transposed=True, dtype="float16"):
    """y = x @ W^T + b in fp16 (or `dtype`) with fp32 accumulation, W stored [N, K] (as the layout stage leaves it)
    or [K, N]."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, rows, k), dtype))
    w = relax.Var("w", relax.TensorType((n, k) if transposed else (k, n), dtype))
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
