"""tvmfuse.prepare (prepare_module, same_shape_reshapes): what the prepare stage does to a model before decide and fuse."""

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


def test_only_reshapes_to_the_same_shape_go():
    """A reshape to another shape, and a reshape of a reshape (the GQA repeat's, which the attention pattern reads),
    stay; a reshape to its input's shape goes, its user reading the input."""
    import tvm_ffi
    from tvm.script import relax as R

    from tvmfuse.prepare.same_shape_reshapes import drop_same_shape_reshapes

    @tvm.script.ir_module
    class Mod:  # pylint: disable=too-few-public-methods
        @R.function
        def main(x: R.Tensor((2, 4, 8), "float32")):
            with R.dataflow():
                a = R.reshape(x, R.shape([2, 4, 8]))
                b = R.add(a, a)
                c = R.reshape(b, R.shape([8, 8]))
                d = R.reshape(c, R.shape([64]))
                R.output(d)
            return d

    out = drop_same_shape_reshapes(Mod)
    calls = []
    relax.analysis.post_order_visit(out["main"], lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    ops = [c.op.name for c in calls]
    assert ops == ["relax.add", "relax.reshape", "relax.reshape"], ops
    assert calls[0].args[0].same_as(out["main"].params[0])
    assert tvm_ffi.structural_equal(drop_same_shape_reshapes(out), out)  # nothing left to drop
    assert not tvm_ffi.structural_equal(out, Mod)
