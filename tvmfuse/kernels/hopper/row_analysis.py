"""Row-reduction analysis: reads a fused LayerNorm/RMSNorm-like PrimFunc as sums over rows and elementwise steps the row kernel rebuilds."""

from __future__ import annotations

import contextlib
import math

from tvm import s_tir, tirx
from tvm.sym import Analyzer
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.tirx.buffer import is_buffer_var

from tvmfuse.kernels.hopper.expr_nodes import BINARY as _BINARY
from tvmfuse.kernels.hopper.expr_nodes import CALL as _CALL
from tvmfuse.kernels.hopper.expr_nodes import LOAD as _LOAD

_F32, _DTYPES, _REDUCE = "float32", ("float16", "bfloat16", "float32"), tirx.IterVar.CommReduce


def _ext(iv) -> int:
    return int(iv.dom.extent)


def find(pairs, key, default=None):
    """The value paired with `key` (same_as) in (key, value) pairs."""
    return next((v for k, v in pairs if k.same_as(key)), default)


def analyze_rows(func: tirx.PrimFunc) -> tuple[dict | None, str]:
    """({rows, r, h, params, steps, inputs, outputs, n_red}, "") when `func` (static shapes) sums elementwise
    expressions over rows of h elements and writes its outputs elementwise over the same rows, from inputs at
    [row.., k], per-column parameters [k], constants and the sums at [row..]; else (None, why not)."""
    params = list(func.params)
    if not all(is_buffer_var(p) for p in params):  # a size passed in (arange's, a symbolic past's): no row kernel
        return None, "scalar parameters"
    if any(not isinstance(d, tirx.IntImm) for p in params for d in p.shape):
        return None, "symbolic shapes"
    is_param = lambda buf: any(buf.same_as(p) for p in params)
    is_red = lambda st: any(iv.iter_type == _REDUCE for iv in st.iter_vars)
    sch = s_tir.Schedule(func)
    for blk in sch.get_child_blocks(get_root_block(sch)):  # inline what is neither a sum nor an output
        if not is_red(sch.get(blk)) and not any(is_param(w.source) for w in sch.get(blk).writes):
            with contextlib.suppress(Exception):  # such a block stays and is refused below
                sch.compute_inline(blk)
    blocks = [sch.get(b) for b in sch.get_child_blocks(get_root_block(sch))]
    first = next((b for b in blocks if is_red(b)), None)
    if first is None:
        return None, "not a row reduction (no reduction block)"
    if any(not isinstance(iv.dom.extent, tirx.IntImm) for b in blocks for iv in b.iter_vars):
        return None, "symbolic sizes"
    rows, h = [_ext(iv) for iv in first.iter_vars[:-1] if _ext(iv) != 1], _ext(first.iter_vars[-1])
    if not rows:
        return None, "a single row (decode): the generic schedule spreads it over a whole block"
    if h % 256:
        return None, f"row length {h} is not a multiple of 256 (8 elements x 32 lanes)"
    info = {"rows": rows, "r": math.prod(rows), "h": h, "params": params, "steps": [], "inputs": [], "outputs": []}
    known = []  # (buffer, "row" | "red") for what earlier steps made
    for st in blocks:
        red, kinds = is_red(st), [iv.iter_type for iv in st.iter_vars]
        if red and (kinds[-1] != _REDUCE or sum(k != tirx.IterVar.DataPar for k in kinds) > 1):
            return None, "a reduction over more than the innermost axis"
        nonunit = [iv for iv in st.iter_vars if _ext(iv) != 1]
        if [_ext(iv) for iv in nonunit] != rows + [h]:
            return None, "rows differ" if red else "a per-row step that is not a sum (a per-row output?)"
        roles = [(iv.var, i if i < len(rows) else "k") for i, iv in enumerate(nonunit)]
        roles += [(iv.var, None) for iv in st.iter_vars if _ext(iv) == 1]
        ana = Analyzer()  # a reshape's index inlined here, e.g. [(k // h + i) % rows, k % h], is [i, k]
        for iv in st.iter_vars:
            ana.bind(iv.var, iv.dom)
        stores = list(st.body) if isinstance(st.body, tirx.SeqStmt) else [st.body]  # a tuple sum: several
        made = []
        for s in stores:
            if not isinstance(s, tirx.BufferStore) or (not red and len(stores) > 1):
                return None, "unexpected block structure"
            buf, v = s.buffer, s.value
            if red and not (isinstance(v, tirx.Add) and isinstance(v.a, _LOAD) and v.a.source.same_as(buf)):
                return None, "a reduction that is not a sum"
            loads = []

            def look(ld, want32, loads=loads, roles=roles, known=known, ana=ana):
                if want32 is not None:  # a load, not a block var
                    loads.append((ld, _classify(ld, roles, rows, h, known, is_param, ana)))
                return tirx.const(0, _F32 if want32 else ld.ty.dtype)
            try:  # every load classified, every node one the kernel rebuilds
                at = _index_roles(s.indices, roles, buf, ana)
                conv(v.b if red else v, look)
            except ValueError as err:
                return None, str(err)
            if at != list(range(len(rows))) + ([] if red else ["k"]) or (red and is_param(buf)):
                return None, "a sum not written at [row] or an output" if red else "an output not written at [row, k]"
            if str(buf.dtype) not in _DTYPES:
                return None, f"dtype {buf.dtype} (float16, bfloat16 or float32 only)"
            info["inputs"] += [b for i, (_, (k, b)) in enumerate(loads) if k == "row" and find(known, b) is None
                               and not any(b.same_as(x) for x in info["inputs"] + [y for _, (_, y) in loads[:i]])]
            made.append({"kind": "red" if red else "row", "buf": buf, "expr": v.b if red else v, "roles": roles,
                         "loads": loads, "out": is_param(buf), "red": None})
        info["steps"] += made
        known += [(m["buf"], m["kind"]) for m in made]
    info["outputs"] = [s["buf"] for s in info["steps"] if s["out"]]
    sums = [s for s in info["steps"] if s["kind"] == "red"]
    for j, s in enumerate(sums):
        s["red"] = j
    info["n_red"] = len(sums)
    if not info["outputs"] or info["steps"][-1]["kind"] != "row":
        return None, "no elementwise output after the sums"
    return info, ""


def _index_roles(indices, roles, buf, ana=None) -> list:
    """The roles (row dim i, "k") of a block's `indices` into `buf`, constants into unit dims left out and others
    "const"; ValueError where an index is computed (after simplifying with `ana`, which knows the block vars' ranges)."""
    out = []
    for idx, ext in zip(indices, buf.shape):
        idx = ana.simplify(idx) if ana is not None else idx
        role = find(roles, idx, "?") if isinstance(idx, tirx.Var) else None if isinstance(idx, tirx.IntImm) else "?"
        if role == "?":
            raise ValueError("an index that is not a block variable")
        if role is not None or int(ext) != 1:
            out.append("const" if role is None else role)
    return out


def _classify(load, roles, rows, h, known, is_param, ana=None) -> tuple[str, object]:
    """("row" | "col" | "red" | "scalar", buffer) for a load in a block with these (var, role) pairs: a row
    tensor [rows.., h] at [row.., k], a column parameter [h] at [k], a row sum at [row..], a parameter at
    constant indices."""
    buf = load.source
    pos, made, dims = _index_roles(load.indices, roles, buf, ana), find(known, buf), list(range(len(rows)))
    sizes = [int(d) for d in buf.shape if int(d) != 1]
    if pos == dims + ["k"] and sizes == rows + [h] and (made == "row" or (made is None and is_param(buf))):
        kind = "row"
    elif pos == dims and made == "red":
        kind = "red"
    elif pos == ["k"] and sizes == [h] and made is None and is_param(buf):
        kind = "col"
    elif all(p == "const" for p in pos) and made is None and is_param(buf):
        return "scalar", buf
    else:
        raise ValueError(f"reads {buf.name} at other indices than [row, k], [k], [row] or constants")
    if str(buf.dtype) not in _DTYPES:
        raise ValueError(f"dtype {buf.dtype} (float16, bfloat16 or float32 only)")
    return kind, buf


def conv(e, look):
    """`e` with loads replaced by look(load, want_fp32) (Cast(float32, load) asks for the fp32 register itself)
    and block vars by look(var, None); ValueError on nodes the kernel does not rebuild."""
    go = lambda x: conv(x, look)
    if isinstance(e, tirx.Var):
        return look(e, None)
    if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
        return e
    if isinstance(e, _LOAD):
        return look(e, False)
    if isinstance(e, tirx.Cast):
        if str(e.ty.dtype) == _F32 and isinstance(e.value, _LOAD):
            return look(e.value, True)
        return tirx.Cast(str(e.ty.dtype), go(e.value))
    if isinstance(e, _BINARY):
        return type(e)(go(e.a), go(e.b))
    if isinstance(e, tirx.Select):
        return tirx.Select(go(e.condition), go(e.true_value), go(e.false_value))
    if isinstance(e, _CALL):
        return _CALL(e.op, [go(a) for a in e.args], attrs=e.attrs, ty_args=e.ty_args, ret_ty=e.ty)
    raise ValueError(f"expression {type(e).__name__} not supported")
