"""Operators that change nothing go, their uses reading their input: reshapes to the input's own shape, slices
of a whole tensor, and a concatenation's zero-width parts (each was a kernel, or kept its neighbours apart)."""

from __future__ import annotations

from typing import Callable

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard


def _same_shape(a: relax.Expr, b: relax.Expr) -> bool:
    sa, sb = getattr(a.ty, "shape", None), getattr(b.ty, "shape", None)
    return sa is not None and sb is not None and tvm_ffi.structural_equal(sa, sb)


def _reshape(call: relax.Call) -> relax.Expr:
    """A reshape to its input's own shape (dynamo's K^T round trip through [B*H, S, D] folds to one at static
    sizes; the legacy exports put one before a mask's `where`): the input. (TVM's RemoveRedundantReshape also folds
    a reshape of a reshape, which hides the GQA repeat's reshape from the attention pattern: not used.)"""
    return call.args[0] if _same_shape(call.args[0], call) else call


def _strided_slice(call: relax.Call) -> relax.Expr:
    """A slice of unit strides whose output has its input's shape (HF's partial rotary at a rotary dim equal to
    the head dim, `q[..., :head_dim]`: the legacy Phi-3 export): the input."""
    strides = call.args[4].fields if len(call.args) > 4 else []
    unit = all(_is_one(getattr(s, "value", None)) for s in strides)
    return call.args[0] if unit and _same_shape(call.args[0], call) else call


def _is_one(value) -> bool:
    return isinstance(value, (int, tvm.tirx.IntImm)) and int(value) == 1


def _concat(call: relax.Call) -> relax.Expr:
    """A concatenation without its parts of zero extent on the axis (the empty `q_pass` of that partial rotary);
    one part left: that part."""
    parts = call.args[0]
    if not isinstance(parts, relax.Tuple) or call.attrs.axis is None:
        return call
    axis = int(call.attrs.axis) % call.ty.ndim
    kept = [p for p in parts.fields
            if not (getattr(p.ty, "shape", None) is not None and isinstance(p.ty.shape.values[axis], tvm.tirx.IntImm)
                    and int(p.ty.shape.values[axis]) == 0)]
    if len(kept) == len(parts.fields) or not kept:
        return call
    if len(kept) == 1:
        return kept[0] if _same_shape(kept[0], call) else call
    return relax.op.concat(kept, axis=int(call.attrs.axis))


#: (operator, its argument counts, what a call of it becomes)
RULES: tuple[tuple[str, tuple[int, ...], Callable[[relax.Call], relax.Expr]], ...] = (
    ("relax.reshape", (2,), _reshape),
    ("relax.strided_slice", (4, 5), _strided_slice),  # without and with strides
    ("relax.concat", (1,), _concat),
)


def drop_no_ops(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with each call `RULES` names rewritten as its rule says, in every Relax function."""
    out = mod.clone()
    for gv, fn in mod.functions.items():
        if isinstance(fn, relax.Function):
            for op, arities, rule in RULES:
                for arity in arities:
                    call = is_op(op)(*[wildcard() for _ in range(arity)])
                    # (the matcher also offers a variable bound to such a call: the call itself is rewritten where
                    # it is bound)
                    fn = rewrite_call(call, lambda expr, matches, call=call, rule=rule:
                                      rule(matches[call]) if isinstance(expr, relax.Call) else expr, fn)
            out[gv] = fn
    return out
