"""Default CUDA schedule for small-M matmuls (decode batches, M of 2, 4, 8, 16 or 32 rows) reading a [N, K] weight: one warp per few output columns, lanes splitting K with vector loads, every row's partial sums in registers.

dlight leaves this shape badly served: its GEMV rule takes M = 1 only, its Matmul rule skips tensor cores at
M <= 64 and runs a 32x64 CUDA-core tile, which for M = 16 launches N/64 blocks (64 for N = 4096: half the H200's
SMs idle): 280 µs for 16x4096x4096 fp16 (bench/results/models_run5.json profile), 35x the weight read. Here each
warp streams TN rows of W once for all M rows of x (fp32 accumulation), lanes combine through shared memory, and
the epilogue (cast, bias, activation) runs on the same warp.

It is CUDA-core FMA code, the same for every float dtype: fp16 and bf16 operands are widened to fp32 in registers
(a decode GEMM is bound by the weight read, not by the multiply). Both operands must share one dtype; a mixed
fp16 x bf16 matmul is left to dlight.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial

from tvmfuse.spaces.common import schedule_or_none

MAX_M = 32
LANES = 32


def _analyze(sch: s_tir.Schedule):
    """(reduction block info, epilogue info or None, M, N, K) for `C[m.., n] += X[m.., k] * W[n, k]` (+ one
    injective epilogue), both operands read with k innermost; else None."""
    infos = normalize_prim_func(sch)
    if not infos:
        return None
    infos = try_inline_contiguous_spatial(sch, infos)
    if not infos or len(infos) > 2 or not infos[0].is_reduction():
        return None
    red, epi = infos[0], (infos[1] if len(infos) == 2 else None)
    if epi is not None and not epi.is_injective():
        return None
    kind = red.dom_kind()
    if kind.count("R") != 1 or not kind.endswith("SR") or len(kind) < 3:
        return None
    doms = [d for d in red.dom()]
    if not all(isinstance(d, (int, tirx.IntImm)) for d in doms):
        return None
    doms = [int(d) for d in doms]
    block = sch.get(red.block_rv)
    n_var, k_var = block.iter_vars[-2].var, block.iter_vars[-1].var
    reads = [r for r in block.reads if len(r.region) >= 2]
    if len(reads) != 2 or any(not r.region[-1].min.same_as(k_var) for r in reads):
        return None
    if str(reads[0].source.dtype) != str(reads[1].source.dtype):
        return None  # mixed operand dtypes (fp16 x bf16): no conversion this schedule would make is the model's
    if not any(len(r.region) == 2 and r.region[0].min.same_as(n_var) for r in reads):
        return None  # no [N, K] weight
    return red, epi, math.prod(doms[:-2]), doms[-2], doms[-1]


def default_knobs(m: int) -> dict:
    """64 outputs per warp (TN = 64 / M columns: two per lane, so the lanes' sum and the epilogue need no guard),
    4 warps per block, 8-byte loads. Measured at M = 16 on the H200 (bench/results/smallm_run1.json, 18 knob sets
    per shape): within 3% of the best set at 16x4096x11008 (+bias+GELU), 16x4096x4096 and 16x11008x4096, where the
    first default (TN 2, 16-byte loads) was 1.2-1.8x slower. Other M: the same rule, not measured."""
    return {"tn": max(1, 64 // m), "warps": 4, "vec": 4}


def applies(func: tirx.PrimFunc) -> bool:
    """True for a small-M (2..32) inner-reduction matmul this schedule takes with its default knobs."""
    try:
        got = _analyze(s_tir.Schedule(func))
    except Exception:  # noqa: BLE001  (a kernel this schedule cannot take)
        return False
    if got is None:
        return False
    _, _, m, n, k = got
    return _fits(m, n, k, **default_knobs(m))


def _fits(m: int, n: int, k: int, tn: int, warps: int, vec: int) -> bool:
    return 1 < m <= MAX_M and (m * tn) % LANES == 0 and n % (tn * warps) == 0 and k % (LANES * vec) == 0


def schedule_small_m(sch: s_tir.Schedule, tn=None, warps=None, vec=None) -> bool:
    """Schedule in place; False if the kernel is not a small-M inner-reduction matmul of fitting sizes. The knobs
    are ints, sampled variables whose every choice fits (`space_fn`), or None: `default_knobs`."""
    got = _analyze(sch)
    if got is None:
        return False
    red, epi, m, n, k = got
    if tn is None:
        tn, warps, vec = (default_knobs(m)[key] for key in ("tn", "warps", "vec"))
    if all(isinstance(x, int) for x in (tn, warps, vec)) and not _fits(m, n, k, tn, warps, vec):
        return False
    block = red.block_rv
    *rows, col, red_loop = sch.get_loops(block)
    row = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    bx, ty, tc = sch.split(col, [None, warps, tn])
    ko, tx, kv = sch.split(red_loop, [None, LANES, vec])
    sch.reorder(bx, ty, tx, ko, row, tc, kv)
    rf = sch.rfactor(tx, factor_axis=0)  # partial sums per lane
    bx, ty, tx, ko, _, _, _ = sch.get_loops(rf)
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.set_scope(rf, 0, "shared")  # the lanes' partials meet in shared memory ...
    acc = sch.cache_write(rf, 0, "local")  # ... accumulated in registers first
    sch.reverse_compute_at(acc, tx, preserve_unit_loops=True)
    for i in range(len(sch.get(rf).reads)):  # 16-byte loads of x's rows and W's columns
        cache = sch.cache_read(rf, i, "local")
        sch.compute_at(cache, ko, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(cache)[-1])
    sch.decompose_reduction(rf, ko)
    sch.reverse_compute_at(block, ty, preserve_unit_loops=True)  # lanes sum the partials of one output each
    lane_r, out_row, out_col = sch.get_loops(block)[2:]
    sch.reorder(out_row, out_col, lane_r)
    _, t = sch.split(sch.fuse(out_row, out_col), [None, LANES])
    sch.bind(t, "threadIdx.x")
    sch.set_scope(block, 0, "shared")
    if epi is not None:
        sch.reverse_compute_at(epi.block_rv, ty, preserve_unit_loops=True)
        _, t = sch.split(sch.fuse(*sch.get_loops(epi.block_rv)[2:]), [None, LANES])
        sch.bind(t, "threadIdx.x")
    return True


def default_schedule(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """The schedule with `default_knobs`, or None where it does not apply."""
    return schedule_or_none(func, schedule_small_m)


def space_fn(sch: s_tir.Schedule):
    """ScheduleFn body: the schedule with its knobs sampled among the choices that fit this kernel's M, N, K."""
    got = _analyze(sch.copy())
    if got is None:
        return []
    _, _, m, n, k = got
    warps = [w for w in (2, 4, 8) if n % w == 0]
    tns = [t for t in (1, 2, 4, 8, 16, 32) if (m * t) % LANES == 0 and m * t <= 128 and n % (t * max(warps or [1])) == 0]
    vecs = [v for v in (4, 8) if k % (LANES * v) == 0]
    if not 1 < m <= MAX_M or not (warps and tns and vecs):
        return []
    pick = [sch.sample_categorical(c, [1.0 / len(c)] * len(c)) for c in (tns, warps, vecs)]
    return [sch] if schedule_small_m(sch, *pick) else []
