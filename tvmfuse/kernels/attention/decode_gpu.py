"""Decode template's CUDA kernel: a split-KV pass (per block one KV head's query group over one chunk of keys,
16-byte loads, warp-shuffle dot products, an in-block combine in shared memory) and a combine pass over the splits."""

from __future__ import annotations

from tvm.script import tirx as T

from tvmfuse.kernels.attention.common import LOG2E, NEG, at, dims, extents, f32, template_func
from tvmfuse.kernels.attention.decode_guards import guards
from tvmfuse.kernels.attention.decode_knobs import VEC, chunk_of, group, keys_per_warp, lanes


def gpu_kernel(s: dict, knobs: dict):
    """The CUDA PrimFunc (q, k, v[, mask], out) for these shapes and knobs (split, warps, unroll)."""
    ext = extents(s)
    return template_func(s, ext, gpu_body(s, knobs, ext, s["seq_q"]), "gpu", gpu=True)


def gpu_body(s: dict, knobs: dict, ext: dict, rows: int):
    """The kernel's two passes as a TVMScript macro over (q, k, v, mask, out), with the sizes `ext` and `rows`
    query rows (the step template calls it in its one-token branch, under a symbolic seq_q)."""
    B, H, HKV, _, L, D, dt, scale = dims(s, ext)
    split, lq, lk, lv, lo = knobs["split"], s["q_layout"], s["k_layout"], s["v_layout"], s["out_layout"]
    HQ, G = H * rows, group(dict(s, seq_q=rows))  # rows as heads: row r of head h is head h * rows + r
    chunk, qs = chunk_of(s, knobs, L), float(scale * LOG2E)
    LANES = lanes(D)
    RPW, W, U = keys_per_warp(D), knobs["warps"], knobs["unroll"]
    partial = LANES * VEC != D  # head dims 80 and 96: lanes whose vector lies past D load zeros, store nothing
    SLOTS, NT, steps = W * RPW, W * 32, chunk // (W * RPW * U)
    NOUT = G * D
    masked = s["mask"] == "additive"
    has, qo, score, alive = guards(s, knobs, L, rows)
    # the zeros of a slot without keys: one vector store where VEC elements are 16 bytes; fp32's 32 bytes element by
    # element (TVM 0.27 writes a float32x8 constant as make_ulonglong4 of 8 floats, which nvcc rejects)
    zero_fill = T.vectorized if dt in ("float16", "bfloat16") else T.unroll

    def lane_in(d0):
        """Whether the lane's vector [d0, d0 + VEC) lies inside the head dim: always (no guard) at a power of two."""
        return True if not partial else d0 < D

    def loads(pos, d0):
        """Whether the lane loads key `pos`: it lies below L and the lane's vector inside the head dim."""
        key, lane = has(pos), lane_in(d0)
        return key if lane is True else lane if key is True else T.And(key, lane)

    def live(x, flag):
        """x, or 0 for a slot none of whose keys the mask lets through (it then weighs 0 in the combines)."""
        return x * flag if masked else x

    def ratio(num, den):
        """The combined output; 0 for a row no live key reached (fully masked)."""
        return T.Select(den > T.float32(0), num / den, T.float32(0)) if masked else num / den

    @T.macro
    def body(q, k, v, mask, out):
        Op = T.alloc_buffer((B, HQ, split, D), "float32")
        Mp = T.alloc_buffer((B, HQ, split), "float32")
        Lp = T.alloc_buffer((B, HQ, split), "float32")
        for bx in T.thread_binding(B * HKV * split, thread="blockIdx.x"):
            for ty in T.thread_binding(W, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("partial"):
                        T.reads()
                        T.writes()
                        qr = T.sblock_alloc_buffer((G, VEC), "float32", scope="local")
                        kr = T.sblock_alloc_buffer((U, VEC), dt, scope="local")
                        vr = T.sblock_alloc_buffer((U, VEC), dt, scope="local")
                        sc = T.sblock_alloc_buffer((U, G), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((G, VEC), "float32", scope="local")
                        m = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        al = T.sblock_alloc_buffer((G,), "float32", scope="local")  # the row has a live key
                        l = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        t = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        o_sm = T.sblock_alloc_buffer((SLOTS, G, D), "float32", scope="shared")
                        ml_sm = T.sblock_alloc_buffer((2, SLOTS, G), "float32", scope="shared")
                        b: T.let[T.int32] = bx // (HKV * split)
                        hk: T.let[T.int32] = bx // split % HKV
                        sp: T.let[T.int32] = bx % split
                        slot: T.let[T.int32] = ty * RPW + tx // LANES
                        d0: T.let[T.int32] = tx % LANES * VEC
                        for g in T.unroll(G):
                            for e in T.unroll(VEC):
                                if partial:  # a lane past D: a zero query vector
                                    qr[g, e] = T.if_then_else(d0 < D, f32(q[qo(lq, b, hk * G + g, d0 + e)]) * qs,
                                                              T.float32(0))
                                else:
                                    qr[g, e] = f32(q[qo(lq, b, hk * G + g, d0 + e)]) * qs
                                acc[g, e] = T.float32(0)
                            m[g] = T.float32(NEG)
                            l[g] = T.float32(0)
                            if masked:
                                al[g] = T.float32(0)
                        for it in T.serial(steps):
                            if has(sp * chunk + it * U * SLOTS):  # the block's step holds keys (block-uniform)
                                for u in T.unroll(U):
                                    if loads(sp * chunk + (it * U + u) * SLOTS + slot, d0):
                                        for e in T.vectorized(VEC):
                                            kr[u, e] = k[at(lk, b, hk, sp * chunk + (it * U + u) * SLOTS + slot, d0 + e)]
                                        for e in T.vectorized(VEC):
                                            vr[u, e] = v[at(lv, b, hk, sp * chunk + (it * U + u) * SLOTS + slot, d0 + e)]
                                    else:
                                        for e in zero_fill(VEC):
                                            kr[u, e] = T.Cast(dt, 0)
                                        for e in zero_fill(VEC):
                                            vr[u, e] = T.Cast(dt, 0)
                                for u in T.unroll(U):
                                    for g in T.unroll(G):
                                        sc[u, g] = T.float32(0)
                                        for e in T.unroll(VEC):
                                            sc[u, g] = sc[u, g] + qr[g, e] * f32(kr[u, e])
                                        sc[u, g] = T.cuda.warp_sum(sc[u, g], width=LANES)  # every lane: full-mask shuffles
                                        sc[u, g] = score(sc[u, g], mask, b, hk * G + g, sp * chunk + (it * U + u) * SLOTS + slot)
                                        if masked:
                                            al[g] = T.max(al[g], alive(mask, b, hk * G + g, sp * chunk + (it * U + u) * SLOTS + slot))
                                for g in T.unroll(G):
                                    t[0] = m[g]
                                    for u in T.unroll(U):
                                        t[0] = T.max(t[0], sc[u, g])
                                    t[1] = T.exp2(m[g] - t[0])
                                    l[g] = l[g] * t[1]
                                    for e in T.unroll(VEC):
                                        acc[g, e] = acc[g, e] * t[1]
                                    for u in T.unroll(U):
                                        sc[u, g] = T.exp2(sc[u, g] - t[0])
                                        l[g] = l[g] + sc[u, g]
                                        for e in T.unroll(VEC):
                                            acc[g, e] = acc[g, e] + sc[u, g] * f32(vr[u, e])
                                    m[g] = t[0]
                        for g in T.unroll(G):  # a slot whose keys are all masked weighs 0
                            if lane_in(d0):
                                for e in T.unroll(VEC):
                                    o_sm[slot, g, d0 + e] = live(acc[g, e], al[g])
                            ml_sm[0, slot, g] = m[g]
                            ml_sm[1, slot, g] = live(l[g], al[g])
                        T.tvm_storage_sync("shared")
                        for i in T.serial((NOUT + NT - 1) // NT):
                            if i * NT + ty * 32 + tx < NOUT:
                                t[0] = T.float32(NEG)
                                for r in T.serial(SLOTS):
                                    t[0] = T.max(t[0], ml_sm[0, r, (i * NT + ty * 32 + tx) // D])
                                acc[0, 0] = T.float32(0)
                                acc[0, 1] = T.float32(0)
                                for r in T.serial(SLOTS):
                                    t[1] = T.exp2(ml_sm[0, r, (i * NT + ty * 32 + tx) // D] - t[0])
                                    acc[0, 0] = acc[0, 0] + ml_sm[1, r, (i * NT + ty * 32 + tx) // D] * t[1]
                                    acc[0, 1] = acc[0, 1] + o_sm[r, (i * NT + ty * 32 + tx) // D, (i * NT + ty * 32 + tx) % D] * t[1]
                                Op[b, hk * G + (i * NT + ty * 32 + tx) // D, sp, (i * NT + ty * 32 + tx) % D] = acc[0, 1]
                                if (i * NT + ty * 32 + tx) % D == 0:
                                    Mp[b, hk * G + (i * NT + ty * 32 + tx) // D, sp] = t[0]
                                    Lp[b, hk * G + (i * NT + ty * 32 + tx) // D, sp] = acc[0, 0]
        for bh in T.thread_binding(B * HQ, thread="blockIdx.x"):
            for d in T.thread_binding(D, thread="threadIdx.x"):
                with T.sblock("combine"):
                    T.reads()
                    T.writes()
                    c = T.sblock_alloc_buffer((3,), "float32", scope="local")
                    c[0] = T.float32(NEG)
                    c[1] = T.float32(0)
                    c[2] = T.float32(0)
                    for s_ in T.serial(split):
                        c[0] = T.max(c[0], Mp[bh // HQ, bh % HQ, s_])
                    for s_ in T.serial(split):
                        c[1] = c[1] + Lp[bh // HQ, bh % HQ, s_] * T.exp2(Mp[bh // HQ, bh % HQ, s_] - c[0])
                        c[2] = c[2] + Op[bh // HQ, bh % HQ, s_, d] * T.exp2(Mp[bh // HQ, bh % HQ, s_] - c[0])
                    out[qo(lo, bh // HQ, bh % HQ, d)] = T.Cast(dt, ratio(c[2], c[1]))

    return body
