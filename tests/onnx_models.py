"""Tiny ONNX models for the tests, built with onnx.helper (nothing downloaded)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper


def _model(nodes, inputs, outputs, inits, opset=20) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "t", inputs, outputs, inits)
    # IR 10 (not the newest) so older onnxruntime builds, such as the GPU machine's, read them too
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model)
    return model


def _f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _const(name, array):
    array = np.asarray(array)
    dtype = TensorProto.INT64 if array.dtype.kind == "i" else TensorProto.FLOAT
    return helper.make_tensor(name, dtype, array.shape, array.ravel().tolist())


def layer_norm_gelu(rows=8, hidden=64, ln_also_output=False, dyn=False) -> onnx.ModelProto:
    """y = Gelu(LayerNorm(x)); with `ln_also_output`, the LayerNorm result is a model output too."""
    rng = np.random.default_rng(1)
    r = "batch" if dyn else rows
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1, epsilon=1e-5),
             helper.make_node("Gelu", ["ln"], ["y"])]
    outputs = [_f32("y", [r, hidden])] + ([_f32("ln", [r, hidden])] if ln_also_output else [])
    return _model(nodes, [_f32("x", [r, hidden])], outputs,
                  [_const("g", rng.standard_normal(hidden).astype(np.float32)),
                   _const("b", rng.standard_normal(hidden).astype(np.float32) * 0.1)])


def rms_norm_residual(rows=8, hidden=64, leak: str | None = None) -> onnx.ModelProto:
    """h = x + r; y = h / sqrt(mean(h*h) + eps) * w; outputs y and h (and `leak`, an intermediate)."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Add", ["x", "r"], ["h"]),
             helper.make_node("Mul", ["h", "h"], ["h_sq"]),
             helper.make_node("ReduceMean", ["h_sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["ms_eps"]),
             helper.make_node("Sqrt", ["ms_eps"], ["rms"]),
             helper.make_node("Div", ["h", "rms"], ["h_norm"]),
             helper.make_node("Mul", ["h_norm", "w"], ["y"])]
    outputs = [_f32("y", [rows, hidden]), _f32("h", [rows, hidden])]
    if leak:
        outputs.append(_f32(leak, [rows, 1] if leak in ("ms", "ms_eps", "rms") else [rows, hidden]))
    return _model(nodes, [_f32("x", [rows, hidden]), _f32("r", [rows, hidden])], outputs,
                  [_const("axes", np.array([-1])), _const("eps", np.float32(1e-6)),
                   _const("w", rng.standard_normal(hidden).astype(np.float32))])


def with_op(op_type: str = "NoSuchOp") -> onnx.ModelProto:
    """A model using an operator the importer does not know (checker-free: custom domain)."""
    node = helper.make_node(op_type, ["x"], ["y"], name="mystery_node", domain="com.example")
    graph = helper.make_graph([node], "t", [_f32("x", [4])], [_f32("y", [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                   helper.make_opsetid("com.example", 1)], ir_version=10)


def projection(rows=1, k=64, n=96, leak: bool = False, shared: bool = False) -> onnx.ModelProto:
    """y = x @ W (a linear layer without bias, W an initializer [K, N]); `leak`: the projection is also fed to a
    Relu that is a second output (nothing may fuse around it); `shared`: a second MatMul reads the same W."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((k, n)).astype("float32") / np.sqrt(k)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    outputs = [_f32("y", [1, rows, n])]
    if leak:
        nodes.append(helper.make_node("Relu", ["y"], ["r"]))
        outputs.append(_f32("r", [1, rows, n]))
    if shared:
        nodes.append(helper.make_node("MatMul", ["x2", "w"], ["y2"]))
        outputs.append(_f32("y2", [1, rows, n]))
    inputs = [_f32("x", [1, rows, k])] + ([_f32("x2", [1, rows, k])] if shared else [])
    return _model(nodes, inputs, outputs, [_const("w", w)])


def sibling_projections(rows=128, k=64, n=64, bias: bool = True, tied: bool = False, widths=None) -> onnx.ModelProto:
    """Three linear layers of one input x (BERT's Q, K, V: x @ W_i (+ b_i)), put side by side into one output
    y = [q, k * k, v + 1]; `tied`: a second output reads K's weight again (x2 @ W_k); `widths`: each projection's N."""
    rng = np.random.default_rng(5)
    widths = widths or (n, n, n)
    nodes, inits = [], []
    for name, width in zip("qkv", widths):
        inits.append(_const(f"w_{name}", rng.standard_normal((k, width)).astype("float32") / np.sqrt(k)))
        nodes.append(helper.make_node("MatMul", ["x", f"w_{name}"], [f"{name}_mm" if bias else name]))
        if bias:
            inits.append(_const(f"b_{name}", rng.standard_normal(width).astype("float32") * 0.1))
            nodes.append(helper.make_node("Add", [f"{name}_mm", f"b_{name}"], [name]))
    nodes += [helper.make_node("Mul", ["k", "k"], ["kk"]), helper.make_node("Add", ["v", "one"], ["v1"]),
              helper.make_node("Concat", ["q", "kk", "v1"], ["y"], axis=-1)]
    inits.append(_const("one", np.ones(1, "float32")))
    inputs, outputs = [_f32("x", [1, rows, k])], [_f32("y", [1, rows, sum(widths)])]
    if tied:
        nodes.append(helper.make_node("MatMul", ["x2", "w_k"], ["y2"]))
        inputs.append(_f32("x2", [1, rows, k]))
        outputs.append(_f32("y2", [1, rows, widths[1]]))
    return _model(nodes, inputs, outputs, inits)


def learned_positions(vocab=32, positions=16, hidden=8) -> onnx.ModelProto:
    """GPT-2's embedding: y = wte[ids] + wpe[arange(seq)], ids [batch, seq] symbolic; a sequence longer than
    `positions` runs past wpe's end."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Gather", ["wte", "ids"], ["tok"]),
             helper.make_node("Shape", ["ids"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
             helper.make_node("Range", ["zero", "seq", "one"], ["pos"]),
             helper.make_node("Gather", ["wpe", "pos"], ["pe"], name="position_table"),
             helper.make_node("Add", ["tok", "pe"], ["y"])]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    return _model(nodes, [ids], [_f32("y", ["batch", "seq", hidden])],
                  [_const("wte", rng.standard_normal((vocab, hidden)).astype(np.float32)),
                   _const("wpe", rng.standard_normal((positions, hidden)).astype(np.float32)),
                   _const("one", np.int64(1)), _const("zero", np.int64(0))])
