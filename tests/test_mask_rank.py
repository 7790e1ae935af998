"""tvmfuse.prepare.mask_rank: a rank-2/3 mask added to rank-4 scores before a softmax is read as rank 4."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvmfuse.prepare.mask_rank import full_rank_masks


def _scores_plus_mask(mask_shape, then="softmax", cast=False):
    """main(scores [2, 4, 5, 5], mask `mask_shape`) = then(scores + mask) (through an fp16 round trip: `cast`)."""
    bb = relax.BlockBuilder()
    s = relax.Var("scores", relax.TensorType([2, 4, 5, 5], "float32"))
    m = relax.Var("mask", relax.TensorType(list(mask_shape), "float32"))
    with bb.function("main", [s, m]):
        with bb.dataflow():
            x = bb.emit(relax.op.add(s, m))
            if cast:
                x = bb.emit(relax.op.astype(relax.op.astype(x, "float16"), "float32"))
            y = bb.emit_output(relax.op.nn.softmax(x) if then == "softmax" else relax.op.exp(x))
        bb.emit_func_output(y)
    return bb.get()


def _run(mod, *args):
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _expands(mod) -> list:
    return [b.value for blk in mod["main"].body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.expand_dims"]


@pytest.mark.parametrize("mask_shape,axes,cast", [((5, 5), [0, 1], False), ((1, 5, 5), [0], False),
                                                  ((5, 5), [0, 1], True)])
def test_a_low_rank_mask_before_a_softmax_is_read_as_rank_4_and_computes_the_same(mask_shape, axes, cast):
    mod = _scores_plus_mask(mask_shape, cast=cast)
    out = full_rank_masks(mod)
    (expand,) = _expands(out)
    assert [int(a) for a in expand.attrs.axis] == axes
    add = next(b.value for blk in out["main"].body.blocks for b in blk.bindings
               if isinstance(b.value, relax.Call) and b.value.op.name == "relax.add")
    assert [int(d) for d in add.args[1].ty.shape] == [1, 1, 5, 5]
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((2, 4, 5, 5)).astype("float32")
    mask = np.where(rng.random(mask_shape) < 0.3, -1e4, 0).astype("float32")
    np.testing.assert_allclose(_run(out, scores, mask), _run(mod, scores, mask), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mask_shape,then", [((5, 5), "exp"), ((2, 4, 5, 5), "softmax")])
def test_other_adds_and_full_rank_masks_are_left_alone(mask_shape, then):
    """An add that feeds no softmax (a residual, a bias) keeps its broadcast; a rank-4 mask needs nothing."""
    mod = _scores_plus_mask(mask_shape, then=then)
    assert not _expands(full_rank_masks(mod))
    tvm.ir.assert_structural_equal(full_rank_masks(mod), mod)
