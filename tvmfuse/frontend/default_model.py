"""The embedded default job: a small transformer-style block built with onnx.helper."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

NAME = "tiny-block"


def make_tiny_block(seq: int = 64, hidden: int = 128, ffn: int = 256, seed: int = 0) -> onnx.ModelProto:
    """x -> LayerNorm -> GELU -> MatMul+Bias -> MatMul+Bias, h = x + that -> RMSNorm; outputs y and h.

    It holds one LayerNorm+GELU, two MatMul+Bias and one RMSNorm+residual group (with `h` used
    downstream): four kernels to tune, a few minutes on 2 cores.
    """
    rng = np.random.default_rng(seed)

    def weight(name, *shape, scale=1.0):
        return helper.make_tensor(name, TensorProto.FLOAT, shape,
                                  (rng.standard_normal(shape) * scale).astype(np.float32).ravel())

    nodes = [
        helper.make_node("LayerNormalization", ["x", "ln_g", "ln_b"], ["ln"], axis=-1, epsilon=1e-5),
        helper.make_node("Gelu", ["ln"], ["act"]),
        helper.make_node("MatMul", ["act", "w1"], ["mm1"]),
        helper.make_node("Add", ["mm1", "b1"], ["up"]),
        helper.make_node("MatMul", ["up", "w2"], ["mm2"]),
        helper.make_node("Add", ["mm2", "b2"], ["down"]),
        helper.make_node("Add", ["x", "down"], ["h"]),
        helper.make_node("Mul", ["h", "h"], ["h_sq"]),
        helper.make_node("ReduceMean", ["h_sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["ms_eps"]),
        helper.make_node("Sqrt", ["ms_eps"], ["rms"]),
        helper.make_node("Div", ["h", "rms"], ["h_norm"]),
        helper.make_node("Mul", ["h_norm", "rms_w"], ["y"]),
    ]
    inits = [
        weight("ln_g", hidden), weight("ln_b", hidden, scale=0.1),
        weight("w1", hidden, ffn, scale=hidden ** -0.5), weight("b1", ffn, scale=0.1),
        weight("w2", ffn, hidden, scale=ffn ** -0.5), weight("b2", hidden, scale=0.1),
        weight("rms_w", hidden),
        helper.make_tensor("axes", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-6]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [seq, hidden]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, [seq, hidden])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], producer_name="tvmfuse",
                              ir_version=10)  # readable by older onnxruntime builds too
    onnx.checker.check_model(model)
    return model
