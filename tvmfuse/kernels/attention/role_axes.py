"""Axis labels of a lowered attention PrimFunc's buffers (b, h, q, k, d, or v // G for a GQA repeat), seeded at its
two matmuls and flowed backwards to the parameters and forwards to the output through every block."""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.sym import Analyzer


def sblocks(fn: tirx.PrimFunc) -> list:
    sch = tvm.s_tir.Schedule(fn)
    root = sch.get(sch.get_sblock("root"))
    out, todo = [], [sch.get_sblock("root")]
    while todo:
        for rv in sch.get_child_blocks(todo.pop(0)):
            out.append(sch.get(rv))
            todo.append(rv)
    return [b for b in out if not b.same_as(root)]


class LabelConflict(Exception):
    pass


def size_vars(bufs: dict) -> list:
    """The symbolic sizes the buffers' shapes use (batch, seq, past)."""
    found = {}
    for buf in bufs.values():
        for extent in buf.shape:
            for var in tirx.analysis.undefined_vars(extent):
                found.setdefault(var.name, var)
    return list(found.values())


#: what each symbolic size stands for while indices are read: distinct primes, far above any static extent, so
#: a reshape's (i * (past + seq) + j) // (past + seq) with j < past + seq simplifies to i (TVM's simplifier does
#: not do it with the symbols) and no two sizes can be mistaken for each other
_SIZE_STAND_INS = (1000003, 1000033, 1000037, 1000039, 1000081, 1000099)


def _analyzer(blk, sizes: list) -> Analyzer:
    """An analyzer knowing the block's iteration ranges, with each symbolic size bound to its stand-in."""
    ana = Analyzer()
    if len(sizes) > len(_SIZE_STAND_INS):
        raise LabelConflict(f"{len(sizes)} symbolic sizes")
    for var, value in zip(sizes, _SIZE_STAND_INS):
        ana.bind(var, tirx.IntImm(str(var.ty), value))
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


def label_axes(blocks, seeds: dict, bufs: dict) -> dict:
    """{buffer name: [label or None per axis]}; a label is (name, div): the axis indexes `name // div`."""
    labels: dict[str, list] = {n: list(v) for n, v in seeds.items()}
    sizes = size_vars(bufs)

    def merge(name, axis, lab):
        cur = labels.setdefault(name, [None] * len(bufs[name].shape))
        if lab is None:
            return False
        if cur[axis] is None:
            cur[axis] = lab
            return True
        if cur[axis] != lab:
            raise LabelConflict(f"{name} axis {axis}: {cur[axis]} vs {lab}")
        return False

    for _ in range(4):  # labels settle in two sweeps; a few more cost nothing
        changed = False
        for blk, red in reversed(blocks):  # backwards: from what a block writes to what it reads
            if len(blk.writes) != 1 or blk.writes[0].source.name not in labels:
                continue
            ana, var_lab = _analyzer(blk, sizes), dict(red)
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
            ana, var_lab = _analyzer(blk, sizes), {}
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
