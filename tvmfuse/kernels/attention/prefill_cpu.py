"""Prefill template's CPU variant (target llvm): one schedule-free block per query row, the same tiled online
softmax as the GPU kernel, for tests and CPU checks."""

from __future__ import annotations

from tvm.script import tirx as T

from tvmfuse.kernels.attention.common import LOG2E, NEG, at, dims, f32, tshape
from tvmfuse.kernels.attention.prefill_logits import logit_rules


def cpu_kernel(s: dict, knobs: dict):
    """The CPU PrimFunc (q, k, v, mask, out) for these shapes; of the knobs only block_n (keys per tile) counts."""
    B, HQ, HKV, L, D, dt, scale = dims(s)
    SQ, G, GV, causal = s["seq_q"], HQ // HKV, HQ // s["v_heads"], s["causal"]
    HV, lq, lk, lv, lo = s["v_heads"], s["q_layout"], s["k_layout"], s["v_layout"], s["out_layout"]
    qs = float(scale * LOG2E)
    mshape = tuple(s.get("mask_shape") or (1, 1, SQ, L))
    mdt = s.get("mask_dtype", dt)
    BN = knobs["block_n"]
    bias, visible, alive, _, final = logit_rules(s)

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

    return cpu
