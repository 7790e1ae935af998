"""Template shapes of an attention PrimFunc from its parameters' axis labels: the layout (BHSD, BSHD or SBHD), head
count, dtype and sizes of Q, K, V and out, and the additive mask's broadcast shape."""

from __future__ import annotations

from tvm import tirx

LAYOUTS = {("b", "h", "s", "d"): "BHSD", ("b", "s", "h", "d"): "BSHD", ("s", "b", "h", "d"): "SBHD"}


def dim_value(extent) -> int | str:
    """A buffer extent as the template shapes hold it: an int, or the text of a symbolic one ("past + seq")."""
    return int(extent) if isinstance(extent, tirx.IntImm) else str(extent)


def template_shapes(names: list, order: list, bufs: dict, labels: dict,
                    q: str, k: str, v: str, out: str) -> dict | None:
    """The template's shapes dict for parameters `names` with roles `order` (q, k, v and out the parameter names
    of those roles), or None when the labels do not describe one attention (a layout, head or size mismatch)."""
    shp = {r: [dim_value(x) for x in bufs[n].shape] for r, n in zip(order, names)
           if r in ("q", "k", "v", "mask", "out")}
    axes = {}
    for role, n in (("q", q), ("k", k), ("v", v), ("out", out)):
        seq = "q" if role in ("q", "out") else "k"
        got = tensor_layout(labels.get(n), shp[role], seq)
        if got is None:
            return None
        axes[role] = got  # (layout, {label: axis}, head divisor)
    dim = lambda role, lab: shp[role][axes[role][1][lab]]
    b, h, sq, d = dim("q", "b"), dim("q", "h"), dim("q", "s"), dim("q", "d")
    sk, hk, hv = dim("k", "s"), dim("k", "h"), dim("v", "h")
    if axes["q"][2] not in (1, None) or axes["out"][2] not in (1, None) or [dim("out", x) for x in "bhsd"] != [b, h, sq, d]:
        return None
    if not all(isinstance(x, int) for x in (h, hk, hv, d)):
        return None  # heads and head dim are static in every template
    for role, heads in (("k", hk), ("v", hv)):
        if h % heads or axes[role][2] not in (h // heads, None) or dim(role, "b") != b or dim(role, "d") != d:
            return None
    if dim("v", "s") != sk:
        return None
    shapes = {"batch": b, "heads": h, "kv_heads": hk, "v_heads": hv, "seq_q": sq, "seq_k": sk, "head_dim": d,
              "dtype": str(bufs[out].dtype), "mask": "additive" if "mask" in shp else "none", "causal": False,
              "q_layout": axes["q"][0], "k_layout": axes["k"][0], "v_layout": axes["v"][0],
              "out_layout": axes["out"][0], "where_guard": "const" in order}
    if str(bufs[q].dtype) != shapes["dtype"]:
        shapes["q_dtype"] = str(bufs[q].dtype)  # an fp32 Q (rotary in fp32) rounded to the compute dtype in the group
    if {str(bufs[k].dtype), str(bufs[v].dtype)} != {shapes["dtype"]}:
        return None
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
    return shapes


def tensor_layout(labels, shape, seq: str):
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
