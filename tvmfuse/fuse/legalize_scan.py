"""Legalization of cumsum / cumprod at any shape, symbolic dims included.

TVM registers no FLegalize for `relax.cumsum` / `relax.cumprod`: its backend pipeline's DispatchSortScan lowers them
(to topi's target-specific scans), and tvmfuse's lowering runs LegalizeOps instead. At static shapes the mask
subgraphs that hold them (transformers' causal mask when no attention_mask is given: CumSum, GatherND, IsNaN, Where)
fold to constants; at symbolic shapes the call reached VM codegen unlowered ("CodeGenVM cannot emit this Relax
operator directly"). Here the input is viewed as [outer, n, inner] (n the scanned axis) and one block per
(outer, inner) position runs the scan as a serial loop: a plain schedulable PrimFunc (dlight's Fallback binds its
spatial loop to threads on GPUs), with every dim symbolic.
"""

from __future__ import annotations

import functools
import operator

from tvm import relax, tirx
from tvm.script import tirx as T


@functools.lru_cache(maxsize=None)
def scan_func(kind: str, in_dtype: str, out_dtype: str, exclusive: bool) -> tirx.PrimFunc:
    """The [m, n, k] -> [m, n, k] scan along axis 1 ('sum' or 'prod'), m, n, k symbolic."""
    identity = 0 if kind == "sum" else 1

    def combine(a, b):
        return a + b if kind == "sum" else a * b

    @T.prim_func(s_tir=True, private=True)
    def scan(a: T.handle, b: T.handle):
        T.func_attr({"tirx.noalias": True})
        m, n, k = T.int64(), T.int64(), T.int64()
        A = T.match_buffer(a, (m, n, k), in_dtype)
        B = T.match_buffer(b, (m, n, k), out_dtype)
        for i, j in T.grid(m, k):
            with T.sblock("scan"):
                vi, vj = T.axis.remap("SS", [i, j])
                T.reads(A[vi, 0:n, vj])
                T.writes(B[vi, 0:n, vj])
                if n > T.int64(0):
                    if exclusive:
                        B[vi, 0, vj] = T.Cast(out_dtype, identity)
                    else:
                        B[vi, 0, vj] = T.Cast(out_dtype, A[vi, 0, vj])
                    for t in T.serial(T.int64(1), n):
                        if exclusive:
                            B[vi, t, vj] = combine(B[vi, t - 1, vj], T.Cast(out_dtype, A[vi, t - 1, vj]))
                        else:
                            B[vi, t, vj] = combine(B[vi, t - 1, vj], T.Cast(out_dtype, A[vi, t, vj]))

    return scan


def _prod(dims):
    return functools.reduce(operator.mul, dims, tirx.IntImm("int64", 1))


def legalize_scan(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """cumsum / cumprod(x, axis, dtype, exclusive) as a reshape to [outer, n, inner], the scan, a reshape back.
    `axis=None` scans the flattened tensor (as numpy)."""
    x = call.args[0]
    shape = x.ty.shape
    if shape is None or not isinstance(shape, relax.ShapeExpr):
        return call  # unknown rank: left for check_lowered to name
    dims = list(shape.values)
    axis = call.attrs.axis
    if axis is None:
        dims, axis = [_prod(dims)], 0
    axis = int(axis) % len(dims) if dims else 0
    if not dims:  # a scalar: the scan of one element
        dims, axis = [tirx.IntImm("int64", 1)], 0
    in_dtype = x.ty.dtype
    out_dtype = str(call.attrs.dtype) if call.attrs.dtype is not None and str(call.attrs.dtype) else in_dtype
    out_dtype = out_dtype if out_dtype not in ("void", "") else in_dtype
    view = [_prod(dims[:axis]), dims[axis], _prod(dims[axis + 1:])]
    kind = "sum" if call.op.name == "relax.cumsum" else "prod"
    gv = bb.add_func(scan_func(kind, in_dtype, out_dtype, bool(call.attrs.exclusive)), f"cum{kind}")
    flat = bb.emit(relax.op.reshape(x, relax.ShapeExpr(view)))
    scanned = bb.emit(relax.call_tir(gv, [flat], relax.TensorType(view, out_dtype)))
    return relax.op.reshape(scanned, call.ty.shape)


LEGALIZE = {"relax.cumsum": legalize_scan, "relax.cumprod": legalize_scan}
