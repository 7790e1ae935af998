"""tvmfuse.hopper, tvmfuse.gemm_analysis, tvmfuse.kernels.wgmma_gemm, tvmfuse.kernels.mma_smallm: fused GEMMs become a TIRx kernel on sm_90a
(wgmma, or mma.sync for small M), epilogue included."""

import dataclasses
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import tvm
from checks import cuda_sources, ptxas_report
from test_smallm import _kernel, _projection
from tvm import relax

from tvmfuse.build.compile import (
    MMA_SMALLM,
    WGMMA,
    apply_default_schedules,
    compile_module,
    schedule_kinds,
)
from tvmfuse.fuse.fusion import lower
from tvmfuse.kernels.hopper.gemm_analysis import analyze_gemm, gemm_dtypes_refused
from tvmfuse.kernels.hopper.select import (
    DEEP_RING,
    WIDE_DUAL,
    TILE_COSTS,
    apply_hopper_kernels,
    check_deep_ring,
    choose_smallm_tile,
    choose_tile,
    estimate_us,
    gemm_kernel_from_fused,
)
from tvmfuse.kernels.hopper.mma_smallm import SmallMTile, check_smallm_shape
from tvmfuse.kernels.hopper.wgmma_gemm import TIRX_ATTR, consumer_regs
from tvmfuse.kernels.hopper.wgmma_tile import WgmmaTile, check_wgmma_shape, pair_tile_of, tile_of
from tvmfuse.targets import resolve_target


def _gelu_projection(rows, k, n, dtype="float16"):
    """y = gelu(x @ W^T + b), fp16 (or `dtype`), fp32 accumulation, W [N, K]: the issue-5 GEMM at small sizes."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, rows, k), dtype))
    w = relax.Var("w", relax.TensorType((n, k), dtype))
    b = relax.Var("b", relax.TensorType((n,), dtype))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            mm = bb.emit(relax.op.astype(bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w)),
                                                                   out_dtype="float32")), dtype))
            out = bb.emit_output(relax.op.nn.gelu(bb.emit(relax.op.add(mm, b))))
        bb.emit_func_output(out)
    return lower(bb.get()).mod


def _fp32_projection(rows, k, n, dtype="float16", w_dtype=None):
    """y = x @ W^T with the fp32 sums as the output (a model's last matmul with fp32 outputs); x `dtype`, W
    `w_dtype` (the same by default)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, rows, k), dtype))
    w = relax.Var("w", relax.TensorType((n, k), w_dtype or dtype))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w)), out_dtype="float32"))
        bb.emit_func_output(out)
    return lower(bb.get()).mod


def test_analysis_finds_the_gemm_and_its_sizes():
    info, why = analyze_gemm(_kernel(_projection(256, 512, 384)))
    assert why == "" and (info["m"], info["n"], info["k"]) == (256, 384, 512)


@pytest.mark.parametrize("rows,k,n,transposed,reason", [
    (256, 512, 384, False, "K innermost"),  # W read [K, N]: TMA boxes are K-innermost rows
    (100, 512, 384, True, None),  # between the small-M kernel (<= 64) and one 128-row tile: 64-row tiles
    (64, 512, 384, True, None),  # small M: the mma.sync kernel
    (256, 100, 384, True, "not a multiple of 8"),  # TMA needs 16-byte row strides
    (256, 512, 384, True, None),
    (300, 200, 1000, True, None)])  # ragged M, N and K: TMA zero-fills past the ends, the stores are guarded
def test_kernels_the_wgmma_tile_cannot_take_keep_their_schedule(rows, k, n, transposed, reason):
    got, why = gemm_kernel_from_fused(_kernel(_projection(rows, k, n, transposed=transposed)), "main")
    if reason is None:
        assert got is not None and got.attrs[TIRX_ATTR] == ("mma_smallm" if rows <= 64 else "wgmma"), why
    else:
        assert got is None and reason in why, why


def test_an_epilogue_that_reads_the_product_transposed_is_refused():
    """The accumulator is substituted only where the epilogue reads the matmul result at the element it writes."""
    src = _kernel(_projection(256, 512, 256)).script()
    moved = src.replace("matmul_intermediate[v_ax0, v_ax1, v_ax2] + compute_intermediate[v_ax2]",
                        "matmul_intermediate[v_ax0, v_ax2, v_ax1] + compute_intermediate[v_ax2]")
    assert moved != src
    got, why = gemm_kernel_from_fused(tvm.script.from_source(moved), "main")
    assert got is None and "other indices" in why, why


def test_tile_choice_and_shape_checks():
    # the measured best tiles (wgmma_run4.json, wgmma_run5.json in bench/results/archive-sessions-5-7.tar.xz;
    # wgmma_run13_*.json)
    sr = dict(stepped_desc=True, setmaxnreg=True)
    assert choose_tile(2048, 4096, 4096) == WgmmaTile(256, 4, **sr)  # 256 tiles of 128x256: two full waves
    assert choose_tile(2048, 11008, 4096) == WIDE_DUAL  # 1056 tiles: 8 full waves (192x192's 638: 4.8)
    assert choose_tile(512, 4096, 4096) == DEEP_RING  # 128 tiles: one wave, 64 k-steps
    assert choose_tile(512, 4096, 11008) == DEEP_RING
    assert choose_tile(2048, 4096, 11008) == WgmmaTile(256, 4, **sr)  # (512 128x128 tiles: no deep ring)
    assert choose_tile(512, 11008, 4096) == WIDE_DUAL  # 264 tiles: two full waves
    assert choose_tile(512, 768, 3072) == WgmmaTile(64, 8, 64, dual=True)  # GPT-2's MLP down: 96 64x64 tiles
    assert choose_tile(512, 50257, 768) == WgmmaTile(256, 4, **sr)
    assert "one wave" in check_deep_ring(2048, 4096, 4096, DEEP_RING)  # 512 tiles
    assert "K >= 4096" in check_deep_ring(512, 4096, 3072, DEEP_RING)
    assert check_deep_ring(512, 4096, 4096, DEEP_RING) is None and check_deep_ring(2048, 1, 1, WgmmaTile()) is None
    assert choose_tile(100, 512, 512).bm == 64  # 65 <= M < 128: the 64-row tiles only
    assert "below one 128-row tile" in check_wgmma_shape(100, 512, 512, WgmmaTile(128, 4))
    assert estimate_us(512, 4096, 4096, WgmmaTile(256, 4, **sr)) > estimate_us(512, 4096, 4096, WgmmaTile(128, 4, dual=True))
    assert "registers" in check_wgmma_shape(512, 512, 512, WgmmaTile(256, 4, dual=True))
    assert "registers" in check_wgmma_shape(512, 11008, 4096, WgmmaTile(168, 4, dual=True))  # 168 a thread
    assert check_wgmma_shape(512, 11008, 4096, WgmmaTile(168, 4, dual=True, setmaxnreg=True)) is None  # 232
    assert check_wgmma_shape(512, 11008, 4096, WgmmaTile(192, 4, dual=True, setmaxnreg=True)) is None
    assert "registers" in check_wgmma_shape(512, 11008, 4096, WgmmaTile(208, 4, dual=True, setmaxnreg=True))
    assert "three computing warpgroups" in check_wgmma_shape(512, 512, 512, WgmmaTile(128, 4, 192, dual=True))
    assert "three computing warpgroups" in check_wgmma_shape(512, 512, 512, WgmmaTile(256, 3, 192))
    assert "unsupported tile" in check_wgmma_shape(512, 512, 512, WgmmaTile(128, 4, 256))
    assert "unsupported tile" in check_wgmma_shape(512, 512, 512, WgmmaTile(164, 4))  # N of wgmma: steps of 8
    assert check_wgmma_shape(512, 11008, 4096, WgmmaTile(168, 5)) is None  # 4 x 66 = 264 tiles: two full waves
    assert check_wgmma_shape(512, 512, 512, WgmmaTile(192, 4, 192, setmaxnreg=True)) is None
    assert [consumer_regs(c) for c in (2, 3)] == [232, 152]  # 128 x 40 + 128 x c x regs <= 65536
    assert "shared memory" in check_wgmma_shape(512, 512, 512, WgmmaTile(256, 8))
    assert "setmaxnreg needs two computing warpgroups" in check_wgmma_shape(
        512, 512, 512, WgmmaTile(128, 6, bm=64, dual=True, setmaxnreg=True))
    assert check_wgmma_shape(512, 4096, 4096, WgmmaTile(256, 4)) is None
    assert check_wgmma_shape(2048, 50257, 768, WgmmaTile(128, 4)) is None  # GPT-2's LM head: ragged N
    assert "multiple of 8" in check_wgmma_shape(512, 4096, 4100, WgmmaTile(128, 4))
    assert "odd number of 128-row tiles" in check_wgmma_shape(384, 512, 512, WgmmaTile(128, 4, cluster=2))
    assert check_wgmma_shape(384, 512, 512, WgmmaTile(128, 4, cluster=2, multicast="a")) is None  # pairs columns
    assert "odd number of 128-column tiles" in check_wgmma_shape(512, 384, 512, WgmmaTile(128, 4, cluster=2,
                                                                                          multicast="a"))
    assert "sharing A or B" in check_wgmma_shape(512, 512, 512, WgmmaTile(128, 4, cluster=2, multicast="c"))
    assert check_wgmma_shape(250, 512, 512, WgmmaTile(128, 4, cluster=2)) is None  # two row tiles, one ragged
    assert "even group_m" in check_wgmma_shape(512, 512, 512, WgmmaTile(128, 4, cluster=2, group_m=3))
    assert "keep one in flight" in check_wgmma_shape(512, 512, 512, WgmmaTile(128, 4, dual=True, inflight=1))
    assert "persistent" in check_wgmma_shape(512, 512, 512, WgmmaTile(128, 4, cluster=2, persistent=True))
    assert "odd N" in check_wgmma_shape(512, 1001, 512, WgmmaTile(128, 4, persistent=True))
    assert "no wg_release" in check_wgmma_shape(512, 512, 512, WgmmaTile(128, 4, persistent=True, wg_release=True))


def test_the_log_line_names_each_knob_off_its_default():
    from tvmfuse.kernels.hopper.select import _knob_notes

    assert _knob_notes(WgmmaTile(128, 6, dual=True, cluster=2, multicast="a", stepped_desc=True, setmaxnreg=True)) \
        == ", clusters of 2, sharing A, stepped descriptors, setmaxnreg"
    assert _knob_notes(WgmmaTile(128, 4, dual=True)) == ""
    assert _knob_notes(WgmmaTile(128, 4, dual=True, wg_release=True)) == ", one release a warpgroup"


def test_the_log_says_why_a_gemm_keeps_its_generic_schedule():
    """A GEMM neither kernel takes keeps its generic schedule, and the log says so; kernels that are no GEMM are
    not named."""
    cuda = resolve_target("cuda")
    logged = []
    mod = _projection(256, 100, 384)
    assert apply_hopper_kernels(mod, cuda, logged.append) is mod
    assert len(logged) == 1 and "generic GEMM schedule (256x384x100: K=100 is not a multiple of 8" in logged[0], logged
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((256, 384), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(x))
        bb.emit_func_output(out)
    logged.clear()
    apply_hopper_kernels(lower(bb.get()).mod, cuda, logged.append)
    assert logged == []


def test_only_sm_90a_targets_get_the_kernel():
    mod = _projection(256, 512, 384)
    logged = []
    assert apply_hopper_kernels(mod, resolve_target('{"kind": "cuda", "arch": "sm_80"}'), logged.append) is mod
    assert apply_hopper_kernels(mod, resolve_target("llvm"), logged.append) is mod
    assert not logged


def test_hopper_build_is_one_wgmma_kernel_with_tma_loads_and_the_epilogue():
    cuda = resolve_target("cuda")
    logged = []
    mod = apply_hopper_kernels(_gelu_projection(256, 512, 384), cuda, logged.append)
    assert len(logged) == 1 and "wgmma 256x384x512, tile 64x64, 8 stages, two accumulator sets" in logged[0], logged
    assert set(schedule_kinds(mod, cuda).values()) == {WGMMA}
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
    assert src.count("__global__") == 2  # declaration + definition: GEMM, bias and GELU in one kernel
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in src and "wgmma.wait_group.sync.aligned 1" in src
    assert "cp.async.bulk.tensor.2d" in src and "mbarrier" in src
    assert "erff(" in src and "tvmfuse_store_half2" in src  # the graph's GELU, written two halves at a time


@pytest.mark.parametrize("dtype, low", [("fp16", "half"), ("bf16", "nv_bfloat16")])
def test_an_exported_gelus_fp32_epilogue_is_rounded_once_by_the_store(dtype, low):
    """An exported (opset 17) GELU's epilogue computes in fp32 and the group ends in a cast to the compute dtype:
    the store rounds the fp32 value itself, with no round trip through the low dtype and back to fp32 first."""
    mod, logged, _ = _exported_gelu_on_hopper(dtype)
    assert any("wgmma 256x384x512" in line for line in logged), logged
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, resolve_target("cuda")), resolve_target("cuda")))
    assert "erff(" in src and f"((float)(({low})" not in src


def _exported_gelu_on_hopper(dtype: str, rows: int = 256):
    """(the module with its Hopper kernels, the log, the ONNX model) of x @ W + b then GELU as torch.onnx writes it
    at opset 17 (Div, Erf, Add, Mul: no Gelu op), x [rows, 512], W [512, 384], in `dtype` (fp32 interface)."""
    from test_scalar_params import exported_gelu
    from tvmfuse.decide.decision import decide
    from tvmfuse.frontend.importer import import_model
    from tvmfuse.prepare import prepare_module

    model = exported_gelu("gelu", m=rows, k=512, n=384)
    cuda = resolve_target("cuda")
    bound = prepare_module(import_model(model, {}), dtype)
    logged: list = []
    return apply_hopper_kernels(lower(bound, plan=decide(bound, cuda)).mod, cuda, logged.append), logged, model


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("fp16", 2e-2), ("bf16", 8e-2)])
def test_an_exported_gelus_wgmma_kernel_matches_onnxruntime_on_the_gpu(dtype, tol):
    """The exported GELU's kernel (constants inline, fp32 epilogue rounded once at the store) against onnxruntime
    in fp32, at 300 rows (a ragged row tile)."""
    from tvmfuse.verify.outputs import onnxruntime_outputs

    mod, logged, model = _exported_gelu_on_hopper(dtype, rows=300)
    assert any("wgmma 300x384x512" in line for line in logged), logged
    cuda = resolve_target("cuda")
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(mod, cuda), cuda), tvm.cuda(0))
    x = np.random.default_rng(0).standard_normal((300, 512)).astype("float32")
    got = vm["main"](tvm.runtime.tensor(x, tvm.cuda(0))).numpy()
    (want,) = onnxruntime_outputs(model, {"x": x})
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_a_matmul_without_epilogue_writes_its_fp32_sums():
    cuda = resolve_target("cuda")
    logged = []
    mod = apply_hopper_kernels(_fp32_projection(256, 512, 384), cuda, logged.append)
    assert len(logged) == 1 and "wgmma 256x384x512" in logged[0], logged
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
    kernel = src.split("__global__")[-1]
    assert "float* __restrict__" in kernel and "tvmfuse_store_half2(" not in kernel


def test_ragged_sizes_guard_the_stores():
    """M = 300, N = 1001: the last row and column tiles are partial; N odd: no 4-byte stores (misaligned), the
    rows staged in shared memory behind named barriers and written by consecutive lanes."""
    cuda = resolve_target("cuda")
    def kernel_source(rows, k, n):
        mod = apply_hopper_kernels(_gelu_projection(rows, k, n), cuda, lambda s: None)
        (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
        return src.split("__global__")[-1]  # the kernel's definition
    ragged, even = kernel_source(300, 200, 1001), kernel_source(256, 256, 1024)
    assert "wgmma_f16_ss_mma_async" in ragged and "tvmfuse_store_half2(" not in ragged
    assert ragged.count("tvmfuse_bar_sync(") == 2 and "tvmfuse_bar_sync(" not in even
    assert ragged.count("if (") >= even.count("if (") + 32  # stores guarded (those TVM cannot prove safe); none where the tile divides


def test_small_m_build_is_one_mma_kernel_reading_the_weight_once():
    """M = 16: one launch, the weight streamed with 16-byte loads past L1 into mma.sync fragments, GELU applied."""
    cuda = resolve_target("cuda")
    logged = []
    mod = apply_hopper_kernels(_gelu_projection(16, 4096, 4096), cuda, logged.append)
    assert len(logged) == 1 and "mma.sync small-M 16x4096x4096" in logged[0], logged
    assert set(schedule_kinds(mod, cuda).values()) == {MMA_SMALLM}
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
    kernel = src.split("__global__")[-1]
    assert src.count("__global__") == 2 and "erff(" in kernel
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src
    assert "ld.global.nc.L1::no_allocate.v4.u32" in src
    tile = choose_smallm_tile(16, 4096, 4096)  # the weight loads of one round of unrolled chunks, each one n8 tile
    assert kernel.count("tvmfuse_ld_stream(") == tile.unroll * tile.n8 * tile.vec


@pytest.mark.parametrize("m,n,k,tile", [(16, 11008, 4096, "4x8x1x4"), (16, 4096, 4096, "2x16x1x2"),
                                        (16, 22016, 4096, "4x4x1x4"), (64, 11008, 4096, "4x4x1x4"),
                                        (16, 3072, 768, "1x8x1x4")])
def test_small_m_tile_rule_fills_the_gpu(m, n, k, tile):
    """Wide column tiles where they still make 256 blocks, the K split across warps until ~2560 warps stream the
    weight; 4 warps above M = 16 (registers): the tiles measured fastest (smallm_tc_run1.json, results archive)."""
    t = choose_smallm_tile(m, n, k)
    assert f"{t.n8}x{t.warps}x{t.vec}x{t.unroll}" == tile


def test_small_m_takes_batched_rows_and_ragged_sizes(monkeypatch):
    """Rows from several leading dims (decode batch 8, sequence 1) flatten to M = 8; K = 200 (not a multiple of
    the 32-wide chunks) zero-fills the loads past K; N = 1001 guards the stores."""
    info, why = analyze_gemm(_kernel(_projection(1, 512, 384, batch=8)))
    assert why == "" and (info["m"], info["rows"]) == (8, [8, 1])
    got, why = gemm_kernel_from_fused(_kernel(_projection(3, 200, 1001)), "main")
    assert got is not None and "mma.sync small-M 3x1001x200" in why, why
    assert "T.uint32(0)" in got.script()  # the zero-filled tail
    assert check_smallm_shape(65, 256, 256, SmallMTile()) is not None
    got, why = gemm_kernel_from_fused(_kernel(_projection(1, 512, 384)), "main")  # M = 1 too, by default
    assert got is not None and "mma.sync small-M 1x384x512" in why, why
    monkeypatch.setenv("TVMFUSE_SMALLM_M1", "0")
    got, why = gemm_kernel_from_fused(_kernel(_projection(1, 512, 384)), "main")  # switched off: the GEMV schedule
    assert got is None and "M=1" in why, why
    assert "multiple of 8" in check_smallm_shape(16, 256, 100, SmallMTile())


@pytest.mark.gpu
@pytest.mark.parametrize("rows,batch,k,n", [(16, 1, 512, 384), (3, 1, 200, 1001), (1, 8, 1024, 256),
                                            (64, 1, 1024, 1024), (1, 1, 4096, 1001)])
def test_small_m_kernel_matches_numpy_on_the_gpu(rows, batch, k, n):
    cuda = resolve_target("cuda")
    mod = apply_hopper_kernels(_projection(rows, k, n, batch=batch), cuda, lambda s: None)
    assert set(schedule_kinds(mod, cuda).values()) == {MMA_SMALLM}
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(mod, cuda), cuda), tvm.cuda(0))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((batch, rows, k)).astype("float16")
    w = (rng.standard_normal((n, k)) * 0.05).astype("float16")
    b = (rng.standard_normal(n) * 0.1).astype("float16")
    got = vm["main"](*[tvm.runtime.tensor(a, tvm.cuda(0)) for a in (x, w, b)]).numpy().astype("float32")
    want = x.astype("float32") @ w.astype("float32").T + b.astype("float32")
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


def test_small_m_ring_copies_the_weights_asynchronously_stages_ahead():
    """`SmallMTile.stages` = 4: each lane's weight loads of a round become cp.async copies into its slots of a
    shared-memory ring (the first three rounds before the loop), the loop waits until at most three groups are in
    flight and reads its round back with ld.shared; no weight goes straight to registers. It compiles for sm_90a.
    Without stages the CUDA keeps its register loads (the default)."""
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target
    from tvmfuse.kernels.hopper.mma_smallm import make_smallm_gemm, ring_bytes

    tile = SmallMTile(n8=2, warps=16, vec=1, unroll=2, stages=4)
    assert ring_bytes(tile) == 4 * 16 * 4 * 512 and check_smallm_shape(16, 4096, 4096, tile) is None
    target = hopper_target()
    (src,) = cuda_sources(tvm.compile(tvm.IRModule({"main": make_smallm_gemm(16, 4096, 4096, tile)}), target=target,
                                      tir_pipeline="tirx"))
    kernel = src.split("__global__")[-1]
    loads = tile.unroll * tile.n8 * tile.vec
    assert kernel.count("tvmfuse_cp_async16(") == loads * tile.stages  # three rounds ahead, one in the loop
    assert kernel.count("tvmfuse_cp_async_commit()") == tile.stages + 1  # the loop's own, issued or empty
    assert "tvmfuse_cp_async_wait3()" in kernel and kernel.count("tvmfuse_lds16(") == loads
    assert "cp.async.cg.shared.global" in src and "tvmfuse_ld_stream(" not in kernel
    assert "sm_90a" in str(target.attrs["arch"]) and len(_nvcc_fatbin(src, target)) > 1000
    plain = make_smallm_gemm(16, 4096, 4096, SmallMTile(n8=2, warps=16, vec=1, unroll=2))
    (src,) = cuda_sources(tvm.compile(tvm.IRModule({"main": plain}), target=target, tir_pipeline="tirx"))
    assert "tvmfuse_cp_async16(" not in src.split("__global__")[-1] and "tvmfuse_ld_stream(" in src


def test_gemvs_take_the_small_m_kernel_unless_the_m1_switch_is_0(monkeypatch):
    """By default a decode batch of 1 (M = 1) takes the small-M kernel with the rule's tile (and its ring when
    TVMFUSE_SMALLM_RING asks); TVMFUSE_SMALLM_M1=0: the GEMV schedule."""
    from tvmfuse.kernels.hopper.mma_smallm import M1_SWITCH, RING_SWITCH

    monkeypatch.setenv(M1_SWITCH, "0")
    got, why = gemm_kernel_from_fused(_kernel(_projection(1, 4096, 4096)), "main")
    assert got is None and "GEMV" in why
    monkeypatch.delenv(M1_SWITCH)
    monkeypatch.setenv(RING_SWITCH, "4")
    got, why = gemm_kernel_from_fused(_kernel(_projection(1, 4096, 4096)), "main")
    assert got is not None and got.attrs[TIRX_ATTR] == "mma_smallm", why
    assert "mma.sync small-M 1x4096x4096, 16 warps x 16 columns, unroll 2, a weight ring of 4 stages" in why, why


@pytest.mark.parametrize("m,n,k,stages", [(16, 4096, 4096, 4), (16, 11008, 4096, 2), (64, 11008, 4096, 4)])
def test_ring_switch_gives_the_rules_tiles_the_most_stages_that_fit(monkeypatch, m, n, k, stages):
    """TVMFUSE_SMALLM_RING=4: the rule's tile keeps its columns, warps and unroll and takes the most stages up to 4
    whose ring fits 128 KB (4x8x1x4: two); unset, none, and the log line says which."""
    from tvmfuse.kernels.hopper.mma_smallm import RING_BUDGET, RING_SWITCH, ring_bytes

    monkeypatch.delenv(RING_SWITCH, raising=False)
    plain = choose_smallm_tile(m, n, k)
    assert plain.stages == 0
    monkeypatch.setenv(RING_SWITCH, "4")
    ringed = choose_smallm_tile(m, n, k)
    assert ringed == dataclasses.replace(plain, stages=stages) and ring_bytes(ringed) <= RING_BUDGET
    cuda, logged = resolve_target("cuda"), []
    apply_hopper_kernels(_gelu_projection(m, k, n), cuda, logged.append)
    assert f"a weight ring of {stages} stages" in logged[0], logged


@pytest.mark.parametrize("m,n,k,unroll", [(1, 4096, 4096, 2), (1, 11008, 4096, 2), (16, 4096, 4096, 2)])
def test_bulk_switch_gives_the_rules_tiles_a_bulk_ring_of_three_stages(monkeypatch, m, n, k, unroll):
    """TVMFUSE_SMALLM_BULK=4: the rule's tile keeps its columns and warps, its round halved (4x8x1x4 at N = 11008:
    unroll 2) until 3 stages of bulk copies fit 128 KB (4 do not); the log line says so."""
    from tvmfuse.kernels.hopper.mma_smallm import BULK_SWITCH, RING_BUDGET, ring_bytes

    monkeypatch.delenv(BULK_SWITCH, raising=False)
    plain = choose_smallm_tile(m, n, k)
    monkeypatch.setenv(BULK_SWITCH, "4")
    bulk = choose_smallm_tile(m, n, k)
    assert bulk == dataclasses.replace(plain, unroll=unroll, stages=3, bulk=True), bulk
    assert ring_bytes(bulk) <= RING_BUDGET < ring_bytes(dataclasses.replace(bulk, stages=4))
    logged = []
    apply_hopper_kernels(_gelu_projection(m, k, n), resolve_target("cuda"), logged.append)
    assert "a weight ring of 3 stages (bulk copies)" in logged[0], logged


def test_small_m_l2_prefetch_keeps_rounds_ahead_in_l2_without_registers():
    """`SmallMTile.l2_ahead` = 2 at 1 x 4096 x 4096 (4 rounds of 2048 bytes a row): the first two rounds prefetched
    into L2 before the loop, then round r + 2 in round r, one thread a weight row, each a bulk prefetch of the round's
    contiguous bytes (within K at a ragged K); the loads into registers stay; it compiles for sm_90a; not with a
    ring, nor negative."""
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target
    from tvmfuse.kernels.hopper.mma_smallm import make_smallm_gemm

    target = hopper_target()
    tile = SmallMTile(n8=2, warps=16, vec=1, unroll=2, l2_ahead=2)
    (src,) = cuda_sources(tvm.compile(tvm.IRModule({"main": make_smallm_gemm(1, 4096, 4096, tile)}), target=target,
                                      tir_pipeline="tirx"))
    kernel = src.split("__global__")[-1]
    prefetches = re.findall(r"tvmfuse_prefetch_l2_bulk\(.*?\), \(uint\)(\d+)\);", kernel)
    assert prefetches == ["2048"] * 3, prefetches  # rounds 0 and 1, then r + 2 inside the loop
    assert "(r * 1024)) + 2048)" in kernel and "if ((((int)threadIdx.x) < 16) &&" in kernel  # a thread a row
    assert "cp.async.bulk.prefetch.L2.global" in src and "tvmfuse_ld_stream(" in kernel
    assert len(_nvcc_fatbin(src, target)) > 1000
    (ragged,) = cuda_sources(tvm.compile(tvm.IRModule({"main": make_smallm_gemm(1, 4096, 1000, tile)}),
                                         target=target, tir_pipeline="tirx"))
    assert re.findall(r"tvmfuse_prefetch_l2_bulk\(.*?\), \(uint\)(\d+)\);", ragged) == ["2000"]  # one round
    assert "L2 prefetch" in check_smallm_shape(1, 4096, 4096, dataclasses.replace(tile, stages=2))
    assert "L2 prefetch" in check_smallm_shape(1, 4096, 4096, dataclasses.replace(tile, l2_ahead=-1))


def test_small_m_bulk_ring_copies_a_weight_row_a_round_without_registers():
    """`SmallMTile.bulk` with 3 stages at 1 x 4096 x 4096 (2x16x1x2: 16 rows, 4 rounds of 2048 bytes a row): thread t
    copies row t's round with one bulk copy (`cp.async.bulk`) completing on the stage's mbarrier (initialised for
    16 arrivals, each expecting its row's bytes), two rounds before the loop and one in it; the warps read their
    fragments back from rows ROW_PAD bytes apart (no bank conflicts), meet once a round, and hold no weight load in
    registers. It compiles for sm_90a. Bulk copies need a ring and a thread a row."""
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target
    from tvmfuse.kernels.hopper.mma_smallm import ROW_PAD, make_smallm_gemm, ring_bytes

    target = hopper_target()
    tile = SmallMTile(n8=2, warps=16, vec=1, unroll=2, stages=3, bulk=True)
    assert ring_bytes(tile) == 3 * 16 * (2048 + ROW_PAD) and check_smallm_shape(1, 4096, 4096, tile) is None
    (src,) = cuda_sources(tvm.compile(tvm.IRModule({"main": make_smallm_gemm(1, 4096, 4096, tile)}), target=target,
                                      tir_pipeline="tirx"))
    kernel = src.split("__global__")[-1]
    copies = re.findall(r"tvmfuse_bulk_copy\(.*?\(uint\)(\d+), ", kernel)
    assert copies == ["2048"] * 3  # rounds 0 and 1, then r + 2 in the loop
    assert kernel.count("mbarrier_init_init_shared_b64(") == 3 and kernel.count("(uint)16);") >= 3  # 16 arrivals each
    assert kernel.count("tvmfuse_lds16(") == tile.unroll * tile.n8 and "tvmfuse_ld_stream(" not in kernel
    assert "tvmfuse_cp_async16(" not in kernel and kernel.count("tvm_builtin_cuda_cta_sync()") == 3  # init, round, sums
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in src
    assert len(_nvcc_fatbin(src, target)) > 1000
    (ragged,) = cuda_sources(tvm.compile(tvm.IRModule({"main": make_smallm_gemm(1, 1001, 1000, tile)}),
                                         target=target, tir_pipeline="tirx"))
    assert re.findall(r"tvmfuse_bulk_copy\(.*?\(uint\)(\d+), ", ragged) == ["2000"]  # one round, within K
    assert "a ring" in check_smallm_shape(1, 4096, 4096, dataclasses.replace(tile, stages=0))
    assert "a thread a weight row" in check_smallm_shape(1, 4096, 4096, SmallMTile(n8=8, warps=1, stages=2, bulk=True))


@pytest.mark.parametrize("stages,why", [(1, "unsupported"), (9, "unsupported"), (8, "ring of")])
def test_small_m_ring_takes_two_to_eight_stages_that_fit_shared_memory(stages, why):
    assert why in check_smallm_shape(16, 4096, 4096, SmallMTile(n8=4, warps=16, vec=1, unroll=4, stages=stages))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,tile", [(16, 1000, 1024, (2, 16, 1, 2, 4)), (3, 1001, 200, (1, 4, 2, 2, 3)),
                                        (1, 384, 4104, (4, 8, 1, 4, 2)), (16, 4096, 4096, (2, 8, 1, 2, 3)),
                                        (16, 4096, 11008, (2, 16, 1, 2, 4)),
                                        (1, 4096, 4096, (2, 16, 1, 2, 0, False, 2)),  # L2 prefetch, no ring
                                        (1, 1001, 1000, (4, 8, 1, 4, 0, False, 3)),
                                        # bulk copies: one round, ragged K and N, stages reused (5, 11 rounds)
                                        (16, 1000, 1024, (2, 16, 1, 2, 4, False, 0, True)),
                                        (3, 1001, 200, (1, 4, 2, 2, 3, False, 0, True)),
                                        (1, 384, 4104, (4, 8, 1, 4, 2, False, 0, True)),
                                        (1, 4096, 4096, (2, 16, 1, 2, 3, False, 0, True)),
                                        (16, 4096, 11008, (2, 16, 1, 2, 3, False, 0, True)),
                                        (1, 1001, 1000, (1, 8, 1, 4, 6, False, 0, True))])
def test_small_m_ring_matches_numpy_on_the_gpu(m, n, k, tile):
    """The ring (cp.async stages ahead, or bulk copies a row a round) computing gelu(x @ w^T + b): one round (the
    empty commits), more rounds than stages (each slot reused: 5, 8 and 11 rounds), K not a multiple of the chunks
    (zero-filled copies past K, or what a bulk stage held there zeroed: 200, 4104, 11008), ragged N."""
    from tvmfuse.kernels.hopper.mma_smallm import make_smallm_gemm

    x, w, b, got = _gemm_on_the_gpu(make_smallm_gemm(m, n, k, SmallMTile(*tile), "bias_gelu"), m, n, k, "float16", 4)
    np.testing.assert_allclose(got, _bf16_gelu_reference(x, w, b), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tiles_m,tiles_n,group", [(4, 63, 1), (4, 63, 4), (16, 43, 8), (5, 7, 2), (3, 5, 8)])
def test_cta_order_covers_every_tile_once_rows_fastest_in_groups(tiles_m, tiles_n, group):
    group = min(group, tiles_m)  # as wgmma_kernel clamps it
    order = [tile_of(bid, tiles_m, tiles_n, group) for bid in range(tiles_m * tiles_n)]
    assert sorted(order) == [(x, y) for x in range(tiles_n) for y in range(tiles_m)]
    first = order[:group]  # the first CTAs: one column tile (one B tile), consecutive row tiles
    assert [x for x, _ in first] == [0] * group and [y for _, y in first] == list(range(group))


@pytest.mark.parametrize("tiles_m,tiles_n,group", [(4, 32, 4), (4, 86, 16), (5, 8, 2), (3, 6, 8)])
def test_clusters_sharing_a_pair_neighbouring_columns_of_one_row_and_cover_every_tile_once(tiles_m, tiles_n, group):
    group = min(group, tiles_m)
    order = [pair_tile_of(bid, tiles_m, tiles_n, group) for bid in range(tiles_m * tiles_n)]
    assert sorted(order) == [(x, y) for x in range(tiles_n) for y in range(tiles_m)]
    for (x0, y0), (x1, y1) in zip(order[::2], order[1::2]):  # a cluster: CTAs 2i and 2i + 1
        assert y0 == y1 and x0 % 2 == 0 and x1 == x0 + 1


@pytest.mark.gpu
def test_fp32_output_matches_numpy_on_the_gpu():
    cuda = resolve_target("cuda")
    mod = apply_hopper_kernels(_fp32_projection(300, 256, 1000), cuda, lambda s: None)
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(mod, cuda), cuda), tvm.cuda(0))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 300, 256)).astype("float16")
    w = (rng.standard_normal((1000, 256)) * 0.05).astype("float16")
    got = vm["main"](*[tvm.runtime.tensor(a, tvm.cuda(0)) for a in (x, w)]).numpy()
    np.testing.assert_allclose(got, x.astype("float32") @ w.astype("float32").T, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,k,n", [(256, 512, 384), (512, 1024, 1024), (300, 200, 1001)])
def test_wgmma_kernel_matches_numpy_on_the_gpu(rows, k, n):
    cuda = resolve_target("cuda")
    mod = apply_hopper_kernels(_gelu_projection(rows, k, n), cuda, lambda s: None)
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(mod, cuda), cuda), tvm.cuda(0))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, rows, k)).astype("float16")
    w = (rng.standard_normal((n, k)) * 0.05).astype("float16")
    b = (rng.standard_normal(n) * 0.1).astype("float16")
    got = vm["main"](*[tvm.runtime.tensor(a, tvm.cuda(0)) for a in (x, w, b)]).numpy().astype("float32")
    pre = x.astype("float32") @ w.astype("float32").T + b.astype("float32")
    want = 0.5 * pre * (1 + np.vectorize(__import__("math").erf)(pre / np.sqrt(2)))
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cli_exports_a_model_whose_gemm_is_the_wgmma_kernel(dtype, tmp_path, capsys):
    """The product path on a machine without a GPU: `--target cuda --trials 0` builds, logs the kernel, names it in
    the manifest and exports one library (fp16 and bf16 alike)."""
    import json

    import onnx
    import onnx_models

    from tvmfuse.cli.tune import main

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU (the job would verify and time on it)")
    onnx.save(onnx_models.projection(rows=256, k=512, n=384), tmp_path / "proj.onnx")
    code = main(["--target", "cuda", "--trials", "0", "--dtype", dtype, "--out", str(tmp_path / "o"),
                 "--logs", str(tmp_path / "l"), str(tmp_path / "proj.onnx")])
    assert code == 0
    out = capsys.readouterr().out
    assert "wgmma 256x384x512, tile 64x64, 8 stages" in out and "generic GEMM schedule" not in out
    export = tmp_path / "o" / "proj-cuda-sm_90a"
    kernels = json.loads((export / "manifest.json").read_text())["kernels"]
    assert [k["schedule"] for k in kernels if k["pattern"] == "tvmfuse.matmul"] == [WGMMA]
    assert (export / "model.so").stat().st_size > 0


def test_bucket_functions_get_the_wgmma_kernel_and_the_generic_one_does_not(tmp_path, capsys):
    """--buckets with --dtype fp16: the static copy for seq=256 takes the kernel; main_generic (symbolic seq) keeps
    the generic GEMM. (fp16 with a symbolic input used to stop in TVM's ToMixedPrecision: tvmfuse.precision.)"""
    import json

    import onnx
    from onnx import TensorProto, helper

    from tvmfuse.cli.tune import main

    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU (the job would verify and time on it)")
    w = (np.random.default_rng(0).standard_normal((512, 384)) / 20).astype("float32")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "t",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", 384])],
                              [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel().tolist())])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10), tmp_path / "d.onnx")
    code = main(["--target", "cuda", "--trials", "0", "--dtype", "fp16", "--out", str(tmp_path / "o"),
                 "--logs", str(tmp_path / "l"), str(tmp_path / "d.onnx"), "--buckets", "seq=256"])
    assert code == 0
    out = capsys.readouterr().out
    assert "main_seq256: " in out and "wgmma 256x384x512" in out
    manifest = json.loads((tmp_path / "o" / "d-cuda-sm_90a" / "manifest.json").read_text())
    kinds = {k["name"]: k["schedule"] for k in manifest["kernels"]}
    assert WGMMA in {kinds[k] for f in manifest["buckets"]["functions"] for k in f["kernels"]}
    assert WGMMA not in {kinds[k] for k in manifest["buckets"]["generic"]["kernels"]}
    assert manifest["inputs"][0]["shape"] == [1, "seq", 512]  # fp16 compute, the interface still symbolic


def _epilogue_on_cpu(func):
    """A CPU function computing, for every (row, col), what the GEMM kernels store: `finish` of a given fp32
    product at `place` (the epilogue as rebuilt from the fused kernel, without the GEMM)."""
    from tvmfuse.kernels.hopper.gemm_analysis import epilogue

    info, why = analyze_gemm(func)
    assert info is not None, why
    fresh = {p: tvm.tirx.decl_buffer(p.shape, p.dtype, p.name) for p in func.params}
    finish, place, _ = epilogue(info, fresh)
    acc = tvm.tirx.decl_buffer((info["m"], info["n"]), "float32", "acc")
    r, c = tvm.tirx.Var("r", "int32"), tvm.tirx.Var("c", "int32")
    out = next(v for k, v in fresh.items() if k.same_as(info["out"]))
    store = tvm.tirx.BufferStore(out, tvm.tirx.Cast(str(out.dtype), finish(tvm.tirx.BufferLoad(acc, [r, c]), r, c)),
                                 list(place(r, c)))
    loops = tvm.tirx.For(r, 0, info["m"], tvm.tirx.ForKind.SERIAL,
                         tvm.tirx.For(c, 0, info["n"], tvm.tirx.ForKind.SERIAL, store))
    return tvm.tirx.PrimFunc([*fresh.values(), acc], loops).with_attr("global_symbol", "main")


def test_a_reshaped_output_and_scalar_parameters_keep_the_fused_epilogue():
    """GPT-2's MLP-up kernel (tests/data/gelu_new_gemm.tvmscript): gelu_new over the product reshaped [M, N] ->
    [1, M, N], its constants 0-d parameters. The kernel takes it (it used to say "the output is not written elementwise"),
    compiles for sm_90a (the 0-d parameters read through views), and its epilogue, run on the CPU from the same
    fp32 product, matches the fused kernel itself."""
    from pathlib import Path

    func = tvm.script.from_source((Path(__file__).parent / "data" / "gelu_new_gemm.tvmscript").read_text())
    kernel, why = gemm_kernel_from_fused(func, "main")
    assert kernel is not None and why.startswith("wgmma 128x96x64"), why
    cuda = resolve_target("cuda")
    tvm.compile(tvm.IRModule({"main": kernel}), target=cuda, tir_pipeline="tirx")
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((96, 64)) * 0.1).astype("float16")
    x = rng.standard_normal((128, 64)).astype("float16")
    bias = (rng.standard_normal(96) * 0.1).astype("float16")
    consts = [np.array(3.0, "float32")] + [np.array(v, "float16") for v in (0.044715, 0.7978846, 0.5, 1.0)]
    ins = [w, x, bias, *consts]
    cpu = tvm.cpu()
    fused = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    want = tvm.runtime.tensor(np.zeros((1, 128, 96), "float16"), cpu)
    fused["main"](*[tvm.runtime.tensor(a, cpu) for a in ins], want)
    product = x.astype("float32") @ w.astype("float32").T
    epi = tvm.compile(tvm.IRModule({"main": _epilogue_on_cpu(func)}), target="llvm")
    got = tvm.runtime.tensor(np.zeros((1, 128, 96), "float16"), cpu)
    epi["main"](*[tvm.runtime.tensor(a, cpu) for a in ins], got, tvm.runtime.tensor(product, cpu))
    ref = want.numpy().astype("float32")
    assert np.abs(ref).max() > 0.1  # gelu_new of a real product, not zeros
    np.testing.assert_allclose(got.numpy().astype("float32"), ref, atol=2e-3, rtol=2e-3)


# bf16: the same kernels with bf16 operands (fp32 sums, the same epilogues), fp16 unchanged

BF16 = ml_dtypes.bfloat16  # numpy has no bfloat16; tvm.runtime.tensor takes and returns ml_dtypes arrays


def _nvcc_fatbin(src: str, target) -> bytes:
    with target:  # nvcc for the target's arch (sm_90a: wgmma, and native bf16 rather than emulation)
        return tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")


def test_gemm_dtype_rule_takes_fp16_and_bf16_and_refuses_mixed_operands():
    assert gemm_dtypes_refused("float16", "float16", "float32", "float16") is None
    assert gemm_dtypes_refused("bfloat16", "bfloat16", "float32", "bfloat16") is None
    assert gemm_dtypes_refused("bfloat16", "bfloat16", "float32", "float32") is None
    for dts in [("bfloat16", "float16", "float32", "float32"), ("float16", "bfloat16", "float32", "float16"),
                ("bfloat16", "bfloat16", "float32", "float16"), ("bfloat16", "bfloat16", "bfloat16", "bfloat16"),
                ("float32", "float32", "float32", "float32")]:
        why = gemm_dtypes_refused(*dts)
        assert why is not None and why.startswith(f"dtypes {dts[0]} x {dts[1]} -> {dts[2]} -> {dts[3]}"), why
        assert ("--dtype fp16 or bf16" in why) == (dts[0] == "float32"), why  # an fp32 model: say how


def test_analysis_reads_a_bf16_gemm_and_a_mixed_one_keeps_its_schedule_with_the_dtypes_named():
    info, why = analyze_gemm(_kernel(_projection(256, 512, 384, dtype="bfloat16")))
    assert why == "" and str(info["a"].dtype) == str(info["b"].dtype) == "bfloat16", why
    logged = []
    mixed = _fp32_projection(256, 512, 384, "bfloat16", "float16")  # bf16 activations, fp16 weight
    assert apply_hopper_kernels(mixed, resolve_target("cuda"), logged.append) is mixed
    assert len(logged) == 1 and "generic GEMM schedule (dtypes bfloat16 x float16 -> float32 -> float32" in logged[0], logged


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("rows,k,n,kind,desc", [
    (256, 512, 384, WGMMA, "wgmma 256x384x512"),
    (300, 200, 1001, WGMMA, "wgmma 300x1001x200"),  # ragged, N odd: the rows staged in shared memory (bf16)
    (16, 4096, 4096, MMA_SMALLM, "mma.sync small-M 16x4096x4096"),
    (3, 200, 1001, MMA_SMALLM, "mma.sync small-M 3x1001x200")])
def test_bf16_gemm_is_the_tirx_kernel_with_bf16_instructions_and_compiles_for_sm_90a(rows, k, n, kind, desc):
    """gelu(x @ W^T + b) in bf16: the same kernel as fp16, its mma/wgmma on .bf16 operands, its TMA maps of
    bfloat16, its stores bf16; nvcc compiles it for sm_90a."""
    cuda = resolve_target("cuda")
    assert str(cuda.attrs["arch"]) == "sm_90a"
    logged = []
    mod = apply_hopper_kernels(_gelu_projection(rows, k, n, "bfloat16"), cuda, logged.append)
    assert len(logged) == 1 and desc in logged[0], logged
    assert set(schedule_kinds(mod, cuda).values()) == {kind}
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
    kernel = src.split("__global__")[-1]
    assert "#include <cuda_bf16.h>" in src and "nv_bfloat16* __restrict__" in kernel and "half" not in kernel
    assert "erff(" in kernel or "herf(" in kernel  # the graph's GELU
    if kind == WGMMA:
        assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in src and ".f32.f16.f16" not in src
        assert "cp.async.bulk.tensor.2d" in src
        assert ("tvmfuse_store_bf162(" in kernel) == (n % 2 == 0)  # two bf16 in one 4-byte store, N even
        assert ("tvmfuse_bar_sync(" in kernel) == (n % 2 == 1)  # N odd: rows staged in shared memory
    else:
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src and ".f32.f16.f16" not in src
        assert "tvmfuse_mma16816_bf16(" in kernel
    assert len(_nvcc_fatbin(src, cuda)) > 1000


def test_bf16_tma_maps_are_encoded_as_bfloat16():
    """The host's cuTensorMapEncodeTiled calls name the operands' dtype: the CUDA runtime derives
    CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 from bfloat16 (FLOAT16 from float16)."""
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target, make_wgmma_gemm

    for dtype in ("float16", "bfloat16"):
        func = make_wgmma_gemm(256, 384, 512, WgmmaTile(128, 4), "bias", dtype=dtype)
        assert func.script().count(f'"runtime.cuTensorMapEncodeTiled", a_map, "{dtype}"') == 1
        assert func.script().count(f'"runtime.cuTensorMapEncodeTiled", b_map, "{dtype}"') == 1
        ex = tvm.compile(tvm.IRModule({"main": func}), target=hopper_target(), tir_pipeline="tirx")
        host = ex.mod.inspect_source("ll")
        assert f'c"{dtype}\\00"' in host


def test_bf16_gemm_with_fp32_output_writes_its_sums():
    cuda = resolve_target("cuda")
    logged = []
    mod = apply_hopper_kernels(_fp32_projection(256, 512, 384, "bfloat16"), cuda, logged.append)
    assert len(logged) == 1 and "wgmma 256x384x512" in logged[0], logged
    (src,) = cuda_sources(compile_module(apply_default_schedules(mod, cuda), cuda))
    kernel = src.split("__global__")[-1]
    assert "float* __restrict__" in kernel and "CUtensorMap a_map" in kernel  # operands through TMA maps only
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in src and "tvmfuse_store_bf162(" not in kernel


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("tile,spills", [(WgmmaTile(192, 4, dual=True, stepped_desc=True, setmaxnreg=True), False),
                                         (WgmmaTile(168, 4, dual=True, stepped_desc=True), True)], ids=str)
def test_wide_dual_tiles_fit_the_registers_setmaxnreg_gives(tile, spills, monkeypatch):
    """Two accumulator sets of m64n192 (192 fp32 a thread) with a bias + GELU epilogue: ptxas keeps every wgmma
    asynchronous and spills nothing in setmaxnreg's 232 registers; in the launch's 168 (no setmaxnreg) it spills
    and serializes the wgmmas (C7512), which is why check_wgmma_shape refuses that tile."""
    from tvmfuse.kernels.hopper import wgmma_gemm
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target, make_wgmma_gemm

    if spills:  # build the refused tile to show why it is refused
        assert "registers" in check_wgmma_shape(512, 11008, 1024, tile)
        monkeypatch.setattr(wgmma_gemm, "check_wgmma_shape", lambda *args: None)
    func = make_wgmma_gemm(512, 11008, 1024, tile, "bias_gelu")
    src = tvm.compile(tvm.IRModule({"main": func}), target=hopper_target(), tir_pipeline="tirx"
                      ).mod.imports[0].inspect_source()
    code, said = ptxas_report(src)
    assert code == 0, said
    spilled = int(re.search(r"(\d+) bytes spill stores", said).group(1))
    assert (spilled > 0) == spills and ("C7512" in said) == spills, said


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_fp16_and_bf16_small_m_kernels_share_a_module():
    """The mma.sync helpers have one name per dtype, so an fp16 and a bf16 kernel compile in one CUDA module."""
    cuda = resolve_target("cuda")
    funcs = {}
    for dtype in ("float16", "bfloat16"):
        func, why = gemm_kernel_from_fused(_kernel(_projection(16, 512, 384, dtype=dtype)), f"gemm_{dtype}")
        assert func is not None and func.attrs[TIRX_ATTR] == "mma_smallm", why
        funcs[f"gemm_{dtype}"] = func
    ex = tvm.compile(tvm.IRModule(funcs), target=cuda, tir_pipeline="tirx")
    (src,) = cuda_sources(ex)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src
    assert "tvmfuse_mma16816(" in src and "tvmfuse_mma16816_bf16(" in src
    assert len(_nvcc_fatbin(src, cuda)) > 1000


def _bf16_gelu_reference(x, w, b):
    """gelu(x @ w^T + b) in fp32 from the bf16 operands (the kernels round once, at the bf16 store, or as the
    graph's epilogue rounds; within 2e-2 + 2e-2 |want| of this: 0.17 of it on the llvm build of the same graph)."""
    pre = x.astype("float32") @ w.astype("float32").T + b.astype("float32")
    return 0.5 * pre * (1 + np.vectorize(__import__("math").erf)(pre / np.sqrt(2)))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,k,n", [(256, 512, 384), (512, 1024, 1024), (300, 200, 1001), (16, 4096, 4096)])
def test_bf16_gemm_kernels_match_numpy_on_the_gpu(rows, k, n):
    """wgmma (M > 64: even N paired stores, odd N staged rows) and mma.sync (M = 16) in bf16."""
    cuda = resolve_target("cuda")
    mod = apply_hopper_kernels(_gelu_projection(rows, k, n, "bfloat16"), cuda, lambda s: None)
    assert set(schedule_kinds(mod, cuda).values()) == {MMA_SMALLM if rows <= 64 else WGMMA}
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(mod, cuda), cuda), tvm.cuda(0))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, rows, k)).astype(BF16)
    w = (rng.standard_normal((n, k)) * 0.05).astype(BF16)
    b = (rng.standard_normal(n) * 0.1).astype(BF16)
    got = vm["main"](*[tvm.runtime.tensor(a, tvm.cuda(0)) for a in (x, w, b)]).numpy()
    assert got.dtype == BF16 and got.shape == (1, rows, n)
    np.testing.assert_allclose(got.astype("float32"), _bf16_gelu_reference(x, w, b), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,batch,k,n", [(16, 1, 512, 384), (3, 1, 200, 1001), (1, 8, 1024, 256),
                                            (64, 1, 1024, 1024), (1, 1, 4096, 1001)])
def test_bf16_small_m_kernel_matches_numpy_on_the_gpu(rows, batch, k, n):
    cuda = resolve_target("cuda")
    mod = apply_hopper_kernels(_projection(rows, k, n, batch=batch, dtype="bfloat16"), cuda, lambda s: None)
    assert set(schedule_kinds(mod, cuda).values()) == {MMA_SMALLM}
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(mod, cuda), cuda), tvm.cuda(0))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((batch, rows, k)).astype(BF16)
    w = (rng.standard_normal((n, k)) * 0.05).astype(BF16)
    b = (rng.standard_normal(n) * 0.1).astype(BF16)
    got = vm["main"](*[tvm.runtime.tensor(a, tvm.cuda(0)) for a in (x, w, b)]).numpy().astype("float32")
    want = x.astype("float32") @ w.astype("float32").T + b.astype("float32")
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_bf16_fp32_output_matches_numpy_on_the_gpu():
    """bf16 x bf16 products are exact in fp32: the sums match numpy's fp32 ones up to the summation order."""
    cuda = resolve_target("cuda")
    mod = apply_hopper_kernels(_fp32_projection(300, 256, 1000, "bfloat16"), cuda, lambda s: None)
    assert set(schedule_kinds(mod, cuda).values()) == {WGMMA}
    vm = relax.VirtualMachine(compile_module(apply_default_schedules(mod, cuda), cuda), tvm.cuda(0))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 300, 256)).astype(BF16)
    w = (rng.standard_normal((1000, 256)) * 0.05).astype(BF16)
    got = vm["main"](*[tvm.runtime.tensor(a, tvm.cuda(0)) for a in (x, w)]).numpy()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype("float32") @ w.astype("float32").T, atol=1e-3, rtol=1e-3)


#: the wgmma kernel's pipelining variants: (tile, what its CUDA source must hold, what it must not)
WGMMA_VARIANTS = [
    # three computing warpgroups (192 rows; 512 threads, so 128 registers each, 152 with setmaxnreg): M = 512 makes
    # a ragged third row tile
    (WgmmaTile(192, 4, 192, setmaxnreg=True), ("__launch_bounds__(512)", "setmaxnreg_inc_sync_aligned_u32_152",
                                               "setmaxnreg_dec_sync_aligned_u32_40"), ("multicast",)),
    (WgmmaTile(192, 4, 192), ("__launch_bounds__(512)", "wgmma.wait_group.sync.aligned 0;"), ("setmaxnreg",)),
    (WgmmaTile(256, 4, inflight=1), ("wgmma.wait_group.sync.aligned 1;", "wgmma.wait_group.sync.aligned 0;"),
     ("multicast",)),
    (WgmmaTile(256, 4), ("wgmma.wait_group.sync.aligned 0;",), ("aligned 1;", "multicast")),
    (WgmmaTile(128, 4, dual=True, cluster=2),
     ("multicast::cluster [", "mapa.shared::cluster.u32", "barrier.cluster.arrive", "fence.mbarrier_init.release.cluster",
      "%%cluster_ctarank"), ()),
    (WgmmaTile(176, 4, cluster=2), ("multicast::cluster [", "mbarrier.arrive.shared::cluster.b64 _, [r]"), ()),
    (WgmmaTile(128, 4, dual=True, stepped_desc=True), ("desc_a_ptr[0] + (uint64_t)6ULL", "desc_b_ptr[0] + (uint64_t)2ULL"),
     ()),
    (WgmmaTile(128, 4, dual=True, persistent=True), ("for (int ti = 0; ti < ",), ("multicast",)),
    (WgmmaTile(256, 4, setmaxnreg=True), ("setmaxnreg.dec.sync.aligned.u32", "setmaxnreg.inc.sync.aligned.u32"), ()),
    # clusters whose two CTAs share the A tile (neighbouring column tiles of one row tile), as cuBLAS's 1x2
    (WgmmaTile(128, 6, dual=True, cluster=2, multicast="a", stepped_desc=True, setmaxnreg=True),
     ("multicast::cluster [", "mapa.shared::cluster.u32", "barrier.cluster.arrive"), ()),
    # barrier waits by a try-wait without a suspend-time hint (no NANOSLEEP in the SASS between tries)
    (WgmmaTile(128, 6, dual=True, stepped_desc=True, setmaxnreg=True, spin_wait=True),
     ("tvmfuse_mbar_spin(", "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra LSPIN;"),
     ("tvm_builtin_cuda_mbarrier_wait(",)),
    # one stage release a consumer warpgroup, after its four warps meet (as CUTLASS's sm90 pipeline): the empty
    # barriers count 1 arrival a warpgroup a CTA (2 warpgroups, 2 CTAs: 4; without a cluster: 2), not 4 a warpgroup
    (WgmmaTile(128, 6, dual=True, cluster=2, stepped_desc=True, setmaxnreg=True, wg_release=True),
     ("(empty_ptr[0]))), (uint)4);", "tvmfuse_bar_sync(", "multicast::cluster ["), ("(empty_ptr[0]))), (uint)16);",)),
    (WgmmaTile(128, 6, dual=True, stepped_desc=True, setmaxnreg=True, wg_release=True),
     ("(empty_ptr[0]))), (uint)2);", "tvmfuse_bar_sync("), ("(empty_ptr[0]))), (uint)8);", "multicast")),
    # B prefetched into L2 four k-tiles ahead of the ring's loads (with 16 k-tiles: some past the end, skipped);
    # the early weights need the dependent launch's wait to move past (test_dependent_launch.py checks where)
    # 168 columns (cuBLAS's tile at 512x4096 @ 11008: 264 tiles, two full waves), m64n168k16
    (WgmmaTile(168, 5, stepped_desc=True, setmaxnreg=True), ("m64n168k16.f32.f16.f16",), ("multicast",)),
    # two accumulator sets of m64n168 (cuBLAS's tile width at Llama's gate / up projections), in the 232 registers
    # setmaxnreg gives the computing threads
    (WgmmaTile(168, 4, dual=True, stepped_desc=True, setmaxnreg=True),
     ("m64n168k16.f32.f16.f16", "wgmma.wait_group.sync.aligned 1;", "setmaxnreg.inc.sync.aligned.u32"),
     ("multicast",)),
    (WgmmaTile(128, 6, dual=True, stepped_desc=True, setmaxnreg=True, early_weights=True, l2_ahead=4),
     ("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];", "for (int j = 6; j < 10; ++j)",
      "if (kt < 12)"), ("multicast",)),
]


@pytest.mark.parametrize("tile,wants,lacks", WGMMA_VARIANTS, ids=lambda v: str(v) if isinstance(v, WgmmaTile) else "")
def test_wgmma_variants_emit_their_pipelining(tile, wants, lacks):
    """One wgmma group in flight over one accumulator set (`inflight=1`: wait_group 1 in the loop, 0 before the
    epilogue), none (the default), and clusters of two CTAs multicasting halves of the B tile with remote releases and cluster
    barriers: each in the CUDA source, and (with nvcc) compiled for sm_90a. Every variant prefetches its two TMA
    descriptors."""
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target, make_wgmma_gemm

    func = make_wgmma_gemm(512, 1000, 1024, tile, "bias_gelu")
    ex = tvm.compile(tvm.IRModule({"main": func}), target=hopper_target(), tir_pipeline="tirx")
    src = ex.mod.imports[0].inspect_source()
    for text in wants:
        assert text in src, text
    for text in lacks:
        assert text not in src, text
    assert src.count("tvm_builtin_ptx_prefetch_tensormap(") == 1 + 2  # the helper; A's and B's descriptors, once
    if tile.cluster == 2:  # the shared tile's map has a box of half its rows: each CTA loads its half
        a_rows, b_rows = (tile.bm // 2, tile.bn) if tile.multicast == "a" else (tile.bm, tile.bn // 2)
        assert func.script().count(f"a_map, \"float16\", 2, a.data, 1024, 512, 2048, 64, {a_rows},") == 1
        assert func.script().count(f"b_map, \"float16\", 2, b.data, 1024, 1000, 2048, 64, {b_rows},") == 1
    if shutil.which("nvcc"):
        assert len(_nvcc_fatbin(src, hopper_target())) > 1000


def test_wgmma_diagnostic_ablations_leave_out_the_loads_or_the_wgmmas():
    """`ablate="loads"` keeps the first `stages` k-tiles' TMA loads and completes the later stages' barriers with a
    plain arrive; `ablate="mma"` keeps every load and issues no wgmma. A diagnostic of the benchmark: no tile (the
    knobs the product and its records know) carries it."""
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target, make_wgmma_gemm

    def source(ablate):
        func = make_wgmma_gemm(512, 1024, 1024, WgmmaTile(128, 4, dual=True), ablate=ablate)
        return tvm.compile(tvm.IRModule({"main": func}), target=hopper_target(), tir_pipeline="tirx"
                           ).mod.imports[0].inspect_source()
    tma = "cp_async_bulk_tensor_g2s_cluster_async_bulk_tensor_2d_shared__cluster_global_mbarrier__complete_tx__bytes("
    mma = "_ss_mma_async_sync_aligned_m64n128k16_f32_f16_f16_1_1_0_0("
    plain, loads, mmas = (source(a) for a in ("", "loads", "mma"))
    assert plain.count(tma) == loads.count(tma) == mmas.count(tma) > 0
    arrive = "tvm_builtin_ptx_mbarrier_arrive_nocount_arrive_shared_b64("  # a plain arrive: the helper, then calls
    assert loads.count(arrive) == plain.count(arrive) + 1 == mmas.count(arrive) + 1
    assert plain.count(mma) > 1 and loads.count(mma) == plain.count(mma) and mmas.count(mma) <= 1  # (the helper)
    with pytest.raises(ValueError, match="ablate 'softmax'"):
        make_wgmma_gemm(512, 1024, 1024, WgmmaTile(128, 4, dual=True), ablate="softmax")
    assert "ablate" not in {f.name for f in dataclasses.fields(WgmmaTile)}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [v[0] for v in WGMMA_VARIANTS] + [WgmmaTile(128, 4, cluster=2),
                                                                  WgmmaTile(64, 8, 64, dual=True, cluster=2)],
                         ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_variants_match_numpy_on_the_gpu(tile, dtype):
    """Each pipelining variant, ragged N (1000) and 16 k-tiles (every stage reused), against numpy."""
    _check_gelu_gemm_on_the_gpu(512, 1000, 1024, tile, dtype, seed=3)


def _check_gelu_gemm_on_the_gpu(m, n, k, tile, dtype, seed):
    """The wgmma kernel with `tile` computing gelu(x @ w^T + b) at m x n x k, against numpy (bf16's rounding)."""
    from tvmfuse.kernels.hopper.gemm_bench import make_wgmma_gemm

    x, w, b, got = _gemm_on_the_gpu(make_wgmma_gemm(m, n, k, tile, "bias_gelu", dtype), m, n, k, dtype, seed)
    np.testing.assert_allclose(got, _bf16_gelu_reference(x, w, b), atol=2e-2, rtol=2e-2)


def _gemm_on_the_gpu(func, m, n, k, dtype, seed):
    """(x, w, b, the output as fp32) of a benchmark GEMM kernel (parameters x [m, k], w [n, k], b [n], out [m, n])
    built for sm_90a and run on seeded inputs."""
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target

    lib = tvm.compile(tvm.IRModule({"main": func}), target=hopper_target(), tir_pipeline="tirx")
    rng = np.random.default_rng(seed)
    np_dtype = BF16 if dtype == "bfloat16" else "float16"
    x = rng.standard_normal((m, k)).astype(np_dtype)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np_dtype)
    b = (rng.standard_normal(n) * 0.1).astype(np_dtype)
    dev = tvm.cuda(0)
    out = tvm.runtime.empty((m, n), dtype, dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in (x, w, b)], out)
    return x, w, b, out.numpy().astype("float32")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_192_row_tiles_stage_odd_n_rows_and_match_numpy_on_the_gpu(dtype):
    """The rules' 192x192 tile (three computing warpgroups, stepped descriptors, setmaxnreg) at odd N, whose rows
    go through shared memory (GPT-2's LM head), with a ragged third row tile."""
    tile = WgmmaTile(192, 4, 192, stepped_desc=True, setmaxnreg=True)
    assert tile in TILE_COSTS
    _check_gelu_gemm_on_the_gpu(500, 1001, 512, tile, dtype, seed=5)


@pytest.mark.parametrize("tile", [WgmmaTile(128, 4, early_weights=True, persistent=True),
                                  WgmmaTile(128, 4, l2_ahead=2, cluster=2), WgmmaTile(128, 4, l2_ahead=-1)], ids=str)
def test_early_weights_and_l2_prefetch_refuse_persistent_ctas_clusters_and_a_negative_distance(tile):
    assert "early weights and L2 prefetch" in check_wgmma_shape(512, 1024, 1024, tile) or tile.l2_ahead < 0
    assert check_wgmma_shape(512, 1024, 1024, tile)


def test_weight_params_are_the_parameters_every_call_fills_with_a_constant():
    """The wgmma GEMM loads B early only where it is a weight: a bound constant at every call of the kernel."""
    from tvmfuse.kernels.hopper.select import weight_params

    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 256, 512), "float16"))
    w2 = relax.Var("w2", relax.TensorType((512, 512), "float16"))
    with bb.function("main", [x, w2]):
        with bb.dataflow():
            h = x
            for w in [relax.const(rng.standard_normal((512, 512)).astype("float16")) for _ in range(2)] + [w2]:
                h = bb.emit(relax.op.matmul(h, bb.emit(relax.op.permute_dims(w)), out_dtype="float16"))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    mod = lower(bb.get()).mod  # one kernel, called with a constant twice and main's parameter w2 once
    (name,) = [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert weight_params(mod) == {name: set()}
    consts = relax.BlockBuilder()
    with consts.function("main", [x]):
        with consts.dataflow():
            w = relax.const(rng.standard_normal((512, 512)).astype("float16"))
            out = consts.emit_output(consts.emit(relax.op.matmul(x, consts.emit(relax.op.permute_dims(w)),
                                                                 out_dtype="float16")))
        consts.emit_func_output(out)
    mod = lower(consts.get()).mod
    ((gv, func),) = [(gv, f) for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    (at,) = weight_params(mod)[gv.name_hint]
    assert [int(d) for d in func.params[at].shape] == [512, 512]  # the weight, not x


@pytest.mark.parametrize("tile", [WgmmaTile(256, 4, persistent=True), WgmmaTile(128, 4, dual=True, persistent=True),
                                  WgmmaTile(176, 4, inflight=1, persistent=True)], ids=str)
def test_persistent_ctas_walk_every_tile_once(tile):
    """One CTA per SM at most, each walking tiles bid, bid + grid, ... (here 144 to 272 tiles: up to three a CTA),
    with 11 k-tiles a tile so stage and phase run on across tiles; compiled for sm_90a with nvcc."""
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target, make_wgmma_gemm
    from tvmfuse.targets import SMS

    m, n, k = 2048, 2100, 704
    tiles = -(-m // tile.bm) * -(-n // tile.bn)
    ex = tvm.compile(tvm.IRModule({"main": make_wgmma_gemm(m, n, k, tile, "bias")}), target=hopper_target(),
                     tir_pipeline="tirx")
    src = ex.mod.imports[0].inspect_source()
    grid = min(tiles, SMS)
    assert f"for (int ti = 0; ti < ((({tiles + grid - 1} - ((int)blockIdx.x))" in src or \
        f"ti < (({tiles + grid - 1} - ((int)blockIdx.x))" in src, src.split("__global__")[-1][:2000]
    if shutil.which("nvcc"):
        assert len(_nvcc_fatbin(src, hopper_target())) > 1000


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [WgmmaTile(256, 4, persistent=True), WgmmaTile(128, 4, dual=True, persistent=True),
                                  WgmmaTile(176, 4, inflight=1, persistent=True)], ids=str)
def test_persistent_ctas_match_numpy_on_the_gpu(tile):
    """Persistent CTAs (up to three tiles each, 11 k-tiles a tile: stages and phases carried across tiles), ragged
    N, against numpy."""
    from tvmfuse.kernels.hopper.gemm_bench import make_wgmma_gemm

    m, n, k = 2048, 2100, 704
    x, w, b, got = _gemm_on_the_gpu(make_wgmma_gemm(m, n, k, tile, "bias"), m, n, k, "float16", 4)
    want = x.astype("float32") @ w.astype("float32").T + b.astype("float32")
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
