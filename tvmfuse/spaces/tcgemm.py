"""Default CUDA schedule for fp16 and bf16 GEMMs on tensor cores with tunable tiles: dlight's wmma matmul schedule with its block tile, warp tile, K chunk, copy width and pipeline depth as knobs instead of constants.

dlight's MatmulTensorization fixes a 128x128 block of 16 warps, each warp a 32x32 tile (2x2 wmma fragments), a
64-wide K chunk and copies staged through registers: every 16-wide K step a warp loads 4 fragments for 4 MMAs
(68.8 µs for 512x4096x4096 on the H200, bench/results/tcgemm_run1.json). Larger warp tiles reuse each loaded
fragment for more MMAs and a cp.async ring keeps several K chunks in flight. The construction is dlight's (reindex
to C[b, i, j] += A[b, i, k] * B[b, j, k], wmma fragments loaded with ldmatrix, fp32 accumulation, the epilogue fused
into the write-back from shared memory). Both operands must be read K-innermost (the layout stage stores constant
weights [N, K]); the rest stays with dlight. It is still mma.sync (HMMA.16816): ~300 TFLOP/s where cuBLAS's Hopper
kernels reach ~660.

bf16 x bf16 -> fp32 GEMMs get the same schedule with bf16 wmma fragments (tvmfuse.spaces.intrinsics registers
them; TVM 0.27 has none, so without this rule a bf16 GEMM ran on CUDA cores). Both operands must share one dtype:
a mixed fp16 x bf16 matmul has no wmma instruction and stays with dlight.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import (auto_inline_consumer_chain, auto_inline_producers, get_index_map,
                                          get_reduction_blocks)

from tvmfuse.spaces.common import schedule_or_none
from tvmfuse.spaces.intrinsics import WMMA_IN_DTYPES, wmma_intrin_group

WARP = 32
MICRO = 16  # the wmma fragment is 16x16x16
KNOBS = ("wm", "wn", "fm", "fn", "kc", "vec", "stages")


def default_knobs() -> dict:
    """A 128x128 block of 2x2 warps, each a 64x64 tile (4x4 fragments), K staged 64 at a time through a 3-deep
    cp.async ring, 16-byte loads. Measured on the H200 (bench/results/tcgemm_run1.json, 55 knob sets per shape):
    the fastest set at the Llama prefill projections 512x4096x4096 (56.3 µs; dlight 68.8), 512x4096x11008 (180.3;
    dlight 204.0) and 512x11008x4096 (149.3; dlight 179.4), within 4.5% of the fastest at 4096x4096x11008+bias+GELU
    and 2048x4096x4096, where 128x256 blocks were best."""
    return {"wm": 2, "wn": 2, "fm": 4, "fn": 4, "kc": 4, "vec": 8, "stages": 3}


def fits(m: int, n: int, k: int, wm: int, wn: int, fm: int, fn: int, kc: int, vec: int, stages: int = 0) -> bool:
    """True if the tile divides the sizes and each staged tile splits evenly over the block's threads."""
    threads = wm * wn * WARP
    bm, bn, bk = MICRO * wm * fm, MICRO * wn * fn, MICRO * kc
    return (threads <= 1024 and m % bm == 0 and n % bn == 0 and k % bk == 0 and stages != 1
            and (bk * bm) % (threads * vec) == 0 and (bk * bn) % (threads * vec) == 0 and k // bk >= max(stages, 2))


def operand_dtype(stmt) -> str | None:
    """The operands' dtype of a matmul block `stmt` this schedule takes: "float16" or "bfloat16" when both reads
    have it and the block writes float32 (the accumulator), else None (mixed fp16 x bf16 operands included)."""
    dtypes = {str(r.source.dtype) for r in stmt.reads}
    if len(stmt.reads) != 2 or len(dtypes) != 1 or str(stmt.writes[0].source.dtype) != "float32":
        return None
    (dtype,) = dtypes
    return dtype if dtype in WMMA_IN_DTYPES else None


def _normalize(sch: s_tir.Schedule):
    """Reindex the one fp16 x fp16 or bf16 x bf16 -> fp32 matmul to C[b, i, j] += A[b, i, k] * B[b, j, k];
    (block, (B, M, N, K), operand dtype) with static sizes, or None."""
    blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
    if not blocks or len(blocks) != 1:
        return None
    main = blocks[0]
    for producer in sch.get_producers(main):  # the weight's permute (layout stage): read W [N, K] in place
        try:
            sch.compute_inline(producer)
        except Exception:  # noqa: BLE001  (a producer that cannot be inlined stays)
            pass
    stmt = sch.get(main)
    dtype = operand_dtype(stmt)
    if dtype is None:
        return None
    k_vars = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    if len(k_vars) != 1 or any(not r.region[-1].min.same_as(k_vars[0]) for r in stmt.reads):
        return None  # an operand read with K outer ([K, N] weights): its 16-byte cp.async would not be contiguous
    maps = get_index_map(stmt)
    if maps is None:
        return None
    matmul_map, a_map, b_map, c_map = maps
    ra, rb, rc = (sch.reindex(main, ("read", 0)), sch.reindex(main, ("read", 1)), sch.reindex(main, ("write", 0)))
    sch.transform_layout(ra, ("write", 0), a_map)
    sch.transform_layout(rb, ("write", 0), b_map)
    sch.transform_layout(rc, ("read", 0), c_map)
    sch.transform_block_layout(main, matmul_map)
    doms = [iv.dom.extent for iv in sch.get(main).iter_vars]
    if len(doms) != 4 or not all(isinstance(d, tirx.IntImm) for d in doms):
        return None
    return main, tuple(int(d) for d in doms), dtype


def schedule_tc_gemm(sch: s_tir.Schedule, wm=None, wn=None, fm=None, fn=None, kc=None, vec=None, stages=0) -> bool:
    """Schedule in place; False if the kernel is not an fp16 or bf16 matmul (fp32 accumulation) whose sizes the
    tile divides. Knobs: wm x wn warps per block, each warp fm x fn 16x16 fragments, K staged kc x 16 at a time, global
    loads `vec` halves wide, `stages`: the depth of the cp.async ring (0: dlight's register-staged double buffer);
    wm None: `default_knobs`."""
    got = _normalize(sch)
    if got is None:
        return False
    main, (_, m, n, k), dtype = got
    if wm is None:
        wm, wn, fm, fn, kc, vec, stages = (default_knobs()[key] for key in KNOBS)
    if not fits(m, n, k, wm, wn, fm, fn, kc, vec, stages):
        return False
    num_ty = wm * wn
    batch, i, j, kk = sch.get_loops(main)
    i, i_in = sch.split(i, [None, MICRO])
    j, j_in = sch.split(j, [None, MICRO])
    kk, k_in = sch.split(kk, [None, MICRO])
    sch.reorder(i, j, kk, i_in, j_in, k_in)
    inner = main
    outer = sch.blockize(i_in)
    i0, i1, i2, i3 = sch.split(i, [None, 1, wm, fm])
    j0, j1, j2, j3 = sch.split(j, [1, None, wn, fn])
    k0, k1 = sch.split(kk, [None, kc])
    if stages:  # cp.async straight into a `stages`-deep ring of shared buffers (MetaSchedule's tensor-core
        # pipeline: the two copies, then the inner K loop's own prologue, body and epilogue)
        sch.annotate(k0, "software_pipeline_order", [0, 1, 3, 2, 4])
        sch.annotate(k0, "software_pipeline_stage", [0, 0, stages - 2, stages - 1, stages - 1])
        sch.annotate(k0, "software_pipeline_async_stages", [0])
    else:  # dlight's: through registers, double-buffered
        sch.annotate(k0, "software_pipeline_order", [0, 3, 1, 4, 5, 2, 6])
        sch.annotate(k0, "software_pipeline_stage", [0, 0, 0, 0, 0, 1, 1])
    sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
    sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
    sch.reorder(i0, j0, i1, j1, j2, i2, k0, k1, i3, j3)
    sch.bind(batch, "blockIdx.z")
    sch.bind(sch.fuse(i0, j0), "blockIdx.x")
    sch.bind(sch.fuse(i1, j1), "blockIdx.y")
    ty = sch.fuse(j2, i2)
    sch.bind(ty, "threadIdx.y")

    def fetch_to_shared(idx):
        read = sch.cache_read(outer, idx, "shared.dyn")
        sch.compute_at(read, k0)
        fused = sch.fuse(*sch.get_loops(read)[-2:])
        _, f_1, f_2, f_3 = sch.split(fused, [None, num_ty, WARP, vec])
        sch.bind(f_2, "threadIdx.x")
        sch.bind(f_1, "threadIdx.y")
        sch.vectorize(f_3)
        sch.storage_align(read, 0, axis=-2, factor=16, offset=8)
        if not stages:
            sch.annotate(read, "tirx.manifest_shared_memory_local_stage", 1)
            sch.annotate(read, "double_buffer_scope", 0)
        return read

    a_s, b_s = fetch_to_shared(0), fetch_to_shared(1)
    auto_inline_producers(sch, a_s)
    auto_inline_producers(sch, b_s)
    a_frag = sch.cache_read(outer, 0, "wmma.matrix_a")
    b_frag = sch.cache_read(outer, 1, "wmma.matrix_b")
    sch.compute_at(a_frag, k1)
    sch.compute_at(b_frag, k1)
    to_global = sch.cache_write(outer, 0, "shared.dyn")
    sch.storage_align(to_global, 0, -2, 16, 4)
    store = sch.cache_write(outer, 0, "wmma.accumulator")
    sch.reverse_compute_at(store, ty)
    sch.reverse_compute_at(to_global, ty)
    si, sj = sch.get_loops(store)[-2:]
    si0, si1 = sch.split(si, [None, MICRO])
    sj0, sj1 = sch.split(sj, [None, MICRO])
    sch.reorder(si0, sj0, si1, sj1)
    init = sch.get_child_blocks(sch.decompose_reduction(outer, k0))[0]
    intrins = wmma_intrin_group(dtype, load_scope="shared.dyn", store_scope="shared.dyn", trans_b=True)
    for frag, load in ((a_frag, "load_a"), (b_frag, "load_b")):
        fi, fj = sch.get_loops(frag)[-2:]
        fi0, fi1 = sch.split(fi, [None, MICRO])
        fj0, fj1 = sch.split(fj, [None, MICRO])
        sch.reorder(fi0, fj0, fi1, fj1)
        sch.unroll(fi0)
        sch.unroll(fj0)
        sch.tensorize(fi1, intrins[load])
    sch.tensorize(sch.get_loops(init)[-2], intrins["init"])
    sch.tensorize(sch.get_loops(store)[-2], intrins["store"])
    sch.tensorize(sch.get_loops(inner)[-3], intrins["compute"])
    auto_inline_consumer_chain(sch, to_global)
    fused = sch.fuse(*sch.get_loops(to_global)[-2:])
    _, f1, f2 = sch.split(fused, [None, WARP, 4])  # 16-byte reads of the fp32 tile (VerifyGPUCode's vector cap)
    sch.bind(f1, "threadIdx.x")
    sch.vectorize(f2)
    return True


def default_schedule(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """The schedule with `default_knobs`, or None where it does not apply."""
    return schedule_or_none(func, schedule_tc_gemm)


def applies(func: tirx.PrimFunc) -> bool:
    """True for an fp16 or bf16 matmul (fp32 accumulation) this schedule takes with its default knobs."""
    return default_schedule(func) is not None


#: the knob sets (wm, wn, fm, fn, kc, vec, stages) within 15% of the fastest at one or more of the five shapes of
#: bench/results/tcgemm_run1.json (of 55 that built; 36 of the 91 swept hit a TVM 0.27 shared-memory merging error
#: at build time, "tvm_access_ptr element type must match the source buffer")
KNOB_SETS = [(2, 2, 4, 4, 2, 8, 3), (2, 2, 4, 4, 2, 8, 4), (2, 2, 4, 4, 4, 8, 3), (2, 4, 4, 2, 4, 8, 3),
             (2, 4, 4, 4, 2, 8, 3), (2, 4, 4, 4, 2, 8, 4), (2, 4, 4, 4, 4, 8, 0), (2, 4, 4, 4, 4, 8, 3),
             (4, 2, 2, 4, 2, 8, 4), (4, 2, 2, 4, 4, 8, 3), (4, 2, 4, 4, 2, 8, 3), (4, 2, 4, 4, 2, 8, 4),
             (4, 2, 4, 4, 4, 8, 0), (4, 2, 4, 4, 4, 8, 3), (4, 4, 2, 2, 4, 8, 0), (4, 4, 2, 2, 4, 8, 3)]


def space_fn(sch: s_tir.Schedule):
    """ScheduleFn body: one sketch per measured knob set (`KNOB_SETS`) that fits this kernel's M, N, K (the knobs
    shape the loop nest, so they are sketches, not sampled decisions)."""
    got = _normalize(sch.copy())
    if got is None:
        return []
    _, (_, m, n, k), _ = got
    out = []
    for values in KNOB_SETS:
        knobs = dict(zip(KNOBS, values))
        if fits(m, n, k, **knobs):
            trial = sch.copy()
            if schedule_tc_gemm(trial, **knobs):
                out.append(trial)
    return out
