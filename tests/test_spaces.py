"""tvmfuse.spaces: space choice per kernel family, design-space generation and CUDA codegen on tiny shapes."""

import shutil
import sys
from pathlib import Path

import pytest
import tvm
from tvm.s_tir import meta_schedule as ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import cases  # noqa: E402
from tvmfuse.spaces import apply_default_schedules, classify, gemm, gemv, rowreduce, space_for  # noqa: E402

H100 = tvm.target.Target("nvidia/nvidia-h100")
TINY = {"ln_gelu": (cases.ln_gelu, (8, 256)), "rms_res": (cases.rms_res, (8, 256)),
        "gemv": (cases.mm_bias_gelu, (32, 256, 512)), "gemm": (cases.mm_bias_gelu, (256, 128, 256))}


def _pf(name):
    f, a = TINY[name]
    return cases.fused_primfunc(*f(*a))[1]


@pytest.mark.parametrize("name,kind", [("ln_gelu", "row"), ("rms_res", "row"), ("gemv", "gemv"), ("gemm", "gemm")])
def test_classify_and_space_for(name, kind):
    pf = _pf(name)
    assert classify(pf) == kind
    assert space_for(pf, H100) is not None
    assert space_for(pf, tvm.target.Target({"kind": "llvm"})) is None


@pytest.mark.parametrize("name", ["ln_gelu", "rms_res", "gemv", "gemm"])
def test_design_space_and_postprocs(name):
    pf = _pf(name)
    ctx = ms.TuneContext(mod=tvm.IRModule({"main": pf}), target=H100, space_generator=space_for(pf, H100),
                         search_strategy="replay-trace")
    spaces = ctx.generate_design_space()
    # rows: staged / not staged; gemm: 2 stock wmma sketches + the mma one; gemv (fp16, M=32): CUDA cores + gemm's
    # (no small-M sketch: these cases read W as [K, N]; tests/test_smallm.py covers it)
    assert len(spaces) == {"gemm": 3, "gemv": 4}.get(name, 2)
    assert any("sample_categorical" in str(s.trace) for s in spaces)


def test_row_schedule_is_one_kernel_one_pass():
    pf = _pf("rms_res")
    sch = tvm.s_tir.Schedule(pf)
    assert rowreduce.schedule_row(sch, stage=True, threads=64, vec=4, unroll=16)
    src = tvm.compile(sch.mod, target=H100).jit().imports[0].inspect_source("cuda")
    assert src.count("__global__") == 2  # declaration + definition of one kernel
    assert "half4" in src or "uint2" in src  # 4 x fp16 vector loads/stores



def test_row_default_knobs():
    """16-byte vectors of the widest type computed in, whole warps covering the row in whole vectors."""
    assert rowreduce.default_knobs(768, 32) == {"threads": 192, "vec": 4, "unroll": 64}  # fp16 LN: fp32 math
    assert rowreduce.default_knobs(4096, 16) == {"threads": 512, "vec": 8, "unroll": 64}
    assert rowreduce.default_knobs(8192, 32) == {"threads": 1024, "vec": 4, "unroll": 64}  # 2 vectors a thread
    assert rowreduce.default_knobs(100, 32) == {"threads": 128, "vec": 1, "unroll": 64}  # no whole-warp cover


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_row_default_schedule_stages_where_it_fits_and_compiles():
    sch = rowreduce.default_schedule(_pf("ln_gelu"))  # x is read three times: staged once in shared memory
    assert "cache_read" in str(sch.trace) and "sample_categorical" not in str(sch.trace)
    src = tvm.compile(sch.mod, target=H100).jit().imports[0].inspect_source("cuda")
    with H100:
        assert len(tvm.support.nvcc.compile_cuda(src, target_format="fatbin", compiler="nvcc")) > 1000
    too_long = cases.fused_primfunc(*cases.rms_res(8, 32000))[1]  # h: 64 KB of fp16, over 48 KB of shared memory
    assert rowreduce.default_schedule(too_long) is None
    assert rowreduce.default_schedule(_pf("gemv")) is None

def test_gemv_schedule_compiles():
    pf = _pf("gemv")
    sch = tvm.s_tir.Schedule(pf)
    assert gemv.schedule_gemv(sch, tx=16, ky=4, vec=4, unroll=16)
    src = tvm.compile(sch.mod, target=H100).jit().imports[0].inspect_source("cuda")
    assert "threadIdx.y" in src and "__syncthreads" in src


def test_gemv_space_offers_mma_sketch():
    pf = _pf("gemv")  # M=32: CUDA-core split-K sketch + mma sketch; M=16 (below one 32-row ldmatrix tile): CUDA cores
    small = cases.fused_primfunc(*cases.mm_bias_gelu(16, 256, 512))[1]
    assert type(space_for(small, H100)).__name__ == "ScheduleFn"
    space = space_for(pf, H100)
    assert type(space).__name__ == "SpaceGeneratorUnion"
    ctx = ms.TuneContext(mod=tvm.IRModule({"main": pf}), target=H100, space_generator=space,
                         search_strategy="replay-trace")
    assert sum("mma_sync_m16n8k8_f16f16f32" in str(s.trace) for s in ctx.generate_design_space()) == 1


def test_gemm_sample_compiles_to_pipelined_mma():
    pf = _pf("gemm")  # 256 x 256 x 128: tiles in units of 16 rows, 8 columns, 8 of K
    mod = gemm.sample_schedule(pf, H100, tiles=[[2, 2, 2, 2, 1], [2, 2, 2, 2, 2], [4, 1, 4]])
    assert mod is not None
    with tvm.transform.PassContext(config=gemm.BUILD_CONFIG):
        src = tvm.compile(mod, target=H100).jit().imports[0].inspect_source("cuda")
    assert src.count("__global__") == 4  # mma kernel + the bias+GELU epilogue kernel (declaration + definition each)
    assert "__launch_bounds__(32) main_kernel_1" in src  # epilogue: one-warp blocks, threadIdx.x as the mma kernel
    for needle in ("cp.async.cg.shared.global", "mma.sync", "ldmatrix", "cp.async.commit_group", "erf"):
        assert needle in src, needle


def test_default_schedule_does_not_mutate():
    mod = tvm.IRModule({"main": _pf("ln_gelu")})
    before = mod.script()
    apply_default_schedules(mod, H100)
    assert mod.script() == before


@pytest.mark.gpu
def _one_row(case, d):
    """The decode shape: one row, so the spatial blocks lose their unit row dim (dlight's Fallback then reduced
    the row on one thread: 190-270 µs per RMSNorm on the H200, models.json of bench/results/models_run4)."""
    return cases.fused_primfunc(*getattr(cases, case)(1, d))[1]


@pytest.mark.parametrize("case,d", [("rms_res", 4096), ("ln_gelu", 768)])
def test_row_default_schedules_a_single_row_across_threads(case, d):
    pf = _one_row(case, d)
    assert classify(pf) == "row"
    sch = rowreduce.default_schedule(pf)
    assert sch is not None
    src = tvm.compile(sch.mod, target=H100).jit().imports[0].inspect_source("cuda")
    assert src.count("__global__") == 2 and "__launch_bounds__(" in src  # declaration + definition: one kernel
    threads = int(src.split("__launch_bounds__(", 1)[1].split(")", 1)[0])
    assert threads >= 128, threads  # the row is spread across a block, not one thread


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
def test_gpu_row_default_single_row_matches_numpy():
    """Against float64 numpy: an llvm build of this all-fp16 kernel sums 4096 squares serially in fp16 (3.5% off)."""
    import numpy as np

    pf = _one_row("rms_res", 4096)
    rng = np.random.default_rng(0)
    args = {p.name: np.asarray(rng.random([int(d) for d in p.shape])).astype(str(p.dtype)) for p in pf.params}
    dev = tvm.cuda(0)
    dev_args = [tvm.runtime.tensor(a, dev) for a in args.values()]
    tvm.compile(rowreduce.default_schedule(pf).mod, target=H100)["main"](*dev_args)
    x, r, eps, w = (args[n].astype("float64") for n in ("x", "r", "eps", "w"))
    h = x + r
    y = h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * w
    y_got, h_got = (t.numpy().astype("float64") for t in dev_args[-2:])  # the model's outputs: y, h
    assert np.abs(h_got - h).max() < 2e-3 * np.abs(h).max()
    assert np.abs(y_got - y).max() < 1e-2 * np.abs(y).max()
