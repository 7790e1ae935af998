"""Design space for GEMV-shaped MatMul (small M) with a bias/activation epilogue: split-K over threadIdx.y with a shared-memory partial-sum reduction, vectorized weight loads, tunable columns per thread, threads per block and unroll."""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial

MAX_M = 64  # matmuls with at most this many rows use this space
TX = [8, 16, 32, 64]
KY = [2, 4, 8, 16]
VEC = [2, 4, 8]
UNROLL = [0, 16, 64, 256]


def _find(sch: s_tir.Schedule):
    """(block_infos, matmul block info, (M, N, K), a_idx, b_idx) or None."""
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    infos = try_inline_contiguous_spatial(sch, infos)
    reds = [i for i in infos if i.is_reduction()]
    if len(reds) != 1 or infos[0] is not reds[0]:
        return None
    mm = reds[0]
    if any(not i.is_injective() for i in infos[1:]):
        return None
    kind = mm.dom_kind()
    doms = [int(d) for d in mm.dom()]
    while kind and kind[0] == "S" and doms[0] == 1 and len(kind) > 3:
        kind, doms = kind[1:], doms[1:]
    if kind != "SSR":
        return None
    blk = sch.get(mm.block_rv)
    if len(blk.reads) != 2 or not isinstance(blk.body, tirx.BufferStore):
        return None
    # A[m, k] * B[k, n]: identify which read is indexed by the N iteration var
    ivars = [iv.var for iv in blk.iter_vars][-3:]
    b_idx = None
    for j, r in enumerate(blk.reads):
        used = set()
        for rng in r.region:
            tvm_ffi.structural_walk(rng.min, (tirx.Var, used.add), order="post")
        if ivars[1] in used and ivars[0] not in used:
            b_idx = j
    if b_idx is None:
        return None
    return infos, mm, tuple(doms), 1 - b_idx, b_idx


def matmul_shape(func: tirx.PrimFunc):
    """(M, N, K, dtype of the weight) if `func` is one matmul plus elementwise epilogue, else None."""
    try:
        sch = s_tir.Schedule(func)
        got = _find(sch)
    except Exception:  # pylint: disable=broad-except
        return None
    if got is None:
        return None
    _infos, mm, (m, n, k), _a, b_idx = got
    return m, n, k, str(sch.get(mm.block_rv).reads[b_idx].source.dtype)


def schedule_gemv(sch: s_tir.Schedule, tx=None, ky=None, vec=None, unroll=None) -> bool:
    """Schedule in place; knobs are sampled unless given as ints."""
    got = _find(sch)
    if got is None:
        return False
    infos, mm, (m, n, k), _a_idx, b_idx = got
    vecs = [v for v in VEC if n % v == 0]
    kys = [y for y in KY if k % y == 0]

    def cat(vals, given):
        return sch.sample_categorical(vals, [1.0 / len(vals)] * len(vals)) if given is None else given

    t_x, k_y, v, ur = cat(TX, tx), cat(kys, ky), cat(vecs, vec), cat(UNROLL, unroll)
    blk = mm.block_rv
    loops = sch.get_loops(blk)
    lead, (li, lj, lk) = loops[:-3], loops[-3:]
    jo, jt, jv = sch.split(lj, [None, t_x, v])
    ko, ki = sch.split(lk, [k_y, None])
    sch.reorder(*lead, jo, jt, ko, ki, li, jv)
    rf = sch.rfactor(ko, factor_axis=0)
    # partial sums: one thread owns (ky, M rows, vec columns) in registers
    jo, jt, ko, ki = sch.get_loops(rf)[-6:-2]
    sch.bind(jo, "blockIdx.x")
    sch.bind(jt, "threadIdx.x")
    sch.bind(ko, "threadIdx.y")
    acc = sch.cache_write(rf, 0, "local")
    sch.reverse_compute_at(acc, ko, preserve_unit_loops=True)
    sch.set_scope(acc, 0, "shared")
    wl = sch.cache_read(rf, b_idx, "local")
    sch.compute_at(wl, ki, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(wl)[-1])
    sch.annotate(ki, "pragma_auto_unroll_max_step", ur)
    sch.annotate(ki, "pragma_unroll_explicit", 1)
    sch.decompose_reduction(rf, ki)
    # final reduction over ky from shared memory, one output per thread, epilogue fused
    sch.reverse_compute_at(blk, jo, preserve_unit_loops=True)
    wb_loops = sch.get_loops(blk)
    l_ko, l_i, l_j = wb_loops[-3:]  # the write-back block iterates (ky, m, n)
    sch.reorder(l_i, l_j, l_ko)
    f = sch.fuse(l_i, l_j)
    _, fy, fx = sch.split(f, [None, k_y, t_x])
    sch.bind(fy, "threadIdx.y")
    sch.bind(fx, "threadIdx.x")
    if len(infos) > 1:
        sch.set_scope(blk, 0, "local")
        for epi in infos[1:]:
            sch.reverse_compute_at(epi.block_rv, fx, preserve_unit_loops=True)
    return True


def space_fn(sch: s_tir.Schedule):
    """ScheduleFn body."""
    if not schedule_gemv(sch):
        raise ValueError("not a GEMV-shaped matmul")
    return sch
