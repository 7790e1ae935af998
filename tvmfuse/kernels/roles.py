"""Which argument of a lowered attention PrimFunc is Q, K, V, mask, scale or output, read off its TIR dataflow."""

from __future__ import annotations

import tvm
from tvm import tirx


def _blocks(fn: tirx.PrimFunc) -> list:
    sch = tvm.s_tir.Schedule(fn)
    root = sch.get(sch.get_sblock("root"))
    out, todo = [], [sch.get_sblock("root")]
    while todo:
        for rv in sch.get_child_blocks(todo.pop(0)):
            out.append(sch.get(rv))
            todo.append(rv)
    return [b for b in out if not b.same_as(root)]


def attention_roles(fn: tirx.PrimFunc) -> dict | None:
    """{'order': role per parameter ('q','k','v','mask','out','scale*','scale/','const'), 'shapes': template
    shapes} for an unscheduled softmax(scale * Q K^T [+ mask]) V PrimFunc in [B,H,S,D] layout, else None."""
    names = [p.name for p in fn.params]
    blocks = _blocks(fn)
    deps: dict[str, set] = {n: {n} for n in names}
    bufs, consumers = {}, {n: [] for n in names}
    for blk in blocks:
        reads = [r.source for r in blk.reads]
        for r in reads:
            bufs.setdefault(r.name, r)
            if r.name in consumers:
                consumers[r.name].append(blk.name_hint)
        src = set().union(*(deps.get(r.name, set()) for r in reads)) if reads else set()
        for w in blk.writes:
            bufs.setdefault(w.source.name, w.source)
            deps.setdefault(w.source.name, set()).update(src)
    mms = [b for b in blocks if b.name_hint.startswith("matmul") or b.name_hint.startswith("NT_matmul")]
    if len(mms) != 2 or any(len(b.reads) < 2 for b in mms):
        return None
    rank = {n: len(bufs[n].shape) if n in bufs else -1 for n in names}
    pick = lambda buf: {n for n in deps.get(buf.name, ()) if rank[n] == 4}  # noqa: E731
    q, k = pick(mms[0].reads[0].source), pick(mms[0].reads[1].source)
    v = pick(mms[1].reads[1].source)
    out = names[-1]
    if len(q) != 1 or len(k) != 1 or len(v) != 1 or len({*q, *k, *v}) != 3 or out in {*q, *k, *v}:
        return None
    q, k, v = q.pop(), k.pop(), v.pop()
    order = []
    for n in names:
        if n in (q, k, v, out):
            order.append({q: "q", k: "k", v: "v", out: "out"}[n])
        elif rank[n] == 4 and n in deps.get(mms[1].reads[0].source.name, ()):
            order.append("mask")
        elif rank[n] == 0 and consumers[n] and all(c.startswith(("T_multiply", "T_divide")) for c in consumers[n]):
            order.append("scale*" if consumers[n][0].startswith("T_multiply") else "scale/")
        elif rank[n] == 0 and consumers[n] and all(c.startswith(("T_where", "T_select")) for c in consumers[n]):
            order.append("const")
        else:
            return None
    if order.count("mask") > 1 or not any(o.startswith("scale") for o in order):
        return None
    sh = {r: [int(x) for x in bufs[n].shape] for r, n in zip(order, names) if r in ("q", "k", "v", "mask", "out")}
    b, h, sq, d = sh["q"]
    shapes = {"batch": b, "heads": h, "kv_heads": sh["k"][1], "seq_q": sq, "seq_k": sh["k"][2], "head_dim": d,
              "dtype": str(bufs[out].dtype), "mask": "additive" if "mask" in sh else "none", "causal": False}
    if "mask" in sh:
        shapes["mask_shape"], shapes["mask_dtype"] = tuple(sh["mask"]), str(bufs[names[order.index("mask")]].dtype)
    if sh["out"] != sh["q"] or sh["v"] != sh["k"] or sh["k"][0] != b or sh["k"][3] != d:
        return None
    return {"order": order, "shapes": shapes, "scale": None}
