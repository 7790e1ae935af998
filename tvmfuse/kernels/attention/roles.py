"""Which argument of a lowered attention PrimFunc is Q, K, V, mask, scale, where-guard constant or output, and
in which layout each tensor is, read off its TIR dataflow.

The analysis labels tensor axes. The two matmuls fix the labels of their operands: scores[b,h,q,k] =
sum_d Q[b,h,q,d] K^T[b,h,d,k] and out[b,h,q,d] = sum_k P[b,h,q,k] V[b,h,k,d]. Labels then flow backwards
through every producer block to the parameters (an index that simplifies to `v` or `v // G`, as the GQA
repeat's reshape reads, carries the label of iteration variable `v`; a constant index is a broadcast axis)
and forwards to the output. So head permutes, the GQA repeat (expand_dims/broadcast_to/reshape), casts and
the scale multiplies may all be inside the PrimFunc: each of Q, K, V and out comes back with its own layout
(BHSD or BSHD) and head count."""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.ir.expr import (
    TensorLoad,  # what tirx.BufferLoad builds in 0.27; its buffer is `.source`
)

from tvmfuse.kernels.attention.role_axes import LabelConflict, label_axes, sblocks
from tvmfuse.kernels.attention.role_shapes import LAYOUTS, template_shapes


def attention_roles(fn: tirx.PrimFunc) -> dict | None:
    """{'order': role per parameter ('q','k','v','mask','out','scale','const', or 'dim' for a shape scalar such as
    the past length of a KV cache's view), 'uses': {param index:
    (multiplies, divides)} for the scale scalars, 'shapes': template shapes (with the layout of Q, K, V and
    out, and the K and V head counts), 'softcap': the index of the soft cap's scalar or None} for an unscheduled
    softmax(softcap(scale * Q K^T) [+ mask]) V PrimFunc, else None."""
    names = [p.name for p in fn.params]
    dims = {p.name for p in fn.params if isinstance(p.ty, tvm.ir.PrimType)}  # shape scalars (a KV length)
    blocks = sblocks(fn)
    deps: dict[str, set] = {n: {n} for n in names}
    bufs, consumers = {}, {n: [] for n in names}
    for blk in blocks:
        reads = [r.source for r in blk.reads]
        for r in reads:
            bufs.setdefault(r.name, r)
            consumers.setdefault(r.name, [])
            if blk not in consumers[r.name]:
                consumers[r.name].append(blk)
        src = set().union(*(deps.get(r.name, set()) for r in reads)) if reads else set()
        for w in blk.writes:
            bufs.setdefault(w.source.name, w.source)
            deps.setdefault(w.source.name, set()).update(src)
    mms = [b for b in blocks if b.name_hint.startswith("matmul") or b.name_hint.startswith("NT_matmul")]
    if len(mms) != 2 or any(len(b.reads) < 2 or len(b.writes) != 1 for b in mms):
        return None
    rank = {n: len(bufs[n].shape) if n in bufs else -1 for n in names}
    pick = lambda buf: {n for n in deps.get(buf.name, ()) if rank[n] == 4}
    a1, k1 = _operands(mms[0])
    p2, v2 = _operands(mms[1])
    if a1 is None or p2 is None:
        return None
    q, k, v = pick(a1.source), pick(k1.source), pick(v2.source)
    out = names[-1]
    if len(q) != 1 or len(k) != 1 or len(v) != 1 or len({*q, *k, *v}) != 3 or out in {*q, *k, *v}:
        return None
    q, k, v = q.pop(), k.pop(), v.pop()

    # seeds: the matmuls' outputs and their reduction variables
    seeds = {mms[0].writes[0].source.name: [("b", 1), ("h", 1), ("q", 1), ("k", 1)],
             mms[1].writes[0].source.name: [("b", 1), ("h", 1), ("q", 1), ("d", 1)]}
    blocks_red = []
    for blk in blocks:
        red = {}
        if blk.same_as(mms[0]) or blk.same_as(mms[1]):
            rv = [iv.var for iv in blk.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
            if len(rv) != 1:
                return None
            red[rv[0]] = ("d", 1) if blk.same_as(mms[0]) else ("k", 1)
        blocks_red.append((blk, red))
    if any(rank[n] != 4 for n in (q, k, v, out)):
        return None
    try:
        labels = label_axes(blocks_red, seeds, bufs)
    except LabelConflict:
        return None

    order, uses = [], {}
    for i, n in enumerate(names):
        if n in (q, k, v, out):
            order.append({q: "q", k: "k", v: "v", out: "out"}[n])
        elif n in dims:
            order.append("dim")
        elif rank[n] == 4 and n in deps.get(p2.source.name, ()):
            order.append("mask")
        elif rank[n] == 0 or (rank[n] == 1 and int(bufs[n].shape[0]) == 1):
            use = _scalar_use(n, blocks, consumers, bufs)
            if use is None:
                return None
            order.append(use[0])
            if use[0] == "scale":
                uses[i] = (use[1], use[2])
        else:
            return None
    if order.count("mask") > 1 or order.count("const") > 1:  # no scale: 1 (OPT scales Q in its projection)
        return None
    shapes = template_shapes(names, order, bufs, labels, q, k, v, out)
    if shapes is None:
        return None
    cap = _soft_cap(blocks, names, order)
    if cap == -1:
        return None
    return {"order": order, "uses": uses, "shapes": shapes, "scale": None, "softcap": cap}


def _soft_cap(blocks, names: list, order: list) -> int | None:
    """The index of the scale parameter the scores are divided by before a tanh (cap * tanh(s / cap): the
    templates cap the scores by its value); None without a tanh; -1 for a tanh of anything else."""
    tanhs = [blk for blk in blocks if isinstance(blk.body, tirx.BufferStore) and _calls(blk.body.value, "tirx.tanh")]
    if not tanhs:
        return None
    if len(tanhs) != 1 or len(tanhs[0].reads) != 1:
        return -1
    source = tanhs[0].reads[0].source.name
    for blk in blocks:
        store = blk.body
        if not (isinstance(store, tirx.BufferStore) and _store_buffer(store).name == source):
            continue
        val = store.value.value if isinstance(store.value, tirx.Cast) else store.value
        if isinstance(val, tirx.Div):
            div = val.b.value if isinstance(val.b, tirx.Cast) else val.b
            if isinstance(div, TensorLoad) and div.source.name in names:
                i = names.index(div.source.name)
                return i if order[i] == "scale" else -1
    return -1


def _calls(expr, op: str, depth: int = 0) -> bool:
    """Whether expression `expr` calls the intrinsic `op` (through casts and arithmetic)."""
    if isinstance(expr, tvm.ir.expr.Call) and getattr(expr.op, "name", "") == op:
        return True
    return depth <= 16 and any(_calls(k, op, depth + 1) for k in _children(expr))


def _scalar_use(name: str, blocks, consumers: dict, bufs: dict, depth: int = 0) -> tuple[str, int, int] | None:
    """How a scalar parameter is used: ('scale', multiplies, divides) or ('const', 0, 0) for the where
    guard's value; through casts. None for anything else."""
    muls = divs = 0
    kinds = set()
    for blk in consumers.get(name, []):
        store = blk.body
        if not isinstance(store, tirx.BufferStore):
            return None
        val = store.value
        if isinstance(val, tirx.Cast) and isinstance(val.value, TensorLoad) and val.value.source.name == name:
            out = _store_buffer(store).name
            if len(bufs[out].shape) > 1 or depth > 3:
                return None
            sub = _scalar_use(out, blocks, consumers, bufs, depth + 1)
            if sub is None:
                return None
            kinds.add(sub[0])
            muls, divs = muls + sub[1], divs + sub[2]
        elif isinstance(val, tirx.Mul):
            kinds.add("scale")
            muls += 1
        elif isinstance(val, tirx.Div) and _loads(val.b, name) and not _loads(val.a, name):
            kinds.add("scale")
            divs += 1
        elif isinstance(val, tirx.Select) and _loads(val.true_value, name) and not _loads(val.false_value, name):
            kinds.add("const")
        else:
            return None
    if len(kinds) != 1:
        return None
    return (kinds.pop(), muls, divs)


def _store_buffer(store):
    buf = getattr(store, "buffer", None)  # a Buffer has no truth value
    return buf if buf is not None else store.source


def _loads(expr, name: str, depth: int = 0) -> bool:
    """Whether expression `expr` reads buffer `name` (through casts and arithmetic)."""
    if isinstance(expr, TensorLoad):
        return expr.source.name == name
    if depth > 16:
        return True  # be conservative
    return any(_loads(k, name, depth + 1) for k in _children(expr))


def _children(expr) -> list:
    """The operand expressions of `expr` (a cast's value, a binary op's sides, a select's three, a call's args)."""
    kids = [getattr(expr, f) for f in ("a", "b", "value", "condition", "true_value", "false_value")
            if hasattr(expr, f)] + list(getattr(expr, "args", []) or [])
    return [k for k in kids if isinstance(k, tvm.ir.expr.Expr)]


def _operands(mm):
    """(A, B) read regions of a matmul block: the two reads that are not its own output."""
    out = mm.writes[0].source.name
    reads = [r for r in mm.reads if r.source.name != out]
    return (reads[0], reads[1]) if len(reads) == 2 else (None, None)


__all__ = ["LAYOUTS", "attention_roles"]
