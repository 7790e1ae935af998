"""Flash-attention prefill template: mma.sync tensor cores, fp32 online softmax, causal/additive mask, GQA.

Q, K, V and out may each be stored BHSD or BSHD (`q_layout`, ...): BSHD is read in place with strided loads,
as the ONNX exports leave the tensors, so no transpose kernel runs. K and V may have different head counts
(`kv_heads`, `v_heads`: a GQA repeat inside the fused group for one of them only).

Fully masked rows (additive mask): a query row whose every logit is -inf gets 0, as the exports' isnan -> where
guard gives (softmax of all -inf is NaN, replaced by 0); a row of finite but huge negative logits (a
finfo.min mask) still gets the mean of V, as the graph's softmax does. Without a where guard in the graph
such a -inf row would be NaN there; the template still gives 0."""

from __future__ import annotations

from tvm.script import tirx as T

from .common import LOG2E, NEG, Template, at, dims, f32, tshape


def check(s: dict) -> str | None:
    if s["head_dim"] not in (16, 32, 64, 128) or s["heads"] % s["kv_heads"] or s["heads"] % s["v_heads"]:
        return "head_dim must be 16/32/64/128 and K and V heads must divide query heads"
    if s["dtype"] not in ("float16", "bfloat16") and not (s["dtype"] == "float32" and s.get("target") == "llvm"):
        return f"prefill template is fp16/bf16 only, fp32 on llvm (got {s['dtype']})"
    if s["causal"] and s["seq_q"] != s["seq_k"]:
        return "causal needs seq_q == seq_k"
    if s["seq_q"] < 16 or not knob_space(s):
        return f"no tile divides seq_q={s['seq_q']}, seq_k={s['seq_k']}"
    return None


STATIC_SMEM, MAX_SMEM = 48 * 1024, 160 * 1024  # bytes: static shared memory limit; what a knob set may use


def smem_bytes(s: dict, knobs: dict) -> int:
    """Shared memory: stages x (K, V) x block_n rows of head_dim (+8 pad) fp16 elements, plus the Q tile
    (16 x warps x m_tiles rows) with q_smem."""
    rows = knobs.get("stages", 1) * 2 * knobs["block_n"]
    rows += 16 * knobs.get("warps", 4) * knobs.get("m_tiles", 1) if knobs.get("q_smem") else 0
    return rows * (s["head_dim"] + 8) * 2


def knob_space(s: dict) -> list[dict]:
    """warps (4/8, 16 query rows each per m-tile), block_n (keys per tile), m_tiles (16-row tiles per warp:
    2 reuses each K/V fragment twice), stages (1: synchronous K/V loads; 2: cp.async double buffering,
    tile j+1 loads while tile j computes), q_smem (with 2 m-tiles: Q fragments from shared memory by
    ldmatrix instead of registers, fewer registers)."""
    space = [{"warps": w, "block_n": n, "m_tiles": mt, "stages": st} | ({"q_smem": qs} if mt > 1 else {})
             for st in (1, 2) for mt in (1, 2) for qs in ((0, 1) if mt > 1 else (0,)) for w in (4, 8)
             for n in (32, 64, 128)]
    return [k for k in space if s["seq_q"] % (16 * k["warps"] * k["m_tiles"]) == 0 and s["seq_k"] % k["block_n"] == 0
            and k["block_n"] * s["head_dim"] <= 8192
            and k["block_n"] * s["head_dim"] // 8 % (32 * k["warps"]) == 0  # every thread loads as many K/V vectors
            and smem_bytes(s, k) <= MAX_SMEM]


def default_knobs(s: dict) -> dict:
    space = knob_space(s)
    pref = [k for k in space if k == {"warps": 4, "block_n": 64, "m_tiles": 1, "stages": 1}]  # the first form
    return (pref or space or [{"warps": 4, "block_n": 64, "m_tiles": 1, "stages": 1}])[0]


def mask_index(s: dict):
    """Python index function (b, h, row, col) -> mask indices for the broadcast mask shape."""
    mb, mh, mq, _ = s.get("mask_shape") or (1, 1, s["seq_q"], s["seq_k"])
    return lambda b, h, r, c: (b if mb > 1 else 0, h if mh > 1 else 0, r if mq > 1 else 0, c)


def build(s: dict, knobs: dict, target: str = "cuda"):
    B, HQ, HKV, L, D, dt, scale = dims(s)
    SQ, G, GV, causal, masked = s["seq_q"], HQ // HKV, HQ // s["v_heads"], s["causal"], s["mask"] == "additive"
    HV, lq, lk, lv, lo = s["v_heads"], s["q_layout"], s["k_layout"], s["v_layout"], s["out_layout"]
    qs = float(scale * LOG2E)
    mshape = tuple(s.get("mask_shape") or (1, 1, SQ, L))
    mdt = s.get("mask_dtype", dt)
    mi = mask_index(s)
    W, BN, MT, S = knobs["warps"], knobs["block_n"], knobs.get("m_tiles", 1), knobs.get("stages", 1)
    QS = bool(knobs.get("q_smem", 0))
    BM, NT, PAD = 16 * W * MT, 32 * W, 8
    SMEM = "shared" if smem_bytes(s, knobs) <= STATIC_SMEM else "shared.dyn"
    ab = "bf16" if dt == "bfloat16" else "fp16"

    def bias(m, b, h, r, c):
        return f32(m[mi(b, h, r, c)]) * LOG2E if masked else T.float32(0)

    def visible(r, c):
        return c <= r if causal else True

    def alive(dot, m, b, h, r, c):
        """1 when the logit dot * scale + mask is finite (a key the row attends to), else 0; always 1 without a
        mask. Tested on the natural-log logit: finfo.min * LOG2E would overflow to -inf."""
        if not masked:
            return T.float32(1)
        return T.Select(T.isinf(dot * T.float32(scale) + f32(m[mi(b, h, r, c)])), T.float32(0), T.float32(1))

    def logit(dot, m, b, h, r, c):
        """The base-2 logit: dot * scale * log2(e) (+ mask * log2(e), kept above NEG so a -inf mask gives no NaN)."""
        return T.max(dot * qs + bias(m, b, h, r, c), T.float32(NEG)) if masked else dot * qs

    def qoff(t, kk):
        """Where m-tile t's Q fragment for k-step kk sits in qa: all in registers, or the one just loaded."""
        return t * 8 if QS else t * (D // 2) + kk * 8

    def final(x, flag):
        """x, or 0 for a fully masked row (no finite logit)."""
        return T.Select(flag > T.float32(0), x, T.float32(0)) if masked else x

    @T.prim_func(s_tir=True)
    def cpu(q: T.Buffer(tshape(lq, B, HQ, SQ, D), dt), k: T.Buffer(tshape(lk, B, HKV, L, D), dt),
            v: T.Buffer(tshape(lv, B, HV, L, D), dt), mask: T.Buffer(mshape, mdt),
            out: T.Buffer(tshape(lo, B, HQ, SQ, D), dt)):
        T.func_attr({"tirx.noalias": True})
        for b, h, i in T.grid(B, HQ, SQ):
            with T.sblock("row"):
                vb, vh, vi = T.axis.remap("SSS", [b, h, i])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((D,), "float32")
                sc = T.sblock_alloc_buffer((BN,), "float32")
                st = T.sblock_alloc_buffer((5,), "float32")  # m, l, tile max, alpha, any finite logit
                st[0] = T.float32(NEG)
                st[1] = T.float32(0)
                st[4] = T.float32(0)
                for d in range(D):
                    acc[d] = T.float32(0)
                for jt in range((vi // BN + 1) if causal else (L // BN)):
                    st[2] = st[0]
                    for j in range(BN):
                        sc[j] = T.float32(NEG)
                        if visible(vi, jt * BN + j):
                            sc[j] = T.float32(0)
                            for d in range(D):
                                sc[j] = sc[j] + f32(q[at(lq, vb, vh, vi, d)]) * f32(k[at(lk, vb, vh // G, jt * BN + j, d)])
                            st[4] = T.max(st[4], alive(sc[j], mask, vb, vh, vi, jt * BN + j))
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
                            acc[d] = acc[d] + sc[j] * f32(v[at(lv, vb, vh // GV, jt * BN + j, d)])
                    st[0] = st[2]
                for d in range(D):
                    out[at(lo, vb, vh, vi, d)] = T.Cast(dt, final(acc[d] / st[1], st[4]))

    def seen(diag, r, c):
        return visible(r, c) if diag else True

    @T.macro
    def softmax_tile(diag, sa, pa, oa, st, mask, b, h, r0, c0, jt):
        """Scores -> running max, rescale, probabilities of one K/V tile; `diag`: the tile crosses the causal
        diagonal (only then is each score tested against it)."""
        for t in T.unroll(MT):
            for i in T.unroll(2):
                st[t * 10 + 4 + i] = st[t * 10 + i]
            for j in T.unroll(BN // 8):
                for c in T.unroll(4):
                    st[t * 10 + 8 + c // 2] = T.max(st[t * 10 + 8 + c // 2], T.if_then_else(
                        seen(diag, r0 + t * 16 * W + c // 2 * 8, jt * BN + j * 8 + c0 + c % 2),
                        alive(sa[t * (BN // 2) + j * 4 + c], mask, b, h, r0 + t * 16 * W + c // 2 * 8, jt * BN + j * 8 + c0 + c % 2),
                        T.float32(0)))
                    sa[t * (BN // 2) + j * 4 + c] = T.if_then_else(
                        seen(diag, r0 + t * 16 * W + c // 2 * 8, jt * BN + j * 8 + c0 + c % 2),
                        logit(sa[t * (BN // 2) + j * 4 + c], mask, b, h, r0 + t * 16 * W + c // 2 * 8, jt * BN + j * 8 + c0 + c % 2),
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

    @T.prim_func(s_tir=True)
    def gpu(q: T.Buffer(tshape(lq, B, HQ, SQ, D), dt), k: T.Buffer(tshape(lk, B, HKV, L, D), dt),
            v: T.Buffer(tshape(lv, B, HV, L, D), dt), mask: T.Buffer(mshape, mdt),
            out: T.Buffer(tshape(lo, B, HQ, SQ, D), dt)):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for bx in T.thread_binding(SQ // BM, thread="blockIdx.x"):
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
                            b: T.let[T.int32] = by // HQ
                            h: T.let[T.int32] = by % HQ
                            qt: T.let[T.int32] = SQ // BM - 1 - bx
                            r0: T.let[T.int32] = qt * BM + ty * 16 + tx // 4  # m-tile t: rows r0 + t * 16 * W (+ 8)
                            c0: T.let[T.int32] = tx % 4 * 2
                            if QS:  # the Q tile into shared memory (the first tile's barrier publishes it)
                                for it in T.serial(BM * D // 8 // NT):
                                    for e in T.vectorized(8):
                                        q_sm[(it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e] = \
                                            q[at(lq, b, h, qt * BM + (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e)]
                            else:  # Q's mma fragments stay in registers
                                for t in T.unroll(MT):
                                    for kk in T.unroll(D // 16):
                                        for r in T.unroll(4):
                                            for e in T.unroll(2):
                                                qa[t * (D // 2) + kk * 8 + r * 2 + e] = q[at(lq, b, h, r0 + t * 16 * W + r % 2 * 8, kk * 16 + r // 2 * 8 + c0 + e)]
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
                                        T.address_of(k[at(lk, b, h // G, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8)]), 16)
                                    T.ptx["cp.async.cg.shared.global"](
                                        T.address_of(kv_sm[0, 1, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8]),
                                        T.address_of(v[at(lv, b, h // GV, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8)]), 16)
                                T.ptx["cp.async.commit_group"]()
                            for jt in T.serial(((qt + 1) * BM + BN - 1) // BN if causal else L // BN):
                                if S == 2:  # tile jt + 1 loads (cp.async) while tile jt computes
                                    if jt + 1 < (((qt + 1) * BM + BN - 1) // BN if causal else L // BN):
                                        for it in T.unroll(BN * D // 8 // NT):
                                            T.ptx["cp.async.cg.shared.global"](
                                                T.address_of(kv_sm[(jt + 1) % 2, 0, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8]),
                                                T.address_of(k[at(lk, b, h // G, (jt + 1) * BN + (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8)]), 16)
                                            T.ptx["cp.async.cg.shared.global"](
                                                T.address_of(kv_sm[(jt + 1) % 2, 1, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8]),
                                                T.address_of(v[at(lv, b, h // GV, (jt + 1) * BN + (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8)]), 16)
                                    T.ptx["cp.async.commit_group"]()
                                    T.ptx["cp.async.wait_group"](1)
                                else:
                                    for it in T.serial(BN * D // 8 // NT):
                                        for e in T.vectorized(8):
                                            kv_sm[0, 0, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e] = \
                                                k[at(lk, b, h // G, jt * BN + (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e)]
                                        for e in T.vectorized(8):
                                            kv_sm[0, 1, (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e] = \
                                                v[at(lv, b, h // GV, jt * BN + (it * NT + ty * 32 + tx) // (D // 8), (it * NT + ty * 32 + tx) % (D // 8) * 8 + e)]
                                T.tvm_storage_sync("shared")
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
                                        softmax_tile(True, sa, pa, oa, st, mask, b, h, r0, c0, jt)
                                    else:
                                        softmax_tile(False, sa, pa, oa, st, mask, b, h, r0, c0, jt)
                                else:
                                    softmax_tile(False, sa, pa, oa, st, mask, b, h, r0, c0, jt)
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
                                        out[at(lo, b, h, r0 + t * 16 * W + c // 2 * 8, n * 8 + c0 + c % 2)] = T.Cast(
                                            dt, final(oa[t * (D // 2) + n * 4 + c] / st[t * 10 + 2 + c // 2], st[t * 10 + 8 + c // 2]))

    fn = cpu if target == "llvm" else gpu
    return fn if masked else _drop_mask(fn)


def _drop_mask(fn):
    """The unmasked variant: drop the unused mask parameter, so the signature is (q, k, v, out)."""
    from tvm import tirx
    return tirx.PrimFunc([p for i, p in enumerate(fn.params) if i != 3], fn.body, fn.ret_type, fn.attrs)


TEMPLATE = Template("attention_prefill", build, check, knob_space, default_knobs)
