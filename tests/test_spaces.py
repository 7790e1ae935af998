"""tvmfuse.spaces: space choice per kernel family, design-space generation and CUDA codegen on tiny shapes."""

import sys
from pathlib import Path

import pytest
import tvm
from tvm.s_tir import meta_schedule as ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import cases  # noqa: E402
from tvmfuse.spaces import classify, default_schedule, gemv, rowreduce, space_for  # noqa: E402

H100 = tvm.target.Target("nvidia/nvidia-h100")
TINY = {"ln_gelu": (cases.ln_gelu, (8, 256)), "rms_res": (cases.rms_res, (8, 256)),
        "gemv": (cases.mm_bias_gelu, (4, 256, 512)), "gemm": (cases.mm_bias_gelu, (256, 128, 256))}


def _pf(name):
    f, a = TINY[name]
    return cases.fused_primfunc(*f(*a))[1]


@pytest.mark.parametrize("name,kind", [("ln_gelu", "row"), ("rms_res", "row"), ("gemv", "gemv"), ("gemm", "gemm")])
def test_classify_and_space_for(name, kind):
    pf = _pf(name)
    assert classify(pf) == kind
    assert space_for(pf, H100) is not None
    assert space_for(pf, tvm.target.Target({"kind": "llvm"})) is None


@pytest.mark.parametrize("name", ["ln_gelu", "rms_res", "gemv"])
def test_design_space_and_postprocs(name):
    pf = _pf(name)
    ctx = ms.TuneContext(mod=tvm.IRModule({"main": pf}), target=H100, space_generator=space_for(pf, H100),
                         search_strategy="replay-trace")
    spaces = ctx.generate_design_space()
    assert len(spaces) == (2 if name != "gemv" else 1)
    assert any("sample_categorical" in str(s.trace) for s in spaces)


def test_row_schedule_is_one_kernel_one_pass():
    pf = _pf("rms_res")
    sch = tvm.s_tir.Schedule(pf)
    assert rowreduce.schedule_row(sch, stage=True, threads=64, vec=4, unroll=16)
    src = tvm.compile(sch.mod, target=H100).jit().imports[0].inspect_source("cuda")
    assert src.count("__global__") == 2  # declaration + definition of one kernel
    assert "half4" in src or "uint2" in src  # 4 x fp16 vector loads/stores


def test_gemv_schedule_compiles():
    pf = _pf("gemv")
    sch = tvm.s_tir.Schedule(pf)
    assert gemv.schedule_gemv(sch, tx=16, ky=4, vec=4, unroll=16)
    src = tvm.compile(sch.mod, target=H100).jit().imports[0].inspect_source("cuda")
    assert "threadIdx.y" in src and "__syncthreads" in src


def test_default_schedule_does_not_mutate():
    mod = tvm.IRModule({"main": _pf("ln_gelu")})
    before = mod.script()
    default_schedule(mod, H100)
    assert mod.script() == before


@pytest.mark.gpu
def test_gpu_present():
    if not tvm.cuda(0).exist:
        pytest.skip("no CUDA GPU")
