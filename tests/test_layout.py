"""tvmfuse.layout: constant matmul weights stored [N, K], read through a permute the matmul's kernel absorbs."""

import numpy as np
import onnx_models
import pytest
import tvm
from checks import check_against_ort
from tvm import relax, tirx

from tvmfuse.spaces.defaults import default_rule
from tvmfuse.decide.decision import decide
from tvmfuse.fuse.fusion import lower
from tvmfuse.prepare import bind_params
from tvmfuse.frontend.importer import import_model
from tvmfuse.prepare.layout import transpose_weights
from tvmfuse.targets import resolve_target


def _bound(model):
    imp = import_model(model)
    return imp, bind_params(imp.mod, imp.params)


def _weights(mod) -> list:
    """The 2-D constants main reads (each object once)."""
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(e) if isinstance(e, tvm.ir.GenericConst)
                                    and len(e.value.shape) == 2 and not any(e.same_as(f) for f in found) else None)
    return found


def _lower(model):
    imp, bound = _bound(model)
    mod = transpose_weights(bound)
    return imp, lower(mod, plan=decide(mod, None))


def test_weight_is_stored_transposed_once_and_read_through_permute():
    _, bound = _bound(onnx_models.projection(k=64, n=96, shared=True))
    mod = transpose_weights(bound)
    (w,), (w_t,) = _weights(bound), _weights(mod)  # one constant read by both MatMuls, before and after
    np.testing.assert_array_equal(w_t.value.numpy(), w.value.numpy().T)
    assert mod["main"].script(show_meta=False).count("R.permute_dims") == 2


@pytest.mark.parametrize("kw", [{}, {"shared": True}])
def test_transposed_projection_is_one_kernel_reading_n_by_k(llvm, kw):
    model = onnx_models.projection(rows=3, k=64, n=96, **kw)
    imp, fused = _lower(model)
    assert set(fused.kernel_patterns.values()) == {"tvmfuse.matmul"}
    for name in fused.kernels():
        fn = fused.mod[name]
        shapes = {tuple(int(d) for d in p.shape) for p in fn.params}
        assert (96, 64) in shapes and (64, 96) not in shapes
    check = check_against_ort(model, imp, fused, llvm)
    assert check.ok and check.max_abs_err < 1e-4, check


def test_permuted_weight_used_elsewhere_blocks_the_group_and_folds_back(llvm):
    """The permuted weight is also an output: no tvmfuse.matmul group; FoldConstant turns permute(W^T) back into
    a [K, N] constant, so no transpose kernel runs and the matmul reads that constant."""
    w_t = relax.const(np.random.default_rng(0).standard_normal((96, 64)).astype("float32"))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 3, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            w = bb.emit(relax.op.permute_dims(w_t), name_hint="weight_t1")
            y = bb.emit_output(relax.Tuple([bb.emit(relax.op.matmul(x, w)), w]))
        bb.emit_func_output(y)
    mod = bb.get()
    plan = decide(mod, None)
    (cand,) = plan.candidates
    assert cand.decision != "kept" and "weight_t1 is used outside the match" in (cand.reason or cand.match.reason)
    fused = lower(mod, plan=plan)
    assert not fused.kernel_patterns and [k for k in fused.kernels() if "transpose" in k] == []
    (kernel,) = fused.kernels()
    assert (64, 96) in {tuple(int(d) for d in p.shape) for p in fused.mod[kernel].params}
    xs = np.random.default_rng(1).standard_normal((1, 3, 64)).astype("float32")
    out = relax.VirtualMachine(tvm.compile(fused.mod, target=llvm), tvm.cpu())["main"](tvm.runtime.tensor(xs))
    np.testing.assert_allclose(out[0].numpy(), xs @ w_t.value.numpy().T, rtol=1e-4, atol=1e-4)


def test_decode_projection_gets_dlight_gemv_on_cuda():
    """At one row the [K, N] weight left dlight's GEMV rule out (outer reduction: the generic Reduction rule, 62 µs for
    4096x4096 fp16 on the H200); read as [N, K] it takes the GEMV schedule."""
    cuda = resolve_target("cuda")
    _, plain = _bound(onnx_models.projection(rows=1, k=256, n=512))
    _, fused = _lower(onnx_models.projection(rows=1, k=256, n=512))
    before = [default_rule(f, cuda)[0] for f in lower(plain, patterns=[]).mod.functions.values()
              if isinstance(f, tirx.PrimFunc)]
    after = [default_rule(fused.mod[k], cuda)[0] for k in fused.kernels()]
    assert [type(r).__name__ for r in before] == ["Reduction"]
    assert [type(r).__name__ for r in after] == ["GEMV"]


def test_bare_projection_is_kept_for_its_layout_not_for_a_predicted_saving():
    """The permute of a constant costs nothing unfused (FoldConstant folds it), so the group saves no predicted
    time; it is kept, at any threshold, because only inside it does the kernel read W as [N, K]."""
    from tvmfuse.decide.decision import Settings

    _, bound = _bound(onnx_models.projection(rows=3, k=64, n=96))
    (cand,) = decide(transpose_weights(bound), None, Settings(threshold_us=5.0)).candidates
    assert cand.match.pattern == "tvmfuse.matmul" and cand.decision == "kept"
    assert cand.benefit_us == pytest.approx(0.0, abs=1e-9) and cand.reason.startswith("reads its weight [N, K]")
