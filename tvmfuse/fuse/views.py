"""Reshape kernels become views (TVM's RewriteDataflowReshape), guarded against the kernels its analysis raises on."""

from __future__ import annotations

import tvm
from tvm import relax, tirx


def analysis_raises(func) -> bool:
    """Whether TVM's reshape analysis raises on PrimFunc `func`: its iter-map rewrite cannot prove some symbolic
    extents divisible (an identity broadcast_to over [2, 1, 8, past + 8]; a scheduled fp32 transpose of
    [32, past + 2048, 128] on 1024 threads), and RewriteDataflowReshape then fails the whole module."""
    try:
        relax.analysis.has_reshape_pattern(func)
    except tvm.error.InternalError:
        return True
    return False


def is_view(func) -> bool:
    """Whether the build makes `func` a view instead of a launch (a reshape pattern TVM can prove); False where
    TVM's analysis of it raises."""
    if not isinstance(func, tirx.PrimFunc):
        return False
    try:
        return bool(relax.analysis.has_reshape_pattern(func))
    except tvm.error.InternalError:
        return False


def _stand_in(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func`'s signature with an empty body: no reshape pattern, so the pass keeps its calls as they are."""
    return func.with_body(tirx.Evaluate(tirx.const(0, "int32")))


@tvm.transform.module_pass(opt_level=0, name="tvmfuse.RewriteDataflowReshape")
def rewrite_dataflow_reshape(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """TVM's RewriteDataflowReshape; where its analysis raises on some kernels, those are hidden from it behind a
    stand-in with their signature (they stay launches) and put back afterwards."""
    stock = relax.transform.RewriteDataflowReshape()
    try:
        return stock(mod)
    except tvm.error.InternalError:
        raising = [gv for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc) and analysis_raises(f)]
        if not raising:
            raise
    hidden = mod.clone()
    for gv in raising:
        hidden[gv] = _stand_in(mod[gv])
    viewed = stock(hidden)
    for gv in raising:
        viewed[gv] = mod[gv]
    return viewed
