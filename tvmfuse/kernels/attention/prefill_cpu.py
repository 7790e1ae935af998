"""Prefill template's CPU variant (target llvm): one schedule-free block per query row, the same tiled online
softmax as the GPU kernel, for tests and CPU checks."""

from __future__ import annotations

from tvm.script import tirx as T

from tvmfuse.kernels.attention.common import LOG2E, NEG, at, ceil_div, dims, extents, f32, soft_capped, template_func
from tvmfuse.kernels.attention.prefill_logits import logit_rules


def cpu_kernel(s: dict, knobs: dict):
    """The CPU PrimFunc (q, k, v[, mask], out) for these shapes; of the knobs only block_n (keys per tile)
    counts."""
    ext = extents(s)
    return template_func(s, ext, cpu_body(s, knobs, ext), "cpu", gpu=False, v_heads=s["v_heads"])


def cpu_body(s: dict, knobs: dict, ext: dict):
    """One block per query row as a TVMScript macro over (q, k, v, mask, out), with the sizes `ext`; a symbolic
    KV length leaves a ragged last tile, its keys past L not read."""
    B, HQ, HKV, SQ, L, D, dt, scale = dims(s, ext)
    G, GV, causal = HQ // HKV, HQ // s["v_heads"], s["causal"]
    lq, lk, lv, lo = s["q_layout"], s["k_layout"], s["v_layout"], s["out_layout"]
    qs = float(scale * LOG2E)
    BN = knobs["block_n"]
    bias, visible, alive, _, final = logit_rules(s)
    ragged = not isinstance(L, int)

    def krow(j):
        """Key row j as read: past L the last key (weighed 0)."""
        return T.min(j, L - 1) if ragged else j

    def kv_tiles(row):
        """K/V tiles row `row` reads: up to its diagonal when causal, else all (the last one ragged)."""
        return row // BN + 1 if causal else ceil_div(L, BN)

    def seen(r, c):
        """Whether key c counts for row r: below L, and shown by the causal mask."""
        shown = visible(r, c)
        return (c < L if shown is True else T.And(shown, c < L)) if ragged else shown

    @T.macro
    def body(q, k, v, mask, out):
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
                for jt in range(kv_tiles(vi)):
                    st[2] = st[0]
                    for j in range(BN):
                        sc[j] = T.float32(NEG)
                        if seen(vi, jt * BN + j):
                            sc[j] = T.float32(0)
                            for d in range(D):
                                sc[j] = sc[j] + f32(q[at(lq, vb, vh, vi, d)]) * f32(k[at(lk, vb, vh // G, jt * BN + j, d)])
                            st[4] = T.max(st[4], alive(sc[j], mask, vb, vh, vi, jt * BN + j))
                            sc[j] = T.max(soft_capped(s, sc[j] * qs) + bias(mask, vb, vh, vi, jt * BN + j),
                                          T.float32(NEG))
                        st[2] = T.max(st[2], sc[j])
                    st[3] = T.exp2(st[0] - st[2])
                    st[1] = st[1] * st[3]
                    for d in range(D):
                        acc[d] = acc[d] * st[3]
                    for j in range(BN):
                        sc[j] = T.exp2(sc[j] - st[2])
                        st[1] = st[1] + sc[j]
                        for d in range(D):
                            acc[d] = acc[d] + sc[j] * f32(v[at(lv, vb, vh // GV, krow(jt * BN + j), d)])
                    st[0] = st[2]
                for d in range(D):
                    out[at(lo, vb, vh, vi, d)] = T.Cast(dt, final(acc[d] / st[1], st[4]))

    return body
