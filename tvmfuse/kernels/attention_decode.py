"""Flash-decoding attention template: one query token over KV length L, split across blocks, then combined."""

from __future__ import annotations


from tvm.script import tirx as T

from .common import LOG2E, NEG, Template, dims, f32

_VEC = 8  # 16-byte loads of fp16/bf16


def check(s: dict) -> str | None:
    if s["seq_q"] != 1:
        return "decode template needs one query token"
    if s["mask"] not in ("none",):
        return f"decode template takes no mask (got {s['mask']})"
    if any(s[x] != "BHSD" for x in ("q_layout", "k_layout", "v_layout", "out_layout")) or s["v_heads"] != s["kv_heads"]:
        return "decode template takes BHSD tensors only, K and V with the same head count"
    if s["head_dim"] not in (64, 128) or s["heads"] % s["kv_heads"]:
        return "head_dim must be 64/128 and kv heads must divide query heads"
    if s["dtype"] not in ("float16", "bfloat16", "float32"):
        return f"dtype {s['dtype']}"
    return None


def knob_space(s: dict) -> list[dict]:
    L, out = s["seq_k"], []
    for split in (1, 4, 8, 16, 32, 64):
        for warps in (2, 4, 8):
            for unroll in (1, 2, 4):
                rows = warps * (32 * _VEC // s["head_dim"]) * unroll
                if L % split == 0 and (L // split) % rows == 0:
                    out.append({"split": split, "warps": warps, "unroll": unroll})
    return out


def default_knobs(s: dict) -> dict:
    space = knob_space(s)
    blocks = lambda k: s["batch"] * s["kv_heads"] * k["split"]  # noqa: E731
    good = [k for k in space if blocks(k) >= 264 and k["warps"] == 4] or space
    return min(good, key=lambda k: (abs(blocks(k) - 528), -k["unroll"])) if good else {"split": 1, "warps": 4, "unroll": 1}


def build(s: dict, knobs: dict, target: str = "cuda"):
    B, HQ, HKV, L, D, dt, scale = dims(s)
    G, split = HQ // HKV, knobs["split"]
    chunk, qs = L // split, float(scale * LOG2E)
    LANES = D // _VEC
    RPW, W, U = 32 // LANES, knobs["warps"], knobs["unroll"]
    SLOTS, NT, steps = W * RPW, W * 32, chunk // (W * RPW * U)
    NOUT = G * D

    @T.prim_func(s_tir=True)
    def cpu(q: T.Buffer((B, HQ, 1, D), dt), k: T.Buffer((B, HKV, L, D), dt), v: T.Buffer((B, HKV, L, D), dt),
            out: T.Buffer((B, HQ, 1, D), dt)):
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
                    st[2] = T.float32(0)
                    for d in range(D):
                        st[2] = st[2] + f32(q[vb, vh, 0, d]) * qs * f32(k[vb, vh // G, vs * chunk + j, d])
                    st[3] = T.max(st[0], st[2])
                    st[1] = st[1] * T.exp2(st[0] - st[3]) + T.exp2(st[2] - st[3])
                    for d in range(D):
                        acc[d] = acc[d] * T.exp2(st[0] - st[3]) + T.exp2(st[2] - st[3]) * f32(v[vb, vh // G, vs * chunk + j, d])
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
                out[vb, vh, 0, vd] = T.Cast(dt, c[2] / c[1])

    @T.prim_func(s_tir=True)
    def gpu(q: T.Buffer((B, HQ, 1, D), dt), k: T.Buffer((B, HKV, L, D), dt), v: T.Buffer((B, HKV, L, D), dt),
            out: T.Buffer((B, HQ, 1, D), dt)):
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
                                qr[g, e] = f32(q[b, hk * G + g, 0, d0 + e]) * qs
                                acc[g, e] = T.float32(0)
                            m[g] = T.float32(NEG)
                            l[g] = T.float32(0)
                        for it in T.serial(steps):
                            for u in T.unroll(U):
                                for e in T.vectorized(_VEC):
                                    kr[u, e] = k[b, hk, sp * chunk + (it * U + u) * SLOTS + slot, d0 + e]
                                for e in T.vectorized(_VEC):
                                    vr[u, e] = v[b, hk, sp * chunk + (it * U + u) * SLOTS + slot, d0 + e]
                            for u in T.unroll(U):
                                for g in T.unroll(G):
                                    sc[u, g] = T.float32(0)
                                    for e in T.unroll(_VEC):
                                        sc[u, g] = sc[u, g] + qr[g, e] * f32(kr[u, e])
                                    sc[u, g] = T.cuda.warp_sum(sc[u, g], width=LANES)
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
                    out[bh // HQ, bh % HQ, 0, d] = T.Cast(dt, c[2] / c[1])

    return cpu if target == "llvm" else gpu


TEMPLATE = Template("attention_decode", build, check, knob_space, default_knobs)
