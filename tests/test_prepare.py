"""tvmfuse.prepare (prepare_module, no_ops): what the prepare stage does to a model before decide and fuse."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax

from tvmfuse.decide.decision import decide
from tvmfuse.frontend.importer import import_model, load_onnx
from tvmfuse.fuse.fusion import launches, lower
from tvmfuse.prepare import bind_params, prepare_module
from tvmfuse.prepare.mask_rank import full_rank_masks
from tvmfuse.prepare.precision import to_compute_dtype


@pytest.mark.parametrize("name,exporter", [("gpt2", "dynamo"), ("llama", "legacy"), ("bert", "legacy")])
def test_reshapes_to_the_same_shape_go_and_each_layer_launches_one_kernel_less(name, exporter, hf_exports):
    """Tiny exports at batch 2, seq 64, fp16: dynamo's K^T round trip through [B*H, S, D] folds to a same-shape
    reshape before the transpose, and the legacy exports put one before the mask's `where`; each kept a kernel a layer
    (K's transpose outside the attention; the `where` apart from the mask kernel). Prepared, the module has no
    reshape to its own shape, and the two layers launch two kernels fewer than without the removal."""
    import tvm_ffi

    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    imp = import_model(load_onnx(hf_exports(name, exporter)), {"batch": [2], "seq": [64]})
    before = to_compute_dtype(full_rank_masks(bind_params(imp.mod, imp.params)), "float16")

    def same_shape(mod):
        found = []

        def visit(expr):
            if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.reshape" \
                    and tvm_ffi.structural_equal(expr.args[0].ty.shape, expr.ty.shape):
                found.append(expr)
        relax.analysis.post_order_visit(mod["main"], visit)
        return len(found)

    imp = import_model(load_onnx(hf_exports(name, exporter)), {"batch": [2], "seq": [64]})
    after = prepare_module(imp, "fp16")
    assert same_shape(before) >= 2 and same_shape(after) == 0
    assert launches(lower(after, plan=decide(after)).mod) == launches(lower(before, plan=decide(before)).mod) - 2


def test_only_operators_that_change_nothing_go():
    """A reshape to its input's shape, a slice of the whole tensor (with unit strides or none given) go, their users
    reading the input; a concatenation loses its zero-width parts (one part left: that part). A reshape to another
    shape, a reshape of a reshape (the GQA repeat's, which the attention pattern reads), a slice of part of an axis
    or of stride 2, and a concatenation of non-empty parts stay."""
    import tvm_ffi
    from tvm.script import relax as R

    from tvmfuse.prepare.no_ops import drop_no_ops

    @tvm.script.ir_module
    class Mod:  # pylint: disable=too-few-public-methods
        @R.function
        def main(x: R.Tensor((2, 4, 8), "float32")):
            with R.dataflow():
                a = R.reshape(x, R.shape([2, 4, 8]))
                b = R.add(a, a)
                c = R.reshape(b, R.shape([8, 8]))
                d = R.reshape(c, R.shape([64]))
                e = R.strided_slice(x, (2,), (0,), (8,), (1,))
                f = R.strided_slice(e, (0, 2), (0, 0), (2, 8))
                g = R.strided_slice(f, (2,), (8,), (8,), (1,))
                h = R.concat((f, g), axis=2)
                i = R.concat((g, f, g, h), axis=-1)
                j = R.strided_slice(h, (2,), (0,), (4,), (1,))
                k = R.strided_slice(h, (2,), (0,), (8,), (2,))
                R.output(d, h, i, j, k)
            return (d, h, i, j, k)

    out = drop_no_ops(Mod)
    calls = []
    relax.analysis.post_order_visit(out["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    ops = [c.op.name.split(".")[-1] for c in calls]
    assert ops == ["add", "reshape", "reshape", "concat", "strided_slice", "strided_slice"], ops
    x = out["main"].params[0]
    assert calls[0].args[0].same_as(x)  # add(x, x)
    assert [f.same_as(x) for f in calls[3].args[0].fields] == [True, True]  # concat(f, h) of x, x
    assert [list(c.ty.shape) for c in calls[4:]] == [[2, 4, 4], [2, 4, 4]] and calls[4].args[0].same_as(x)
    assert tvm_ffi.structural_equal(drop_no_ops(out), out)  # nothing left to drop
    assert not tvm_ffi.structural_equal(out, Mod)


def _no_ops(mod) -> int:
    """Whole-tensor slices and concatenations with a zero-width part in `main`."""
    import tvm_ffi

    found = []

    def visit(expr):
        name = getattr(getattr(expr, "op", None), "name", "") if isinstance(expr, relax.Call) else ""
        if name == "relax.strided_slice" and tvm_ffi.structural_equal(expr.args[0].ty.shape, expr.ty.shape) \
                or name == "relax.concat" and any(0 in [int(d) for d in f.ty.shape] for f in expr.args[0].fields):
            found.append(expr)
    relax.analysis.post_order_visit(mod["main"], visit)
    return len(found)


@pytest.mark.parametrize("exporter", ["legacy"])  # the dynamo export's (no no-ops): test_decoder_exports
def test_phi3s_rotary_kernels_read_q_and_k_from_its_qkv_projection(exporter, hf_exports):
    """Tiny Phi-3 at batch 2, seq 64, fp16: its Q and K are slices of one QKV projection's output (each slice was a
    kernel), and the legacy export slices each again to its rotary dim (the whole head) and concatenates an empty
    pass-through part. Prepared, no such no-op is left; fused, each layer's Q and K rotary kernels take their
    slices (`tvmfuse.slice_rotary_embedding`): 2 launches a layer fewer than with the plain rotary entry alone."""
    from tvmfuse.fuse.fusion import kernel_calls
    from tvmfuse.patterns import PATTERN_TABLE, fusion_patterns

    imp = import_model(load_onnx(hf_exports("phi3", exporter)), {"batch": [2], "seq": [64]})
    raw = to_compute_dtype(full_rank_masks(bind_params(imp.mod, imp.params)), "float16")
    imp = import_model(load_onnx(hf_exports("phi3", exporter)), {"batch": [2], "seq": [64]})
    mod = prepare_module(imp, "fp16")
    assert _no_ops(raw) == (8 if exporter == "legacy" else 0) and _no_ops(mod) == 0  # 2 layers x Q, K x 2
    fused = lower(mod, plan=decide(mod))
    sliced = [k for k, p in fused.kernel_patterns.items() if p == "tvmfuse.slice_rotary_embedding"]
    assert sum(kernel_calls(fused.mod)[k] for k in sliced) == 4, fused.rejections  # Q and K in 2 layers
    plain = fusion_patterns([n for n, _, _ in PATTERN_TABLE if n != "tvmfuse.slice_rotary_embedding"])
    assert fused.launches() == lower(mod, plan=decide(mod, patterns=plain), patterns=plain).launches() - 4
