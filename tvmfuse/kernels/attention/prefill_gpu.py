"""Prefill template's CUDA kernel: mma.sync m16n8k16 tensor cores, ldmatrix fragments, fp32 online softmax,
K/V tiles in shared memory (synchronous, or cp.async double-buffered), per-warp m-tiles; with an additive mask,
K/V tiles whose mask block is all -inf (a causal mask's upper triangle) skip their math. With a symbolic query or
KV length (an in-place KV cache step: one kernel for every length) the tiles are ragged: loads past the end read
the last row (no out-of-bounds access), keys past L weigh nothing, rows past seq_q are not stored."""

from __future__ import annotations

from tvm.script import tirx as T

from tvmfuse.kernels.attention.common import NEG, at, ceil_div, dims, extents, q_dtype, template_func
from tvmfuse.kernels.attention.prefill_knobs import STATIC_SMEM, smem_bytes
from tvmfuse.kernels.attention.prefill_logits import logit_rules, mask_index


def gpu_kernel(s: dict, knobs: dict):
    """The CUDA PrimFunc (q, k, v[, mask], out) for these shapes and knobs (warps, block_n, m_tiles, stages,
    q_smem)."""
    ext = extents(s)
    return template_func(s, ext, gpu_body(s, knobs, ext), "gpu", gpu=True, v_heads=s["v_heads"])


def gpu_body(s: dict, knobs: dict, ext: dict):
    """The kernel as a TVMScript macro over (q, k, v, mask, out), with the sizes `ext` (the step template calls
    it in its many-token branch)."""
    B, HQ, HKV, SQ, L, D, dt, _ = dims(s, ext)
    G, GV, causal = HQ // HKV, HQ // s["v_heads"], s["causal"]
    lq, lk, lv, lo = s["q_layout"], s["k_layout"], s["v_layout"], s["out_layout"]
    mdt = s.get("mask_dtype", dt)
    W, BN, MT, S = knobs["warps"], knobs["block_n"], knobs.get("m_tiles", 1), knobs.get("stages", 1)
    QS = bool(knobs.get("q_smem", 0))
    BM, NT, PAD = 16 * W * MT, 32 * W, 8
    SMEM = "shared" if smem_bytes(s, knobs) <= STATIC_SMEM else "shared.dyn"
    ab = "bf16" if dt == "bfloat16" else "fp16"
    ragged_q, ragged_k = not isinstance(SQ, int), not isinstance(L, int)
    _, visible, alive, logit, final = logit_rules(s, SQ)
    masked, mi = s["mask"] == "additive", mask_index(s)
    _, _, alive0, logit0, _ = logit_rules(dict(s, mask="none"), SQ)  # for a tile whose mask block is all 0
    MV = 4 if mdt == "float32" else 8  # mask values per 16-byte load (one by one at a symbolic KV length)
    QT, KT = ceil_div(SQ, BM), ceil_div(L, BN)  # query tiles, K/V tiles

    def kv_tiles(qt):
        """K/V tiles query tile qt reads: up to its last row's diagonal when causal, else all."""
        if not causal:
            return KT
        return T.min(ceil_div((qt + 1) * BM, BN), KT) if ragged_k else ceil_div((qt + 1) * BM, BN)

    def qrow(r):
        """Query row r as read (the last row past seq_q: loaded, never stored)."""
        return T.min(r, SQ - 1) if ragged_q else r

    def krow(j):
        """Key row j as read (the last key past L: loaded, weighed 0)."""
        return T.min(j, L - 1) if ragged_k else j

    def qval(x):
        """A Q value in the compute dtype (an fp32 Q rounded, as the graph's cast before Q K^T does)."""
        return x if q_dtype(s) == dt else T.Cast(dt, x)

    def stored(r):
        """Whether query row r is stored (below seq_q)."""
        return r < SQ if ragged_q else True

    def qoff(t, kk):
        """Where m-tile t's Q fragment for k-step kk sits in qa: all in registers, or the one just loaded."""
        return t * 8 if QS else t * (D // 2) + kk * 8

    def seen(diag, r, c):
        """Whether score (r, c) counts: a key below L, and on a diagonal tile one the causal mask shows."""
        shown = visible(r, c) if diag else True
        return (c < L if shown is True else T.And(shown, c < L)) if ragged_k else shown

    @T.macro
    def softmax_tile(diag, plain, sa, pa, oa, st, mask, b, h, r0, c0, jt):
        """Scores -> running max, rescale, probabilities of one K/V tile; `diag`: the tile crosses the causal
        diagonal (only then is each score tested against it); `plain`: its mask block is all 0 (not read)."""
        for t in T.unroll(MT):
            for i in T.unroll(2):
                st[t * 10 + 4 + i] = st[t * 10 + i]
            for j in T.unroll(BN // 8):
                for c in T.unroll(4):
                    st[t * 10 + 8 + c // 2] = T.max(st[t * 10 + 8 + c // 2], T.if_then_else(
                        seen(diag, r0 + t * 16 * W + c // 2 * 8, jt * BN + j * 8 + c0 + c % 2),
                        (alive0 if plain else alive)(sa[t * (BN // 2) + j * 4 + c], mask, b, h, r0 + t * 16 * W + c // 2 * 8, jt * BN + j * 8 + c0 + c % 2),
                        T.float32(0)))
                    sa[t * (BN // 2) + j * 4 + c] = T.if_then_else(
                        seen(diag, r0 + t * 16 * W + c // 2 * 8, jt * BN + j * 8 + c0 + c % 2),
                        (logit0 if plain else logit)(sa[t * (BN // 2) + j * 4 + c], mask, b, h, r0 + t * 16 * W + c // 2 * 8, jt * BN + j * 8 + c0 + c % 2),
                        T.float32(NEG))
                    st[t * 10 + 4 + c // 2] = T.max(st[t * 10 + 4 + c // 2], sa[t * (BN // 2) + j * 4 + c])
            for i in T.unroll(2):
                st[t * 10 + 4 + i] = T.cuda.warp_max(st[t * 10 + 4 + i], width=4)
                st[t * 10 + 6 + i] = T.exp2(st[t * 10 + i] - st[t * 10 + 4 + i])
                st[t * 10 + 2 + i] = st[t * 10 + 2 + i] * st[t * 10 + 6 + i]
                st[t * 10 + i] = st[t * 10 + 4 + i]
            for j in T.unroll(BN // 8):
                for c in T.unroll(4):
                    sa[t * (BN // 2) + j * 4 + c] = T.exp2(sa[t * (BN // 2) + j * 4 + c] - st[t * 10 + c // 2])
                    st[t * 10 + 2 + c // 2] = st[t * 10 + 2 + c // 2] + sa[t * (BN // 2) + j * 4 + c]
                    pa[t * (BN // 2) + j * 4 + c] = T.Cast(dt, sa[t * (BN // 2) + j * 4 + c])
            for n in T.unroll(D // 8):
                for c in T.unroll(4):
                    oa[t * (D // 2) + n * 4 + c] = oa[t * (D // 2) + n * 4 + c] * st[t * 10 + 6 + c // 2]

    @T.macro
    def body(q, k, v, mask, out):
        for bx in T.thread_binding(QT, thread="blockIdx.x"):
            for by in T.thread_binding(B * HQ, thread="blockIdx.y"):
                for ty in T.thread_binding(W, thread="threadIdx.y"):
                    for tx in T.thread_binding(32, thread="threadIdx.x"):
                        with T.sblock("attn"):
                            T.reads()
                            T.writes()
                            kv_sm = T.sblock_alloc_buffer((S, 2, BN, D + PAD), dt, scope=SMEM)  # [stage, K|V]
                            q_sm = T.sblock_alloc_buffer((BM if QS else 1, D + PAD), dt, scope=SMEM)
                            qa = T.sblock_alloc_buffer((MT * 8 if QS else MT * D // 2,), dt, scope="local")
                            sa = T.sblock_alloc_buffer((MT * BN // 2,), "float32", scope="local")
                            pa = T.sblock_alloc_buffer((MT * BN // 2,), dt, scope="local")
                            oa = T.sblock_alloc_buffer((MT * D // 2,), "float32", scope="local")
                            fb = T.sblock_alloc_buffer((8,), dt, scope="local")
                            st = T.sblock_alloc_buffer((MT * 10,), "float32", scope="local")  # per m-tile: m0 m1 l0 l1 mx0 mx1 a0 a1 f0 f1
                            fl = T.sblock_alloc_buffer((2,), "int32", scope="local")  # the tile: a visible key, a nonzero mask value
                            mv = T.sblock_alloc_buffer((MV,), mdt, scope="local")
                            b: T.let[T.int32] = by // HQ
                            h: T.let[T.int32] = by % HQ
                            qt: T.let[T.int32] = QT - 1 - bx
                            r0: T.let[T.int32] = qt * BM + ty * 16 + tx // 4  # m-tile t: rows r0 + t * 16 * W (+ 8)
                            c0: T.let[T.int32] = tx % 4 * 2
                            if QS:  # the Q tile into shared memory (the first tile's barrier publishes it)
                                for it in T.serial(BM * D // 8 // NT):
                                    for e in T.vectorized(8):
                                        q_sm[(it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e] = \
                                            qval(q[at(lq, b, h, qrow(qt * BM + (it * NT + ty * 32 + tx) // (D // 8)), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e)])
                            else:  # Q's mma fragments stay in registers
                                for t in T.unroll(MT):
                                    for kk in T.unroll(D // 16):
                                        for r in T.unroll(4):
                                            for e in T.unroll(2):
                                                qa[t * (D // 2) + kk * 8 + r * 2 + e] = qval(q[at(lq, b, h, qrow(r0 + t * 16 * W + r % 2 * 8), kk * 16 + r // 2 * 8 + c0 + e)])
                            for i in T.unroll(MT * D // 2):
                                oa[i] = T.float32(0)
                            for t in T.unroll(MT):
                                for i in T.unroll(2):
                                    st[t * 10 + i] = T.float32(NEG)
                                    st[t * 10 + 2 + i] = T.float32(0)
                                    st[t * 10 + 8 + i] = T.float32(0)
                            if S == 2:  # prologue: tile 0 in flight
                                for it in T.unroll(BN * D // 8 // NT):
                                    T.ptx["cp.async.cg.shared.global"](
                                        T.address_of(kv_sm[0, 0, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8]),
                                        T.address_of(k[at(lk, b, h // G, krow((it * NT + ty * 32 + tx) // (D // 8)), (it * NT + ty * 32 + tx) % (D // 8) * 8)]), 16)
                                    T.ptx["cp.async.cg.shared.global"](
                                        T.address_of(kv_sm[0, 1, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8]),
                                        T.address_of(v[at(lv, b, h // GV, krow((it * NT + ty * 32 + tx) // (D // 8)), (it * NT + ty * 32 + tx) % (D // 8) * 8)]), 16)
                                T.ptx["cp.async.commit_group"]()
                            for jt in T.serial(kv_tiles(qt)):
                                if S == 2:  # tile jt + 1 loads (cp.async) while tile jt computes
                                    if jt + 1 < kv_tiles(qt):
                                        for it in T.unroll(BN * D // 8 // NT):
                                            T.ptx["cp.async.cg.shared.global"](
                                                T.address_of(kv_sm[(jt + 1) % 2, 0, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8]),
                                                T.address_of(k[at(lk, b, h // G, krow((jt + 1) * BN + (it * NT + ty * 32 + tx) // (D // 8)), (it * NT + ty * 32 + tx) % (D // 8) * 8)]), 16)
                                            T.ptx["cp.async.cg.shared.global"](
                                                T.address_of(kv_sm[(jt + 1) % 2, 1, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8]),
                                                T.address_of(v[at(lv, b, h // GV, krow((jt + 1) * BN + (it * NT + ty * 32 + tx) // (D // 8)), (it * NT + ty * 32 + tx) % (D // 8) * 8)]), 16)
                                    T.ptx["cp.async.commit_group"]()
                                    T.ptx["cp.async.wait_group"](1)
                                else:
                                    for it in T.serial(BN * D // 8 // NT):
                                        for e in T.vectorized(8):
                                            kv_sm[0, 0, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e] = \
                                                k[at(lk, b, h // G, krow(jt * BN + (it * NT + ty * 32 + tx) // (D // 8)), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e)]
                                        for e in T.vectorized(8):
                                            kv_sm[0, 1, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e] = \
                                                v[at(lv, b, h // GV, krow(jt * BN + (it * NT + ty * 32 + tx) // (D // 8)), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e)]
                                T.tvm_storage_sync("shared")
                                if masked:  # the CTA votes on the tile's mask block (16-byte loads): all -inf
                                    fl[0] = 0  # adds nothing (skip the tile), all 0 needs no mask (plain softmax)
                                    fl[1] = 0
                                    for it in T.serial(BM * BN // MV // NT):
                                        if ragged_k:  # a mask row of symbolic length: not 16-byte aligned
                                            for e in T.serial(MV):
                                                mv[e] = mask[mi(b, h, qrow(qt * BM + (it * NT + ty * 32 + tx) // (BN // MV)),
                                                                krow(jt * BN + (it * NT + ty * 32 + tx) % (BN // MV) * MV + e))]
                                        else:
                                            for e in T.vectorized(MV):
                                                mv[e] = mask[mi(b, h, qrow(qt * BM + (it * NT + ty * 32 + tx) // (BN // MV)),
                                                                jt * BN + (it * NT + ty * 32 + tx) % (BN // MV) * MV + e)]
                                        for e in T.unroll(MV):
                                            fl[0] = fl[0] | T.Cast("int32", T.Not(T.isinf(T.Cast("float32", mv[e]))))
                                            fl[1] = fl[1] | T.Cast("int32", T.Cast("float32", mv[e]) != T.float32(0))
                                    fl[0] = T.call_extern("int32", "__syncthreads_or", fl[0])
                                    fl[1] = T.call_extern("int32", "__syncthreads_or", fl[1])
                                else:
                                    fl[0] = 1
                                if fl[0] != 0:
                                    for i in T.unroll(MT * BN // 2):
                                        sa[i] = T.float32(0)
                                    for kk in T.unroll(D // 16):
                                        if QS:
                                            for t in T.unroll(MT):
                                                T.evaluate(T.ptx_legacy.ldmatrix(
                                                    False, 4, ".b16", qa.data, t * 8, q_sm.access_ptr("r"),
                                                    (t * 16 * W + ty * 16 + tx % 16) * (D + PAD) + kk * 16 + tx // 16 * 8, dtype=dt))
                                        for jp in T.unroll(BN // 16):
                                            T.evaluate(T.ptx_legacy.ldmatrix(
                                                False, 4, ".b16", fb.data, 0, kv_sm.access_ptr("r"),
                                                ((jt % S * 2) * BN + jp * 16 + tx // 16 * 8 + tx % 8) * (D + PAD) + kk * 16 + tx // 8 % 2 * 8, dtype=dt))
                                            for t in T.unroll(MT):  # the K fragment serves every m-tile of the warp
                                                for n in T.unroll(2):
                                                    T.evaluate(T.ptx_legacy.mma(
                                                        "m16n8k16", "row", "col", ab, ab, "fp32", qa.data, qoff(t, kk), fb.data, n * 4,
                                                        sa.data, t * (BN // 2) + (jp * 2 + n) * 4, False, dtype="float32"))
                                    if causal:  # only the tiles that cross the diagonal test every score against it
                                        if (jt + 1) * BN - 1 > qt * BM:
                                            softmax_tile(True, False, sa, pa, oa, st, mask, b, h, r0, c0, jt)
                                        else:
                                            softmax_tile(False, False, sa, pa, oa, st, mask, b, h, r0, c0, jt)
                                    elif masked:
                                        if fl[1] != 0:
                                            softmax_tile(False, False, sa, pa, oa, st, mask, b, h, r0, c0, jt)
                                        else:
                                            softmax_tile(False, True, sa, pa, oa, st, mask, b, h, r0, c0, jt)
                                    else:
                                        softmax_tile(False, False, sa, pa, oa, st, mask, b, h, r0, c0, jt)
                                    for kk in T.unroll(BN // 16):
                                        for np_ in T.unroll(D // 16):
                                            T.evaluate(T.ptx_legacy.ldmatrix(
                                                True, 4, ".b16", fb.data, 0, kv_sm.access_ptr("r"),
                                                ((jt % S * 2 + 1) * BN + kk * 16 + tx // 8 % 2 * 8 + tx % 8) * (D + PAD) + np_ * 16 + tx // 16 * 8, dtype=dt))
                                            for t in T.unroll(MT):  # the V fragment serves every m-tile of the warp
                                                for n in T.unroll(2):
                                                    T.evaluate(T.ptx_legacy.mma(
                                                        "m16n8k16", "row", "col", ab, ab, "fp32", pa.data, t * (BN // 2) + kk * 8, fb.data, n * 4,
                                                        oa.data, t * (D // 2) + (np_ * 2 + n) * 4, False, dtype="float32"))
                                T.tvm_storage_sync("shared")  # every warp is done with this stage before it is refilled
                            for t in T.unroll(MT):
                                for i in T.unroll(2):
                                    st[t * 10 + 2 + i] = T.cuda.warp_sum(st[t * 10 + 2 + i], width=4)
                                    st[t * 10 + 8 + i] = T.cuda.warp_max(st[t * 10 + 8 + i], width=4)
                                for n in T.unroll(D // 8):
                                    for c in T.unroll(4):
                                        if stored(r0 + t * 16 * W + c // 2 * 8):
                                            out[at(lo, b, h, r0 + t * 16 * W + c // 2 * 8, n * 8 + c0 + c % 2)] = T.Cast(
                                                dt, final(oa[t * (D // 2) + n * 4 + c] / st[t * 10 + 2 + c // 2], st[t * 10 + 8 + c // 2]))

    return body
