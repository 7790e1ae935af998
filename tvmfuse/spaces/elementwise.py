"""Default CUDA schedule for injective kernels (copies, concatenations, transposes, elementwise chains): each thread writes one 16-byte vector of the output.

dlight's Fallback binds one output element per thread in 1024-thread blocks: for fp16 that is 2-byte loads and
stores, and the KV-cache concatenations of the Llama decode-16 layer ([16, 32, 513, 128], 67 MB each) took 133-153 µs
(bench/results/models_run7.json profile), 3-4x their bytes at copy bandwidth. Here the loops are fused and split
so the innermost `vec` elements (16 bytes of the widest type accessed) are one vectorized access.
"""

from __future__ import annotations

import math

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline

from tvmfuse.spaces.common import schedule_or_none

THREADS = 256
ALLOWED_CODES = {tvm_ffi.dtype("int32").type_code, tvm_ffi.dtype("uint8").type_code,
                 tvm_ffi.dtype("float16").type_code, tvm_ffi.dtype("bfloat16").type_code}


def _injective_blocks(sch: s_tir.Schedule):
    """(the blocks left after inlining everything else into them, their loop extents) for a static all-injective
    kernel that is one block, or several under one loop nest (a multi-output compute: one-kernel splits)."""
    infos = normalize_prim_func(sch)
    if not infos or any(not i.is_injective() for i in infos):
        return None
    infos = try_inline(sch, infos)
    loops = [[sch.get(lp) for lp in sch.get_loops(i.block_rv)] for i in infos]
    if not infos or any(len(ls) != len(loops[0]) or not all(a.same_as(b) for a, b in zip(ls, loops[0]))
                        for ls in loops):
        return None
    doms = list(infos[0].dom())
    if not doms or not all(isinstance(d, (int, tirx.IntImm)) for d in doms):
        return None
    return [i.block_rv for i in infos], [int(d) for d in doms]


def _vector_elements(accesses) -> int | None:
    """The elements of a 16-byte vector of the widest type `accesses` (buffer regions) touch; None where one is
    not an 8-, 16- or 32-bit int or float: bool (no CUDA vector type: "Cannot convert type T.boolx16"), 64-bit or
    vector elements."""
    dtypes = {tvm_ffi.dtype(str(r.source.dtype)) for r in accesses}
    if any(d.type_code not in ALLOWED_CODES or d.bits not in (8, 16, 32) or d.lanes != 1 for d in dtypes):
        return None
    return 128 // max(d.bits for d in dtypes)


def schedule_vectorized(sch: s_tir.Schedule) -> bool:
    """Schedule in place; False if the kernel is not static injective blocks under one loop nest, of 8-, 16- or
    32-bit ints or floats, whose innermost extent splits into 16-byte vectors of the widest type they access. Reads
    that do not move with the innermost index (a gather's int64 row ids: an embedding lookup) are not vector
    accesses."""
    got = _injective_blocks(sch)
    if got is None:
        return False
    blocks, doms = got
    moving, reads, writes = [], [], []
    for block in blocks:
        stmt = sch.get(block)
        inner = stmt.iter_vars[-1].var  # reads that do not move with it (a gather's row ids) are loaded once per vector
        moving += [r for r in stmt.reads if any(v.same_as(inner) for rng in r.region
                                                for v in tirx.analysis.undefined_vars(rng.min))]
        reads += list(stmt.reads)
        writes += list(stmt.writes)
    gather = len(moving) < len(reads)
    vec = _vector_elements(moving + writes)
    if vec is None:
        return False
    total = math.prod(doms)
    if doms[-1] % vec != 0 or total < vec * THREADS:
        return False
    if gather and any(not isinstance(r.source.shape[-1], tirx.IntImm) or int(r.source.shape[-1]) % vec
                      for r in moving):  # rows picked by an index: each must start on a whole vector
        return False
    # the vector is the innermost axis' last `vec` elements (the same order as splitting all loops fused): outer
    # indices do not depend on the lane, so a gather's row id is one scalar load (fused-then-split made BERT's
    # lookup ids [16, 1] an int64x8 vector, which CUDA codegen has no type for: the row length, 768, divides no
    # power of two the simplifier could see)
    *outer, inner = sch.get_loops(blocks[0])
    inner, v = sch.split(inner, [None, vec])
    fused = sch.fuse(*outer, inner) if outer else inner
    bx, tx = sch.split(fused, [None, THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)
    return True


def default_schedule(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """The vectorized schedule, or None where it does not apply."""
    return schedule_or_none(func, schedule_vectorized)


def schedule_rows(sch: s_tir.Schedule) -> bool:
    """Schedule in place a one-block injective kernel whose symbolic axes are outer to a static row (the KV-cache
    write at the past length: [batch, seq] symbolic, [kv heads, head dim] static): one CTA per row of the outer axes,
    fused unsplit (no divisibility to prove), its threads across the row in 16-byte vectors. False where the row is
    not whole vectors or there is no symbolic outer axis (`schedule_vectorized` takes static kernels).

    Why: Fallback moved the cache writes one element per thread with 64-bit divisions by the symbolic sizes:
    ~240 GB/s for the prefill's writes (generate_run3.json, bench/results/archive-generate-runs-2-5.tar.xz)."""
    infos = normalize_prim_func(sch)
    if not infos or len(infos) != 1 or not infos[0].is_injective():
        return False
    block = infos[0].block_rv
    loops = sch.get_loops(block)
    static = [isinstance(sch.get(lp).extent, tirx.IntImm) for lp in loops]
    if all(static) or static[-1] is False:
        return False
    first = max(i for i, known in enumerate(static) if not known) + 1  # the static row after the last symbolic axis
    stmt = sch.get(block)
    accesses = list(stmt.reads) + list(stmt.writes)
    vec = _vector_elements(accesses)
    if vec is None:
        return False
    inner = stmt.iter_vars[-1].var
    for access in accesses:  # each vector starts on 16 bytes: the innermost index is the innermost axis itself, in
        last = access.source.shape[-1]  # a row of whole vectors (an offset, a gather's odd rows would misalign it)
        if not access.region[-1].min.same_as(inner) or not isinstance(last, tirx.IntImm) or int(last) % vec:
            return False
    row = math.prod(int(sch.get(lp).extent) for lp in loops[first:])
    if int(sch.get(loops[-1]).extent) % vec:
        return False
    fused = sch.fuse(*loops[first:]) if len(loops) - first > 1 else loops[first]
    vectors, lanes = sch.split(fused, [None, vec])
    if row // vec > 1024:
        _, vectors = sch.split(vectors, [None, 1024])
    sch.bind(sch.fuse(*loops[:first]) if first > 1 else loops[0], "blockIdx.x")
    sch.bind(vectors, "threadIdx.x")
    sch.vectorize(lanes)
    return True


def rows_schedule(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """`schedule_rows`' schedule, or None where it does not apply."""
    return schedule_or_none(func, schedule_rows)


def schedule_unsplit(sch: s_tir.Schedule) -> bool:
    """Schedule in place an injective kernel whose fused loops TVM cannot split: each block's innermost loop on the
    threads (split by THREADS where it is symbolic or longer), everything outside it fused onto the CTAs, unsplit.

    Why: dlight's Fallback fuses all loops and splits the product by 1024; with a symbolic axis that TVM's iter-map
    rewrite cannot prove divisible (a concatenation along the past at batch 16 and seq 512: extent 32 * past + 16384)
    it raises, and so does every other rule: the kernel had no schedule and failed the build. No fused loop is split
    here, so no divisibility proof is needed; the price is one element per thread, as Fallback."""
    infos = normalize_prim_func(sch)
    if not infos or any(not i.is_injective() for i in infos):
        return False
    for info in try_inline(sch, infos):
        loops = sch.get_loops(info.block_rv)
        if not loops:
            return False
        inner, outer = loops[-1], list(loops[:-1])
        extent = sch.get(inner).extent
        if isinstance(extent, tirx.IntImm) and int(extent) <= 1024:
            threads = inner
        else:
            ctas, threads = sch.split(inner, [None, THREADS])
            outer.append(ctas)
        if outer:
            sch.bind(sch.fuse(*outer) if len(outer) > 1 else outer[0], "blockIdx.x")
        sch.bind(threads, "threadIdx.x")
    return True


def unsplit_schedule(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    """`schedule_unsplit`'s schedule, or None where it does not apply."""
    return schedule_or_none(func, schedule_unsplit)
