"""GEMM analysis: reads a fused kernel as one fp16 or bf16 matmul (K innermost) and an elementwise epilogue the TIRx GEMM kernels rebuild from registers."""

from __future__ import annotations

import math
from collections.abc import Callable

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import get_reduction_blocks
from tvm.script import tirx as T
from tvm.sym import Analyzer

from tvmfuse.kernels.hopper.expr_nodes import BINARY as _BINARY
from tvmfuse.kernels.hopper.expr_nodes import CALL as _CALL
from tvmfuse.kernels.hopper.expr_nodes import LOAD as _LOAD


#: operand dtypes the GEMM kernels multiply (both operands the same), and the PTX type each names in mma/wgmma
OPERAND_PTX = {"float16": "f16", "bfloat16": "bf16"}


def gemm_dtypes_refused(a: str, b: str, acc: str, out: str) -> str | None:
    """Why the GEMM kernels cannot take a matmul of these dtypes, or None: fp16 x fp16 or bf16 x bf16, summed in
    fp32, written as that same 16-bit dtype or as the fp32 sums."""
    if a in OPERAND_PTX and a == b and acc == "float32" and out in (a, "float32"):
        return None
    hint = "; --dtype fp16 or bf16 computes in those" if a == b == "float32" else ""
    return (f"dtypes {a} x {b} -> {acc} -> {out} (needs float16 x float16 or bfloat16 x bfloat16 -> float32 "
            f"-> the operands' dtype or float32{hint})")


def _block_store(stmt):
    body = stmt.body
    return body if isinstance(body, tirx.BufferStore) else None


def analyze_gemm(func: tirx.PrimFunc) -> tuple[dict | None, str]:
    """({a, b, out, acc, m, n, k, rows, value, out_vars}, "") for a fused kernel that is exactly one fp16 or bf16 matmul
    out[.., i, j] = f(sum_k A[.., i, k] * W[j, k]) (fp32 sums) with an elementwise epilogue f over its parameters
    (or none: the sums are the fp32 output), else (None, why not). The leading dims of A and out are rows: M is
    their product (`rows` their extents), A and out being contiguous."""
    sch = s_tir.Schedule(func)
    root = get_root_block(sch)
    mains = get_reduction_blocks(sch, sch.get_child_blocks(root)) or []
    if len(mains) != 1:
        return None, "not a single reduction"
    main = mains[0]
    for producer in sch.get_producers(main):  # the weight's permute: read W [N, K] in place
        try:
            sch.compute_inline(producer)
        except Exception:  # noqa: BLE001
            return None, "a producer of the matmul cannot be inlined"
    blocks = list(sch.get_child_blocks(root))
    if not sch.get(blocks[0]).same_as(sch.get(main)):
        return None, "work before the matmul"
    for blk in blocks[1:-1]:  # the epilogue chain, inlined into the output block
        try:
            sch.compute_inline(blk)
        except Exception:  # noqa: BLE001
            return None, "the epilogue is not elementwise"
    blocks = list(sch.get_child_blocks(root))
    if len(blocks) > 2:
        return None, "the epilogue is not elementwise"
    mstmt, ostmt = sch.get(blocks[0]), sch.get(blocks[-1])  # one block: the matmul writes the (fp32) output
    upd, store = _block_store(mstmt), _block_store(ostmt)
    if upd is None or store is None or len(mstmt.reads) != 2:
        return None, "unexpected block structure"
    acc = upd.buffer
    a_reg, b_reg = mstmt.reads
    a, b, out = a_reg.source, b_reg.source, store.buffer
    if len(a.shape) < 2 or len(b.shape) != 2:  # e.g. RMSNorm's sum of x ** p, the exponent a 0-d parameter
        return None, "operands are not matrices"
    why = gemm_dtypes_refused(str(a.dtype), str(b.dtype), str(acc.dtype), str(out.dtype))
    if why:
        return None, why
    if not all(any(buf.same_as(p) for p in func.params) for buf in (a, b, out)):
        return None, "operands are not kernel parameters"
    ivars = [iv.var for iv in mstmt.iter_vars]
    kinds = [iv.iter_type for iv in mstmt.iter_vars]
    if kinds[-1] != tirx.IterVar.CommReduce or tirx.IterVar.CommReduce in kinds[:-1]:
        return None, "reduction is not the innermost block axis"
    *batch, i, j, kv = ivars
    a_idx, b_idx = [r.min for r in a_reg.region], [r.min for r in b_reg.region]
    same = lambda xs, ys: len(xs) == len(ys) and all(x.same_as(y) for x, y in zip(xs, ys))
    if not (same(a_idx, [*batch, i, kv]) and same(b_idx, [j, kv]) and same(list(upd.indices), [*batch, i, j])):
        return None, "operands are not A[.., i, k] and W[j, k] (K innermost)"
    doms = [iv.dom.extent for iv in mstmt.iter_vars]
    if not all(isinstance(d, tirx.IntImm) for d in doms):
        return None, "symbolic sizes"
    rows = [int(d) for d in doms[:-2]]
    n, k = int(doms[-2]), int(doms[-1])
    info = {"a": a, "b": b, "out": out, "acc": acc, "m": math.prod(rows), "n": n, "k": k, "rows": rows}
    if len(blocks) == 1:  # out = the accumulator itself
        ovars = [*batch, i, j]
        return {**info, "value": tirx.BufferLoad(acc, ovars), "out_vars": ovars, "out_extents": rows + [n]}, ""
    ovars = [iv.var for iv in ostmt.iter_vars]
    extents = [iv.dom.extent for iv in ostmt.iter_vars]
    if not same(list(store.indices), ovars) or not all(isinstance(d, tirx.IntImm) for d in extents) \
            or math.prod(int(d) for d in extents) != info["m"] * n:
        return None, "the output is not written elementwise"
    # the output may be the product reshaped ([512, 3072] -> [1, 512, 3072]): same elements, same row-major order
    # (checked where the epilogue reads the product: _rebuild)
    return {**info, "value": store.value, "out_vars": ovars, "out_extents": [int(d) for d in extents]}, ""


def epilogue(info: dict, fresh: dict) -> tuple[Callable, Callable, Callable]:
    """(finish, place, setup) for the GEMM kernels: the output block's value with the accumulator substituted (its final
    cast to the output dtype left to the kernel's store) and the parameters read through their `fresh` buffers,
    the output indices of (row, col), and what the kernel runs first: 1-element views of the 0-d parameters
    (scalar constants such as gelu_new's 0.044715), which TVM's TIRx pipeline cannot read in place ("used before
    its definition")."""
    views: dict = {}

    def setup():
        for buf in fresh.values():
            if len(buf.shape) == 0:
                views[buf] = T.decl_buffer((1,), buf.dtype, data=buf.data)
    acc_buf, value, ovars, rows = info["acc"], info["value"], info["out_vars"], info["rows"]
    dtypes, shape, n = [str(v.ty.dtype) for v in ovars], info["out_extents"], info["n"]

    def place(row, col):
        if shape == rows + [n]:  # the flat row unflattened over the leading dims (unit dims: 0)
            lead = [tirx.const(0, d) if ext == 1 else tirx.Cast(d, row // math.prod(rows[r + 1:]) % ext)
                    for r, (ext, d) in enumerate(zip(rows[:-1], dtypes))]
            return tuple(lead + [tirx.Cast(dtypes[-2], row % rows[-1] if len(rows) > 1 else row),
                                 tirx.Cast(dtypes[-1], col)])
        flat = row * n + col  # a reshaped output: element row * n + col of its row-major order
        return tuple(tirx.const(0, d) if ext == 1 else tirx.Cast(d, flat // math.prod(shape[r + 1:]) % ext)
                     for r, (ext, d) in enumerate(zip(shape, dtypes)))

    # the group's own cast to the output dtype is left to the store, which rounds the fp32 value once, as it does:
    # float(half(x)) stored as half is half(x) (the round trip is exact), two conversions an element fewer
    last = value.value if isinstance(value, tirx.Cast) and str(value.value.ty.dtype) == "float32" else value

    def finish(acc, row, col):
        return tirx.Cast("float32", _rebuild(last, ovars, list(place(row, col)), acc_buf, acc, fresh, shape, views))

    return finish, place, setup


def _flat(indices, shape) -> tirx.PrimExpr:
    return sum((i * math.prod(int(d) for d in shape[r + 1:]) for r, i in enumerate(indices)), tirx.const(0, "int64"))


def _rebuild(expr, ovars: list, idx: list, acc_buf, acc, fresh: dict, shape: list, views: dict):
    """`expr` with the output block's vars `ovars` (extents `shape`) replaced by `idx` and loads of the accumulator
    buffer replaced by `acc`, where they read the element the block writes (at those vars, or through a reshape:
    the same row-major position, proven over the vars' ranges), 0-d parameters read through their `views` once
    declared; raises ValueError on anything else (the kernel then keeps its generic schedule)."""
    var_map = dict(zip(ovars, idx))
    ana = Analyzer()
    for v, ext in zip(ovars, shape):
        ana.bind(v, tvm.ir.Range(tirx.const(0, v.ty.dtype), tirx.const(ext, v.ty.dtype)))

    def elementwise(indices) -> bool:
        if len(indices) == len(ovars) and all(i.same_as(v) for i, v in zip(indices, ovars)):
            return True
        here = tirx.Cast("int64", _flat([tirx.Cast("int64", i) for i in indices], acc_buf.shape))
        return ana.can_prove_equal(here, _flat([tirx.Cast("int64", v) for v in ovars], shape))

    def go(e):
        if isinstance(e, tirx.Var):
            return next((v for k, v in var_map.items() if k.same_as(e)), e)
        if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
            return e
        if isinstance(e, _LOAD):
            if e.source.same_as(acc_buf):
                if not elementwise(e.indices):
                    raise ValueError("the epilogue reads the matmul result at other indices than it writes")
                return acc
            src = next((new for old, new in fresh.items() if old.same_as(e.source)), None)
            if src is None:
                raise ValueError("the epilogue reads a buffer that is not a parameter")
            if src in views:
                return tirx.BufferLoad(views[src], [tirx.const(0, "int32")])
            return tirx.BufferLoad(src, [go(i) for i in e.indices])
        if isinstance(e, tirx.Cast):
            return tirx.Cast(str(e.ty.dtype), go(e.value))
        if isinstance(e, _BINARY):
            return type(e)(go(e.a), go(e.b))
        if isinstance(e, tirx.Select):
            return tirx.Select(go(e.condition), go(e.true_value), go(e.false_value))
        if isinstance(e, tirx.Not):
            return tirx.Not(go(e.a))
        if isinstance(e, _CALL):
            return _CALL(e.op, [go(a) for a in e.args], attrs=e.attrs, ty_args=e.ty_args, ret_ty=e.ty)
        raise ValueError(f"epilogue expression {type(e).__name__} not supported")
    return go(expr)
