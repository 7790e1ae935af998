"""Hopper prefill attention kernel (sm_90a) in TIRx: Q, K and V tiles by TMA into a shared-memory ring guarded by
mbarriers, S = Q K^T and O += P V on wgmma with fp32 accumulators, the online softmax in registers.

One CTA: a loading warpgroup (one thread issues every TMA copy) and `consumers` computing warpgroups of 64 query rows
each, which read the same K/V stages. S comes from shared memory by descriptors (Q and K both K-major, 128-byte
swizzled as TMA writes them); P stays in registers, where the fp32 accumulator layout of S is the A-fragment layout of
the next wgmma (FlashAttention-3's identity), so only V is read from shared memory for P V, as an MN-major operand
(`trans_b`). Causal tiles past the diagonal are never loaded; only the tiles that cross it (and the last, ragged one)
test each score."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvmfuse.kernels.attention.common import LOG2E, NEG, at, ceil_div, packed, tshape
from tvmfuse.kernels.dependent_launch import dependent_launch
from tvmfuse.kernels.hopper.gemm_analysis import OPERAND_PTX
from tvmfuse.kernels.hopper.wgmma_gemm import (BAR_SRC, FENCE_SRC, LOADER_REGS, PAIR_STORES, REMOTE_ARRIVE_SRC,
                                                TIRX_ATTR, consumer_regs)
from tvmfuse.targets import SMS

#: keeps the compiler from reusing a P fragment register while the wgmma that reads it is in flight
FENCE_U32_SRC = ('__device__ __forceinline__ void tvmfuse_fence_u32(unsigned& r) '
                 '{ asm volatile("" : "+r"(r) :: "memory"); }')
#: (helper, source) per dtype: two fp32 probabilities rounded into one 32-bit A-fragment register, the first in the
#: low half (the lower column, as wgmma reads it)
PACKS = {
    "float16": ("tvmfuse_pack_half2", "__device__ __forceinline__ unsigned tvmfuse_pack_half2(float a, float b) "
                "{ __half2 h = __floats2half2_rn(a, b); return *reinterpret_cast<unsigned*>(&h); }"),
    "bfloat16": ("tvmfuse_pack_bf162", "__device__ __forceinline__ unsigned tvmfuse_pack_bf162(float a, float b) "
                 "{ __nv_bfloat162 h = __floats2bfloat162_rn(a, b); return *reinterpret_cast<unsigned*>(&h); }")}
ARRIVE_SRC = ('__device__ __forceinline__ void tvmfuse_bar_arrive(int id, int n) '
              '{ asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(n) : "memory"); }')
#: output layouts whose TMA store (`tma_store`) has run on a GPU, where it is on by default
TMA_STORE_LAYOUTS = ("BHSD", "BSHD")
#: 2^x by the SFU alone (`ex2.approx.ftz`, relative error 2^-22): exp2f adds range scaling around it, 2 FMULs an
#: element at each probability
EX2_SRC = ('__device__ __forceinline__ float tvmfuse_ex2(float x) '
           '{ float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }')
#: keeps the overlapped loop's softmax ahead of its `wgmma.wait_group 0`: register fences are empty asm that ptxas never
#: sees, and no register-only instruction is ordered with the wait (WARPGROUP.DEPBAR), so ptxas 13.0 scheduled it after
#: the row max, before all 64 EX2s (the causal loop's mask branch kept them apart), and P V overlapped nothing; shared
#: memory accesses stay on their side of it, so a store of the row sums (every probability adds into them), predicated
#: on a sum below zero (never: NaN compares false), pins every EX2 ahead of the wait for 4 instructions a tile
ANCHOR_SRC = ('__device__ __forceinline__ void tvmfuse_softmax_anchor(float* p, float x) '
              '{ asm volatile("{ .reg .pred p; setp.lt.f32 p, %1, 0f00000000; @p st.shared.f32 [%0], %1; }" '
              ':: "r"((unsigned)__cvta_generic_to_shared(p)), "f"(x) : "memory"); }')
TMA_4D = "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
TMA_MC = TMA_4D + ".multicast::cluster"
TMA_STORE = "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group"
# dynamic shared memory a knob set may take (a CTA may have 227 KB, 1 KB of it static here): 220 KB leaves out 128 keys
# in 3 stages (224 KB), behind 2 stages in all 9 cases of attention_run13/14, and 192 keys (224 KB), where ptxas
# spills and serializes the wgmmas (C7512)
MAX_SMEM = 220 * 1024
PANEL = 64  # elements of head dim per 128-byte swizzled shared-memory row (one TMA box, one wgmma K-major atom)


def tma_map(layout: str, batch: int, heads: int, seq: int, dim: int, rows: int, row: int | None = None):
    """The 4-D tensor map of a [B, H, S, D] tensor stored in `layout` (dims innermost first): the arguments of
    `runtime.cuTensorMapEncodeTiled` after the pointer (box: 64 elements of D x `rows` positions, 128-byte swizzle,
    zeros past the ends), and coords(b, h, pos, d0) -> the box's coordinates. `row`: BSHD positions that many
    elements apart (Q, K and V packed in one tensor's rows), not heads x dim."""
    order = {"BHSD": "dshb", "BSHD": "dhsb", "SBHD": "dhbs"}[layout]
    size = {"d": dim, "s": seq, "h": heads, "b": batch}
    dims = [size[x] for x in order]
    strides, run = [], 2
    for x, extent in zip(order, dims[:-1]):
        run = 2 * row if row is not None and x == "h" else run * extent  # packed: a position is a row apart
        strides.append(run)
    if row is not None and layout != "BSHD":
        raise ValueError(f"a row width for the packed BSHD layout only, not {layout}")
    box = [PANEL if x == "d" else rows if x == "s" else 1 for x in order]
    args = [*dims, *strides, *box, 1, 1, 1, 1, 0, 3, 3, 0]  # no interleave, 128B swizzle, 256B L2 promotion, zero fill

    def coords(b, h, pos, d0):
        return [{"d": d0, "s": pos, "h": h, "b": b}[x] for x in order]

    return args, coords


def smem_bytes(s: dict, knobs: dict) -> int:
    """Shared memory: the Q tile (64 rows a consumer; two with `chain`) and `stages` K and V tiles of block_n rows,
    2-byte elements."""
    q_tiles = 2 if knobs.get("chain") else 1
    return 2 * s["head_dim"] * (q_tiles * 64 * knobs["consumers"] + 2 * knobs["stages"] * knobs["block_n"])


def pairs_query_tiles(s: dict, consumers: int) -> bool:
    """Whether clusters of two neighbouring query tiles (of 64 * consumers rows) can share this shape's K and V: not
    causal (the pair reads the same K/V tiles), head dim 128 (one 64-wide panel a CTA), an even number of tiles."""
    return not s["causal"] and s["head_dim"] == 2 * PANEL and ceil_div(s["seq_q"], 64 * consumers) % 2 == 0


def wgmma_attention(s: dict, knobs: dict):
    """The TIRx PrimFunc (q, k, v, out) for static shapes `s` (no additive mask) and knobs (consumers, block_n,
    stages, setmaxnreg, overlap, batched, pingpong, cluster, persistent, order, chain).

    order 1: consecutive CTAs take consecutive query tiles of one head (with causality from its longest rows down),
    so the CTAs running at once read the K and V of a few heads from L2 (0: consecutive CTAs take the heads of one
    query tile, the longest causal rows first). persistent: one CTA an SM, each taking the query tiles bid, bid + grid, ...: the loader fetches the next
    tile's Q (once the last S of this one is done) and K/V while the consumers store this tile's output. chain
    (persistent, overlapped, no ping-pong, not causal): two Q buffers, so the next item's Q loads during this one,
    and the consumers issue the next item's first S right after this one's last P V, before they store this item's
    output (which then runs beside that S). cluster 2 (not causal, head dim 128, an even number of query tiles): the
    CTAs of two neighbouring query tiles of one head form a cluster, and each loads one 64-wide panel of every K and
    V tile and multicasts it to both (half the K/V bytes from L2)."""
    B, H, HKV, HV = s["batch"], s["heads"], s["kv_heads"], s["v_heads"]
    SQ, L, D, dt, causal = s["seq_q"], s["seq_k"], s["head_dim"], s["dtype"], s["causal"]
    G, GV = H // HKV, H // HV
    C, BN, S, regs = knobs["consumers"], knobs["block_n"], knobs["stages"], bool(knobs.get("setmaxnreg", 0))
    overlap = bool(knobs.get("overlap", 0))
    batched = bool(knobs.get("batched", 0)) and not overlap
    pingpong = bool(knobs.get("pingpong", 0)) and C == 2 and (overlap or batched)
    cluster = int(knobs.get("cluster", 1))
    persistent = bool(knobs.get("persistent", 0))
    if persistent and cluster != 1:
        raise ValueError("persistent CTAs take no clusters")
    chain = bool(knobs.get("chain", 0))
    if chain and not (persistent and overlap and not pingpong and not causal):
        # (with causality ptxas serializes every wgmma of the chained kernel: C7515, accumulators defined in a stage)
        raise ValueError("chain needs persistent CTAs, the overlapped loop without ping-pong, and no causality")
    # tma_store (not with persistent CTAs): each consumer writes its 64 rows of the output into its rows of Q's buffer
    # (free once its last S is done), 128-byte swizzled as TMA reads them, and one thread stores each 64-wide panel by
    # TMA: whole lines, asynchronous, where the half2 stores from registers (tma_store=0) write 16 bytes of a row each;
    # non-causal 2048 129.0 -> 123.6 µs (attention_run16.json). On by default for the layouts it has run with on a
    # GPU: BHSD, and the models' head-merged BSHD (gpu_tests_run45.txt)
    if knobs.get("tma_store") and persistent:
        raise ValueError("tma_store stages the output in Q's buffer, which persistent CTAs load the next Q into")
    tma_store = bool(knobs.get("tma_store", s["out_layout"] in TMA_STORE_LAYOUTS)) and not persistent
    order = int(knobs.get("order", 0))
    if order not in (0, 1):
        raise ValueError(f"order {order}: 0 (heads first) or 1 (query tiles first)")
    # a diagnostic, never in the knob space (bench/attention.py --ablate): "softmax" leaves S as it is for P (no max,
    # exponentials or sums), "pv" issues no P V wgmma; the output is then wrong, the time says what the part costs
    ablate = knobs.get("ablate", "")
    if ablate not in ("", "softmax", "pv"):
        raise ValueError(f"ablate {ablate!r}: '', 'softmax' or 'pv'")
    BM, P = 64 * C, D // PANEL
    QT, KT = ceil_div(SQ, BM), ceil_div(L, BN)
    if cluster == 2 and not pairs_query_tiles(s, C):
        raise ValueError(f"cluster 2 needs non-causal attention, head dim {2 * PANEL} and an even number of "
                         f"{BM}-row query tiles (causal={causal}, head_dim={D}, {QT} tiles)")
    qs = float(s["scale"] * LOG2E)
    ab = OPERAND_PTX[dt]
    s_n, o_n = BN // 2, D // 2  # fp32 accumulators a thread holds: S (m64 x BN), O (m64 x D)
    q_elems, kv_elems = BM * D, BN * D
    QB = 2 if chain else 1  # Q buffers: item ti reads buffer ti % QB
    if smem_bytes(s, knobs) > MAX_SMEM:
        raise ValueError(f"{QB} Q buffers and {S} stages of {BN} keys take more than {MAX_SMEM} bytes of shared memory")
    # tail (overlapped, not causal, L not a multiple of BN): the last K/V tile's softmax and P V over the keys it has
    # (rounded up to 16; TMA zero-fills the rest), not BN: at 2048 keys a 176-key tile otherwise spends 64 of its last
    # 176 on zeros. Its S stays BN wide: with a narrower wgmma for it ptxas serializes every wgmma of some sets (C7511,
    # 176 keys at 2048 and 8192), as it does with this tail in the loops that are not overlapped.
    LAST = min(BN, ceil_div(L - (KT - 1) * BN, 16) * 16)
    tail = bool(knobs.get("tail", 1)) and overlap and not causal and LAST < BN
    LAST = LAST if tail else BN
    mma_s = f"wgmma.mma_async.sync.aligned.m64n{BN}k16.f32.{ab}.{ab}"
    mma_o = f"wgmma.mma_async.sync.aligned.m64n{D}k16.f32.{ab}.{ab}"
    pack, pack_src = PACKS[dt]
    store, store_src = PAIR_STORES[dt]
    lq, lk, lv, lo = s["q_layout"], s["k_layout"], s["v_layout"], s["out_layout"]
    Q, K, V, O = (tirx.decl_buffer(tshape(lay, B, heads, n, D), dt, nm, data_alignment=16) for nm, lay, heads, n in
                  (("q", lq, H, SQ), ("k", lk, HKV, L), ("v", lv, HV, L), ("out", lo, H, SQ)))
    width, offsets = packed(s) or (None, None)
    params, (q_ptr, k_ptr, v_ptr) = [Q, K, V, O], (Q.data, K.data, V.data)
    if width is not None:  # one [B, S, width] tensor holds Q, K and V: each map starts at its offset in a row
        QKV = tirx.decl_buffer((B, SQ, width), dt, "qkv", data_alignment=16)
        params = [QKV, O]
        q_ptr, k_ptr, v_ptr = (tirx.address_of(tirx.BufferLoad(QKV, [0, 0, off])) for off in offsets)
    q_args, q_at = tma_map(lq, B, H, SQ, D, BM, width)
    k_args, k_at = tma_map(lk, B, HKV, L, D, BN, width)
    v_args, v_at = tma_map(lv, B, HV, L, D, BN, width)
    o_args, o_at = tma_map(lo, B, H, SQ, D, 64)  # tma_store: one consumer's 64 rows a box

    TILES = QT * B * H
    GRID = min(TILES, SMS) if persistent else TILES  # CTAs

    def tile_of(t):
        """(query tile, batch, head) of work item t: the longest causal rows first; in a cluster (CTAs 2i, 2i + 1)
        the query tiles 2j, 2j + 1 of one head; order 1: query tiles first (pairs them too, QT being even), with
        causality each head's longest first."""
        if order:  # with causality the longest rows of each head first
            return (QT - 1 - t % QT if causal else t % QT), t // QT // H, t // QT % H
        if cluster == 1:
            return QT - 1 - t // (B * H), t % (B * H) // H, t % H
        return t // (2 * B * H) * 2 + t % 2, t // 2 % (B * H) // H, t // 2 % H

    def kv_tiles(qt):
        """K/V tiles query tile qt reads: up to its last row's diagonal when causal, else all."""
        return T.min(ceil_div((qt + 1) * BM, BN), KT) if causal else KT

    def full_tiles(qt):
        """K/V tiles of query tile qt at the full width BN: all but the tail tile (with `tail`)."""
        return max(KT - 1, 1) if tail else kv_tiles(qt)  # (1: an empty loop, where the tail is tile 0)

    W0 = LAST if KT == 1 else BN  # tile 0's width

    def needs_mask(qt, jt):
        """Whether tile jt has a score query tile qt must not see: it crosses the diagonal, or runs past L."""
        cross = (jt + 1) * BN - 1 > qt * BM if causal else False
        ragged = jt == KT - 1 if L % BN and not tail else False  # (with `tail` the tail tile alone, by its width)
        return T.Or(cross, ragged) if causal and L % BN else cross if causal else ragged

    def seen(row, col):
        shown = col <= row if causal else None
        inside = col < L if L % BN else None
        both = [c for c in (shown, inside) if c is not None]
        return both[0] if len(both) == 1 else T.And(both[0], both[1])

    def ex2(x):
        return T.cuda.func_call("tvmfuse_ex2", x, source_code=EX2_SRC, return_type="float32")

    pdl = dependent_launch()  # kernels.dependent_launch
    # fmt: off
    @T.macro
    def logits(sacc, st, qt, jt, cw, warp, lane, masked, width):
        """S of tile jt -> base-2 probabilities in place (masked: the scores the rows must not see at NEG first),
        the running max and the row sums rescaled; st: m0 m1 l0 l1 mx0 mx1 alpha0 alpha1 (rows lane / 4, + 8). The
        max is taken over the unscaled scores (the scale is positive), so each probability is one FFMA and an EX2:
        exp2(s * scale * log2(e) - max * scale * log2(e)). Only the first `width` columns (the tail tile's S holds no
        more)."""
        for i in T.unroll(2):
            st[4 + i] = st[i]
        for j in T.unroll(width // 8):
            for i in T.unroll(2):
                for c in T.unroll(2):
                    if masked:
                        sacc[j * 4 + i * 2 + c] = T.Select(
                            seen(qt * BM + cw * 64 + warp * 16 + lane // 4 + i * 8, jt * BN + j * 8 + lane % 4 * 2 + c),
                            sacc[j * 4 + i * 2 + c], T.float32(NEG))
                    st[4 + i] = T.max(st[4 + i], sacc[j * 4 + i * 2 + c])
        for i in T.unroll(2):
            st[4 + i] = T.cuda.warp_max(st[4 + i], width=4)
            st[6 + i] = ex2((st[i] - st[4 + i]) * T.float32(qs))
            st[i] = st[4 + i]
            st[2 + i] = st[2 + i] * st[6 + i]
            st[4 + i] = st[i] * T.float32(qs)
        for j in T.unroll(width // 8):
            for i in T.unroll(2):
                for c in T.unroll(2):
                    sacc[j * 4 + i * 2 + c] = ex2(sacc[j * 4 + i * 2 + c] * T.float32(qs) - st[4 + i])
                    st[2 + i] = st[2 + i] + sacc[j * 4 + i * 2 + c]

    @T.macro
    def rescale_and_pack(sacc, o, st, pa, width):
        """O times each row's alpha (its sum so far at the new max), and the probabilities (`width` of them a row) as
        A fragments."""
        for n in T.unroll(D // 8):
            for i in T.unroll(2):
                for c in T.unroll(2):
                    o[n * 4 + i * 2 + c] = o[n * 4 + i * 2 + c] * st[6 + i]
        for r in T.unroll(width // 4):
            pa[r] = T.cuda.func_call(pack, sacc[2 * r], sacc[2 * r + 1], source_code=pack_src, return_type="uint32")

    @T.macro
    def softmax(sacc, o, st, pa, qt, jt, cw, warp, lane, width):
        """`logits` of tile jt, masked only where it crosses the diagonal or runs past L."""
        if ablate == "softmax":
            T.evaluate(0)
        elif width < BN:  # the tail tile: runs past L
            logits(sacc, st, qt, jt, cw, warp, lane, True, width)
        elif needs_mask(qt, jt):
            logits(sacc, st, qt, jt, cw, warp, lane, True, width)
        else:
            logits(sacc, st, qt, jt, cw, warp, lane, False, width)

    @T.macro
    def fence_s(sacc, width):
        """S's registers (its first `width` columns) pinned: the compiler moves none of them across an in-flight
        group."""
        for i in T.unroll(width // 2):
            T.cuda.func_call("tvmfuse_fence_acc", sacc[i], source_code=FENCE_SRC)

    @T.macro
    def fence_pv(o, pa, width):
        """The registers P V reads or writes pinned: O, and P (its first `width` columns)."""
        for i in T.unroll(o_n):
            T.cuda.func_call("tvmfuse_fence_acc", o[i], source_code=FENCE_SRC)
        for r in T.unroll(width // 4):
            T.cuda.func_call("tvmfuse_fence_u32", pa[r], source_code=FENCE_U32_SRC)

    @T.macro
    def fence(sacc, o, pa, width=BN):
        """The registers wgmma reads or writes, pinned: the compiler moves none of them across an in-flight group (of
        S and P, the first `width` columns)."""
        fence_s(sacc, width)
        fence_pv(o, pa, width)

    @T.macro
    def issue_s(sacc, Qs, Ks, k_full, desc_q, desc_k, jt, cw, qb):
        """S = Q K^T of tile jt (its K stage full) with Q buffer qb, committed as one wgmma group: K-major Q and K, 16
        of head dim a step, 4 steps a 64-wide panel; the first step overwrites S."""
        T.cuda.mbarrier_wait(T.address_of(k_full[jt % S]), jt // S % 2)
        for kk in T.unroll(D // 16):
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_q), T.address_of(Qs[qb * q_elems + kk // 4 * BM * PANEL + cw * 64 * PANEL + kk % 4 * 16]), 1, 64, 3)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_k), T.address_of(Ks[jt % S, kk // 4 * BN * PANEL + kk % 4 * 16]), 1, 64, 3)
            T.ptx[mma_s](*[sacc[i] for i in range(s_n)], desc_q, desc_k, kk > 0, 1, 1, 0, 0)
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def issue_pv(o, pa, Vs, v_full, desc_v, jt, width):
        """O += P V of tile jt (its V stage full), committed as one wgmma group: P from registers, V MN-major, 16
        keys (rows) a step (the first `width` keys), its 64-wide panels BN rows apart."""
        T.cuda.mbarrier_wait(T.address_of(v_full[jt % S]), jt // S % 2)
        for kk in T.unroll(width // 16):
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_v), T.address_of(Vs[jt % S, kk * 16 * PANEL]), BN * PANEL * 2 // 16, 64, 3)
            if ablate != "pv":
                T.ptx[mma_o](*[o[i] for i in range(o_n)], pa[kk * 4], pa[kk * 4 + 1], pa[kk * 4 + 2], pa[kk * 4 + 3], desc_v, T.bool(True), 1, 1, 1)
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def my_turn(cw):
        """Ping-pong: wait until the other consumer has issued its GEMMs (named barrier 1 + cw, both warpgroups)."""
        if pingpong:
            T.cuda.func_call("tvmfuse_bar_sync", 1 + cw, 256, source_code=BAR_SRC)

    @T.macro
    def their_turn(cw, last):
        """Ping-pong: this consumer's GEMMs are issued, the other's may go (its barrier); consumer 1's last issue
        has no turn of consumer 0 after it, so it does not arrive (every barrier ends complete)."""
        if pingpong:
            if not last:
                T.cuda.func_call("tvmfuse_bar_arrive", 2 - cw, 256, source_code=ARRIVE_SRC)
            else:
                if cw == 0:
                    T.cuda.func_call("tvmfuse_bar_arrive", 2, 256, source_code=ARRIVE_SRC)

    @T.macro
    def release(empty, jt, lane, rank):
        """Every warp past its reads of tile jt's K (or V) stage (lane 0 of each arrives on `empty`, k_empty or
        v_empty): the loader may refill it; in a cluster both loaders write into it, so each hears from both CTAs'
        warps. K and V are released apart, K as soon as S is done: with one barrier for both, overlapped or batched
        loops (P V a tile behind S) held each stage a tile longer, and with 2 stages the next K was not loaded in
        time (the loops without a softmax took 21% longer than in turn, `attention_run7_ablate.json`)."""
        if lane == 0:
            T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[jt % S]))
            if cluster == 2:
                T.cuda.func_call("tvmfuse_arrive_cluster", T.address_of(empty[jt % S]), 1 - rank,
                                 source_code=REMOTE_ARRIVE_SRC)

    @T.macro
    def q_done(q_empty, lane, qb):
        """Persistent: this warp's last S of the work item is done, so the loader may load Q buffer qb again."""
        if persistent:
            if lane == 0:
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(q_empty[qb]))

    @T.macro
    def overlapped_tile(sacc, o, st, pa, Qs, Ks, Vs, k_full, v_full, k_empty, v_empty, desc_q, desc_k, desc_v, anchor,
                        g0, jt, qt, qb, cw, warp, lane, rank, width):
        """Overlapped or batched, tile jt (0 < jt): its S issued with tile jt - 1's P V, then its softmax (of its first
        `width` columns) while P V runs (overlapped) or after both (batched)."""
        fence(sacc, o, pa)  # (P of tile jt - 1: every column)
        my_turn(cw)
        T.ptx.wgmma.fence.sync.aligned()
        issue_s(sacc, Qs, Ks, k_full, desc_q, desc_k, g0 + jt, cw, qb)
        issue_pv(o, pa, Vs, v_full, desc_v, g0 + jt - 1, BN)
        their_turn(cw, False)
        if overlap:
            T.ptx.wgmma.wait_group.sync.aligned(1)  # S of tile jt is done; P V of jt - 1 may still run
            fence_s(sacc, width)
            release(k_empty, g0 + jt, lane, rank)
            softmax(sacc, o, st, pa, qt, jt, cw, warp, lane, width)
            T.cuda.func_call("tvmfuse_softmax_anchor", T.address_of(anchor[0]), st[2] + st[3], source_code=ANCHOR_SRC)
            T.ptx.wgmma.wait_group.sync.aligned(0)
            fence(sacc, o, pa, width)
            release(v_empty, g0 + jt - 1, lane, rank)
        else:
            T.ptx.wgmma.wait_group.sync.aligned(0)
            fence(sacc, o, pa, width)
            release(k_empty, g0 + jt, lane, rank)
            release(v_empty, g0 + jt - 1, lane, rank)
            softmax(sacc, o, st, pa, qt, jt, cw, warp, lane, width)
        rescale_and_pack(sacc, o, st, pa, width)

    @T.macro
    def tile_in_turn(sacc, o, st, pa, Qs, Ks, Vs, k_full, v_full, k_empty, v_empty, desc_q, desc_k, desc_v, g0, jt, qt,
                     qb, cw, warp, lane, rank):
        """Tile jt's S, softmax and P V, each waited for before the next."""
        fence(sacc, o, pa)
        T.ptx.wgmma.fence.sync.aligned()
        issue_s(sacc, Qs, Ks, k_full, desc_q, desc_k, g0 + jt, cw, qb)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        fence(sacc, o, pa)
        release(k_empty, g0 + jt, lane, rank)
        softmax(sacc, o, st, pa, qt, jt, cw, warp, lane, BN)
        rescale_and_pack(sacc, o, st, pa, BN)
        fence(sacc, o, pa)
        T.ptx.wgmma.fence.sync.aligned()
        issue_pv(o, pa, Vs, v_full, desc_v, g0 + jt, BN)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        fence(sacc, o, pa)
        release(v_empty, g0 + jt, lane, rank)

    @T.prim_func(check_well_formed=False)
    def attention():
        q_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", q_map, dt, 4, q_ptr, *q_args)
        k_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", k_map, dt, 4, k_ptr, *k_args)
        v_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", v_map, dt, 4, v_ptr, *v_args)
        if tma_store:
            o_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", o_map, dt, 4, O.data, *o_args)

        T.device_entry()
        if cluster == 2:
            rank = T.cta_id_in_cluster([2])
        else:
            rank = T.meta_var(0)
        bid = T.cta_id([GRID])
        tx = T.thread_id([128 * (1 + C)])
        arena = T.alloc_buffer((QB * q_elems + 2 * S * kv_elems,), dt, scope="shared.dyn", align=1024)
        Qs = T.decl_buffer((QB * q_elems,), dt, data=arena.data, scope="shared.dyn")  # [buffer, panel, BM rows, 64]
        Ks = T.decl_buffer((S, kv_elems), dt, data=arena.data, elem_offset=QB * q_elems, scope="shared.dyn")
        Vs = T.decl_buffer((S, kv_elems), dt, data=arena.data, elem_offset=QB * q_elems + S * kv_elems, scope="shared.dyn")
        q_full = T.alloc_shared((QB,), "uint64")
        q_empty = T.alloc_shared((QB,), "uint64")  # persistent: the consumers' last S of an item read its Q buffer
        k_full = T.alloc_shared((S,), "uint64")
        v_full = T.alloc_shared((S,), "uint64")
        k_empty = T.alloc_shared((S,), "uint64")
        v_empty = T.alloc_shared((S,), "uint64")
        sacc = T.alloc_local((s_n,), "float32")
        o = T.alloc_local((o_n,), "float32")
        pa = T.alloc_local((BN // 4,), "uint32")
        st = T.alloc_local((8,), "float32")
        desc_q: T.uint64
        desc_k: T.uint64
        desc_v: T.uint64
        gacc = T.alloc_local((1,), "int32")  # persistent: K/V tiles of this CTA's earlier work items (stage counter)
        if overlap:
            anchor = T.alloc_shared((1,), "float32")  # never written (ANCHOR_SRC)
        else:
            anchor = T.meta_var(None)  # (the batched loops share overlapped_tile, which reads it only when overlapped)
        cw = T.meta_var(tx // 128 - 1)
        warp = T.meta_var(tx % 128 // 32)
        lane = T.meta_var(tx % 32)
        items = T.meta_var((TILES - bid + GRID - 1) // GRID if persistent else 1)  # work items of this CTA

        if tx == 0:
            T.ptx.prefetch.tensormap(T.address_of(q_map))  # the descriptors on their way before the first TMA
            T.ptx.prefetch.tensormap(T.address_of(k_map))
            T.ptx.prefetch.tensormap(T.address_of(v_map))
            for qb in T.unroll(QB):
                T.ptx.mbarrier.init.shared.b64(T.address_of(q_full[qb]), T.uint32(1))
                if persistent:
                    T.ptx.mbarrier.init.shared.b64(T.address_of(q_empty[qb]), T.uint32(4 * C))
            for i in T.unroll(S):
                T.ptx.mbarrier.init.shared.b64(T.address_of(k_full[i]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(T.address_of(v_full[i]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(T.address_of(k_empty[i]), T.uint32(4 * C * cluster))
                T.ptx.mbarrier.init.shared.b64(T.address_of(v_empty[i]), T.uint32(4 * C * cluster))
        T.ptx.fence.proxy.async_.shared__cta()
        if cluster == 2:  # the other CTA arrives on these barriers and its multicasts complete on them
            T.ptx.fence.mbarrier_init.release.cluster()
            T.cuda.cluster_sync()
        else:
            T.cuda.cta_sync()
        if pdl:  # the kernel before has finished and its writes are seen; the next may launch
            T.ptx.griddepcontrol.wait()
            T.ptx.griddepcontrol.launch_dependents()
        if tx < 128:
            if regs:
                T.ptx["setmaxnreg.dec.sync.aligned.u32"](LOADER_REGS)
            if tx == 0:
                if persistent:
                    gacc[0] = 0
                for ti in T.serial(items):
                    qt, b, hd = T.meta_var(tile_of(bid + ti * GRID))
                    g0 = T.meta_var(gacc[0] if persistent else 0)
                    if persistent:  # Q's buffer is free once the consumers' last S of the item QB before is done
                        if ti >= QB:
                            T.cuda.mbarrier_wait(T.address_of(q_empty[ti % QB]), (ti - QB) // QB % 2)
                    T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(q_full[ti % QB]), T.uint32(q_elems * 2))
                    for p in T.unroll(P):
                        T.ptx[TMA_4D](T.address_of(Qs[ti % QB * q_elems + p * BM * PANEL]), T.address_of(q_map), *q_at(b, hd, qt * BM, p * PANEL), T.address_of(q_full[ti % QB]))
                    for jt in T.serial(kv_tiles(qt)):
                        if g0 + jt >= S:
                            T.cuda.mbarrier_wait(T.address_of(k_empty[(g0 + jt) % S]), ((g0 + jt) // S + 1) % 2)
                        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(k_full[(g0 + jt) % S]), T.uint32(kv_elems * 2))
                        if cluster == 2:  # this CTA's panel, to the same place in both CTAs
                            T.ptx[TMA_MC](T.address_of(Ks[(g0 + jt) % S, rank * BN * PANEL]), T.address_of(k_map), *k_at(b, hd // G, jt * BN, rank * PANEL), T.address_of(k_full[(g0 + jt) % S]), T.uint16(3))
                        else:
                            for p in T.unroll(P):
                                T.ptx[TMA_4D](T.address_of(Ks[(g0 + jt) % S, p * BN * PANEL]), T.address_of(k_map), *k_at(b, hd // G, jt * BN, p * PANEL), T.address_of(k_full[(g0 + jt) % S]))
                        if g0 + jt >= S:
                            T.cuda.mbarrier_wait(T.address_of(v_empty[(g0 + jt) % S]), ((g0 + jt) // S + 1) % 2)
                        T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(v_full[(g0 + jt) % S]), T.uint32(kv_elems * 2))
                        if cluster == 2:
                            T.ptx[TMA_MC](T.address_of(Vs[(g0 + jt) % S, rank * BN * PANEL]), T.address_of(v_map), *v_at(b, hd // GV, jt * BN, rank * PANEL), T.address_of(v_full[(g0 + jt) % S]), T.uint16(3))
                        else:
                            for p in T.unroll(P):
                                T.ptx[TMA_4D](T.address_of(Vs[(g0 + jt) % S, p * BN * PANEL]), T.address_of(v_map), *v_at(b, hd // GV, jt * BN, p * PANEL), T.address_of(v_full[(g0 + jt) % S]))
                    if persistent:
                        gacc[0] = gacc[0] + kv_tiles(qt)
        else:
            if regs:
                T.ptx["setmaxnreg.inc.sync.aligned.u32"](consumer_regs(C))
            if persistent:
                gacc[0] = 0
            if chain:  # the first item's first S; each item issues the next one's after its last P V
                T.cuda.mbarrier_wait(T.address_of(q_full[0]), 0)
                fence(sacc, o, pa)
                T.ptx.wgmma.fence.sync.aligned()
                issue_s(sacc, Qs, Ks, k_full, desc_q, desc_k, 0, cw, 0)
            for ti in T.serial(items):
                qt, b, hd = T.meta_var(tile_of(bid + ti * GRID))
                g0 = T.meta_var(gacc[0] if persistent else 0)
                if not chain:
                    for i in T.unroll(o_n):
                        o[i] = T.float32(0)
                for i in T.unroll(2):
                    st[i] = T.float32(NEG)
                    st[2 + i] = T.float32(0)
                    st[6 + i] = T.float32(1)  # alpha (set by each tile's softmax; ablate "softmax" keeps this one)
                if not chain:  # (chained: waited for before this item's first S, issued by the item before)
                    T.cuda.mbarrier_wait(T.address_of(q_full[ti % QB]), ti // QB % 2)
                # P V of tile jt - 1 issued with S of tile jt, then overlapped: the softmax of jt runs while P V does;
                # batched: both waited for, then the softmax (one wait a tile, not two)
                if overlap or batched:
                    if pingpong:  # consumer 0 issues first; then they take turns, one's softmax beside the other's GEMMs
                        if cw == 1:
                            T.cuda.func_call("tvmfuse_bar_arrive", 1, 256, source_code=ARRIVE_SRC)
                    if not chain:
                        my_turn(cw)
                        T.ptx.wgmma.fence.sync.aligned()
                        issue_s(sacc, Qs, Ks, k_full, desc_q, desc_k, g0, cw, ti % QB)
                        their_turn(cw, False)
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    if chain:  # O is zeroed once no wgmma is in flight (ptxas serializes every wgmma otherwise)
                        for i in T.unroll(o_n):
                            o[i] = T.float32(0)
                    fence(sacc, o, pa)
                    release(k_empty, g0, lane, rank)
                    softmax(sacc, o, st, pa, qt, 0, cw, warp, lane, W0)
                    rescale_and_pack(sacc, o, st, pa, W0)
                    for jt in T.serial(1, full_tiles(qt)):
                        overlapped_tile(sacc, o, st, pa, Qs, Ks, Vs, k_full, v_full, k_empty, v_empty, desc_q, desc_k,
                                        desc_v, anchor, g0, jt, qt, ti % QB, cw, warp, lane, rank, BN)
                    if tail and KT > 1:
                        overlapped_tile(sacc, o, st, pa, Qs, Ks, Vs, k_full, v_full, k_empty, v_empty, desc_q, desc_k,
                                        desc_v, anchor, g0, KT - 1, qt, ti % QB, cw, warp, lane, rank, LAST)
                    q_done(q_empty, lane, ti % QB)
                    fence(sacc, o, pa)
                    my_turn(cw)
                    T.ptx.wgmma.fence.sync.aligned()
                    issue_pv(o, pa, Vs, v_full, desc_v, g0 + kv_tiles(qt) - 1, LAST)
                    their_turn(cw, True)
                    if chain:  # the next item's first S runs beside this one's last P V and output store
                        if ti + 1 < items:
                            T.cuda.mbarrier_wait(T.address_of(q_full[(ti + 1) % QB]), (ti + 1) // QB % 2)
                            T.ptx.wgmma.fence.sync.aligned()
                            issue_s(sacc, Qs, Ks, k_full, desc_q, desc_k, g0 + kv_tiles(qt), cw, (ti + 1) % QB)
                            T.ptx.wgmma.wait_group.sync.aligned(1)
                        else:
                            T.ptx.wgmma.wait_group.sync.aligned(0)
                        fence_pv(o, pa, BN)  # P V is done; S may still run: its registers are not touched
                    else:
                        T.ptx.wgmma.wait_group.sync.aligned(0)
                        fence(sacc, o, pa)
                    release(v_empty, g0 + kv_tiles(qt) - 1, lane, rank)
                else:  # each tile's S, softmax and P V in turn
                    for jt in T.serial(kv_tiles(qt)):
                        tile_in_turn(sacc, o, st, pa, Qs, Ks, Vs, k_full, v_full, k_empty, v_empty, desc_q, desc_k,
                                     desc_v, g0, jt, qt, ti % QB, cw, warp, lane, rank)
                    q_done(q_empty, lane, ti % QB)
                for i in T.unroll(2):  # one division a row, then products: 64 IEEE divisions cost ~10 instructions each
                    st[2 + i] = T.float32(1) / T.cuda.warp_sum(st[2 + i], width=4)
                if tma_store:
                    for n in T.unroll(D // 8):  # row r, 16-byte chunk n % 8 of panel n // 8 -> chunk (n % 8) ^ (r % 8)
                        for i in T.unroll(2):
                            r = T.meta_var(cw * 64 + warp * 16 + lane // 4 + i * 8)
                            T.cuda.func_call(store, T.address_of(Qs[n // 8 * BM * PANEL + r * PANEL + (n % 8 ^ lane // 4) * 8 + lane % 4 * 2]),
                                             o[n * 4 + i * 2] * st[2 + i], o[n * 4 + i * 2 + 1] * st[2 + i],
                                             source_code=store_src)
                    T.ptx.fence.proxy.async_.shared__cta()  # the writes, visible to the TMA engine
                    T.cuda.func_call("tvmfuse_bar_sync", 3 + cw, 128, source_code=BAR_SRC)
                    if tx % 128 == 0:
                        for p in T.unroll(P):  # rows past seq_q are clipped by the tensor map
                            T.ptx[TMA_STORE](T.address_of(o_map), *o_at(b, hd, qt * BM + cw * 64, p * PANEL),
                                             T.address_of(Qs[p * BM * PANEL + cw * 64 * PANEL]))
                        T.ptx["cp.async.bulk.commit_group"]()
                        T.ptx["cp.async.bulk.wait_group.read"](0)  # the buffer is read before the CTA leaves
                else:
                    for n in T.unroll(D // 8):
                        for i in T.unroll(2):
                            row = T.meta_var(qt * BM + cw * 64 + warp * 16 + lane // 4 + i * 8)
                            if row < SQ:  # TVM drops the guard where the tiles divide seq_q
                                T.cuda.func_call(store, T.address_of(O[at(lo, b, hd, row, n * 8 + lane % 4 * 2)]),
                                                 o[n * 4 + i * 2] * st[2 + i], o[n * 4 + i * 2 + 1] * st[2 + i],
                                                 source_code=store_src)
                if persistent:
                    gacc[0] = gacc[0] + kv_tiles(qt)
        if cluster == 2:  # neither CTA exits while the other may still multicast into it or arrive on its barriers
            T.cuda.cluster_sync()
    # fmt: on
    return tirx.PrimFunc(params, attention.body).with_attrs(
        {"global_symbol": "main", "tirx.noalias": True, TIRX_ATTR: "wgmma_attention", "tirx.is_scheduled": True})
