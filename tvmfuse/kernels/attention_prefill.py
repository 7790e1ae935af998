"""Flash-attention prefill template: mma.sync tensor cores, fp32 online softmax, causal/additive mask, GQA."""

from __future__ import annotations

from tvm.script import tirx as T

from .common import LOG2E, NEG, Template, dims, f32


def check(s: dict) -> str | None:
    if s["head_dim"] not in (64, 128) or s["heads"] % s["kv_heads"]:
        return "head_dim must be 64/128 and kv heads must divide query heads"
    if s["dtype"] not in ("float16", "bfloat16"):
        return f"prefill template is fp16/bf16 only (got {s['dtype']})"
    if s["causal"] and s["seq_q"] != s["seq_k"]:
        return "causal needs seq_q == seq_k"
    if s["seq_q"] < 16 or not knob_space(s):
        return f"no tile divides seq_q={s['seq_q']}, seq_k={s['seq_k']}"
    return None


def knob_space(s: dict) -> list[dict]:
    return [{"warps": w, "block_n": n} for w in (4, 8) for n in (32, 64, 128)
            if s["seq_q"] % (16 * w) == 0 and s["seq_k"] % n == 0 and n * s["head_dim"] <= 8192]


def default_knobs(s: dict) -> dict:
    space = knob_space(s)
    pref = [k for k in space if k == {"warps": 4, "block_n": 64}]
    return (pref or space or [{"warps": 4, "block_n": 64}])[0]


def mask_index(s: dict):
    """Python index function (b, h, row, col) -> mask indices for the broadcast mask shape."""
    mb, mh, mq, _ = s.get("mask_shape") or (1, 1, s["seq_q"], s["seq_k"])
    return lambda b, h, r, c: (b if mb > 1 else 0, h if mh > 1 else 0, r if mq > 1 else 0, c)


def build(s: dict, knobs: dict, target: str = "cuda"):
    B, HQ, HKV, L, D, dt, scale = dims(s)
    SQ, G, causal, masked = s["seq_q"], HQ // HKV, s["causal"], s["mask"] == "additive"
    qs = float(scale * LOG2E)
    mshape = tuple(s.get("mask_shape") or (1, 1, SQ, L))
    mdt = s.get("mask_dtype", dt)
    mi = mask_index(s)
    W, BN = knobs["warps"], knobs["block_n"]
    BM, NT, PAD = 16 * W, 32 * W, 8
    ab = "bf16" if dt == "bfloat16" else "fp16"

    def bias(m, b, h, r, c):
        return f32(m[mi(b, h, r, c)]) * LOG2E if masked else T.float32(0)

    def visible(r, c):
        return c <= r if causal else True

    @T.prim_func(s_tir=True)
    def cpu(q: T.Buffer((B, HQ, SQ, D), dt), k: T.Buffer((B, HKV, L, D), dt), v: T.Buffer((B, HKV, L, D), dt),
            mask: T.Buffer(mshape, mdt), out: T.Buffer((B, HQ, SQ, D), dt)):
        T.func_attr({"tirx.noalias": True})
        for b, h, i in T.grid(B, HQ, SQ):
            with T.sblock("row"):
                vb, vh, vi = T.axis.remap("SSS", [b, h, i])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((D,), "float32")
                sc = T.sblock_alloc_buffer((BN,), "float32")
                st = T.sblock_alloc_buffer((4,), "float32")  # m, l, tile max, alpha
                st[0] = T.float32(NEG)
                st[1] = T.float32(0)
                for d in range(D):
                    acc[d] = T.float32(0)
                for jt in range((vi // BN + 1) if causal else (L // BN)):
                    st[2] = st[0]
                    for j in range(BN):
                        sc[j] = T.float32(NEG)
                        if visible(vi, jt * BN + j):
                            sc[j] = T.float32(0)
                            for d in range(D):
                                sc[j] = sc[j] + f32(q[vb, vh, vi, d]) * f32(k[vb, vh // G, jt * BN + j, d])
                            sc[j] = T.max(sc[j] * qs + bias(mask, vb, vh, vi, jt * BN + j), T.float32(NEG))
                        st[2] = T.max(st[2], sc[j])
                    st[3] = T.exp2(st[0] - st[2])
                    st[1] = st[1] * st[3]
                    for d in range(D):
                        acc[d] = acc[d] * st[3]
                    for j in range(BN):
                        sc[j] = T.exp2(sc[j] - st[2])
                        st[1] = st[1] + sc[j]
                        for d in range(D):
                            acc[d] = acc[d] + sc[j] * f32(v[vb, vh // G, jt * BN + j, d])
                    st[0] = st[2]
                for d in range(D):
                    out[vb, vh, vi, d] = T.Cast(dt, acc[d] / st[1])

    @T.prim_func(s_tir=True)
    def gpu(q: T.Buffer((B, HQ, SQ, D), dt), k: T.Buffer((B, HKV, L, D), dt), v: T.Buffer((B, HKV, L, D), dt),
            mask: T.Buffer(mshape, mdt), out: T.Buffer((B, HQ, SQ, D), dt)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for bx in T.thread_binding(SQ // BM, thread="blockIdx.x"):
            for by in T.thread_binding(B * HQ, thread="blockIdx.y"):
                for ty in T.thread_binding(W, thread="threadIdx.y"):
                    for tx in T.thread_binding(32, thread="threadIdx.x"):
                        with T.sblock("attn"):
                            T.reads()
                            T.writes()
                            k_sm = T.sblock_alloc_buffer((BN, D + PAD), dt, scope="shared")
                            v_sm = T.sblock_alloc_buffer((BN, D + PAD), dt, scope="shared")
                            qa = T.sblock_alloc_buffer((D // 16 * 8,), dt, scope="local")
                            sa = T.sblock_alloc_buffer((BN // 2,), "float32", scope="local")
                            pa = T.sblock_alloc_buffer((BN // 2,), dt, scope="local")
                            oa = T.sblock_alloc_buffer((D // 2,), "float32", scope="local")
                            fb = T.sblock_alloc_buffer((8,), dt, scope="local")
                            st = T.sblock_alloc_buffer((8,), "float32", scope="local")  # m0 m1 l0 l1 mx0 mx1 a0 a1
                            b: T.let[T.int32] = by // HQ
                            h: T.let[T.int32] = by % HQ
                            qt: T.let[T.int32] = SQ // BM - 1 - bx
                            r0: T.let[T.int32] = qt * BM + ty * 16 + tx // 4
                            c0: T.let[T.int32] = tx % 4 * 2
                            for kk in T.unroll(D // 16):
                                for r in T.unroll(4):
                                    for e in T.unroll(2):
                                        qa[kk * 8 + r * 2 + e] = q[b, h, r0 + r % 2 * 8, kk * 16 + r // 2 * 8 + c0 + e]
                            for i in T.unroll(D // 2):
                                oa[i] = T.float32(0)
                            for i in T.unroll(2):
                                st[i] = T.float32(NEG)
                                st[2 + i] = T.float32(0)
                            for jt in T.serial(((qt + 1) * BM + BN - 1) // BN if causal else L // BN):
                                T.tvm_storage_sync("shared")
                                for it in T.serial(BN * D // 8 // NT):
                                    for e in T.vectorized(8):
                                        k_sm[(it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e] = \
                                            k[b, h // G, jt * BN + (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e]
                                    for e in T.vectorized(8):
                                        v_sm[(it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e] = \
                                            v[b, h // G, jt * BN + (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e]
                                T.tvm_storage_sync("shared")
                                for i in T.unroll(BN // 2):
                                    sa[i] = T.float32(0)
                                for kk in T.unroll(D // 16):
                                    for jp in T.unroll(BN // 16):
                                        T.evaluate(T.ptx_legacy.ldmatrix(
                                            False, 4, ".b16", fb.data, 0, k_sm.access_ptr("r"),
                                            (jp * 16 + tx // 16 * 8 + tx % 8) * (D + PAD) + kk * 16 + tx // 8 % 2 * 8, dtype=dt))
                                        for n in T.unroll(2):
                                            T.evaluate(T.ptx_legacy.mma(
                                                "m16n8k16", "row", "col", ab, ab, "fp32", qa.data, kk * 8, fb.data, n * 4,
                                                sa.data, (jp * 2 + n) * 4, False, dtype="float32"))
                                for i in T.unroll(2):
                                    st[4 + i] = st[i]
                                for j in T.unroll(BN // 8):
                                    for c in T.unroll(4):
                                        sa[j * 4 + c] = T.if_then_else(
                                            visible(r0 + c // 2 * 8, jt * BN + j * 8 + c0 + c % 2),
                                            T.max(sa[j * 4 + c] * qs + bias(mask, b, h, r0 + c // 2 * 8, jt * BN + j * 8 + c0 + c % 2),
                                                  T.float32(NEG)), T.float32(NEG))
                                        st[4 + c // 2] = T.max(st[4 + c // 2], sa[j * 4 + c])
                                for i in T.unroll(2):
                                    st[4 + i] = T.cuda.warp_max(st[4 + i], width=4)
                                    st[6 + i] = T.exp2(st[i] - st[4 + i])
                                    st[2 + i] = st[2 + i] * st[6 + i]
                                    st[i] = st[4 + i]
                                for j in T.unroll(BN // 8):
                                    for c in T.unroll(4):
                                        sa[j * 4 + c] = T.exp2(sa[j * 4 + c] - st[c // 2])
                                        st[2 + c // 2] = st[2 + c // 2] + sa[j * 4 + c]
                                        pa[j * 4 + c] = T.Cast(dt, sa[j * 4 + c])
                                for n in T.unroll(D // 8):
                                    for c in T.unroll(4):
                                        oa[n * 4 + c] = oa[n * 4 + c] * st[6 + c // 2]
                                for kk in T.unroll(BN // 16):
                                    for np_ in T.unroll(D // 16):
                                        T.evaluate(T.ptx_legacy.ldmatrix(
                                            True, 4, ".b16", fb.data, 0, v_sm.access_ptr("r"),
                                            (kk * 16 + tx // 8 % 2 * 8 + tx % 8) * (D + PAD) + np_ * 16 + tx // 16 * 8, dtype=dt))
                                        for n in T.unroll(2):
                                            T.evaluate(T.ptx_legacy.mma(
                                                "m16n8k16", "row", "col", ab, ab, "fp32", pa.data, kk * 8, fb.data, n * 4,
                                                oa.data, (np_ * 2 + n) * 4, False, dtype="float32"))
                            for i in T.unroll(2):
                                st[2 + i] = T.cuda.warp_sum(st[2 + i], width=4)
                            for n in T.unroll(D // 8):
                                for c in T.unroll(4):
                                    out[b, h, r0 + c // 2 * 8, n * 8 + c0 + c % 2] = T.Cast(dt, oa[n * 4 + c] / st[2 + c // 2])

    fn = cpu if target == "llvm" else gpu
    return fn if masked else _drop_mask(fn)


def _drop_mask(fn):
    """The unmasked variant: drop the unused mask parameter, so the signature is (q, k, v, out)."""
    from tvm import tirx
    return tirx.PrimFunc([p for i, p in enumerate(fn.params) if i != 3], fn.body, fn.ret_type, fn.attrs)


TEMPLATE = Template("attention_prefill", build, check, knob_space, default_knobs)
