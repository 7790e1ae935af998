"""Reshapes to their input's own shape go: their uses read the input (the no-op half of TVM's
RemoveRedundantReshape, whose other half, folding a reshape of a reshape, would hide the GQA repeat's reshape from
the attention pattern)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard


def drop_same_shape_reshapes(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with every reshape whose output shape is its input's replaced by the input, in each Relax function.
    Dynamo exports' K^T round trip through [B*H, S, D] folds to one at static sizes (it kept K's transpose out of
    the attention); the legacy exports put one before a mask's `where` (it kept the `where` out of the mask's
    kernel)."""
    x = wildcard()
    pattern = is_op("relax.reshape")(x, wildcard())

    def rewriter(expr, matches):
        src = matches[x]
        same = getattr(src.ty, "shape", None) is not None and getattr(expr.ty, "shape", None) is not None \
            and tvm_ffi.structural_equal(src.ty.shape, expr.ty.shape)
        return src if same else expr

    out = mod.clone()
    for gv, fn in mod.functions.items():
        if isinstance(fn, relax.Function):
            out[gv] = rewrite_call(pattern, rewriter, fn)
    return out
