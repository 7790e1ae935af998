"""tvmfuse.spaces.tcgemm: the tensor-core GEMM default schedule and its tile sketches on CUDA."""

import shutil

import numpy as np
import pytest
import tvm
from checks import cuda_sources
from test_smallm import _kernel, _projection
from tvm.s_tir import meta_schedule as ms

from tvmfuse.spaces.defaults import TensorCoreGemm, TensorCoreMatmul, default_rule
from tvmfuse.build import compile_module
from tvmfuse.spaces import apply_default_schedules
from tvmfuse.spaces import gemm, space_for, tcgemm
from tvmfuse.targets import resolve_target


@pytest.mark.parametrize("rows,transposed,rule", [(512, True, TensorCoreGemm), (512, False, TensorCoreMatmul),
                                                  (256, True, TensorCoreGemm), (100, True, TensorCoreMatmul),
                                                  (192, True, TensorCoreMatmul)])
def test_gemm_rule_takes_the_shapes_its_tile_divides(rows, transposed, rule):
    """128x128x64 tiles: M = 100 or 192 go to dlight's Matmul (which pads), and so does W read [K, N] (its copies
    into shared memory would be strided: cp.async moves 16 contiguous bytes; on the H200 that kernel aborted)."""
    got, _ = default_rule(_kernel(_projection(rows, 1024, 512, transposed=transposed)), resolve_target("cuda"))
    assert type(got) is rule, type(got).__name__


def test_fits_checks_every_tile_dimension():
    knobs = tcgemm.default_knobs()
    assert tcgemm.fits(512, 512, 1024, **knobs)
    assert not tcgemm.fits(512, 512, 1000, **knobs)  # K not a multiple of the 64-wide chunk
    assert not tcgemm.fits(512, 520, 1024, **knobs)  # N not a multiple of 128
    assert not tcgemm.fits(512, 512, 128, **knobs)  # two K chunks cannot fill a 3-deep pipeline


def test_gemm_kernel_is_one_launch_on_tensor_cores_with_async_copies():
    cuda = resolve_target("cuda")
    (src,) = cuda_sources(compile_module(apply_default_schedules(_projection(512, 1024, 512), cuda), cuda))
    assert src.count("__global__") == 2  # declaration + definition: the epilogue (bias) is in the same kernel
    assert "wmma::mma_sync" in src and "wmma::accumulator, 16, 16, 16, float>" in src  # fp32 accumulation
    assert "cp.async.cg.shared.global" in src  # the 3-deep ring is filled by cp.async (needs tirx.use_async_copy:
    # without it the pipeline's copies are plain loads and stores)


def test_tile_sketches_pass_postprocs_with_the_dynamic_shared_memory_limit():
    """One sketch per measured tile set that fits; every one stages more than the tag's 48 KB, so the stock
    VerifyGPUCode rejects it and tvmfuse's (the limit a block can opt into on sm_90) accepts it."""
    cuda = resolve_target("cuda")
    fn = _kernel(_projection(512, 1024, 512))
    ctx = ms.TuneContext(mod=tvm.IRModule({"main": fn}), target=cuda, space_generator=space_for(fn, cuda),
                         search_strategy="replay-trace")
    fitting = [v for v in tcgemm.KNOB_SETS if tcgemm.fits(512, 512, 1024, **dict(zip(tcgemm.KNOBS, v)))]
    sketches = ctx.generate_design_space()
    tiles = [s for s in sketches if "sample_categorical" not in str(s.trace) and "wmma" in str(s.mod)]
    assert len(tiles) == len(fitting) >= 8
    stock = ms.postproc.VerifyGPUCode()
    stock._initialize_with_tune_context(ctx)  # pylint: disable=protected-access
    ours = gemm.VerifyGPUCodeDynamicSmem()
    ours._initialize_with_tune_context(ctx)  # pylint: disable=protected-access
    for sch in tiles:
        assert ours.apply(sch.copy()) and not stock.apply(sch.copy())


def test_bf16_gemm_runs_on_bf16_wmma_fragments_and_compiles_for_sm_90a():
    """bf16 x bf16 -> fp32: the same rule and kernel, with nv_bfloat16 wmma fragments (tvmfuse.spaces.intrinsics);
    nvcc turns them into the m16n16k16 bf16 wmma.mma with fp32 accumulation for sm_90a."""
    cuda = resolve_target("cuda")
    mod = _projection(512, 1024, 512, dtype="bfloat16")
    got, _ = default_rule(_kernel(mod), cuda)
    assert type(got) is TensorCoreGemm, type(got).__name__
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
    assert src.count("__global__") == 2
    assert "wmma::matrix_a, 16, 16, 16, nv_bfloat16, nvcuda::wmma::row_major>" in src
    assert "wmma::matrix_b, 16, 16, 16, nv_bfloat16, nvcuda::wmma::col_major>" in src
    assert "wmma::accumulator, 16, 16, 16, float>" in src and "cp.async.cg.shared.global" in src
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    with cuda:
        ptx = bytes(tvm.support.nvcc.compile_cuda(src, target_format="ptx", compiler="nvcc")).decode()
    assert ".target sm_90a" in ptx
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32" in ptx
    assert "wmma.load.a.sync.aligned.row.m16n16k16.bf16" in ptx


@pytest.mark.parametrize("rows,k,n", [(100, 768, 1000), (192, 1024, 512), (512, 768, 50257)])
def test_bf16_gemm_the_tile_does_not_divide_gets_dlights_padded_wmma_with_bf16_fragments(rows, k, n):
    """Shapes tcgemm's tile does not divide (GPT-2's 768 x 50257 LM head) go to dlight's padded wmma GEMM, with
    the bf16 intrinsics in place of the fp16 ones it asks for; stock dlight ran them on CUDA cores (bf16 is not
    one of its tensor-core dtypes) or, here, left them to its GeneralReduction rule."""
    cuda = resolve_target("cuda")
    mod = _projection(rows, k, n, dtype="bfloat16")
    got, _ = default_rule(_kernel(mod), cuda)
    assert type(got) is TensorCoreMatmul, type(got).__name__
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
    assert "wmma::matrix_a, 16, 16, 16, nv_bfloat16, nvcuda::wmma::row_major>" in src
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    with cuda:
        ptx = bytes(tvm.support.nvcc.compile_cuda(src, target_format="ptx", compiler="nvcc")).decode()
    assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32" in ptx


def test_wmma_operands_patch_is_undone():
    from tvm.s_tir.tensor_intrin import cuda as tvm_cuda

    from tvmfuse.spaces.intrinsics import wmma_operands

    stock = tvm_cuda.get_wmma_intrin_group
    with wmma_operands("bfloat16"):
        got = tvm_cuda.get_wmma_intrin_group(load_scope="shared.dyn", store_scope="shared.dyn", in_dtype="float16",
                                             out_dtype="float32", trans_b=True)
        assert got["compute"] == "wmma_sync_16x16x16_bf16bf16f32_trans"
        with pytest.raises(ValueError, match="no bfloat16 wmma intrinsics accumulating in float16"):
            tvm_cuda.get_wmma_intrin_group(load_scope="shared.dyn", store_scope="shared.dyn", in_dtype="float16",
                                           out_dtype="float16", trans_b=True)
    assert tvm_cuda.get_wmma_intrin_group is stock


@pytest.mark.parametrize("x_dtype,w_dtype", [("float16", "bfloat16"), ("bfloat16", "float16")])
def test_gemm_rule_refuses_mixed_fp16_bf16_operands(x_dtype, w_dtype):
    """wmma has no fp16 x bf16 instruction: the tensor-core rule leaves such a GEMM to dlight."""
    fn = _kernel(_projection(512, 1024, 512, dtype=x_dtype, w_dtype=w_dtype))
    assert tcgemm.default_schedule(fn) is None and not tcgemm.applies(fn)
    got, _ = default_rule(fn, resolve_target("cuda"))
    assert type(got) is not TensorCoreGemm


def test_wmma_intrinsics_exist_for_fp16_and_bf16_only():
    from tvm.s_tir import TensorIntrin

    from tvmfuse.spaces.intrinsics import wmma_intrin_group

    for dtype in ("float16", "bfloat16"):
        for name in wmma_intrin_group(dtype).values():
            assert TensorIntrin.get(name) is not None, name
    with pytest.raises(ValueError, match="no wmma intrinsics for 'float32'"):
        wmma_intrin_group("float32")


def test_bf16_gemm_tunes_over_the_tile_sketches():
    """MetaSchedule registers no bf16 tensor-core sketches: `--trials` on a bf16 GEMM explores tcgemm's tile sets."""
    cuda = resolve_target("cuda")
    fn = _kernel(_projection(512, 1024, 512, dtype="bfloat16"))
    assert space_for(fn, cuda) is not None
    ctx = ms.TuneContext(mod=tvm.IRModule({"main": fn}), target=cuda, space_generator=space_for(fn, cuda),
                         search_strategy="replay-trace")
    fitting = [v for v in tcgemm.KNOB_SETS if tcgemm.fits(512, 512, 1024, **dict(zip(tcgemm.KNOBS, v)))]
    sketches = ctx.generate_design_space()
    assert len(sketches) == len(fitting) >= 8
    assert all("wmma_sync_16x16x16_bf16bf16f32_trans" in str(s.trace) for s in sketches)


def _gpu_run_projection(mod, knobs, args):
    """`mod` built for the H200 with the kernel scheduled by tile set `knobs` (None: the default rules), run on
    `args`; the output as fp32."""
    from tvm import relax, s_tir

    cuda, dev = resolve_target("cuda"), tvm.cuda(0)
    if knobs is not None:  # the kernel scheduled with this tile set, the rest by the defaults
        gv = [g for g, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)][0]
        sch = s_tir.Schedule(mod[gv])
        assert tcgemm.schedule_tc_gemm(sch, **dict(zip(tcgemm.KNOBS, knobs)))
        mod[gv] = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(mod, cuda), cuda), dev)
    return vm["main"](*[tvm.runtime.tensor(a, dev) for a in args]).numpy().astype("float32")


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
@pytest.mark.parametrize("knobs", [None, (2, 4, 4, 4, 4, 8, 0), (4, 4, 2, 2, 4, 8, 3)])
def test_gpu_bf16_tile_sets_match_numpy(knobs):
    """bf16 inputs, fp32 accumulation on the tensor cores, one bf16 rounding of the output (at most 2^-8
    relative): within 1e-2 + 1e-2 |want| of the fp32 product of the same bf16 values."""
    _check_bf16_projection(256, 1024, 512, knobs, TensorCoreGemm if knobs is None else None)


def _check_bf16_projection(rows, k, n, knobs, rule):
    """x @ W^T + b in bf16 on the GPU (with `knobs`, or the default rule, asserted to be `rule` when given) against
    the fp32 product of the same bf16 values, within 1e-2 + 1e-2 |want|."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, rows, k)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((n, k)) * 0.03).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    mod = _projection(rows, k, n, dtype="bfloat16")
    if rule is not None:
        assert type(default_rule(_kernel(mod), resolve_target("cuda"))[0]) is rule
    got = _gpu_run_projection(mod, knobs, (x, w, b))
    want = x.astype("float32") @ w.astype("float32").T + b.astype("float32")
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
@pytest.mark.parametrize("rows,k,n", [(100, 768, 1000), (192, 1024, 512)])
def test_gpu_bf16_padded_gemm_matches_numpy(rows, k, n):
    """dlight's padded wmma GEMM with bf16 fragments (shapes tcgemm's tile does not divide), same bound as above."""
    _check_bf16_projection(rows, k, n, None, TensorCoreMatmul)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
@pytest.mark.parametrize("knobs", [None, (2, 4, 4, 4, 4, 8, 0), (4, 4, 2, 2, 4, 8, 3)])
def test_gpu_tile_sets_match_numpy(knobs):
    rng = np.random.default_rng(0)
    m, k, n = 256, 1024, 512
    x = rng.standard_normal((1, m, k)).astype("float16")
    w = (rng.standard_normal((n, k)) * 0.03).astype("float16")
    b = rng.standard_normal(n).astype("float16")
    got = _gpu_run_projection(_projection(m, k, n), knobs, (x, w, b))
    want = x.astype("float32") @ w.astype("float32").T + b.astype("float32")
    assert np.abs(got - want).max() < 2e-2


def test_the_cli_imports_no_tensor_intrinsics_until_a_cuda_record_is_replayed():
    """Importing the CLI leaves TVM's ~500 tensor intrinsics unparsed (7-10 s a process, which an llvm job or a bad
    path never needs); replaying a record for a CUDA target registers them, the bf16 wmma ones included."""
    import subprocess
    import sys

    code = """
import sys
import tvmfuse.cli.tune
assert not [m for m in sys.modules if m.startswith("tvm.s_tir.tensor_intrin")], "imported eagerly"
import tvm
from tvm import te
from tvm.s_tir import TensorIntrin
from tvm.s_tir import meta_schedule as ms
from tvmfuse.build.compile import replay_record
from tvmfuse.targets import resolve_target

a = te.placeholder((4,), "float32", "a")
add = te.create_prim_func([a, te.compute((4,), lambda i: a[i] + 1.0, "b")])
replay_record(tvm.ir.GlobalVar("add"), add, resolve_target("llvm"), ms.database.MemoryDatabase())
assert "tvm.s_tir.tensor_intrin" not in sys.modules, "an llvm replay imported them"
replay_record(tvm.ir.GlobalVar("add"), add, resolve_target("cuda"), ms.database.MemoryDatabase())
assert TensorIntrin.get("wmma_sync_16x16x16_bf16bf16f32_trans") is not None
assert TensorIntrin.get("wmma_sync_16x16x16_f16f16f32") is not None
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
