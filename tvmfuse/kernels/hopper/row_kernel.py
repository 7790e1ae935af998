"""Row-reduction kernel in TIRx (LayerNorm/RMSNorm with elementwise prologue and epilogue): a few warps own a row, held in fp32 registers after 16-byte loads, summed with warp shuffles, stored with 16-byte stores."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T

from tvmfuse.kernels.dependent_launch import dependent_launch
from tvmfuse.kernels.hopper.row_analysis import analyze_rows, conv, find
from tvmfuse.kernels.hopper.wgmma_gemm import TIRX_ATTR

_F32 = "float32"
#: per 16-bit dtype: its CUDA scalar type, its pair type, and the pair <-> float2 conversions
_HALF = {"float16": ("half", "half2", "__half22float2", "__floats2half2_rn"),
         "bfloat16": ("nv_bfloat16", "nv_bfloat162", "__bfloat1622float2", "__floats2bfloat162_rn")}
#: the short name of each dtype in the helpers' names (fp16 ones keep the names they had)
_SHORT = {_F32: "32", "float16": "16", "bfloat16": "bf16"}


def _cvt(op: str, mem: str, reg: str) -> str:
    """The body of a helper moving 8 elements between a uint4 `v` (8 of the 16-bit dtype `mem`) and 8 registers
    a0..a7 of dtype `reg` (fp32, or `mem` itself)."""
    scalar, pair, to_f2, from_f2 = _HALF[mem]
    if reg == _F32 and op == "ld":
        return "".join(f"float2 f{j} = {to_f2}(reinterpret_cast<const {pair}*>(&v)[{j}]); "
                       f"a{2 * j} = f{j}.x; a{2 * j + 1} = f{j}.y; " for j in range(4))
    if reg == _F32:
        return "".join(f"reinterpret_cast<{pair}*>(&v)[{j}] = {from_f2}(a{2 * j}, a{2 * j + 1}); " for j in range(4))
    if reg != mem:
        raise ValueError(f"no 8-element move between {mem} memory and {reg} registers")
    if op == "ld":
        return "".join(f"a{i} = reinterpret_cast<const {scalar}*>(&v)[{i}]; " for i in range(8))
    return "".join(f"reinterpret_cast<{scalar}*>(&v)[{i}] = a{i}; " for i in range(8))


_F4 = {"ld": "const float4* q = reinterpret_cast<const float4*>(p); float4 u = __ldg(q), w = __ldg(q + 1); "
             + "".join(f"a{i} = {'uw'[i // 4]}.{'xyzw'[i % 4]}; " for i in range(8)),
       "st": "float4* q = reinterpret_cast<float4*>(p); q[0] = make_float4(a0, a1, a2, a3); "
             "q[1] = make_float4(a4, a5, a6, a7); "}


def _vec_src(op: str, mem: str, reg: str) -> tuple[str, str]:
    """(name, source) of the device helper that loads (op "ld") or stores ("st") 8 elements of dtype `mem` (one
    16-byte access for fp16/bf16, two for fp32) from/to 8 registers of dtype `reg` (float& / half& /
    nv_bfloat16& for a load)."""
    name, ctype = f"tvmfuse_{op}8_{_SHORT[mem]}_{_SHORT[reg]}", "float" if reg == _F32 else _HALF[reg][0]
    args = ", ".join(f"{ctype}{'&' * (op == 'ld')} a{i}" for i in range(8))
    body = _F4[op] if mem == _F32 else ("uint4 v = __ldg(reinterpret_cast<const uint4*>(p)); " + _cvt(op, mem, reg)
                                        if op == "ld" else "uint4 v; " + _cvt(op, mem, reg) + "*reinterpret_cast<uint4*>(p) = v; ")
    return name, f"__device__ __forceinline__ void {name}(void* p, {args}) {{ {body}}}\n"


@dataclass(frozen=True)
class RowKnobs:
    """warps_per_row warps share a row (each lane holds H / (32 * warps_per_row) elements of it); rows_per_cta rows
    per CTA of rows_per_cta * warps_per_row warps."""

    warps_per_row: int = 2
    rows_per_cta: int = 4


def default_knobs(info: dict) -> RowKnobs:
    """The fewest warps per row (1, 2, 4) that keep at most 32 elements of the input rows per lane, 4 warps per CTA
    (fewer rows where they do not divide the rows). On the H200 at 8192 x 4096 fp16 (bench/rowk.py), 4 warps per
    row and 1 row per CTA was the fastest knob set measured: LayerNorm+GELU 51.9 us at 56 registers (2 warps per row:
    54-55 us at 86-101; 8 or 16 warps per CTA: 52.3, 56.0 us), RMSNorm+residual 69.6 us."""
    n_in, h = max(1, len(info["inputs"])), info["h"]
    fits = [w for w in (1, 2, 4) if h % (256 * w) == 0]
    w = next((w for w in fits if n_in * h // (32 * w) <= 32), fits[-1])
    rpc = max(1, 4 // w)
    while info["r"] % rpc:
        rpc //= 2
    return RowKnobs(w, rpc)


def row_kernel(info: dict, knobs: RowKnobs, name: str) -> tirx.PrimFunc:
    """The TIRx PrimFunc computing what the analysed function computes, with its parameters (fresh buffers):
    the inputs' row loaded once into registers, each sum a lane's partial sums (fp32) added across the row's
    lanes, each output computed from the registers and stored 8 elements at a time."""
    rows, r, h, steps = info["rows"], info["r"], info["h"], info["steps"]
    w, rpc, n_red = knobs.warps_per_row, knobs.rows_per_cta, info["n_red"]
    if w not in (1, 2, 4) or h % (256 * w) or rpc < 1 or r % rpc or rpc * w > 32:
        raise ValueError(f"{knobs} does not fit {r} rows of {h}")
    chunks = h // (256 * w)  # 8-element vectors per lane and row tensor
    fresh = [(p, tirx.decl_buffer(p.shape, p.dtype, p.name, data_alignment=16)) for p in info["params"]]
    held = info["inputs"] + [s["buf"] for i, s in enumerate(steps) if s["kind"] == "row" and any(
        ld.source.same_as(s["buf"]) for t in steps[i + 1:] for ld, _ in t["loads"])]  # made, read later
    cols = [b for s in steps for _, (k, b) in s["loads"] if k == "col"]
    cols = [b for i, b in enumerate(cols) if not any(b.same_as(c) for c in cols[:i])]
    sums = [(s["buf"], s["red"]) for s in steps if s["kind"] == "red"]

    def emit(bid, tx):
        warp, lane = tx // 32, tx % 32
        row = tirx.Cast("int64", bid * rpc + warp // w)
        li = warp % w * 32 + lane  # lane within the row
        col = lambda c, i: tirx.Cast("int64", (c * (32 * w) + li) * 8 + i)
        digit = lambda d: row // math.prod(rows[d + 1:]) % rows[d]
        # flat views of the parameters (the TIRx pipeline cannot read 0-d parameter buffers themselves)
        flat = [(p, T.decl_buffer((math.prod(int(d) for d in p.shape),), p.dtype, data=b.data)) for p, b in fresh]
        regs = [(b, T.alloc_local((chunks * 8,), _F32)) for b in held]
        colr = [(b, T.alloc_local((8,), b.dtype)) for b in cols]  # per-column parameters in their own dtype
        acc = T.alloc_local((max(n_red, 1),), _F32)
        smem = T.alloc_shared((rpc * w * n_red,), _F32) if w > 1 and n_red else None

        def vec(op, buf, c, vals, kind="row", reg=_F32):  # 8 elements from/to registers of dtype `reg`
            name, src = _vec_src(op, str(buf.dtype), reg)
            at = (row * h if kind == "row" else 0) + col(c, 0)
            T.evaluate(T.cuda.func_call(name, T.address_of(find(flat, buf)[at]), *vals, source_code=src))

        def value(step, c, i):  # the step's expression for element (chunk c, i) of the lane
            def look(x, want32):
                if want32 is None:  # a block var
                    role = find(step["roles"], x)
                    return tirx.Cast(str(x.ty.dtype), 0 if role is None else col(c, i) if role == "k" else digit(role))
                kind, buf = find(step["loads"], x)
                if kind == "scalar":
                    strides = [math.prod(int(d) for d in buf.shape[k + 1:]) for k in range(len(buf.shape))]
                    return find(flat, buf)[sum(int(i) * s for i, s in zip(x.indices, strides)
                                                if isinstance(i, tirx.IntImm))]  # unit block vars: 0
                reg = (find(regs, buf)[c * 8 + i] if kind == "row" else find(colr, buf)[i] if kind == "col"
                       else acc[find(sums, buf)])
                want = _F32 if want32 else str(buf.dtype)
                return reg if want == (str(buf.dtype) if kind == "col" else _F32) else tirx.Cast(want, reg)
            return conv(step["expr"], look)

        for buf in info["inputs"]:  # every input row once, all loads in flight together
            with T.unroll(chunks) as c:
                vec("ld", buf, c, [find(regs, buf)[c * 8 + i] for i in range(8)])
        for step in steps:
            buf, j, keep = step["buf"], step["red"], find(regs, step["buf"])
            if j is not None:
                T.buffer_store(acc, tirx.const(0.0, _F32), [j])
            with T.unroll(chunks) as c:
                for cb in cols:
                    if any(k == "col" and b.same_as(cb) for _, (k, b) in step["loads"]):
                        vec("ld", cb, c, [find(colr, cb)[i] for i in range(8)], "col", str(cb.dtype))
                vals = [value(step, c, i) for i in range(8)]
                if j is not None or keep is not None or str(buf.dtype) == _F32:
                    vals = [tirx.Cast(_F32, v) for v in vals]
                if j is not None:
                    while len(vals) > 1:  # pairwise
                        vals = [vals[k] + vals[k + 1] for k in range(0, len(vals), 2)]
                    T.buffer_store(acc, acc[j] + vals[0], [j])
                elif keep is not None:
                    for i in range(8):
                        T.buffer_store(keep, vals[i], [c * 8 + i])
                    vals = [keep[c * 8 + i] for i in range(8)]
                if j is None and step["out"]:  # fp16/bf16 values stored as they are (no round trip through fp32)
                    vec("st", buf, c, vals, reg=str(vals[0].ty.dtype))
            if j is None:
                continue
            T.buffer_store(acc, T.cuda.warp_sum(acc[j]), [j])
            if w > 1:  # the row's warps add their sums through shared memory (a slot per sum: one barrier each)
                base = (warp // w * n_red + j) * w
                with T.If(lane == 0), T.Then():
                    T.buffer_store(smem, acc[j], [base + warp % w])
                T.evaluate(T.cuda.cta_sync())
                T.buffer_store(acc, sum((smem[base + k] for k in range(1, w)), smem[base]), [j])
            if str(buf.dtype) != _F32:  # the sum in the fused function's own accumulation dtype
                T.buffer_store(acc, tirx.Cast(_F32, tirx.Cast(str(buf.dtype), acc[j])), [j])

    pdl = dependent_launch()  # kernels.dependent_launch
    # fmt: off
    @T.prim_func(check_well_formed=False)
    def kernel():
        T.device_entry()
        bid = T.cta_id([r // rpc])
        tx = T.thread_id([rpc * w * 32])
        if pdl:  # the kernel before has finished and its writes are seen; the next may launch
            T.ptx.griddepcontrol.wait()
            T.ptx.griddepcontrol.launch_dependents()
        emit(bid, tx)
    # fmt: on
    return tirx.PrimFunc([b for _, b in fresh], kernel.body).with_attrs(
        {"global_symbol": name, "tirx.noalias": True, TIRX_ATTR: "row", "tirx.is_scheduled": True})


def row_kernel_from_fused(func: tirx.PrimFunc, name: str) -> tuple[tirx.PrimFunc | None, str]:
    """The row kernel computing what `func` computes (same parameters, `default_knobs`), or (None, why not)."""
    info, why = analyze_rows(func)
    if info is None:
        return None, why
    knobs = default_knobs(info)
    desc = f"row kernel {info['r']}x{info['h']}, {knobs.warps_per_row} warp(s) per row, {knobs.rows_per_cta} row(s) per CTA"
    return row_kernel(info, knobs, name), desc
