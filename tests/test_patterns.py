"""Each table entry on a tiny ONNX graph: fused into ONE kernel that matches onnxruntime, and blocked (with
the reason recorded, module unchanged there) when an intermediate is used outside the match."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnx_models
from checks import check_against_ort, lower_model
from tvmfuse.frontend.importer import import_model

RNG = np.random.default_rng(0)


def _t(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _c(name, value, np_dtype=np.float32):
    a = np.asarray(value, dtype=np_dtype)
    return helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape, a.ravel().tolist())


def _model(nodes, inputs, outputs, inits):
    m = helper.make_model(helper.make_graph(nodes, "t", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    onnx.checker.check_model(m)
    return m


def _n(op, ins, outs, **kw):
    return helper.make_node(op, ins, [outs] if isinstance(outs, str) else outs, **kw)


def _act_nodes(act: str, x: str) -> tuple[list, list]:
    """Nodes computing y from x as exporters decompose the activation, and the constants they use."""
    if act == "gelu":
        return ([_n("Div", [x, "sqrt2"], "a0"), _n("Erf", ["a0"], "a1"), _n("Add", ["a1", "one"], "a2"),
                 _n("Mul", [x, "a2"], "a3"), _n("Mul", ["a3", "half"], "y")],
                [_c("sqrt2", math.sqrt(2)), _c("one", 1.0), _c("half", 0.5)])
    if act == "gelu_tanh":
        return ([_n("Pow", [x, "three"], "a0"), _n("Mul", ["a0", "k"], "a1"), _n("Add", [x, "a1"], "a2"),
                 _n("Mul", ["a2", "c"], "a3"), _n("Tanh", ["a3"], "a4"), _n("Mul", [x, "half"], "a5"),
                 _n("Add", ["a4", "one"], "a6"), _n("Mul", ["a5", "a6"], "y")],
                [_c("three", 3.0), _c("k", 0.044715), _c("c", math.sqrt(2 / math.pi)), _c("half", 0.5),
                 _c("one", 1.0)])
    if act == "silu":
        return [_n("Sigmoid", [x], "a0"), _n("Mul", [x, "a0"], "y")], []
    if act in ("relu", "tanh"):
        return [_n(act.capitalize(), [x], "y")], []
    return [_n("Identity", [x], "y")], []


def matmul_bias(act="gelu", m=8, k=32, n=64, leak=None, dtype=np.float32) -> onnx.ModelProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, consts = _act_nodes(act, "h")
    nodes = [_n("MatMul", ["x", "W"], "mm"), _n("Add", ["mm", "b"], "h")] + nodes
    outs = [_t("y", [m, n], elem)] + ([_t(leak, [m, n], elem)] if leak else [])
    return _model(nodes, [_t("x", [m, k], elem)], outs,
                  [_c("W", RNG.standard_normal((k, n)) * 0.2, dtype), _c("b", RNG.standard_normal(n), dtype)]
                  + [_c(c.name, onnx.numpy_helper.to_array(c), dtype) for c in consts])


def skip_layer_norm(bias=True, rows=8, hidden=64, leak=None) -> onnx.ModelProto:
    """y = LayerNorm((x [+ b]) + r); the sum s is a second output (the residual stream)."""
    nodes = ([_n("Add", ["x", "b"], "xb"), _n("Add", ["xb", "r"], "s")] if bias else [_n("Add", ["x", "r"], "s")])
    nodes.append(_n("LayerNormalization", ["s", "g", "beta"], "y", axis=-1, epsilon=1e-5))
    outs = [_t("y", [rows, hidden]), _t("s", [rows, hidden])] + ([_t(leak, [rows, hidden])] if leak else [])
    return _model(nodes, [_t("x", [rows, hidden]), _t("r", [rows, hidden])], outs,
                  [_c("g", RNG.standard_normal(hidden)), _c("beta", RNG.standard_normal(hidden))]
                  + ([_c("b", RNG.standard_normal(hidden))] if bias else []))


def swiglu(rows=8, k=32, inter=64, leak=None) -> onnx.ModelProto:
    nodes = [_n("MatMul", ["x", "Wg"], "g"), _n("Sigmoid", ["g"], "sg"), _n("Mul", ["g", "sg"], "act"),
             _n("MatMul", ["x", "Wu"], "u"), _n("Mul", ["act", "u"], "y")]
    outs = [_t("y", [rows, inter])] + ([_t(leak, [rows, inter])] if leak else [])
    return _model(nodes, [_t("x", [rows, k])], outs,
                  [_c("Wg", RNG.standard_normal((k, inter)) * 0.2), _c("Wu", RNG.standard_normal((k, inter)) * 0.2)])


def matmul_multiply(rows=8, k=32, n=64, leak=None) -> onnx.ModelProto:
    """y = (x @ W) * g, g an input of the product's shape (SwiGLU's up projection times a gate made elsewhere)."""
    nodes = [_n("MatMul", ["x", "W"], "u"), _n("Mul", ["u", "g"], "y")]
    outs = [_t("y", [rows, n])] + ([_t(leak, [rows, n])] if leak else [])
    return _model(nodes, [_t("x", [rows, k]), _t("g", [rows, n])], outs, [_c("W", RNG.standard_normal((k, n)) * 0.2)])


def rotary(b=2, h=4, s=8, d=16, split=None, leak=None, permuted=False, sliced=False, partial=None,
           rest_begin=None) -> onnx.ModelProto:
    """y = x*cos + concat(-x[..., split:], x[..., :split])*sin (split = d/2: rotate-half); `permuted`: x comes in
    [B, S, H, D] and is permuted to heads first (Qwen3's and Gemma 2's Q and K); `sliced`: that x is the middle
    third of an input `qkv` [B, S, 3*H*D] through a head reshape (Phi-3's K, cut from its one QKV projection);
    `partial` = r: the rotary embedding of the first r of the head's `d` dims, y = concat(rope(x[..., :r]),
    x[..., rest_begin:]) (GPT-NeoX's; `rest_begin` r unless given)."""
    head = d
    d = partial or d
    split = d // 2 if split is None else split
    permuted = permuted or sliced
    src = "xr" if partial else "xt" if permuted else "x"
    nodes = [_n("Slice", ["qkv", "q_begin", "q_end", "s_ax"], "xs"), _n("Reshape", ["xs", "heads"], "x")] \
        if sliced else []
    nodes += [_n("Transpose", ["x"], "xt", perm=[0, 2, 1, 3])] if permuted else []
    if partial:
        whole = "xt" if permuted else "x"
        nodes += [_n("Slice", [whole, "s_zero", "r_end", "s_ax"], "xr"),
                  _n("Slice", [whole, "rest_begin", "s_head", "s_ax"], "xp")]
    nodes += [_n("Slice", [src, "s_mid", "s_end", "s_ax"], "hi"), _n("Neg", ["hi"], "nhi"),
              _n("Slice", [src, "s_zero", "s_mid", "s_ax"], "lo"), _n("Concat", ["nhi", "lo"], "rot", axis=-1),
              _n("Mul", [src, "cos"], "xc"), _n("Mul", ["rot", "sin"], "rs"),
              _n("Add", ["xc", "rs"], "yr" if partial else "y")]
    nodes += [_n("Concat", ["yr", "xp"], "y", axis=-1)] if partial else []
    leaked = {"xs": [b, s, h * head], "x": [b, s, h, head], "xp": [b, h, s, head - d]}.get(leak, [b, h, s, d])
    outs = [_t("y", [b, h, s, head])] + ([_t(leak, leaked)] if leak else [])
    i64 = np.int64
    x = _t("qkv", [b, s, 3 * h * head]) if sliced else _t("x", [b, s, h, head] if permuted else [b, h, s, head])
    consts = [_c("q_begin", [h * head], i64), _c("q_end", [2 * h * head], i64), _c("heads", [b, s, h, head], i64)] \
        if sliced else []
    consts += [_c("r_end", [d], i64), _c("rest_begin", [rest_begin or d], i64), _c("s_head", [head], i64)] \
        if partial else []
    return _model(nodes, [x, _t("cos", [s, d]), _t("sin", [s, d])],
                  outs, [_c("s_mid", [split], i64), _c("s_end", [d], i64), _c("s_zero", [0], i64),
                         _c("s_ax", [-1], i64)] + consts)


def attention(b=2, h=4, s=8, d=16, leak=None, seq_k=None) -> onnx.ModelProto:
    """softmax(q @ k^T * scale + mask) @ v, q/k/v/mask as inputs in [B,H,S,D] layout."""
    sk = seq_k or s
    nodes = [_n("Transpose", ["k"], "kt", perm=[0, 1, 3, 2]), _n("MatMul", ["q", "kt"], "sc"),
             _n("Mul", ["sc", "scale"], "ss"), _n("Add", ["ss", "mask"], "sm"),
             _n("Softmax", ["sm"], "p", axis=-1), _n("MatMul", ["p", "v"], "y")]
    outs = [_t("y", [b, h, s, d])] + ([_t(leak, [b, h, s, sk])] if leak else [])
    return _model(nodes, [_t("q", [b, h, s, d]), _t("k", [b, h, sk, d]), _t("v", [b, h, sk, d]),
                          _t("mask", [b, 1, s, sk])], outs, [_c("scale", 1 / math.sqrt(d))])


def attention_softcap(b=2, h=4, s=8, d=16, leak=None, caps=(30.0, 30.0)) -> onnx.ModelProto:
    """Gemma 2's attention: softmax(cap * tanh(q @ k^T * scale / cap) + mask) @ v (`caps`: the divisor and the
    multiplier, one constant in a soft cap)."""
    nodes = [_n("Transpose", ["k"], "kt", perm=[0, 1, 3, 2]), _n("MatMul", ["q", "kt"], "sc"),
             _n("Mul", ["sc", "scale"], "ss"), _n("Div", ["ss", "cap_in"], "sd"), _n("Tanh", ["sd"], "th"),
             _n("Mul", ["th", "cap_out"], "capped"), _n("Add", ["capped", "mask"], "sm"),
             _n("Softmax", ["sm"], "p", axis=-1), _n("MatMul", ["p", "v"], "y")]
    outs = [_t("y", [b, h, s, d])] + ([_t(leak, [b, h, s, s])] if leak else [])
    return _model(nodes, [_t("q", [b, h, s, d]), _t("k", [b, h, s, d]), _t("v", [b, h, s, d]),
                          _t("mask", [b, 1, s, s])], outs,
                  [_c("scale", 1 / math.sqrt(d)), _c("cap_in", caps[0]), _c("cap_out", caps[1])])


def matmul_act(act="gelu_tanh", rows=8, k=32, n=64, leak=None) -> onnx.ModelProto:
    """Dynamo's bias-free linear (an all-zero bias is dropped): Gemm without C, reshape to [2, rows/2, n], act."""
    nodes, consts = _act_nodes(act, "h")
    nodes = [_n("Gemm", ["x", "W"], "mm"), _n("Reshape", ["mm", "shape3"], "h")] + nodes
    shapes = {"mm": [rows, n], "h": [2, rows // 2, n]}
    outs = [_t("y", [2, rows // 2, n])] + ([_t(leak, shapes[leak])] if leak else [])
    return _model(nodes, [_t("x", [rows, k])], outs,
                  [_c("W", RNG.standard_normal((k, n)) * 0.2), _c("shape3", [2, rows // 2, n], np.int64)] + consts)


def attention_dynamo(b=2, h=4, s=8, d=16, leak=None, key_split=None) -> onnx.ModelProto:
    """The dynamo export's attention: K^T as reshape [B*H,S,D] -> transpose -> reshape [B,H,D,S], the scale
    split over Q and K, an additive mask, softmax and isnan/where. `key_split`: the first reshape's shape
    (not [B*H,S,D]: then it is no transpose)."""
    split = key_split or [b * h, s, d]
    nodes = [_n("Reshape", ["k", "kshape"], "k3"), _n("Transpose", ["k3"], "kt", perm=[0, 2, 1]),
             _n("Reshape", ["kt", "ktshape"], "k4"), _n("Mul", ["q", "half"], "qs"), _n("Mul", ["k4", "half"], "ks"),
             _n("MatMul", ["qs", "ks"], "sc"), _n("Add", ["sc", "mask"], "sm"), _n("Softmax", ["sm"], "p", axis=-1),
             _n("IsNaN", ["p"], "nan"), _n("Where", ["nan", "zero", "p"], "pz"), _n("MatMul", ["pz", "v"], "y")]
    shapes = {"kt": [split[0], split[2], split[1]], "p": [b, h, s, s]}
    outs = [_t("y", [b, h, s, d])] + ([_t(leak, shapes[leak])] if leak else [])
    return _model(nodes, [_t("q", [b, h, s, d]), _t("k", [b, h, s, d]), _t("v", [b, h, s, d]),
                          _t("mask", [b, 1, s, s])], outs,
                  [_c("kshape", split, np.int64), _c("ktshape", [b, h, d, s], np.int64),
                   _c("half", d ** -0.25), _c("zero", 0.0)])


def attention_cache_view(b=2, h=4, kv=2, s=8, d=16, leak=None) -> onnx.ModelProto:
    """GQA attention over K and V given positions first, [S,B,KV,D] (the in-place KV cache's view): each is
    permuted to [B,KV,S,D], then repeated to the query heads (expand, reshape), K transposed, softmax, P @ V."""
    g = h // kv
    nodes = []
    for x in ("k", "v"):
        nodes += [_n("Transpose", [x], f"{x}h", perm=[1, 2, 0, 3]), _n("Unsqueeze", [f"{x}h", "ax2"], f"{x}u"),
                  _n("Expand", [f"{x}u", "rep"], f"{x}e"), _n("Reshape", [f"{x}e", "heads"], f"{x}r")]
    nodes += [_n("Transpose", ["kr"], "kt", perm=[0, 1, 3, 2]), _n("MatMul", ["q", "kt"], "sc"),
              _n("Mul", ["sc", "scale"], "ss"), _n("Softmax", ["ss"], "p", axis=-1), _n("MatMul", ["p", "vr"], "y")]
    outs = [_t("y", [b, h, s, d])] + ([_t(leak, [b, h, s, s])] if leak else [])
    return _model(nodes, [_t("q", [b, h, s, d]), _t("k", [s, b, kv, d]), _t("v", [s, b, kv, d])], outs,
                  [_c("scale", 1 / math.sqrt(d)), _c("ax2", [2], np.int64), _c("rep", [b, kv, g, s, d], np.int64),
                   _c("heads", [b, h, s, d], np.int64)])


CASES = {  # pattern[/variant] -> (builder, name of an intermediate to leak)
    "tvmfuse.matmul_bias_gelu": (lambda leak=None: matmul_bias("gelu", leak=leak), "a1"),
    "tvmfuse.matmul_bias_gelu_tanh": (lambda leak=None: matmul_bias("gelu_tanh", leak=leak), "a2"),
    "tvmfuse.matmul_bias_silu": (lambda leak=None: matmul_bias("silu", leak=leak), "mm"),
    "tvmfuse.matmul_bias_relu": (lambda leak=None: matmul_bias("relu", leak=leak), "h"),
    "tvmfuse.matmul_bias_tanh": (lambda leak=None: matmul_bias("tanh", leak=leak), "mm"),
    "tvmfuse.skip_layer_norm_bias": (lambda leak=None: skip_layer_norm(True, leak=leak), "xb"),
    "tvmfuse.swiglu": (lambda leak=None: swiglu(leak=leak), "g"),
    "tvmfuse.matmul_multiply": (lambda leak=None: matmul_multiply(leak=leak), "u"),
    "tvmfuse.rotary_embedding": (lambda leak=None: rotary(leak=leak), "rot"),
    "tvmfuse.rotary_embedding/permuted": (lambda leak=None: rotary(leak=leak, permuted=True), "rot"),
    "tvmfuse.slice_rotary_embedding": (lambda leak=None: rotary(leak=leak, sliced=True), "rot"),
    "tvmfuse.partial_rotary_embedding": (lambda leak=None: rotary(leak=leak, partial=4), "xr"),
    "tvmfuse.partial_rotary_embedding/permuted": (lambda leak=None: rotary(leak=leak, partial=4, permuted=True), "xp"),
    "tvmfuse.slice_partial_rotary_embedding": (lambda leak=None: rotary(leak=leak, partial=8, sliced=True), "rot"),
    "tvmfuse.attention": (lambda leak=None: attention(leak=leak), "p"),
    "tvmfuse.attention/dynamo": (lambda leak=None: attention_dynamo(leak=leak), "kt"),
    "tvmfuse.attention/softcap": (lambda leak=None: attention_softcap(leak=leak), "th"),
    "tvmfuse.matmul_gelu_tanh": (lambda leak=None: matmul_act("gelu_tanh", leak=leak), "mm"),
    "tvmfuse.matmul_silu": (lambda leak=None: matmul_act("silu", leak=leak), "h"),
    "tvmfuse.rms_norm_residual": (lambda leak=None: onnx_models.rms_norm_residual(leak=leak), "ms"),
    "tvmfuse.layer_norm_gelu": (lambda leak=None: onnx_models.layer_norm_gelu(ln_also_output=bool(leak)), "ln"),
}


@pytest.mark.parametrize("pattern", sorted(CASES))
def test_pattern_fuses_to_one_kernel_and_matches_onnxruntime(pattern, llvm):
    model = CASES[pattern][0]()
    imp, fused = lower_model(model)
    assert list(fused.kernel_patterns.values()) == [pattern.split("/")[0]], (fused.kernels(), fused.rejections)
    check = check_against_ort(model, imp, fused, llvm)
    assert check.ok, check.as_dict()


@pytest.mark.parametrize("pattern", sorted(CASES))
def test_intermediate_used_outside_blocks_the_pattern(pattern):
    make, leak = CASES[pattern]
    _, fused = lower_model(make(leak=leak))
    pattern = pattern.split("/")[0]
    assert pattern not in fused.kernel_patterns.values()
    reasons = [why for p, _, why in fused.rejections if p == pattern]
    assert reasons and all("used outside the match" in why for why in reasons), fused.rejections


def test_skip_layer_norm_without_bias_keeps_the_sum():
    _, fused = lower_model(skip_layer_norm(bias=False))
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.skip_layer_norm"]
    assert len(fused.kernels()) == 1  # both outputs (y and the sum) come from the one kernel


def test_unsupported_dtype_is_rejected_with_reason():
    _, fused = lower_model(matmul_bias("relu", dtype=np.float64))
    assert not fused.kernel_patterns
    assert any(p == "tvmfuse.matmul_bias_relu" and "float64" in why for p, _, why in fused.rejections)


def test_a_head_permute_before_both_halves_is_in_the_rotary_kernel():
    """Qwen3's and Gemma 2's Q and K: permute(x) * cos + rotate_half(permute(x)) * sin is one kernel with the permute
    (it was a transpose kernel of its own)."""
    _, fused = lower_model(rotary(permuted=True))
    (name,) = fused.kernel_patterns
    assert name.startswith("fused_relax_permute_dims") and len(fused.kernels()) == 1, fused.kernels()


@pytest.mark.parametrize("leak", ["xs", "x"])
def test_a_slice_read_elsewhere_stays_outside_the_rotary_kernel(leak, llvm):
    """Where the slice (or its head reshape) is also an output, the rotary kernel cannot take it: the sliced entry is
    rejected for it, the plain rotary embedding is fused instead, and the slice stays a kernel of its own."""
    model = rotary(sliced=True, leak=leak)
    imp, fused = lower_model(model)
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.rotary_embedding"], fused.rejections
    assert any(p == "tvmfuse.slice_rotary_embedding" and "used outside the match" in why
               for p, _, why in fused.rejections), fused.rejections
    assert fused.launches() == 2, fused.kernels()  # the slice, the rotary embedding (the reshape is a view)
    check = check_against_ort(model, imp, fused, llvm)
    assert check.ok, check.as_dict()


def test_a_rest_that_is_not_the_heads_remainder_is_rejected_with_reason():
    """concat(rope(x[..., :4]), x[..., 6:]) is no partial rotary embedding (the output would be two dims short of the
    head): rejected for that with the reason; the rotary embedding of the slice x[..., :4] is fused instead."""
    model = rotary(partial=4, rest_begin=6)
    model.graph.output[0].type.tensor_type.shape.dim[3].dim_value = 14
    _, fused = lower_model(model)
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.slice_rotary_embedding"], fused.rejections
    assert any(p == "tvmfuse.partial_rotary_embedding" and "rest slice" in why for p, _, why in fused.rejections)


def test_rotate_not_by_half_is_rejected_with_reason():
    _, fused = lower_model(rotary(d=16, split=4))
    assert "tvmfuse.rotary_embedding" not in fused.kernel_patterns.values()
    assert any("half" in why for p, _, why in fused.rejections if p == "tvmfuse.rotary_embedding")


def test_attention_candidate_records_shapes_for_templates():
    from tvmfuse.decide.decision import decide
    from tvmfuse.prepare import bind_params

    imp = import_model(attention(b=2, h=4, s=8, d=16))
    plan = decide(bind_params(imp.mod, imp.params))
    (att,) = [c for c in plan.kept() if c.match.pattern == "tvmfuse.attention"]
    info = att.match.info
    assert (info["batch"], info["heads"], info["kv_heads"], info["seq_q"], info["seq_k"], info["head_dim"]) == \
        ("2", "4", "4", "8", "8", "16")
    assert info["mask"] == "additive" and info["causal"] is False


def test_soft_capped_scores_are_attention_with_their_cap_and_the_graphs_scale():
    """cap * tanh(s / cap) between the scaled scores and the mask: the candidate records the cap; the kernel's
    roles and softmax scale (the cap's divide and multiply cancel) are what the templates take."""
    from tvmfuse.decide.decision import decide
    from tvmfuse.kernels.attention.roles import attention_roles
    from tvmfuse.prepare import bind_params

    imp = import_model(attention_softcap(d=16))
    (att,) = [c for c in decide(bind_params(imp.mod, imp.params)).kept() if c.match.pattern == "tvmfuse.attention"]
    assert att.match.info["softcap"] == 30.0
    _, fused = lower_model(attention_softcap(d=16))
    (kernel,) = fused.kernel_patterns
    roles = attention_roles(fused.mod[kernel])
    assert roles is not None and roles["order"].count("scale") == 3, roles  # the scale, the cap twice
    assert roles["order"][roles["softcap"]] == "scale"  # the tanh's divisor
    from tvmfuse.kernels import substitute

    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=[])
    shapes = json.loads(str(new[kernel].attrs["tvmfuse.template"]))["shapes"]
    assert shapes["scale"] == pytest.approx(0.25) and shapes["softcap"] == 30.0, shapes


def test_a_tanh_between_two_different_constants_is_no_soft_cap():
    _, fused = lower_model(attention_softcap(caps=(30.0, 20.0)))
    assert "tvmfuse.attention" not in fused.kernel_patterns.values()
    assert any("not a soft cap" in why for p, _, why in fused.rejections if p == "tvmfuse.attention"), \
        fused.rejections


def test_key_reshape_that_is_not_a_transpose_is_rejected_with_reason():
    """[B,H,S,D] -> [B,H*S,D] -> transpose -> [B,H,D,S] has the shape of K^T but mixes heads."""
    _, fused = lower_model(attention_dynamo(b=2, h=4, s=8, d=16, key_split=[2, 32, 16]))
    assert "tvmfuse.attention" not in fused.kernel_patterns.values()
    assert any("not a transpose" in why for p, _, why in fused.rejections if p == "tvmfuse.attention")


def test_dynamo_attention_kernel_reads_k_as_bhsd():
    """The fused K^T is one 4-D permute of the [B,H,S,D] input, so the kernel templates find its role."""
    from tvmfuse.kernels.attention.roles import attention_roles

    _, fused = lower_model(attention_dynamo())
    (kernel,) = fused.kernel_patterns
    roles = attention_roles(fused.mod[kernel])
    assert roles is not None and {"q", "k", "v", "mask", "out"} <= set(roles["order"]), roles
    shapes = roles["shapes"]
    dims = (shapes["batch"], shapes["heads"], shapes["kv_heads"], shapes["seq_k"], shapes["head_dim"])
    assert dims == (2, 4, 4, 8, 16)
    assert "reshape" not in fused.mod[kernel].script().lower()


def test_rms_norm_leaves_a_cast_from_int_outside_the_kernel(llvm):
    """The optional casts are float-to-fp32 only: x (int32) -> Cast(float) -> RMSNorm fuses from the float value."""
    nodes = [_n("Cast", ["x"], "xf", to=TensorProto.FLOAT), _n("Mul", ["xf", "xf"], "sq"),
             _n("ReduceMean", ["sq", "axes"], "ms", keepdims=1), _n("Add", ["ms", "eps"], "ms_eps"),
             _n("Sqrt", ["ms_eps"], "rms"), _n("Div", ["xf", "rms"], "xn"), _n("Mul", ["xn", "w"], "y")]
    model = _model(nodes, [_t("x", [4, 32], TensorProto.INT32)], [_t("y", [4, 32])],
                   [_c("axes", [-1], np.int64), _c("eps", 1e-6), _c("w", RNG.standard_normal(32))])
    imp, fused = lower_model(model)
    assert list(fused.kernel_patterns.values()) == ["tvmfuse.rms_norm"], fused.rejections
    (kernel,) = fused.kernel_patterns
    assert "int32" not in fused.mod[kernel].script()  # the cast is not in the kernel
    check = check_against_ort(model, imp, fused, llvm)
    assert check.ok, check.as_dict()


def attention_head_merge(b=2, h=4, s=8, d=16, leak=None, mid=None, perm=(0, 2, 1, 3)) -> onnx.ModelProto:
    """attention() then GPT-2's head merge: reshape to the same [B,H,S,D] (`mid`: another shape), transpose
    [0,2,1,3] (`perm`) and reshape to [B,S,H*D]. `leak`: also output that intermediate ('y4')."""
    base = attention(b, h, s, d)
    mid = list(mid or [b, h, s, d])
    tshape = [mid[i] for i in perm]
    nodes = list(base.graph.node) + [_n("Reshape", ["y", "same"], "y4"), _n("Transpose", ["y4"], "yt", perm=list(perm)),
                                     _n("Reshape", ["yt", "merged"], "out")]
    outs = [_t("out", [tshape[0], tshape[1], tshape[2] * tshape[3]])] + ([_t(leak, mid)] if leak else [])
    return _model(nodes, list(base.graph.input), outs,
                  list(base.graph.initializer) + [_c("same", mid, np.int64),
                                                  _c("merged", [tshape[0], tshape[1], tshape[2] * tshape[3]], np.int64)])


def test_attention_takes_the_head_merge_permute(llvm):
    """The head merge after attention (same-shape reshape, permute [0,2,1,3]) is in the attention kernel (its
    out stored BSHD): no transpose kernel is left, only the [B,S,H*D] reshape; numbers match onnxruntime."""
    from tvmfuse.kernels.attention.roles import attention_roles

    model = attention_head_merge()
    imp, fused = lower_model(model)
    att = [k for k, p in fused.kernel_patterns.items() if p == "tvmfuse.attention"]
    assert len(att) == 1, (fused.kernels(), fused.rejections)
    names = [gv.name_hint for gv, f in fused.mod.functions.items() if gv.name_hint != "main"]
    assert not [n for n in names if "transpose" in n or ("permute" in n and n not in att)], names
    roles = attention_roles(fused.mod[att[0]])
    assert roles is not None and roles["shapes"]["out_layout"] == "BSHD", roles
    check = check_against_ort(model, imp, fused, llvm)
    assert check.ok, check.as_dict()


@pytest.mark.parametrize("variant", ["leak", "mid_shape", "perm"])
def test_attention_head_merge_not_taken(variant, llvm):
    """The permute stays outside when the reshaped output is used elsewhere too, when the reshape changes the
    shape, or when the permute is not the head merge; attention still fuses (ending at its output)."""
    kw = {"leak": dict(leak="y4"), "mid_shape": dict(mid=[2, 4, 16, 8]), "perm": dict(perm=(0, 2, 3, 1))}[variant]
    why = {"leak": "used outside the match", "mid_shape": "changes the shape", "perm": "not the head merge"}[variant]
    model = attention_head_merge(**kw)
    imp, fused = lower_model(model)
    att = [k for k, p in fused.kernel_patterns.items() if p == "tvmfuse.attention"]
    assert len(att) == 1 and "permute" not in att[0].split("matmul")[-1], (att, fused.rejections)
    assert any(why in r for p, _, r in fused.rejections if p == "tvmfuse.attention"), fused.rejections
    names = [gv.name_hint for gv, f in fused.mod.functions.items() if gv.name_hint != "main"]
    assert any("transpose" in n for n in names), names
    check = check_against_ort(model, imp, fused, llvm)
    assert check.ok, check.as_dict()


def test_attention_reads_a_positions_first_cache_view_in_one_kernel(llvm):
    """K and V as the in-place KV cache's [S,B,KV,D] view: their head permutes and the GQA repeat are inside the
    attention kernel (before, K's permute was a kernel of its own: a copy of the cache every step)."""
    model = attention_cache_view()
    imp, fused = lower_model(model)
    assert [fused.pattern_of(k) for k in fused.kernels()] == ["tvmfuse.attention"], fused.kernels()
    assert check_against_ort(model, imp, fused, llvm).ok
