"""Fuse stage: each pattern group is ONE PrimFunc; an intermediate used outside a match blocks fusion."""

import numpy as np
import pytest

import onnx_models
import tvm
from tvm import relax, tirx
from checks import check_against_ort, lower_model
from tvmfuse.fuse.fusion import DEFAULT_FUSION, launches, lower, symbolic_kernels
from tvmfuse.frontend.importer import import_model


def test_rms_norm_residual_with_both_outputs_is_one_kernel(llvm):
    model = onnx_models.rms_norm_residual()
    imp, fused = lower_model(model)
    kernels = fused.kernels()
    assert len(kernels) == 1
    assert fused.pattern_of(kernels[0]) == "tvmfuse.rms_norm_residual"
    check = check_against_ort(model, imp, fused, llvm)
    assert check.ok and check.max_abs_err < 1e-4


def test_stock_fusion_splits_rms_norm_residual():
    """What the pattern buys: TVM's own FuseOps makes several kernels of the same graph."""
    _, fused = lower_model(onnx_models.rms_norm_residual(), None)
    stock = lower(import_model(onnx_models.rms_norm_residual()).mod, import_model(
        onnx_models.rms_norm_residual()).params, patterns=[])
    assert len(stock.kernels()) >= 3 > len(fused.kernels())
    assert all(stock.pattern_of(k) == DEFAULT_FUSION for k in stock.kernels())


def test_layer_norm_gelu_is_one_kernel(llvm):
    model = onnx_models.layer_norm_gelu()
    imp, fused = lower_model(model)
    assert [fused.pattern_of(k) for k in fused.kernels()] == ["tvmfuse.layer_norm_gelu"]
    assert check_against_ort(model, imp, fused, llvm).ok


@pytest.mark.parametrize("leak", ["h_sq", "ms", "rms", "h_norm"])
def test_rms_norm_residual_intermediate_used_outside_blocks_fusion(leak):
    _, fused = lower_model(onnx_models.rms_norm_residual(leak=leak))
    assert "tvmfuse.rms_norm_residual" not in fused.kernel_patterns.values()
    assert any(p == "tvmfuse.rms_norm_residual" and "used outside the match" in why
               for p, _, why in fused.rejections)


def test_layer_norm_output_used_outside_blocks_layer_norm_gelu():
    _, fused = lower_model(onnx_models.layer_norm_gelu(ln_also_output=True))
    assert "tvmfuse.layer_norm_gelu" not in fused.kernel_patterns.values()
    assert [p for p, _, _ in fused.rejections] == ["tvmfuse.layer_norm_gelu"]


def test_symbolic_dims_stay_symbolic_and_still_run(llvm):
    model = onnx_models.layer_norm_gelu(hidden=64, dyn=True)
    imp, fused = lower_model(model)
    assert symbolic_kernels(fused.mod) == set(fused.kernels())
    assert check_against_ort(model, imp, fused, llvm).ok


def test_identical_groups_share_one_prim_func(llvm):
    """Two same-shaped layers fuse into two calls of ONE PrimFunc (as stock FuseTIR shares its functions)."""
    rng = np.random.default_rng(0)
    nodes = [onnx_models.helper.make_node(op, ins, [out]) for op, ins, out in [
        ("MatMul", ["x", "W1"], "m1"), ("Add", ["m1", "b1"], "a1"), ("Relu", ["a1"], "r1"),
        ("MatMul", ["r1", "W2"], "m2"), ("Add", ["m2", "b2"], "a2"), ("Relu", ["a2"], "y")]]
    inits = [onnx_models._const(n, rng.standard_normal(s).astype("float32") * 0.3)
             for n, s in (("W1", (32, 32)), ("b1", (32,)), ("W2", (32, 32)), ("b2", (32,)))]
    model = onnx_models._model(nodes, [onnx_models._f32("x", [8, 32])], [onnx_models._f32("y", [8, 32])], inits)
    imp, fused = lower_model(model)
    assert fused.kernels() == [next(iter(fused.kernel_patterns))]  # one PrimFunc ...
    assert launches(fused.mod) == 2  # ... called by both layers
    assert len(fused.candidate_kernels) == 2  # both candidates ("pattern@root") name the shared kernel
    assert all(c.startswith("tvmfuse.matmul_bias_relu@") for c in fused.candidate_kernels)
    assert set(fused.candidate_kernels.values()) == set(fused.kernels())
    assert check_against_ort(model, imp, fused, llvm).ok


def test_kernel_taking_a_scalar_stays_out_of_fuseops_groups(llvm):
    """positions = arange(seq) + past (a KV cache step's positions, `past` a symbolic dim passed as a scalar):
    FuseTIR failed in RenewDefs when FuseOps grouped the add with its neighbours; now the add is its own kernel,
    marked opaque, and the module runs."""
    import tvm
    from tvm import relax

    past, seq = tvm.tirx.Var("past", "int64"), tvm.tirx.Var("seq", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([past, seq], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            pos = bb.emit(relax.op.add(relax.op.arange(relax.prim_value(seq), dtype="int64"), relax.prim_value(past)))
            out = bb.emit_output(relax.op.multiply(pos, pos))
        bb.emit_func_output(out)
    fused = lower(bb.get(), patterns=[])
    opaque = [k for k in fused.kernels() if int(fused.mod[k].attrs.get("op_pattern", -1)) == 8]
    assert opaque and all("add" in k for k in opaque)
    vm = relax.VirtualMachine(tvm.compile(fused.mod, llvm), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(np.zeros((3, 4), "float32"))).numpy()
    np.testing.assert_array_equal(got, (np.arange(4) + 3) ** 2)


def test_launches_counts_kernels_that_tvms_reshape_analysis_raises_on():
    """An identity broadcast_to over [2, 1, 8, past + 8] (a decoder's mask in a seq-8 bucket): TVM's
    RewriteDataflowReshape raises on it (iter-map: `(past + 8) * 8` not provably divisible by `past + 8`), which
    failed the job's fusion report; the launches are then counted kernel by kernel, reshapes still views."""
    past = tirx.Var("past", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 1, 8, past + 8), "bool"))
    y = relax.Var("y", relax.TensorType((2, 8, 4), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            m = bb.emit(relax.op.broadcast_to(x, (2, 1, 8, past + 8)))
            r = bb.emit(relax.op.reshape(y, (2, 32)))
            out = bb.emit_output(relax.Tuple([m, bb.emit(relax.op.exp(r))]))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    with pytest.raises(tvm.error.InternalError, match="CanProveDivisible"):
        relax.transform.RewriteDataflowReshape()(mod)
    assert launches(mod) == 2  # broadcast_to and exp; the reshape is a view
