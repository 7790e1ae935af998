"""Design space for row-reduction fusions (LayerNorm/RMSNorm/softmax with elementwise prologue and epilogue): one block per row, the row staged once in shared memory, tunable threads per row, vector width and unroll (fixed default knobs for untuned CUDA builds)."""

from __future__ import annotations

import math
import re

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block, normalize_prim_func
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial

THREADS = [64, 128, 256, 512, 1024]
VECS = [1, 2, 4, 8]
UNROLL = [0, 16, 64, 256]


def _analyze(sch: s_tir.Schedule):
    """Inline elementwise blocks; return (block_infos, n_leading_s, row_len) or None if not a row reduction."""
    infos = normalize_prim_func(sch)
    infos = try_inline_contiguous_spatial(sch, infos)
    if not infos or len(infos) < 2:
        return None
    if not any(info.is_reduction() for info in infos):
        return None
    last = infos[-1]
    if not last.is_injective():
        return None
    kinds = [info.dom_kind() for info in infos]
    red = [k for k in kinds if "R" in k]
    nlead = len(red[0]) - len(red[0].lstrip("S"))
    if nlead == 0:
        return None
    for info, k in zip(infos, kinds):
        if "R" in k:
            if k != red[0] or k[nlead:] != "R" * (len(k) - nlead):
                return None
        elif len(k) != len(kinds[-1]):
            return None
    red_dom = [int(d) for d in next(i for i in infos if i.is_reduction()).dom()]
    if all(d == 1 for d in red_dom[:nlead]):  # one row (decode: [1, 1, H]): the spatial blocks lost their unit
        return infos, 0, math.prod(red_dom[nlead:])  # dims, so no loop is a row loop; schedule_row adds the block loop
    doms = [int(d) for d in last.dom()]
    if len(doms) <= nlead:
        return None
    return infos, nlead, math.prod(doms[nlead:])


def is_row_reduction(func: tirx.PrimFunc) -> bool:
    """True if the PrimFunc is a per-row reduction with an elementwise epilogue over the same rows."""
    try:
        return _analyze(s_tir.Schedule(func)) is not None
    except Exception:  # pylint: disable=broad-except
        return False


def _global_inputs_read_twice(sch, infos):
    """Buffers from the function's parameters that more than one remaining block reads."""
    allocated = set()
    allocated.update(sch.get(get_root_block(sch)).alloc_buffers)
    for info in infos:  # outputs written here are not inputs
        allocated.update(w.source for w in sch.get(info.block_rv).writes)
    counts = {}
    for info in infos:
        blk = sch.get(info.block_rv)
        seen = set()
        for r in blk.reads:
            b = r.source
            if b not in allocated and b not in seen and len(b.shape) > 1:
                seen.add(b)
                counts[b] = counts.get(b, 0) + 1
    return [b for b, c in counts.items() if c > 1]


def schedule_row(sch: s_tir.Schedule, stage: bool = True, threads=None, vec=None, unroll=None):
    """Schedule `sch` in place. Knobs are sampled (tunable) unless given as ints. Returns False if not applicable."""
    got = _analyze(sch)
    if got is None:
        return False
    infos, nlead, row_len = got
    ths = [t for t in THREADS if t <= max(row_len, 32)] or [32]
    vecs = [v for v in VECS if row_len % v == 0]
    tx = sch.sample_categorical(ths, [1.0 / len(ths)] * len(ths)) if threads is None else threads
    vv = sch.sample_categorical(vecs, [1.0 / len(vecs)] * len(vecs)) if vec is None else vec
    ur = sch.sample_categorical(UNROLL, [0.25] * 4) if unroll is None else unroll
    # Blocks in execution order: staged-input copies, then the remaining blocks; each spatial block
    # that writes a buffer later blocks read (e.g. the residual sum h) is computed into shared memory
    # and copied out vectorized.
    order = []
    if stage:
        for buf in _global_inputs_read_twice(sch, infos):
            consumers = [i.block_rv for i in infos if any(r.source.same_as(buf) for r in sch.get(i.block_rv).reads)]
            idx = [j for j, r in enumerate(sch.get(consumers[0]).reads) if r.source.same_as(buf)][0]
            order.append(("copy", sch.cache_read(consumers[0], idx, "shared", consumer_blocks=consumers)))
    for info in infos:
        blk = info.block_rv
        if info.is_reduction():
            for i, _ in enumerate(sch.get(blk).writes):
                sch.set_scope(blk, i, "shared")
            order.append(("red", blk))
            continue
        order.append(("ew", blk))
        if info is infos[-1]:
            continue
        buf = sch.get(blk).writes[0].source
        readers = [i.block_rv for i in infos if i is not info
                   and any(r.source.same_as(buf) for r in sch.get(i.block_rv).reads)]
        if readers:
            order.append(("copy", sch.cache_write(blk, 0, "shared", consumer_blocks=readers)))
    # anchor: the first block's row loop; every later block is moved under it in order
    bx = None
    for i, (kind, blk) in enumerate(order):
        if bx is not None:
            sch.reverse_compute_at(blk, bx, preserve_unit_loops=True)
            lps = sch.get_loops(blk)[1:]
        else:
            lps = sch.get_loops(blk)
            bx = sch.fuse(*lps[:nlead]) if nlead else sch.add_unit_loop(lps[0])
            sch.bind(bx, "blockIdx.x")
            lps = sch.get_loops(blk)[1:]
        lps = [l for l in lps if sch.get(l).extent != 1] or lps[-1:]
        inner = sch.fuse(*lps) if len(lps) > 1 else lps[0]
        if kind == "red":
            ro, rt = sch.split(inner, [None, tx])
            sch.reorder(rt, ro)
            sch.bind(rt, "threadIdx.x")
            sch.annotate(ro, "pragma_auto_unroll_max_step", ur)
            sch.annotate(ro, "pragma_unroll_explicit", 1)
        else:
            _, rt, rv = sch.split(inner, [None, tx, vv])
            sch.bind(rt, "threadIdx.x")
            sch.vectorize(rv)
    return True


SHARED_BYTES = 48 * 1024  # static shared memory per block


def default_knobs(row_len: int, widest_bits: int) -> dict:
    """Fixed knobs for an untuned kernel: vectors of 16 bytes of the widest type the kernel computes in (fp16 math:
    8, fp32 or fp16 accumulated in fp32: 4; wider vectors do not compile) where whole warps of threads, at most 1024,
    cover the row in whole vectors (no predicated vector loop); else scalar and up to 1024 threads."""
    vec = max(1, 128 // max(8, widest_bits))
    while vec >= 1:
        per_row = row_len // vec
        fits = [t for t in range(32, 1025, 32) if row_len % vec == 0 and per_row % t == 0]
        if fits and max(fits) >= min(256, per_row):
            return {"threads": max(fits), "vec": vec, "unroll": 64}
        vec //= 2
    return {"threads": min(1024, -(-row_len // 32) * 32), "vec": 1, "unroll": 64}


def _widest_float_bits(func: tirx.PrimFunc) -> int:
    """Bits of the widest float type in the kernel's buffers, casts and constants (its TVMScript names them all)."""
    return max([int(b) for b in re.findall(r"\bb?float(16|32|64)\b", func.script())] or [32])


def _shared_bytes(sch: s_tir.Schedule, row_len: int) -> int:
    """Shared memory one block (one row) allocates: a staging buffer holds one row of its full-size shape
    (leading unit dims included, e.g. (1, 512, 768) for rows of 768; CompactBufferAllocation keeps one row)."""
    total = 0
    for buf in sch.get(get_root_block(sch)).alloc_buffers:
        if buf.scope() == "shared":
            n = math.prod(int(d) for d in buf.shape)
            total += (row_len if n % row_len == 0 else n) * tvm.DataType(str(buf.dtype)).bits // 8
    return total


def default_schedule(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """The row schedule with `default_knobs`, the row staged in shared memory where it fits, else read through
    L1; None if `func` is not a row reduction or its row does not fit in shared memory."""
    probe = s_tir.Schedule(func)
    got = _analyze(probe)
    if got is None:
        return None
    _, nlead, row_len = got
    knobs = default_knobs(row_len, _widest_float_bits(func))
    for stage in (True, False):
        sch = s_tir.Schedule(func)
        try:
            if schedule_row(sch, stage=stage, **knobs) and _shared_bytes(sch, row_len) <= SHARED_BYTES:
                return sch
        except Exception:  # pylint: disable=broad-except  (a fused kernel the row schedule cannot take)
            continue
    return None


def space_fn(sch: s_tir.Schedule):
    """ScheduleFn body: two structural variants (row staged in shared memory / read through L1)."""
    out = []
    for stage in (True, False):
        s = sch.copy()
        try:
            if schedule_row(s, stage=stage):
                out.append(s)
        except Exception:  # pylint: disable=broad-except
            continue
    return out
