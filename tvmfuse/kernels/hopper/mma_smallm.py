"""Small-M GEMM kernel (decode batches, M <= 64) on tensor cores, written in TIRx: mma.sync m16n8k16 streaming the weight once, split K across a block's warps."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from tvm import tirx
from tvm.script import tirx as T

from tvmfuse.kernels.dependent_launch import dependent_launch
from tvmfuse.kernels.hopper.gemm_analysis import OPERAND_PTX
from tvmfuse.kernels.hopper.wgmma_gemm import TIRX_ATTR

# 16-byte loads: the weight streams past L1 (read once), the activations go through it (every block reads them).
STREAM_SRC = ("__device__ __forceinline__ void tvmfuse_ld_stream(const void* p, unsigned& a, unsigned& b, unsigned& c,"
              " unsigned& d) { asm(\"ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\" : \"=r\"(a), \"=r\"(b),"
              " \"=r\"(c), \"=r\"(d) : \"l\"(p)); }")
#: prefetch `bytes` (a multiple of 16) from global address `p` into L2: one bulk asynchronous copy, no registers
PREFETCH_SRC = ("__device__ __forceinline__ void tvmfuse_prefetch_l2_bulk(const void* p, unsigned bytes) { "
                "asm volatile(\"cp.async.bulk.prefetch.L2.global [%0], %1;\" :: \"l\"(p), \"r\"(bytes) "
                ": \"memory\"); }")
#: bytes of each of a block's weight rows prefetched into L2 before the dependency wait (`SmallMTile.early_weights`)
EARLY_BYTES = 16384
LOAD_SRC = ("__device__ __forceinline__ void tvmfuse_ld16(const void* p, unsigned& a, unsigned& b, unsigned& c, "
            "unsigned& d) { uint4 v = *reinterpret_cast<const uint4*>(p); a = v.x; b = v.y; c = v.z; d = v.w; }")


def mma_helper(dtype: str) -> tuple[str, str]:
    """(name, source) of the m16n8k16 mma.sync helper for fp16 or bf16 operands (fp32 sums), each its own name so
    kernels of both dtypes can share a module."""
    ab = OPERAND_PTX[dtype]
    name = "tvmfuse_mma16816" if ab == "f16" else f"tvmfuse_mma16816_{ab}"
    return name, (f"__device__ __forceinline__ void {name}(float& d0, float& d1, float& d2, float& d3, unsigned a0, "
                  "unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) { asm volatile(\"mma.sync.aligned."
                  f"m16n8k16.row.col.f32.{ab}.{ab}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};\" : "
                  "\"+f\"(d0), \"+f\"(d1), \"+f\"(d2), \"+f\"(d3) : \"r\"(a0), \"r\"(a1), \"r\"(a2), \"r\"(a3), "
                  "\"r\"(b0), \"r\"(b1)); }")


MAX_M = 64
#: environment switch read when a small-M tile is chosen: "S" gives the rules' tiles a weight ring of up to S stages
#: (`SmallMTile.stages`, within RING_BUDGET); unset or 0: none. Off by default: with 4 the Llama layer's decode b16
#: took 406.5 µs against 356.3 (models_run40_ring.json, H100; `bench/models.py --before smallm_ring`)
RING_SWITCH = "TVMFUSE_SMALLM_RING"
#: environment switch read when a GEMM's kernel is chosen: M = 1 GEMMs take this kernel unless it is "0" (then the
#: GEMV schedule); `bench/models.py --before smallm_m1` builds a case both ways (Llama decode b1 188 against 202 µs)
M1_SWITCH = "TVMFUSE_SMALLM_M1"
#: environment switch read when a small-M tile is chosen: "S" gives the rules' tiles a ring of up to S stages filled
#: by bulk copies (`SmallMTile.bulk`; its round halved until 3 stages fit RING_BUDGET); unset or 0: none. Off by
#: default: not measured in a model yet
BULK_SWITCH = "TVMFUSE_SMALLM_BULK"
RING_BUDGET = 128 << 10  # the rules' rings: at most this much shared memory a block
MAX_RING_BYTES = 160 << 10  # of the H100's 227 KB of shared memory a block, the warps' partial sums beside it
#: 16-byte asynchronous copy global -> shared (cached in L2 only: the weight is read once); `bytes` 0 fills zeros
CP_ASYNC_SRC = ("__device__ __forceinline__ void tvmfuse_cp_async16(void* dst, const void* src, unsigned bytes) { "
                "unsigned s = (unsigned)__cvta_generic_to_shared(dst); asm volatile(\"cp.async.cg.shared.global "
                "[%0], [%1], 16, %2;\" :: \"r\"(s), \"l\"(src), \"r\"(bytes) : \"memory\"); }")
COMMIT_SRC = ("__device__ __forceinline__ void tvmfuse_cp_async_commit() { "
              "asm volatile(\"cp.async.commit_group;\" ::: \"memory\"); }")
LDS_SRC = ("__device__ __forceinline__ void tvmfuse_lds16(const void* p, unsigned& a, unsigned& b, unsigned& c, "
           "unsigned& d) { unsigned s = (unsigned)__cvta_generic_to_shared(p); asm volatile(\"ld.shared.v4.u32 "
           "{%0,%1,%2,%3}, [%4];\" : \"=r\"(a), \"=r\"(b), \"=r\"(c), \"=r\"(d) : \"r\"(s) : \"memory\"); }")


#: one bulk asynchronous copy global -> shared of `bytes` (a multiple of 16, both addresses 16-byte aligned), no
#: registers held, completing its bytes on the mbarrier at `bar`
BULK_SRC = ("__device__ __forceinline__ void tvmfuse_bulk_copy(void* dst, const void* src, unsigned bytes, "
            "void* bar) { unsigned d = (unsigned)__cvta_generic_to_shared(dst); "
            "unsigned b = (unsigned)__cvta_generic_to_shared(bar); "
            "asm volatile(\"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\" "
            ":: \"r\"(d), \"l\"(src), \"r\"(bytes), \"r\"(b) : \"memory\"); }")
#: bytes after each weight row of a bulk ring's stage: rows 64 bytes apart mod 128, so the 8 lanes of a quarter warp
#: (two rows, 64 bytes of each) read distinct banks
ROW_PAD = 64


def wait_src(pending: int) -> tuple[str, str]:
    """(name, source) of the helper that waits until at most `pending` committed copy groups are in flight."""
    name = f"tvmfuse_cp_async_wait{pending}"
    return name, (f"__device__ __forceinline__ void {name}() {{ "
                  f"asm volatile(\"cp.async.wait_group {pending};\" ::: \"memory\"); }}")


def takes_m1() -> bool:
    """Whether M = 1 GEMMs take this kernel (the default; M1_SWITCH=0: the GEMV schedule)."""
    return os.environ.get(M1_SWITCH, "1").strip() != "0"


def _switch_stages(switch: str) -> int:
    """The stages the environment switch `switch` asks of the rules' small-M tiles (unset or not a count: 0)."""
    value = os.environ.get(switch, "0").strip()
    return int(value) if value.isdigit() else 0


def ring_stages() -> int:
    """The stages RING_SWITCH asks of the rules' small-M tiles (0: no ring)."""
    return _switch_stages(RING_SWITCH)


def bulk_stages() -> int:
    """The stages BULK_SWITCH asks of the rules' small-M tiles (0: no bulk ring)."""
    return _switch_stages(BULK_SWITCH)


def with_bulk_ring(tile, most: int):
    """`tile` with a ring of bulk copies of the most stages up to `most` that fit RING_BUDGET, its unroll (the
    round's K range) halved while fewer than min(3, most) stages fit; None where not even 2 fit at unroll 1."""
    best = None
    unroll = tile.unroll
    while unroll >= 1:
        ringed = with_ring(replace(tile, unroll=unroll, bulk=True), most)
        if ringed and (best is None or ringed.stages > best.stages):
            best = ringed
        if best and best.stages >= min(3, most):
            break
        unroll //= 2
    return best


def ring_bytes(tile) -> int:
    """Shared memory the weight ring of `tile` takes: per stage, per warp, its loads of a round (16 bytes a lane);
    with bulk copies, per stage, the block's weight rows over a round's K range (each padded by ROW_PAD)."""
    if tile.bulk:
        return tile.stages * tile.bn * (tile.unroll * tile.warps * 32 * tile.vec * 2 + ROW_PAD)
    return tile.stages * tile.warps * tile.unroll * tile.n8 * tile.vec * 32 * 16


def with_ring(tile, most: int):
    """`tile` with a weight ring of the most stages up to `most` that fit RING_BUDGET, or None where not even 2 do."""
    stages = next((s for s in range(most, 1, -1) if ring_bytes(replace(tile, stages=s)) <= RING_BUDGET), None)
    return replace(tile, stages=stages) if stages else None


@dataclass(frozen=True)
class SmallMTile:
    """A block of `warps` warps computes M x 8*`n8` outputs; each warp takes every `warps`-th chunk of K (32*`vec`
    wide: `vec` 16-byte loads per row per lane), `unroll` chunks' weights loaded before their mma."""

    n8: int = 4
    warps: int = 8
    vec: int = 1
    unroll: int = 4
    #: 0: each round's weights are loaded straight into registers (ptxas keeps two or three loads a warp in flight);
    #: S >= 2: each lane copies them asynchronously (`cp.async`, no registers held) into its own slots of a
    #: shared-memory ring of S rounds, issued S - 1 rounds ahead of the mma that reads them
    stages: int = 0
    #: before waiting for the kernel before (programmatic dependent launch), the block prefetches the first
    #: EARLY_BYTES of each of its weight rows into L2 (not with bulk copies) and (with a ring) issues the ring's first
    #: `stages - 1` rounds of weight copies, so the weights stream from HBM while that kernel ends; only
    #: where the weight is one no kernel writes (`select.weight_params`; chosen with
    #: `kernels.dependent_launch.early_weights()`); nothing changes without the dependent launch
    early_weights: bool = False
    #: without a ring: after the dependency wait each block prefetches its weight rows' next `l2_ahead` rounds into
    #: L2 (`cp.async.bulk.prefetch.L2`, one thread a row, no registers), one round further each round, so that the
    #: loads into registers find them there; 0: none. For M = 1, where ptxas issues 3-4 of a lane's weight loads
    #: before its first mma whatever `unroll` is (nvcc 13, 4096 x 4096): the HBM stream need not wait on them.
    #: Off by default: at M = 1 on an H100, 4 rounds ahead was slower at every shape (wgmma_run20_smallm.json)
    l2_ahead: int = 0
    #: with a ring (stages >= 2): filled by bulk copies (`cp.async.bulk`, one a weight row a round, issued by the
    #: row's thread, completing on the stage's mbarrier) into row-major stages, instead of each lane's 16-byte copies;
    #: the block meets once a round before a stage is refilled. Bytes in flight no longer take LSU slots a lane
    bulk: bool = False

    @property
    def bn(self) -> int:
        return 8 * self.n8


def check_smallm_shape(m: int, n: int, k: int, tile: SmallMTile) -> str | None:
    """Why this kernel cannot compute an m x n x k GEMM with `tile`, or None when it can."""
    if not 1 <= m <= MAX_M:
        return f"M={m} is not in 1..{MAX_M}"
    if k % 8:
        return f"K={k} is not a multiple of 8 (16-byte loads of each row)"
    if tile.n8 < 1 or tile.warps < 1 or tile.vec not in (1, 2) or tile.unroll < 1 or tile.stages == 1 or not (
            0 <= tile.stages <= 8):
        return f"unsupported tile {tile}"
    if tile.bulk and not tile.stages:
        return f"unsupported tile {tile}: bulk copies fill a ring (stages >= 2)"
    if tile.bulk and tile.bn > tile.warps * 32:
        return f"unsupported tile {tile}: a thread a weight row issues its bulk copies ({tile.bn} rows)"
    if tile.l2_ahead < 0 or (tile.l2_ahead and tile.stages):
        return f"unsupported tile {tile}: L2 prefetch rounds ahead (>= 0) where no ring keeps rounds in flight"
    if ring_bytes(tile) > MAX_RING_BYTES:
        return f"tile {tile}: a ring of {ring_bytes(tile)} bytes (at most {MAX_RING_BYTES})"
    return None


def smallm_kernel(m: int, n: int, k: int, tile: SmallMTile, a, b, out, finish, place, params, name: str,
                  setup=lambda: None):
    """The TIRx PrimFunc computing out = finish(a @ b^T) for small m: `a` holds [m, k] rows (any leading dims, K
    innermost, contiguous), `b` is [n, k] (both fp16 or both bf16); `finish(acc, row, col)` is the fp32 value of element (row, col)
    from its fp32 sum, `place(row, col)` its indices in `out`; `params` (buffers) the PrimFunc's signature; `setup()`
    runs first in the kernel (declares the views the epilogue reads).

    Lane (g, q) of a warp (g = lane / 4, q = lane % 4) loads 8*vec consecutive k of weight row g and of activation
    rows g and g + 8 with 16-byte loads; the k order inside a chunk is permuted the same way for both operands, so
    the registers are the mma fragments as loaded (no shuffles, no shared memory on the way in). The warps' partial
    sums meet in shared memory; the block sums them and applies the epilogue."""
    why = check_smallm_shape(m, n, k, tile)
    if why:
        raise ValueError(why)
    n8, warps, vec, unroll = tile.n8, tile.warps, tile.vec, tile.unroll
    mt = -(-m // 16)  # m16 tiles
    chunk = 32 * vec
    chunks = -(-k // chunk)
    rounds = -(-chunks // (warps * unroll))
    guard = k % chunk != 0 or chunks % (warps * unroll) != 0  # some loads fall past K: zero them
    threads = warps * 32
    per_warp = mt * n8 * 128  # partial sums one warp leaves in shared memory
    out_dtype, dt = str(out.dtype), str(a.dtype)
    if dt not in OPERAND_PTX or str(b.dtype) != dt:
        raise ValueError(f"operands {a.dtype} x {b.dtype} (both float16 or both bfloat16)")
    mma, mma_src = mma_helper(dt)
    A, B = a, b

    pdl = dependent_launch()  # kernels.dependent_launch
    early = pdl and tile.early_weights
    early_bytes = min(EARLY_BYTES, k * 2 // 16 * 16)  # of each weight row (K contiguous 2-byte values)
    stages = tile.stages
    ringed = stages > 0  # a Python bool: TIRx's parser takes it as a static condition
    ahead = tile.l2_ahead
    round_k = unroll * warps * chunk  # the K values of a round
    round_bytes = round_k * 2  # the K range of one round of a weight row: contiguous
    bulk = ringed and tile.bulk  # the ring filled by bulk copies, a weight row a round (Python bool: static)
    row_words = (round_bytes + ROW_PAD) // 4  # a bulk stage's weight row, padded
    stage_words = tile.bn * row_words
    ring_words = ring_bytes(tile) // 4  # beside the partial sums, in the one dynamic allocation
    bar_words = 2 * stages if bulk else 0  # a bulk ring's mbarriers after it (8 bytes each)
    # the warps' partial sums before the ring; a bulk ring's block meets after its last round, so the sums reuse it
    sums_words = max(warps * per_warp - ring_words, 0) if bulk else warps * per_warp
    ring_at = 0 if bulk else warps * per_warp
    wait_name, wait_code = wait_src(max(stages - 1, 0))

    def slot(stage, warp, u, t, v, lane):  # the first of the 4 words a lane's load (u, t, v) of a stage fills
        return (((((stage * warps + warp) * unroll + u) * n8 + t) * vec + v) * 32 + lane) * 4

    # fmt: off
    @T.macro
    def issue_round(ring, rr, bid, warp, lane):
        """Round rr's weights: each lane's `loads` 16-byte copies into its slots of stage rr % stages."""
        for u in T.unroll(unroll):
            for t in T.unroll(n8):
                for v in T.unroll(vec):
                    kk = T.meta_var(((rr * unroll + u) * warps + warp) * chunk + (lane % 4) * 8 * vec + v * 8)
                    col = T.meta_var(T.min(bid * tile.bn + t * 8 + lane // 4, n - 1))
                    dst = T.meta_var(T.address_of(ring[slot(rr % stages, warp, u, t, v, lane)]))
                    if guard:
                        T.cuda.func_call("tvmfuse_cp_async16", dst, T.address_of(B[col, T.min(kk, k - 8)]),
                                         T.Select(kk < k, T.uint32(16), T.uint32(0)), source_code=CP_ASYNC_SRC)
                    else:
                        T.cuda.func_call("tvmfuse_cp_async16", dst, T.address_of(B[col, kk]), T.uint32(16),
                                         source_code=CP_ASYNC_SRC)
        T.cuda.func_call("tvmfuse_cp_async_commit", source_code=COMMIT_SRC)

    @T.macro
    def issue_bulk(ring, bars, rr, bid, tx):
        """Round rr's weights into stage rr % stages: thread t copies the block's weight row t over the round's K
        range (one bulk copy), its bytes expected by its arrival on the stage's mbarrier (one arrival a row)."""
        if tx < tile.bn:
            size = T.meta_var(T.min(round_bytes, k * 2 - rr * round_bytes) if guard else round_bytes)
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(bars[rr % stages]), T.uint32(size))
            T.cuda.func_call("tvmfuse_bulk_copy", T.address_of(ring[(rr % stages) * stage_words + tx * row_words]),
                             T.address_of(B[T.min(bid * tile.bn + tx, n - 1), rr * round_k]), T.uint32(size),
                             T.address_of(bars[rr % stages]), source_code=BULK_SRC)

    @T.macro
    def ring_prologue(ring, bars, bid, warp, lane, tx):
        """Rounds 0 .. stages - 2 issued (with cp.async, an empty group for each past the last round)."""
        for p in T.unroll(stages - 1):
            if p < rounds:
                if bulk:
                    issue_bulk(ring, bars, p, bid, tx)
                else:
                    issue_round(ring, p, bid, warp, lane)
            elif not bulk:
                T.cuda.func_call("tvmfuse_cp_async_commit", source_code=COMMIT_SRC)

    @T.macro
    def prefetch_rows(bid, tx, first, nbytes):
        """`nbytes` of each of the block's weight rows from element `first` into L2: one bulk prefetch a row, by its
        thread."""
        if tx < tile.bn and bid * tile.bn + tx < n:
            T.cuda.func_call("tvmfuse_prefetch_l2_bulk", T.address_of(B[bid * tile.bn + tx, first]), T.uint32(nbytes),
                             source_code=PREFETCH_SRC)

    @T.macro
    def prefetch_round(rr, bid, tx):
        """Round rr of the block's weight rows into L2 (its part within K)."""
        if rr * round_bytes < k * 2:
            prefetch_rows(bid, tx, rr * (round_bytes // 2), T.min(round_bytes, k * 2 - rr * round_bytes) // 16 * 16)

    @T.prim_func(check_well_formed=False)
    def gemm():
        T.device_entry()
        setup()  # what the epilogue reads declared first (views of 0-d parameters)
        bid = T.cta_id([-(-n // tile.bn)])
        tx = T.thread_id([threads])
        A2 = T.decl_buffer((m, k), dt, data=A.data)
        red = T.alloc_buffer((sums_words + ring_words + bar_words,), "float32", scope="shared.dyn")
        ring = T.decl_buffer((max(ring_words, 4),), "uint32", data=red.data, elem_offset=ring_at,
                             scope="shared.dyn")
        bars = T.decl_buffer((max(stages, 1),), "uint64", data=red.data, elem_offset=(sums_words + ring_words) // 2,
                             scope="shared.dyn")
        wreg = T.alloc_local((unroll * n8 * vec * 4,), "uint32")
        areg = T.alloc_local((mt * 2 * vec * 4,), "uint32")
        acc = T.alloc_local((mt * n8 * 4,), "float32")
        tot = T.alloc_local((1,), "float32")
        warp = T.meta_var(tx // 32)
        lane = T.meta_var(tx % 32)
        if bulk:  # a stage's barrier completes once each of its rows has arrived and its bytes have landed
            if tx == 0:
                for s in T.unroll(stages):
                    T.ptx.mbarrier.init.shared.b64(T.address_of(bars[s]), T.uint32(tile.bn))
            T.ptx.fence.proxy.async_.shared__cta()
            T.cuda.cta_sync()
        if early and not bulk:  # the weights need not wait for the kernel before (the activations do)
            prefetch_rows(bid, tx, 0, early_bytes)
        if ringed:  # the ring's first stages - 1 rounds in flight (with early weights: before the wait)
            if early:
                ring_prologue(ring, bars, bid, warp, lane, tx)
        if pdl:  # the kernel before has finished and its writes are seen; the next may launch
            T.ptx.griddepcontrol.wait()
            T.ptx.griddepcontrol.launch_dependents()
        for i in T.unroll(mt * n8 * 4):
            acc[i] = T.float32(0)
        if ringed:
            if not early:
                ring_prologue(ring, bars, bid, warp, lane, tx)
        for p in T.unroll(ahead):  # the first `ahead` rounds into L2
            prefetch_round(p, bid, tx)
        for r in T.serial(rounds):
            if ahead > 0:  # round r + ahead into L2 as round r is loaded
                if r + ahead < rounds:
                    prefetch_round(r + ahead, bid, tx)
            if bulk:  # round r + stages - 1 into the stage all warps left at the end of round r - 1, then round r
                if r + stages - 1 < rounds:
                    issue_bulk(ring, bars, r + stages - 1, bid, tx)
                T.cuda.mbarrier_wait(T.address_of(bars[r % stages]), (r // stages) % 2)
                for u in T.unroll(unroll):
                    for t in T.unroll(n8):
                        for v in T.unroll(vec):
                            kin = T.meta_var((u * warps + warp) * chunk + (lane % 4) * 8 * vec + v * 8)
                            ws = T.meta_var([wreg[((u * n8 + t) * vec + v) * 4 + j] for j in range(4)])
                            T.cuda.func_call("tvmfuse_lds16", T.address_of(
                                ring[(r % stages) * stage_words + (t * 8 + lane // 4) * row_words + kin // 2]), *ws,
                                source_code=LDS_SRC)
                            if guard:  # past K: what an earlier round left there
                                if r * round_k + kin >= k:
                                    for j in T.unroll(4):
                                        wreg[((u * n8 + t) * vec + v) * 4 + j] = T.uint32(0)
            elif ringed:  # round r + stages - 1 issued, then round r's copies waited for and read back
                if r + stages - 1 < rounds:
                    issue_round(ring, r + stages - 1, bid, warp, lane)
                else:
                    T.cuda.func_call("tvmfuse_cp_async_commit", source_code=COMMIT_SRC)
                T.cuda.func_call(wait_name, source_code=wait_code)
                for u in T.unroll(unroll):
                    for t in T.unroll(n8):
                        for v in T.unroll(vec):
                            T.cuda.func_call("tvmfuse_lds16", T.address_of(ring[slot(r % stages, warp, u, t, v, lane)]),
                                             *[wreg[((u * n8 + t) * vec + v) * 4 + j] for j in range(4)],
                                             source_code=LDS_SRC)
            else:
                for u in T.unroll(unroll):  # the weights of `unroll` chunks in flight at once
                    for t in T.unroll(n8):
                        for v in T.unroll(vec):
                            kk = T.meta_var(((r * unroll + u) * warps + warp) * chunk + (lane % 4) * 8 * vec + v * 8)
                            col = T.meta_var(T.min(bid * tile.bn + t * 8 + lane // 4, n - 1))
                            ws = T.meta_var([wreg[((u * n8 + t) * vec + v) * 4 + j] for j in range(4)])
                            if guard:
                                if kk < k:
                                    T.cuda.func_call("tvmfuse_ld_stream", T.address_of(B[col, kk]), *ws,
                                                     source_code=STREAM_SRC)
                                else:
                                    for j in T.unroll(4):
                                        wreg[((u * n8 + t) * vec + v) * 4 + j] = T.uint32(0)
                            else:
                                T.cuda.func_call("tvmfuse_ld_stream", T.address_of(B[col, kk]), *ws,
                                                 source_code=STREAM_SRC)
            for u in T.unroll(unroll):
                for i in T.unroll(mt):
                    for h in T.unroll(2):
                        for v in T.unroll(vec):
                            kk = T.meta_var(((r * unroll + u) * warps + warp) * chunk + (lane % 4) * 8 * vec + v * 8)
                            row = T.meta_var(T.min(i * 16 + h * 8 + lane // 4, m - 1))
                            ars = T.meta_var([areg[((i * 2 + h) * vec + v) * 4 + j] for j in range(4)])
                            if guard:
                                if kk < k:
                                    T.cuda.func_call("tvmfuse_ld16", T.address_of(A2[row, kk]), *ars, source_code=LOAD_SRC)
                                else:
                                    for j in T.unroll(4):
                                        areg[((i * 2 + h) * vec + v) * 4 + j] = T.uint32(0)
                            else:
                                T.cuda.func_call("tvmfuse_ld16", T.address_of(A2[row, kk]), *ars, source_code=LOAD_SRC)
                for i in T.unroll(mt):
                    for t in T.unroll(n8):
                        for s in T.unroll(2 * vec):  # mma step s: halves 4s..4s+3 of each lane's 8*vec
                            ai = T.meta_var((i * 2 * vec + s // 2) * 4 + (s % 2) * 2)
                            bi = T.meta_var(((u * n8 + t) * vec + s // 2) * 4 + (s % 2) * 2)
                            ci = T.meta_var((i * n8 + t) * 4)
                            T.cuda.func_call(mma, acc[ci], acc[ci + 1], acc[ci + 2], acc[ci + 3],
                                             areg[ai], areg[ai + vec * 4], areg[ai + 1], areg[ai + vec * 4 + 1],
                                             wreg[bi], wreg[bi + 1], source_code=mma_src)
            if bulk:  # every warp is done with stage r % stages before round r + 1 refills it
                T.cuda.cta_sync()
        for i in T.unroll(mt * n8 * 4):  # [warp][m16 tile][n8 tile][fragment i][lane]
            red[warp * per_warp + (i // 4) * 128 + (i % 4) * 32 + lane] = acc[i]
        T.cuda.cta_sync()
        for j in T.serial(-(-per_warp // threads)):
            e = T.meta_var(j * threads + tx)
            if e < per_warp:
                tot[0] = T.float32(0)
                for w in T.unroll(warps):
                    tot[0] = tot[0] + red[w * per_warp + e]
                # fragment i of lane l in tile (m16 i0, n8 t): row i0*16 + l/4 + 8*(i/2), column t*8 + 2*(l%4) + i%2
                row = T.meta_var(e // (128 * n8) * 16 + (e % 32) // 4 + ((e // 32) % 4) // 2 * 8)
                col = T.meta_var(bid * tile.bn + (e // 128) % n8 * 8 + (e % 32) % 4 * 2 + (e // 32) % 2)
                if row < m and col < n:
                    out[place(row, col)] = T.Cast(out_dtype, finish(tot[0], row, col))
    # fmt: on
    return tirx.PrimFunc(params, gemm.body).with_attrs({"global_symbol": name, "tirx.noalias": True,
                                                      TIRX_ATTR: "mma_smallm",
                                                      "tirx.is_scheduled": True})


def make_smallm_gemm(m: int, n: int, k: int, tile: SmallMTile = SmallMTile(), epilogue: str = "none",
                     dtype: str = "float16"):
    """C[m, n] = epilogue(A[m, k] @ B[n, k]^T (+ bias[n])) in `dtype` (fp16 or bf16), fp32 accumulation: the
    benchmark's kernel, parameters (A, B, bias, C)."""
    from tvmfuse.kernels.hopper.gemm_bench import bench_operands

    bufs, finish = bench_operands(m, n, k, epilogue, dtype)
    suffix = "" if dtype == "float16" else f"_{dtype}"
    return smallm_kernel(m, n, k, tile, bufs[0], bufs[1], bufs[3], finish, lambda row, col: (row, col), bufs,
                         f"smallm_gemm_{m}x{n}x{k}_{tile.n8}_{tile.warps}_{tile.vec}_{tile.unroll}_{epilogue}{suffix}")
