"""Decode template's CPU variant (target llvm): a split-KV pass (one block per head and split) and a combine pass,
schedule-free, for tests and CPU checks."""

from __future__ import annotations

from tvm.script import tirx as T

from tvmfuse.kernels.attention.common import LOG2E, NEG, at, dims, f32, tshape
from tvmfuse.kernels.attention.decode_guards import guards
from tvmfuse.kernels.attention.decode_knobs import chunk_of, group


def cpu_kernel(s: dict, knobs: dict):
    """The CPU PrimFunc (q, k, v, out) for these shapes; the knobs count only through split and chunk_of."""
    B, H, HKV, L, D, dt, scale = dims(s)
    SQ, split, lq, lk, lv, lo = s["seq_q"], knobs["split"], s["q_layout"], s["k_layout"], s["v_layout"], s["out_layout"]
    HQ, G = H * SQ, group(s)  # rows as heads: row r of head h is head h * SQ + r of the group of KV head h // G
    chunk, qs = chunk_of(s, knobs), float(scale * LOG2E)
    has, qo, _ = guards(s, knobs)

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

    return cpu
