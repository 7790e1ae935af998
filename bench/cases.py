"""The four bench cases: ONNX model -> one fused PrimFunc (the fuse stage), numpy inputs, torch reference, byte/FLOP counts."""

from __future__ import annotations

import numpy as np
import tvm
from onnx import TensorProto as TP
from onnx import helper
from tvm import relax
from tvm.relax.dpl import is_op, wildcard
from tvm.relax.frontend.onnx import from_onnx
from tvm.relax.transform import FusionPattern

F16 = TP.FLOAT16


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F16, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, F16, s) for n, s in outputs], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def ln_gelu(n, d):
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1, epsilon=1e-5),
             helper.make_node("Gelu", ["ln"], ["y"])]
    ln = is_op("relax.nn.layer_norm")(wildcard(), wildcard(), wildcard())
    return _model(nodes, [("x", [n, d]), ("g", [d]), ("b", [d])], [("y", [n, d])]), \
        [FusionPattern("ln_gelu", is_op("relax.nn.gelu")(ln))]


def rms_res(n, d):
    nodes = [helper.make_node("Add", ["x", "r"], ["h"]), helper.make_node("Mul", ["h", "h"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "ax"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rt"]),
             helper.make_node("Div", ["h", "rt"], ["nh"]), helper.make_node("Mul", ["nh", "w"], ["y"])]
    inits = [helper.make_tensor("ax", TP.INT64, [1], [-1]),
             helper.make_tensor("eps", F16, [], np.array([1e-5], np.float16).view(np.uint16).tolist())]
    h = is_op("relax.add")(wildcard(), wildcard())
    y = is_op("relax.multiply")(is_op("relax.divide")(h, is_op("relax.sqrt")(
        is_op("relax.add")(is_op("relax.mean")(is_op("relax.multiply")(h, h)), wildcard()))), wildcard())
    return _model(nodes, [("x", [n, d]), ("r", [n, d]), ("w", [d])], [("y", [n, d]), ("h", [n, d])], inits), \
        [FusionPattern("rms_res", y)]


def mm_bias_gelu(m, k, n):
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]), helper.make_node("Add", ["mm", "B"], ["ad"]),
             helper.make_node("Gelu", ["ad"], ["y"])]
    mmp = is_op("relax.astype")(is_op("relax.matmul")(wildcard(), wildcard()))
    return _model(nodes, [("x", [m, k]), ("W", [k, n]), ("B", [n])], [("y", [m, n])]), \
        [FusionPattern("mm_bias_gelu", is_op("relax.nn.gelu")(is_op("relax.add")(mmp, wildcard())))], True


def mm_bias_gelu_nk(m, k, n):
    """The same GEMM with the weight stored [N, K], as tvmfuse's layout stage leaves a constant weight (the
    product's GEMM kernels read K innermost)."""
    nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Wt"], ["mm"]),
             helper.make_node("Add", ["mm", "B"], ["ad"]), helper.make_node("Gelu", ["ad"], ["y"])]
    mmp = is_op("relax.astype")(is_op("relax.matmul")(wildcard(), is_op("relax.permute_dims")(wildcard())))
    return _model(nodes, [("x", [m, k]), ("W", [n, k]), ("B", [n])], [("y", [m, n])]), \
        [FusionPattern("mm_bias_gelu", is_op("relax.nn.gelu")(is_op("relax.add")(mmp, wildcard())))], True


def product_kernel(case):
    """(TIRx kernel, why) the product gives this case's fused kernel on sm_90a (tvmfuse.hopper's GEMM kernels,
    the row kernel), the GEMMs built with the weight [N, K]; (None, why not) where it gives none."""
    build, shape, _, _ = CASES[case]
    if build is mm_bias_gelu:
        from tvmfuse.kernels.hopper.select import gemm_kernel_from_fused
        return gemm_kernel_from_fused(fused_primfunc(*mm_bias_gelu_nk(*shape))[1], "main")
    try:
        from tvmfuse.kernels.hopper.row_kernel import row_kernel_from_fused
    except ImportError as err:
        return None, str(err)
    return row_kernel_from_fused(fused_primfunc(*build(*shape))[1], "main")


def fused_primfunc(model, patterns, fp32_accumulate=False):
    """Lower like the notes' section 2 and return the single fused PrimFunc (global_symbol main).

    `fp32_accumulate`: matmuls accumulate in fp32 and cast to fp16 (TVM's ToMixedPrecision, as tvmfuse's
    `--dtype fp16` builds them and as torch computes), instead of the fp16 accumulation of a plain fp16 MatMul."""
    mod = from_onnx(model, keep_params_in_input=True)
    if fp32_accumulate:
        mod = relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
    seq = tvm.transform.Sequential([
        relax.transform.FuseOpsByPattern(patterns, bind_constants=False, annotate_codegen=False),
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
        relax.transform.FuseOps(), relax.transform.FuseTIR(), relax.transform.DeadCodeElimination()])
    low = seq(mod)
    pfs = [(gv.name_hint, f) for gv, f in low.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(pfs) == 1, [n for n, _ in pfs]
    name, pf = pfs[0]
    return name, pf.with_attr("global_symbol", "main")


N, D = 8192, 4096
K, NOUT = 4096, 11008

# name -> (builder, args, kind, bytes moved (ideal), flops)
CASES = {
    "ln_gelu": (ln_gelu, (N, D), 2 * (2 * N * D + 2 * D), 0),
    "rms_res": (rms_res, (N, D), 2 * (4 * N * D + D), 0),
    "gemv_m16": (mm_bias_gelu, (16, K, NOUT), 2 * (16 * K + K * NOUT + NOUT + 16 * NOUT), 2 * 16 * K * NOUT),
    "gemm_m4096": (mm_bias_gelu, (4096, K, NOUT), 2 * (4096 * K + K * NOUT + NOUT + 4096 * NOUT), 2 * 4096 * K * NOUT),
}


def inputs(case, rng):
    """numpy fp16 inputs in the PrimFunc's parameter order (outputs excluded)."""
    if case == "ln_gelu":
        return [rng.standard_normal((N, D)).astype("float16"), (1 + 0.1 * rng.standard_normal(D)).astype("float16"),
                (0.1 * rng.standard_normal(D)).astype("float16")]
    if case == "rms_res":
        return [rng.standard_normal((N, D)).astype("float16"), rng.standard_normal((N, D)).astype("float16"),
                np.array(1e-5, "float16"), (1 + 0.1 * rng.standard_normal(D)).astype("float16")]
    m = 16 if case == "gemv_m16" else 4096
    return [rng.standard_normal((m, K)).astype("float16"), (0.02 * rng.standard_normal((K, NOUT))).astype("float16"),
            (0.1 * rng.standard_normal(NOUT)).astype("float16")]


def torch_fn(case):
    """The same computation in torch (fp16 tensors in, tuple of outputs in the PrimFunc's output order)."""
    import torch
    import torch.nn.functional as F

    if case == "ln_gelu":
        return lambda x, g, b: (F.gelu(F.layer_norm(x, (D,), g, b, 1e-5)),)
    if case == "rms_res":
        def rms(x, r, eps, w):
            h = x + r
            return (h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps) * w, h)
        return rms
    return lambda x, w, b: (F.gelu(x @ w + b),)
