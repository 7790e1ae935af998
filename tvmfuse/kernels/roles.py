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
from tvm.sym import Analyzer

LAYOUTS = {("b", "h", "s", "d"): "BHSD", ("b", "s", "h", "d"): "BSHD"}


def _blocks(fn: tirx.PrimFunc) -> list:
    sch = tvm.s_tir.Schedule(fn)
    root = sch.get(sch.get_sblock("root"))
    out, todo = [], [sch.get_sblock("root")]
    while todo:
        for rv in sch.get_child_blocks(todo.pop(0)):
            out.append(sch.get(rv))
            todo.append(rv)
    return [b for b in out if not b.same_as(root)]


class _Conflict(Exception):
    pass


def _analyzer(blk) -> Analyzer:
    ana = Analyzer()
    for iv in blk.iter_vars:
        ana.bind(iv.var, iv.dom)
    return ana


def _index(expr, ana):
    """('var', v, div) for v or v // div; ('const',) for a constant; None for anything else."""
    e = ana.simplify(expr)
    if isinstance(e, tirx.IntImm):
        return ("const",)
    if isinstance(e, tirx.Var):
        return ("var", e, 1)
    if isinstance(e, tirx.FloorDiv) and isinstance(e.a, tirx.Var) and isinstance(e.b, tirx.IntImm):
        return ("var", e.a, int(e.b.value))
    return None


def _point(region) -> list | None:
    if any(not (isinstance(r.extent, tirx.IntImm) and int(r.extent) == 1) for r in region.region):
        return None
    return [r.min for r in region.region]


def _label_axes(blocks, seeds: dict, bufs: dict) -> dict:
    """{buffer name: [label or None per axis]}; a label is (name, div): the axis indexes `name // div`."""
    labels: dict[str, list] = {n: list(v) for n, v in seeds.items()}

    def merge(name, axis, lab):
        cur = labels.setdefault(name, [None] * len(bufs[name].shape))
        if lab is None:
            return False
        if cur[axis] is None:
            cur[axis] = lab
            return True
        if cur[axis] != lab:
            raise _Conflict(f"{name} axis {axis}: {cur[axis]} vs {lab}")
        return False

    for _ in range(4):  # labels settle in two sweeps; a few more cost nothing
        changed = False
        for blk, red in reversed(blocks):  # backwards: from what a block writes to what it reads
            if len(blk.writes) != 1 or blk.writes[0].source.name not in labels:
                continue
            ana, var_lab = _analyzer(blk), dict(red)
            w = blk.writes[0]
            for idx, lab in zip(_point(w) or [], labels[w.source.name]):
                if isinstance(idx, tirx.Var) and lab is not None:
                    var_lab[idx] = lab
            for r in blk.reads:
                for axis, idx in enumerate(_point(r) or []):
                    ix = _index(idx, ana)
                    if ix and ix[0] == "var" and ix[1] in var_lab:
                        name, div = var_lab[ix[1]]
                        changed |= merge(r.source.name, axis, (name, div * ix[2]))
        for blk, _ in blocks:  # forwards: to blocks (the output permute) whose reads are labelled
            if len(blk.writes) != 1:
                continue
            ana, var_lab = _analyzer(blk), {}
            for r in blk.reads:
                for idx, lab in zip(_point(r) or [], labels.get(r.source.name) or []):
                    ix = _index(idx, ana)
                    if ix and ix[0] == "var" and ix[2] == 1 and lab is not None:
                        var_lab[ix[1]] = lab
            w = blk.writes[0]
            for axis, idx in enumerate(_point(w) or []):
                if isinstance(idx, tirx.Var) and idx in var_lab:
                    changed |= merge(w.source.name, axis, var_lab[idx])
        if not changed:
            break
    return labels


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
    return getattr(store, "buffer", None) or store.source


def _loads(expr, name: str, depth: int = 0) -> bool:
    """Whether expression `expr` reads buffer `name` (through casts and arithmetic)."""
    if isinstance(expr, TensorLoad):
        return expr.source.name == name
    if depth > 16:
        return True  # be conservative
    kids = [getattr(expr, f) for f in ("a", "b", "value", "condition", "true_value", "false_value")
            if hasattr(expr, f)] + list(getattr(expr, "args", []) or [])
    return any(isinstance(k, tvm.ir.PrimExpr) and _loads(k, name, depth + 1) for k in kids)


def attention_roles(fn: tirx.PrimFunc) -> dict | None:
    """{'order': role per parameter ('q','k','v','mask','out','scale','const'), 'uses': {param index:
    (multiplies, divides)} for the scale scalars, 'shapes': template shapes (with the layout of Q, K, V and
    out, and the K and V head counts)} for an unscheduled softmax(scale * Q K^T [+ mask]) V PrimFunc, else
    None."""
    names = [p.name for p in fn.params]
    blocks = _blocks(fn)
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
        labels = _label_axes(blocks_red, seeds, bufs)
    except _Conflict:
        return None

    order, uses = [], {}
    for i, n in enumerate(names):
        if n in (q, k, v, out):
            order.append({q: "q", k: "k", v: "v", out: "out"}[n])
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
    if order.count("mask") > 1 or order.count("const") > 1 or "scale" not in order:
        return None

    shp = {r: [int(x) for x in bufs[n].shape] for r, n in zip(order, names) if r in ("q", "k", "v", "mask", "out")}
    axes = {}
    for role, n in (("q", q), ("k", k), ("v", v), ("out", out)):
        seq = "q" if role in ("q", "out") else "k"
        got = _tensor_layout(labels.get(n), shp[role], seq)
        if got is None:
            return None
        axes[role] = got  # (layout, {label: axis}, head divisor)
    dim = lambda role, lab: shp[role][axes[role][1][lab]]
    b, h, sq, d = dim("q", "b"), dim("q", "h"), dim("q", "s"), dim("q", "d")
    sk, hk, hv = dim("k", "s"), dim("k", "h"), dim("v", "h")
    if axes["q"][2] not in (1, None) or axes["out"][2] not in (1, None) or [dim("out", x) for x in "bhsd"] != [b, h, sq, d]:
        return None
    for role, heads in (("k", hk), ("v", hv)):
        if h % heads or axes[role][2] not in (h // heads, None) or dim(role, "b") != b or dim(role, "d") != d:
            return None
    if dim("v", "s") != sk:
        return None
    shapes = {"batch": b, "heads": h, "kv_heads": hk, "v_heads": hv, "seq_q": sq, "seq_k": sk, "head_dim": d,
              "dtype": str(bufs[out].dtype), "mask": "additive" if "mask" in shp else "none", "causal": False,
              "q_layout": axes["q"][0], "k_layout": axes["k"][0], "v_layout": axes["v"][0],
              "out_layout": axes["out"][0], "where_guard": "const" in order}
    if "mask" in shp:
        mname = names[order.index("mask")]
        mlab = [x[0] if x else None for x in (labels.get(mname) or [None] * 4)]
        want = ["b", "h", "q", "k"]
        if any(lab not in (None, w) or (lab is None and size != 1) for lab, w, size in zip(mlab, want, shp["mask"])):
            return None
        if shp["mask"][3] != sk or shp["mask"][2] not in (1, sq) or shp["mask"][1] not in (1, h) \
                or shp["mask"][0] not in (1, b):
            return None
        shapes["mask_shape"], shapes["mask_dtype"] = tuple(shp["mask"]), str(bufs[mname].dtype)
    return {"order": order, "uses": uses, "shapes": shapes, "scale": None}


def _operands(mm):
    """(A, B) read regions of a matmul block: the two reads that are not its own output."""
    out = mm.writes[0].source.name
    reads = [r for r in mm.reads if r.source.name != out]
    return (reads[0], reads[1]) if len(reads) == 2 else (None, None)


def _tensor_layout(labels, shape, seq: str):
    """(layout, {b,h,s,d: axis}, head divisor) of a parameter from its axis labels; axes without a label
    must be of extent 1 and take the missing labels in b, h, s, d order (any choice is the same memory)."""
    if labels is None:
        return None
    names = [("s" if lab[0] == seq else lab[0]) if lab else None for lab in labels]
    if any(n not in (None, "b", "h", "s", "d") for n in names) or len({n for n in names if n}) != \
            len([n for n in names if n]):
        return None
    missing = [x for x in "bhsd" if x not in names]
    for i, n in enumerate(names):
        if n is None:
            if shape[i] != 1 or not missing:
                return None
            names[i] = missing.pop(0)
    layout = LAYOUTS.get(tuple(names))
    if layout is None:
        return None
    divs = {lab[0]: lab[1] for lab in labels if lab}
    if any(div != 1 for lab, div in divs.items() if lab != "h"):
        return None
    return layout, {n: i for i, n in enumerate(names)}, divs.get("h")  # None: a filled-in head axis of 1
