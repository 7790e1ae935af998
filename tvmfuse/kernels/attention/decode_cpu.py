"""Decode template's CPU variant (target llvm): a split-KV pass (one block per head and split) and a combine pass,
schedule-free, for tests and CPU checks."""

from __future__ import annotations

from tvm.script import tirx as T

from tvmfuse.kernels.attention.common import LOG2E, NEG, at, dims, extents, f32, template_func
from tvmfuse.kernels.attention.decode_guards import guards
from tvmfuse.kernels.attention.decode_knobs import chunk_of, group


def cpu_kernel(s: dict, knobs: dict):
    """The CPU PrimFunc (q, k, v[, mask], out) for these shapes; the knobs count only through split and chunk_of."""
    ext = extents(s)
    return template_func(s, ext, cpu_body(s, knobs, ext, s["seq_q"]), "cpu", gpu=False)


def cpu_body(s: dict, knobs: dict, ext: dict, rows: int):
    """The two passes as a TVMScript macro over (q, k, v, mask, out), with the sizes `ext` and `rows` query rows."""
    B, H, _, _, L, D, dt, scale = dims(s, ext)
    split, lq, lk, lv, lo = knobs["split"], s["q_layout"], s["k_layout"], s["v_layout"], s["out_layout"]
    HQ, G = H * rows, group(dict(s, seq_q=rows))  # rows as heads: row r of head h is head h * rows + r
    chunk, qs = chunk_of(s, knobs, L), float(scale * LOG2E)
    masked = s["mask"] == "additive"
    has, qo, score, alive = guards(s, knobs, L, rows)
    AL0 = 0.0 if masked else 1.0  # without a mask every row has a live key

    def ratio(num, den):
        """The combined output; 0 for a row no live key reached (fully masked)."""
        return T.Select(den > T.float32(0), num / den, T.float32(0)) if masked else num / den

    @T.macro
    def body(q, k, v, mask, out):
        Op = T.alloc_buffer((B, HQ, split, D), "float32")
        Mp = T.alloc_buffer((B, HQ, split), "float32")
        Lp = T.alloc_buffer((B, HQ, split), "float32")
        for b, h, sp in T.grid(B, HQ, split):
            with T.sblock("partial"):
                vb, vh, vs = T.axis.remap("SSS", [b, h, sp])
                T.reads()
                T.writes()
                acc = T.sblock_alloc_buffer((D,), "float32")
                st = T.sblock_alloc_buffer((5,), "float32")  # m, l, score, new m, a live key
                st[0] = T.float32(NEG)
                st[1] = T.float32(0)
                st[4] = T.float32(AL0)
                for d in range(D):
                    acc[d] = T.float32(0)
                for j in range(chunk):
                    if has(vs * chunk + j):
                        st[2] = T.float32(0)
                        for d in range(D):
                            st[2] = st[2] + f32(q[qo(lq, vb, vh, d)]) * qs * f32(k[at(lk, vb, vh // G, vs * chunk + j, d)])
                        st[2] = score(st[2], mask, vb, vh, vs * chunk + j)
                        if masked:
                            st[4] = T.max(st[4], alive(mask, vb, vh, vs * chunk + j))
                        st[3] = T.max(st[0], st[2])
                        st[1] = st[1] * T.exp2(st[0] - st[3]) + T.exp2(st[2] - st[3])
                        for d in range(D):
                            acc[d] = acc[d] * T.exp2(st[0] - st[3]) + T.exp2(st[2] - st[3]) * f32(v[at(lv, vb, vh // G, vs * chunk + j, d)])
                        st[0] = st[3]
                for d in range(D):  # a split whose keys are all masked weighs 0
                    Op[vb, vh, vs, d] = acc[d] * st[4]
                Mp[vb, vh, vs] = st[0]
                Lp[vb, vh, vs] = st[1] * st[4]
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
                out[qo(lo, vb, vh, vd)] = T.Cast(dt, ratio(c[2], c[1]))

    return body
