"""Flash-decoding attention template: one query token over KV length L, split across blocks, then combined.

Any L: each split takes chunk = ceil(L / split) keys rounded up to whole steps; keys from L on (the tail of
the last split with keys, and whole splits past it) are not loaded (zeros) and weigh nothing, a split with no
key gives running max NEG, sum 0, so the combine gives it weight 0. When split x chunk == L there are no guards.
Q and out ([B,1,H,D]: BHSD and BSHD are the same memory) and K and V (BHSD, or BSHD read in place) are taken
in the layout the call passes them (`q_layout`, ...). Without mask or causality a few query rows (seq_q > 1)
are more heads of their KV head's group, as transformers' GQA decode passes Q ([B, kv_heads, G, D])."""

from __future__ import annotations

from tvm.script import tirx as T

from .common import LOG2E, NEG, Template, at, dims, f32, tshape

_VEC = 8  # 16-byte loads of fp16/bf16
_PAST = -3.0e38  # the score of a key at or past L: below NEG, so it never raises a running max and weighs exp2(.) = 0
_SMEM = 48 * 1024  # static shared memory for the in-block combine


def check(s: dict) -> str | None:
    if s["mask"] not in ("none",):
        return f"decode template takes no mask (got {s['mask']})"
    if s["seq_q"] != 1 and (s["causal"] or group(s) > 8):
        return "decode template needs one query token (or, not causal, up to 8 rows of a query head group)"
    if s["v_heads"] != s["kv_heads"]:
        return "decode template needs K and V with the same head count"
    if s["head_dim"] not in (16, 32, 64, 128) or s["heads"] % s["kv_heads"]:
        return "head_dim must be 16/32/64/128 and kv heads must divide query heads"
    if s["dtype"] not in ("float16", "bfloat16", "float32"):
        return f"dtype {s['dtype']}"
    if not knob_space(s):
        return "no knob set fits in shared memory"
    return None


def group(s: dict) -> int:
    """Query rows per KV head. Without mask or causality each of seq_q > 1 rows is one more query head:
    transformers' GQA decode folds the group into the rows (Q [B, kv_heads, G, D])."""
    return s["heads"] * s["seq_q"] // s["kv_heads"]


def chunk_of(s: dict, knobs: dict) -> int:
    """Keys per split: ceil(L / split) rounded up to whole steps of warps x (32 x 8 / head_dim) x unroll keys."""
    rows = knobs.get("warps", 4) * (32 * _VEC // s["head_dim"]) * knobs.get("unroll", 1)
    return _ceil(_ceil(s["seq_k"], knobs["split"]), rows) * rows


def _ceil(a: int, b: int) -> int:
    return (a + b - 1) // b


def knob_space(s: dict) -> list[dict]:
    """split (blocks per KV head), warps, unroll (steps of keys in flight per thread), for any L; those whose
    in-block combine (per key slot: the G heads' D partial outputs, max and sum) fits in static shared memory."""
    slots = {w: w * 32 * _VEC // s["head_dim"] for w in (2, 4, 8)}  # keys in flight per step, per unroll
    return [{"split": split, "warps": w, "unroll": u} for split in (1, 4, 8, 16, 32, 64) for w in (2, 4, 8)
            for u in (1, 2, 4) if 4 * slots[w] * group(s) * (s["head_dim"] + 2) <= _SMEM]


def default_knobs(s: dict) -> dict:
    """About 2 blocks with keys per SM (528), 4 warps; then the fewest empty splits and padded keys."""
    def key(k):
        chunk = chunk_of(s, k)
        live = _ceil(s["seq_k"], chunk)  # splits with keys
        blocks = s["batch"] * s["kv_heads"] * live
        return (blocks < 264 or k["warps"] != 4, abs(blocks - 528), k["split"] - live, chunk * k["split"], -k["unroll"])
    space = knob_space(s)
    return min(space, key=key) if space else {"split": 1, "warps": 4, "unroll": 1}


def build(s: dict, knobs: dict, target: str = "cuda"):
    B, H, HKV, L, D, dt, scale = dims(s)
    SQ, split, lq, lk, lv, lo = s["seq_q"], knobs["split"], s["q_layout"], s["k_layout"], s["v_layout"], s["out_layout"]
    HQ, G = H * SQ, group(s)  # rows as heads: row r of head h is head h * SQ + r of the group of KV head h // G
    chunk, qs = chunk_of(s, knobs), float(scale * LOG2E)
    LANES = D // _VEC
    RPW, W, U = 32 // LANES, knobs["warps"], knobs["unroll"]
    SLOTS, NT, steps = W * RPW, W * 32, chunk // (W * RPW * U)
    NOUT = G * D
    even = chunk * split == L

    def has(pos):
        """Whether key `pos` is below L: always (a Python True, so no guard is emitted) when the splits tile L."""
        return True if even else pos < L

    def qo(layout, b, h, d):
        """Index of (query head h, dim d) in Q or out, stored [B,H,SQ,D] or [B,SQ,H,D]."""
        return at(layout, b, h // SQ, h % SQ, d) if SQ > 1 else at(layout, b, h, 0, d)

    def score(x, pos):
        return x if even else T.Select(pos < L, x, T.float32(_PAST))

    @T.prim_func(s_tir=True)
    def cpu(q: T.Buffer(tshape(lq, B, H, SQ, D), dt), k: T.Buffer(tshape(lk, B, HKV, L, D), dt),
            v: T.Buffer(tshape(lv, B, HKV, L, D), dt), out: T.Buffer(tshape(lo, B, H, SQ, D), dt)):
        T.func_attr({"tirx.noalias": True})
        Op = T.alloc_buffer((B, HQ, split, D), "float32")
        Mp = T.alloc_buffer((B, HQ, split), "float32")
        Lp = T.alloc_buffer((B, HQ, split), "float32")
        for b, h, sp in T.grid(B, HQ, split):
            with T.sblock("partial"):
                vb, vh, vs = T.axis.remap("SSS", [b, h, sp])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((D,), "float32")
                st = T.sblock_alloc_buffer((4,), "float32")  # m, l, score, new m
                st[0] = T.float32(NEG)
                st[1] = T.float32(0)
                for d in range(D):
                    acc[d] = T.float32(0)
                for j in range(chunk):
                    if has(vs * chunk + j):
                        st[2] = T.float32(0)
                        for d in range(D):
                            st[2] = st[2] + f32(q[qo(lq, vb, vh, d)]) * qs * f32(k[at(lk, vb, vh // G, vs * chunk + j, d)])
                        st[3] = T.max(st[0], st[2])
                        st[1] = st[1] * T.exp2(st[0] - st[3]) + T.exp2(st[2] - st[3])
                        for d in range(D):
                            acc[d] = acc[d] * T.exp2(st[0] - st[3]) + T.exp2(st[2] - st[3]) * f32(v[at(lv, vb, vh // G, vs * chunk + j, d)])
                        st[0] = st[3]
                for d in range(D):
                    Op[vb, vh, vs, d] = acc[d]
                Mp[vb, vh, vs] = st[0]
                Lp[vb, vh, vs] = st[1]
        for b, h, d in T.grid(B, HQ, D):
            with T.sblock("combine"):
                vb, vh, vd = T.axis.remap("SSS", [b, h, d])
                T.reads()
                T.writes()
                c = T.sblock_alloc_buffer((3,), "float32")
                c[0] = T.float32(NEG)
                c[1] = T.float32(0)
                c[2] = T.float32(0)
                for sp in range(split):
                    c[0] = T.max(c[0], Mp[vb, vh, sp])
                for sp in range(split):
                    c[1] = c[1] + Lp[vb, vh, sp] * T.exp2(Mp[vb, vh, sp] - c[0])
                    c[2] = c[2] + Op[vb, vh, sp, vd] * T.exp2(Mp[vb, vh, sp] - c[0])
                out[qo(lo, vb, vh, vd)] = T.Cast(dt, c[2] / c[1])

    @T.prim_func(s_tir=True)
    def gpu(q: T.Buffer(tshape(lq, B, H, SQ, D), dt), k: T.Buffer(tshape(lk, B, HKV, L, D), dt),
            v: T.Buffer(tshape(lv, B, HKV, L, D), dt), out: T.Buffer(tshape(lo, B, H, SQ, D), dt)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        Op = T.alloc_buffer((B, HQ, split, D), "float32")
        Mp = T.alloc_buffer((B, HQ, split), "float32")
        Lp = T.alloc_buffer((B, HQ, split), "float32")
        for bx in T.thread_binding(B * HKV * split, thread="blockIdx.x"):
            for ty in T.thread_binding(W, thread="threadIdx.y"):
                for tx in T.thread_binding(32, thread="threadIdx.x"):
                    with T.sblock("partial"):
                        T.reads()
                        T.writes()
                        qr = T.sblock_alloc_buffer((G, _VEC), "float32", scope="local")
                        kr = T.sblock_alloc_buffer((U, _VEC), dt, scope="local")
                        vr = T.sblock_alloc_buffer((U, _VEC), dt, scope="local")
                        sc = T.sblock_alloc_buffer((U, G), "float32", scope="local")
                        acc = T.sblock_alloc_buffer((G, _VEC), "float32", scope="local")
                        m = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        l = T.sblock_alloc_buffer((G,), "float32", scope="local")
                        t = T.sblock_alloc_buffer((2,), "float32", scope="local")
                        o_sm = T.sblock_alloc_buffer((SLOTS, G, D), "float32", scope="shared")
                        ml_sm = T.sblock_alloc_buffer((2, SLOTS, G), "float32", scope="shared")
                        b: T.let[T.int32] = bx // (HKV * split)
                        hk: T.let[T.int32] = bx // split % HKV
                        sp: T.let[T.int32] = bx % split
                        slot: T.let[T.int32] = ty * RPW + tx // LANES
                        d0: T.let[T.int32] = tx % LANES * _VEC
                        for g in T.unroll(G):
                            for e in T.unroll(_VEC):
                                qr[g, e] = f32(q[qo(lq, b, hk * G + g, d0 + e)]) * qs
                                acc[g, e] = T.float32(0)
                            m[g] = T.float32(NEG)
                            l[g] = T.float32(0)
                        for it in T.serial(steps):
                            if has(sp * chunk + it * U * SLOTS):  # the block's step holds keys (block-uniform)
                                for u in T.unroll(U):
                                    if has(sp * chunk + (it * U + u) * SLOTS + slot):
                                        for e in T.vectorized(_VEC):
                                            kr[u, e] = k[at(lk, b, hk, sp * chunk + (it * U + u) * SLOTS + slot, d0 + e)]
                                        for e in T.vectorized(_VEC):
                                            vr[u, e] = v[at(lv, b, hk, sp * chunk + (it * U + u) * SLOTS + slot, d0 + e)]
                                    else:
                                        for e in T.vectorized(_VEC):
                                            kr[u, e] = T.Cast(dt, 0)
                                        for e in T.vectorized(_VEC):
                                            vr[u, e] = T.Cast(dt, 0)
                                for u in T.unroll(U):
                                    for g in T.unroll(G):
                                        sc[u, g] = T.float32(0)
                                        for e in T.unroll(_VEC):
                                            sc[u, g] = sc[u, g] + qr[g, e] * f32(kr[u, e])
                                        sc[u, g] = T.cuda.warp_sum(sc[u, g], width=LANES)  # every lane: full-mask shuffles
                                        sc[u, g] = score(sc[u, g], sp * chunk + (it * U + u) * SLOTS + slot)
                                for g in T.unroll(G):
                                    t[0] = m[g]
                                    for u in T.unroll(U):
                                        t[0] = T.max(t[0], sc[u, g])
                                    t[1] = T.exp2(m[g] - t[0])
                                    l[g] = l[g] * t[1]
                                    for e in T.unroll(_VEC):
                                        acc[g, e] = acc[g, e] * t[1]
                                    for u in T.unroll(U):
                                        sc[u, g] = T.exp2(sc[u, g] - t[0])
                                        l[g] = l[g] + sc[u, g]
                                        for e in T.unroll(_VEC):
                                            acc[g, e] = acc[g, e] + sc[u, g] * f32(vr[u, e])
                                    m[g] = t[0]
                        for g in T.unroll(G):
                            for e in T.unroll(_VEC):
                                o_sm[slot, g, d0 + e] = acc[g, e]
                            ml_sm[0, slot, g] = m[g]
                            ml_sm[1, slot, g] = l[g]
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
                    out[qo(lo, bh // HQ, bh % HQ, d)] = T.Cast(dt, c[2] / c[1])

    return cpu if target == "llvm" else gpu


TEMPLATE = Template("attention_decode", build, check, knob_space, default_knobs)
