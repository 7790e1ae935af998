"""Attention (multi-head layout, scale, mask, GQA) and rotary position embedding (rotate-half)."""

from __future__ import annotations

from typing import Callable

from tvm import relax
from tvm.relax.dpl import DFPattern, is_op, is_tuple, wildcard
from tvm.relax.transform import PatternCheckContext

from tvmfuse.patterns.builders import Annotated, cast, const, upcast
from tvmfuse.patterns.common import finish, only_cast_follows, producer, reject
from tvmfuse.patterns.readers import as_int, dim_str, dtype_of, ndim, same_dim, scalar, shape_of

_COMPARE = {"relax.less", "relax.less_equal", "relax.greater", "relax.greater_equal"}


def _op(name: str, *args) -> DFPattern:
    return is_op(f"relax.{name}")(*args)


def _heads(p: DFPattern) -> DFPattern:
    """[B,S,H,D] -> permute -> [B,H,S,D], or already in head layout. The head-split reshapes stay outside:
    they are free views, and inlined with symbolic dims they sent TVM's simplifier into a near-endless loop."""
    return _op("permute_dims", p) | p


def _cache_heads(p: DFPattern) -> DFPattern:
    """K or V as the heads: [B,S,H,D] or an in-place cache's [S,B,KV,D] view, permuted (and, where the graph
    computes in fp32 around an fp16/bf16 cache, cast up), or already in head layout."""
    return cast(_op("permute_dims", p)) | p


def _gqa(p: DFPattern) -> tuple[DFPattern, DFPattern]:
    """repeat_kv: [B,KV,S,D] -> expand_dims -> broadcast_to -> reshape -> [B,H,S,D]; also the expand_dims."""
    expand = _op("expand_dims", p)
    return _op("reshape", _op("broadcast_to", expand, wildcard()), wildcard()), expand


def _key_transpose(p: DFPattern) -> DFPattern:
    """K^T: one permute, or (dynamo exports) reshape [B,H,S,D]->[B*H,S,D], permute(0,2,1), reshape->[B,H,D,S]."""
    return _op("permute_dims", p) | _op("reshape", _op("permute_dims", _op("reshape", p, wildcard())), wildcard())


def make_attention_pattern() -> Annotated:
    """softmax(softcap(scale * Q @ K^T) [+ mask]) @ V with the multi-head transposes (and GQA repeat) around it,
    softcap(x) = cap * tanh(x / cap) where the model caps its scores (Gemma 2), else x. In mixed
    precision each matmul accumulates in fp32 and is cast to the compute dtype, the scores are cast back up for
    the mask and softmax (fp32), and the probabilities down again for P @ V: the optional `cast`s. Q and K may
    be scaled in fp32 and cast down before Q K^T, V cast down before P V (a rotary embedding computed in fp32 at
    symbolic positions, an fp16/bf16 KV cache read into the fp32 graph)."""
    q_in, k_in, v_in, mask = wildcard(), wildcard(), wildcard(), wildcard()
    k_src, v_src = _cache_heads(k_in), _cache_heads(v_in)
    (k_gqa, k_exp), (v_gqa, _) = _gqa(k_src), _gqa(v_src)
    q = _heads(q_in)
    k = _key_transpose(k_gqa) | _key_transpose(k_src)
    v = cast(v_gqa | v_src)
    qs = cast(_op("multiply", q, const())) | cast(_op("divide", q, const())) | cast(q)
    ks = cast(_op("multiply", k, const())) | cast(_op("divide", k, const())) | cast(k)
    scores = _op("matmul", qs, ks)
    scores_out = cast(cast(scores))
    scaled = _op("multiply", scores_out, const()) | _op("divide", scores_out, const()) | scores_out
    # Gemma 2's soft cap: cap * tanh(scores / cap), in the compute dtype (cast up for the mask)
    cap_in = _op("divide", scaled, const())
    capped = cast(_op("multiply", cast(_op("tanh", cast(cap_in))), const()))
    capped_or_scaled = capped | scaled
    masked = _op("add", capped_or_scaled, mask) | capped_or_scaled
    sm = _op("nn.softmax", upcast(masked))
    probs = _op("where", _op("isnan", sm), const(), sm) | sm
    out = _op("matmul", cast(probs), v)
    out_cast = cast(out)
    # the head merge [B,H,S,D] -> [B,S,H,D] (out stored BSHD), through a reshape that keeps the shape as the
    # legacy GPT-2 export writes it; the [B,S,H*D] reshape after it stays outside (a view)
    out_same = _op("reshape", out_cast, wildcard())
    out_perm = _op("permute_dims", out_same | out_cast)
    root = out_perm | out_cast
    return root, {"q": q, "k": k, "v": v, "scores": scores, "masked": masked, "softmax": sm, "out": out,
                  "k_exp": k_exp, "out_same": out_same, "out_perm": out_perm, "cap_in": cap_in, "capped": capped}


def check_attention(ctx: PatternCheckContext) -> bool:
    name = "tvmfuse.attention"
    ann = dict(ctx.annotated_expr.items())
    scores, out, sm = ann["scores"], ann["out"], ann["softmax"]
    q_t, k_t = scores.args[0], scores.args[1]
    k = ann["k"]
    if k.op.name == "relax.reshape" and batched_transpose_source(k, ctx.matched_bindings.get) is None:
        return reject(ctx, name, "K's reshape/permute/reshape is not a transpose of the last two axes")
    if ndim(out) != 4 or ndim(q_t) != 4 or ndim(k_t) != 4:
        return reject(ctx, name, f"not 4-D multi-head tensors (out rank {ndim(out)})")
    b, h, sq, d = shape_of(q_t)
    if not same_dim(shape_of(k_t)[2], d):
        return reject(ctx, name, "Q and K head dims differ")
    sk = shape_of(k_t)[3]
    if as_int(sm.attrs.axis) not in (-1, 3):
        return reject(ctx, name, f"softmax over axis {sm.attrs.axis}, not the key axis")
    if not same_dim(shape_of(out.args[1])[2], sk):
        return reject(ctx, name, "V length differs from K length")
    if only_cast_follows(ctx):  # the fp32-accumulating P @ V is only cast down: the match ending at the cast
        return reject(ctx, name, f"P @ V accumulates in {dtype_of(out)} and is only cast to another dtype: "
                      "the kernel ends at the cast")
    if _in(ctx, ann.get("out_perm")):
        perm = ann["out_perm"]  # axes None: reversed
        axes = [3, 2, 1, 0] if perm.attrs.axes is None else [as_int(a) for a in perm.attrs.axes]
        if axes != [0, 2, 1, 3]:
            return reject(ctx, name, f"output permute {axes} is not the head merge [0, 2, 1, 3]")
        if _in(ctx, ann.get("out_same")):
            same = ann["out_same"]
            src, dst = shape_of(same.args[0]) or [], shape_of(same) or []
            if len(src) != len(dst) or not all(same_dim(a, b) for a, b in zip(src, dst)):
                return reject(ctx, name, "the reshape before the output permute changes the shape")
    mask, causal = "none", False
    masked = ann.get("masked")
    if masked is not None and getattr(masked.op, "name", "") == "relax.add":
        m = [a for a in masked.args if a not in ctx.matched_bindings]
        m = m[0] if m else masked.args[1]
        ms = shape_of(m) or []
        if len(ms) != 4 or not same_dim(ms[-1], sk) or dim_str(ms[-2]) not in ("1", dim_str(sq)):
            return reject(ctx, name, f"mask shape {[dim_str(x) for x in ms]} does not broadcast to [B,H,Sq,Sk]")
        mask, causal = "additive", _is_causal(m)
    softcap = 0.0
    if _in(ctx, ann.get("cap_in")):
        cap_in, capped = ann["cap_in"], ann["capped"]
        if capped.op.name == "relax.astype":  # cast up for the mask: the multiply is its argument's binding
            capped = ctx.matched_bindings.get(capped.args[0])
        caps = (_const_scalar(ctx, cap_in.args[1]), _const_scalar(ctx, capped.args[1]) if capped is not None else None)
        if caps[0] is None or caps[0] != caps[1] or not caps[0] > 0:
            return reject(ctx, name, f"scores / {caps[0]} -> tanh -> * {caps[1]} is not a soft cap (one positive "
                          "constant twice)")
        softcap = caps[0]
    kv = ann.get("k_exp")
    kv_heads = shape_of(kv.args[0])[1] if kv is not None and _in(ctx, kv) else h
    scale = [scalar(a) for c in ctx.matched_bindings.values() if c.op.name in ("relax.multiply", "relax.divide")
             for a in c.args if scalar(a) is not None]
    info = {"batch": dim_str(b), "heads": dim_str(h), "kv_heads": dim_str(kv_heads), "seq_q": dim_str(sq), "seq_k": dim_str(sk),
            "head_dim": dim_str(d), "mask": mask, "causal": causal, "scale_consts": scale, "softcap": softcap,
            "layout": "BSHD" if _in(ctx, ann.get("q")) and ann["q"].op.name == "relax.permute_dims" else "BHSD"}
    return finish(ctx, name, info)


def _const_scalar(ctx: PatternCheckContext, expr) -> float | None:
    """The value of a scalar constant (through its cast to the compute dtype, inline or bound), else None."""
    if isinstance(expr, relax.Var):
        expr = ctx.matched_bindings.get(expr, expr)
    if isinstance(expr, relax.Call) and expr.op.name == "relax.astype":
        expr = expr.args[0]
    return scalar(expr)


def _in(ctx: PatternCheckContext, expr) -> bool:
    var = ctx.value_to_bound_var.get(expr) if expr is not None else None
    return var is not None and var in ctx.matched_bindings


def _is_causal(mask, depth: int = 12) -> bool:
    """The mask is computed from a comparison of two position ranges giving [.., Sq, Sk] (a causal mask)."""
    stack, seen = [(mask, 0)], set()
    while stack:
        expr, level = stack.pop()
        name = getattr(expr, "name", None)
        call = producer(name) if name else None
        if call is None or name in seen or level > depth:
            continue
        seen.add(name)
        if getattr(call.op, "name", "") in _COMPARE and all(scalar(a) is None for a in call.args):
            shp = shape_of(call) or shape_of(expr)
            if shp and len(shp) >= 2 and dim_str(shp[-1]) != "1" and dim_str(shp[-2]) != "1":
                return True
        stack.extend((a, level + 1) for a in call.args if hasattr(a, "name"))
    return False


def batched_transpose_source(call, bound) -> relax.Expr | None:
    """x when `call` is reshape(permute_dims(reshape(x, [N,S,D]), [0,2,1]), [B,H,D,S]) with x of shape
    [B,H,S,D] (a transpose of the last two axes, as dynamo exports write K^T), else None. `bound` maps a Var
    to the call it is bound to (or None)."""
    if getattr(call, "op", None) is None or call.op.name != "relax.reshape":
        return None
    perm = bound(call.args[0])
    if perm is None or perm.op.name != "relax.permute_dims" or [as_int(a) for a in perm.attrs.axes or []] != [0, 2, 1]:
        return None
    inner = bound(perm.args[0])
    if inner is None or inner.op.name != "relax.reshape":
        return None
    x = inner.args[0]
    xs, ins, outs = shape_of(x), shape_of(inner), shape_of(call)
    if not xs or not ins or not outs or len(xs) != 4 or len(ins) != 3 or len(outs) != 4:
        return None
    b, h, s, d = xs
    ok = all(same_dim(u, v) for u, v in ((ins[1], s), (ins[2], d), (outs[0], b), (outs[1], h), (outs[2], d),
                                         (outs[3], s)))
    return x if ok else None


def make_rotary_embedding_pattern(sliced: bool = False, partial: bool = False) -> Callable[[], Annotated]:
    """y = x * cos + rotate_half(x) * sin, rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2]); or with the
    head split's permute inside, as TVM imports Llama's Q: permute(x * cos) + rotate_half(permute(x)) * sin; or
    before both halves, as Qwen3 (after its per-head Q/K norms) and Gemma 2 have it: permute(x) * cos +
    rotate_half(permute(x)) * sin (where the permute stayed outside, it was a transpose kernel of its own).
    `sliced`: x is a slice of a wider tensor, through its head reshape or not (Phi-3's Q and K, cut from its one
    QKV projection's output: each slice was a kernel writing a copy for the rotary kernel to read). `partial`: the
    rotary embedding of the first r dims of each head, the rest passed through, concat(rope(h[..., :r]), h[..., r:]),
    h the heads or their permute (GPT-NeoX and Pythia, Phi-2, StableLM: the two slices and the concatenation were
    three kernels beside the rotary one)."""
    def make() -> Annotated:
        return _rotary(sliced, partial)
    make.__name__ = f"make_{rotary_embedding_name(sliced, partial).split('.')[1]}_pattern"
    return make


def rotary_embedding_name(sliced: bool = False, partial: bool = False) -> str:
    """The table's name of the rotary embedding with (`sliced`) a slice in front, (`partial`) of a head's first dims."""
    return "tvmfuse." + "slice_" * sliced + "partial_" * partial + "rotary_embedding"


def check_rotary_embedding(sliced: bool = False, partial: bool = False) -> Callable[[PatternCheckContext], bool]:
    name = rotary_embedding_name(sliced, partial)

    def check(ctx: PatternCheckContext) -> bool:
        return (_check_partial(ctx, name) if partial else True) and _check_rotary(ctx, name)
    check.__name__ = f"check_{name.split('.')[1]}"
    return check


def _rotary(sliced: bool, partial: bool) -> Annotated:
    x = wildcard()
    if sliced:
        cut = _op("strided_slice", wildcard(), wildcard(), wildcard(), wildcard(), wildcard())
        x = _op("reshape", cut, wildcard()) | cut
    if partial:
        heads = _op("permute_dims", x) | x
        x = _op("strided_slice", heads, wildcard(), wildcard(), wildcard(), wildcard())
    xh = _op("permute_dims", x)
    src = xh | x
    hi = _op("strided_slice", src, wildcard(), wildcard(), wildcard(), wildcard())
    lo = _op("strided_slice", src, wildcard(), wildcard(), wildcard(), wildcard())
    rot = _op("concat", is_tuple([_op("negative", hi), lo]))
    cos, sin = wildcard(), wildcard()
    xc = _op("multiply", x, cos)
    xhc = _op("multiply", xh, cos)
    y = _op("add", _op("permute_dims", xc) | xhc | xc, _op("multiply", rot, sin))
    ann = {"hi": hi, "lo": lo, "rot": rot, "y": y, "xh": xh, "xc": xc, "xhc": xhc}
    if not partial:
        return y, ann
    rest = _op("strided_slice", heads, wildcard(), wildcard(), wildcard(), wildcard())
    root = _op("concat", is_tuple([y, rest]))
    return root, {**ann, "rotated": x, "rest": rest, "joined": root}


def _last_axis_cut(call, rank: int) -> tuple | None:
    """(begin, extent, stride) of a strided_slice of the last axis alone (None where one is not a known int), else
    None."""
    axes, begins = [as_int(a) for a in call.args[1]], [as_int(a) for a in call.args[2]]
    strides = [as_int(a) for a in call.args[4]] if len(call.args) > 4 else [1]
    if axes not in ([rank - 1], [-1]) or len(begins) != 1 or len(strides) != 1:
        return None
    return begins[0], as_int(shape_of(call)[-1]), strides[0]


def _check_partial(ctx: PatternCheckContext, name: str) -> bool:
    """The rotated part is h[..., :r] and the rest h[..., r:] of one h on its last axis, joined on that axis."""
    ann = dict(ctx.annotated_expr.items())
    heads = ann["rotated"].args[0]
    rank, width = ndim(heads), as_int(shape_of(heads)[-1])
    r = as_int(shape_of(ann["rotated"])[-1])
    for part, begin, extent in (("rotated", 0, r), ("rest", r, None if width is None or r is None else width - r)):
        if extent is None or _last_axis_cut(ann[part], rank) != (begin, extent, 1):
            which = ":r" if part == "rotated" else "r:"
            return reject(ctx, name, f"{part} slice is not h[..., {which}] of the last axis")
    if as_int(ann["joined"].attrs.axis) not in (-1, rank - 1):
        return reject(ctx, name, "the rotated part and the rest are not joined on the last axis")
    return True


def _check_rotary(ctx: PatternCheckContext, name: str) -> bool:
    ann = dict(ctx.annotated_expr.items())
    x = ann["hi"].args[0]
    first = ctx.matched_bindings.get(ann["y"].args[0])  # x * cos, its permute, or permute(x) * cos
    before_both = first is not None and _in(ctx, ann.get("xhc"))  # the permute before both halves
    if first is None or _in(ctx, ann.get("xh")) != (first.op.name == "relax.permute_dims" or before_both):
        return reject(ctx, name, "the head permute is on one side of the sum only")
    if _in(ctx, ann.get("xh")):
        axes = [[as_int(a) for a in c.attrs.axes or []] for c in ((ann["xh"],) if before_both else (ann["xh"], first))]
        if axes[0] != axes[-1] or not axes[0] or axes[0][-1] != len(axes[0]) - 1:
            return reject(ctx, name, f"permutes {axes} differ or move the head dim")
    d = as_int(shape_of(x)[-1])
    if d is None or d % 2:
        return reject(ctx, name, f"head dim {shape_of(x)[-1]} is not a known even size")
    rank = ndim(x)
    for part, begin in (("hi", d // 2), ("lo", 0)):
        cut = _last_axis_cut(ann[part], rank)
        if cut is None or cut[:2] != (begin, d // 2):
            return reject(ctx, name, f"{part} slice is not the {'upper' if begin else 'lower'} half of the last axis")
    if as_int(ann["rot"].attrs.axis) not in (-1, rank - 1):
        return reject(ctx, name, "rotate-half concat is not on the last axis")
    for c in ctx.matched_bindings.values():
        if c.op.name == "relax.multiply" and any(as_int((shape_of(a) or [0])[-1]) not in (d, 1) for a in c.args):
            return reject(ctx, name, "cos/sin do not broadcast over the head dim")
    shp = shape_of(x)
    return finish(ctx, name, {"head_dim": d, "heads": dim_str(shp[1]) if rank == 4 else "?",
                              "seq": dim_str(shp[-2])})
