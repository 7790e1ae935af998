"""Hopper stage (sm_90a): fused GEMMs become a TIRx kernel (wgmma, or mma.sync for small M), epilogue included, and fused row reductions the row kernel."""

from __future__ import annotations

import math
from collections.abc import Callable

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import get_reduction_blocks

from .kernels.mma_smallm import MAX_M, SmallMTile, check_smallm_shape, smallm_kernel
from .kernels.row_kernel import row_kernel_from_fused
from .kernels.wgmma_gemm import TIRX_ATTR, WgmmaTile, check_wgmma_shape, wgmma_kernel

# the node classes of a tensor load and of an intrinsic call in TVM 0.27 (tirx.BufferLoad builds a tvm.ir TensorLoad)
_LOAD = type(tirx.BufferLoad(tirx.decl_buffer((1,), "float32"), [0]))
_CALL = type(tirx.op.exp(tirx.const(0.0, "float32")))

#: a GEMM fills the H200's 132 SMs with 128x256 tiles from about this many blocks on (bench/results/wgmma_run3.json,
#: in blocks of 128x256: 128x256 was faster at MxN 4096x11008 (1376), 2048x4096 (256) and 512x11008 (172),
#: 128x128 at 512x4096 (64))
WIDE_TILE_BLOCKS = 96

#: analysis outcomes that mean "not a matmul kernel at all" (not logged)
NOT_A_GEMM = ("not a single reduction", "unexpected block structure", "a producer of the matmul", "work before")


def is_hopper(target: tvm.target.Target) -> bool:
    """True for CUDA targets with wgmma and TMA (arch sm_90a)."""
    return target.kind.name == "cuda" and str(target.attrs.get("arch", "")) == "sm_90a"


def choose_tile(m: int, n: int, k: int) -> WgmmaTile | None:
    """128x256 tiles when they make enough blocks, else 128x128; 4 stages; None when neither fits."""
    wide, narrow = WgmmaTile(bn=256, stages=4), WgmmaTile(bn=128, stages=4)
    if check_wgmma_shape(m, n, k, wide) is None and -(-m // 128) * -(-n // 256) >= WIDE_TILE_BLOCKS:
        return wide
    return narrow if check_wgmma_shape(m, n, k, narrow) is None else None


def _block_store(stmt):
    body = stmt.body
    return body if isinstance(body, tirx.BufferStore) else None


def analyze_gemm(func: tirx.PrimFunc) -> tuple[dict | None, str]:
    """({a, b, out, acc, m, n, k, rows, value, out_vars}, "") for a fused kernel that is exactly one fp16 matmul
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
    if (acc.dtype, a.dtype, b.dtype) != ("float32", "float16", "float16") or out.dtype not in ("float16", "float32"):
        return None, f"dtypes {a.dtype} x {b.dtype} -> {acc.dtype} -> {out.dtype} (needs fp16 x fp16 -> fp32 -> fp16/32)"
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
        return {**info, "value": tirx.BufferLoad(acc, ovars), "out_vars": ovars}, ""
    ovars = [iv.var for iv in ostmt.iter_vars]
    if not same(list(store.indices), ovars) or len(ovars) != len(upd.indices):
        return None, "the output is not written elementwise"
    return {**info, "value": store.value, "out_vars": ovars}, ""


def _epilogue(info: dict, fresh: dict) -> tuple[Callable, Callable]:
    """(finish, place) for wgmma_kernel: the output block's value with the accumulator substituted and the
    parameters read through their `fresh` buffers, and the output indices of (row, col)."""
    acc_buf, value, ovars, rows = info["acc"], info["value"], info["out_vars"], info["rows"]
    dtypes = [str(v.ty.dtype) for v in ovars]

    def place(row, col):  # the flat row unflattened over the leading dims (unit dims: 0)
        lead = [tirx.const(0, d) if ext == 1 else tirx.Cast(d, row // math.prod(rows[r + 1:]) % ext)
                for r, (ext, d) in enumerate(zip(rows[:-1], dtypes))]
        return tuple(lead + [tirx.Cast(dtypes[-2], row % rows[-1] if len(rows) > 1 else row),
                             tirx.Cast(dtypes[-1], col)])

    def finish(acc, row, col):
        return tirx.Cast("float32", _rebuild(value, ovars, list(place(row, col)), acc_buf, acc, fresh))

    return finish, place


_BINARY = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Max, tirx.Min, tirx.FloorDiv, tirx.FloorMod, tirx.Mod,
           tirx.EQ, tirx.NE, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.And, tirx.Or)


def _rebuild(expr, ovars: list, idx: list, acc_buf, acc, fresh: dict):
    """`expr` with the output block's vars `ovars` replaced by `idx` and loads of the accumulator buffer (which
    must read it at exactly those vars: elementwise) replaced by `acc`; raises ValueError on anything else (the
    kernel then keeps its generic schedule)."""
    var_map = dict(zip(ovars, idx))

    def go(e):
        if isinstance(e, tirx.Var):
            return next((v for k, v in var_map.items() if k.same_as(e)), e)
        if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
            return e
        if isinstance(e, _LOAD):
            if e.source.same_as(acc_buf):
                if len(e.indices) != len(ovars) or not all(i.same_as(v) for i, v in zip(e.indices, ovars)):
                    raise ValueError("the epilogue reads the matmul result at other indices than it writes")
                return acc
            src = next((new for old, new in fresh.items() if old.same_as(e.source)), None)
            if src is None:
                raise ValueError("the epilogue reads a buffer that is not a parameter")
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


def choose_smallm_tile(m: int, n: int, k: int) -> SmallMTile:
    """Columns per block: 32, else 16, else 8, the widest that still makes 256 blocks; warps (K split): the
    fewest of 4, 8, 16 that make 2560 in all (more weight bytes in flight), 4 above M = 16 (4 m16 tiles of
    accumulators per warp). On the H200 (bench/results/smallm_tc_run1.json, 10 tiles per shape) this picks the
    measured best, or a tile within 3% of it, at 8 of the 10 shapes; at M = 4 one 13% slower; at M x K x N =
    16x3072x768 a tile not measured (1x16: the 2x16 tile was the best)."""
    n8 = next((c for c in (4, 2) if -(-n // (8 * c)) >= 256), 1)
    blocks = -(-n // (8 * n8))
    warps = 4 if m > 16 else next((w for w in (4, 8) if blocks * w >= 2560), 16)
    return SmallMTile(n8=n8, warps=warps, vec=1, unroll=2 if warps == 16 else 4)


def gemm_kernel_from_fused(func: tirx.PrimFunc, name: str) -> tuple[tirx.PrimFunc | None, str]:
    """The TIRx kernel computing what `func` computes (same parameters): wgmma for M >= 128, mma.sync for
    M <= 64; or (None, why not)."""
    info, why = analyze_gemm(func)
    if info is None:
        return None, why
    m, n, k = info["m"], info["n"], info["k"]
    if m == 1:  # measured in the models (decode b1); this kernel at M = 1 only alone (smallm_tc_run1.json)
        return None, f"1x{n}x{k}: M=1 stays with the GEMV schedule"
    if m <= MAX_M:
        small = choose_smallm_tile(m, n, k)
        why = check_smallm_shape(m, n, k, small)
        tile, make, desc = small, smallm_kernel, f"mma.sync small-M {m}x{n}x{k}, {small.warps} warps x {small.bn} columns"
    else:
        tile = choose_tile(m, n, k)
        why = None if tile else check_wgmma_shape(m, n, k, WgmmaTile())
        make = wgmma_kernel
        desc = tile and f"wgmma {m}x{n}x{k}, tile 128x{tile.bn}, {tile.stages} stages"
    if why:
        return None, f"{m}x{n}x{k}: {why}"
    # the kernel declares its own parameter buffers (same names, shapes, dtypes): the TIRx pipeline's FlattenBuffer
    # does not see an s_tir function's parameters as definitions ("used before its definition")
    fresh = {p: tirx.decl_buffer(p.shape, p.dtype, p.name, data_alignment=16) for p in func.params}
    a, b, out = (next(v for k, v in fresh.items() if k.same_as(info[r])) for r in ("a", "b", "out"))
    finish, place = _epilogue(info, fresh)
    try:  # once outside the kernel's script, so an epilogue it cannot take is a reason, not a parse error
        finish(tirx.const(0.0, "float32"), tirx.Var("row", "int32"), tirx.Var("col", "int32"))
    except ValueError as err:
        return None, str(err)
    return make(m, n, k, tile, a, b, out, finish, place, list(fresh.values()), name), desc


def apply_hopper_kernels(mod: tvm.IRModule, target: tvm.target.Target, log: Callable[[str], None]) -> tvm.IRModule:
    """On sm_90a, replace each fused GEMM kernel a GEMM kernel takes, and each fused row reduction (LayerNorm,
    RMSNorm, their epilogues) the row kernel takes; the rest is untouched."""
    if not is_hopper(target):
        return mod
    out = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or TIRX_ATTR in (func.attrs or {}):
            continue
        for make in (gemm_kernel_from_fused, row_kernel_from_fused):
            try:
                new, why = make(func, gv.name_hint)
            except Exception as err:  # noqa: BLE001  (an unexpected kernel keeps its generic schedule)
                new, why = None, f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:120]}"
            if new is not None:
                out[gv] = new
                log(f"{gv.name_hint}: {why}")
                break
            if make is gemm_kernel_from_fused and not why.startswith(NOT_A_GEMM):  # a GEMM left alone: say why
                log(f"{gv.name_hint}: generic GEMM schedule ({why})")
                break
    if not out:
        return mod
    return tvm.IRModule({gv: out.get(gv, func) for gv, func in mod.functions.items()}, attrs=mod.attrs,
                        global_infos=mod.global_infos)
