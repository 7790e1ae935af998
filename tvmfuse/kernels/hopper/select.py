"""Hopper stage (sm_90a): fused GEMMs become a TIRx kernel (wgmma, or mma.sync for small M), epilogue included, and fused row reductions the row kernel."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import tvm
from tvm import relax, tirx

from tvmfuse.kernels.dependent_launch import early_weights
from tvmfuse.kernels.hopper.gemm_analysis import analyze_gemm, epilogue
from tvmfuse.kernels.hopper.mma_smallm import (MAX_M, SmallMTile, bulk_stages, check_smallm_shape, ring_stages,
                                              smallm_kernel, takes_m1, with_bulk_ring, with_ring)
from tvmfuse.kernels.hopper.row_kernel import row_kernel_from_fused
from tvmfuse.kernels.hopper.wgmma_gemm import TIRX_ATTR, wgmma_kernel
from tvmfuse.kernels.hopper.wgmma_tile import WgmmaTile, check_wgmma_shape
from tvmfuse.isolation import HOPPER
from tvmfuse.isolation import record as record_failure
from tvmfuse.targets import SMS  # one CTA of these tiles each at a time on each (shared memory)

#: microseconds one CTA of each tile spends per 64-deep k-step on the H200, and per tile besides (pipeline fill,
#: epilogue): fitted to wgmma_run4.json and wgmma_run5.json (bench/results/archive-sessions-5-7.tar.xz; 17 GPT-2 /
#: Llama prefill projections, 6-11 tiles each), where the cheapest estimate is the measured best tile at 16 shapes
#: and within 4% at the 17th. Three tiles were added from wgmma_run13_llama.json / wgmma_run13_gpt2.json (an H100,
#: 14 Llama-2-7B / GPT-2 / BERT projections, 9-11 tiles each), each at its measured ratio to a tile above:
#: 128x256 with stepped descriptors and setmaxnreg (0.4-2.4% faster than without at all 6 shapes measured);
#: 192x192 (three computing warpgroups) at 1.10x the 128x256's cost (2048x4096 @ 11008: 638 tiles, 4.8 waves
#: where 128x256 makes 688 and 5.2: 313.9 against 334.9 µs; 2048x768 @ 2304: 21.0 against 23.9 for 128x176);
#: and the 128x128 dual tile's 6-stage ring (DEEP_RING) at 0.905x the 4-stage one's
TILE_COSTS = {WgmmaTile(256, 4, stepped_desc=True, setmaxnreg=True): 0.83, WgmmaTile(192, 4): 0.70,
              WgmmaTile(176, 4): 0.62, WgmmaTile(144, 4): 0.55, WgmmaTile(128, 4, dual=True): 0.47,
              WgmmaTile(128, 6, 64, dual=True): 0.35, WgmmaTile(64, 8, 64, dual=True): 0.21,
              WgmmaTile(192, 4, 192, stepped_desc=True, setmaxnreg=True): 0.91}
#: the 128x128 dual tile with 6 stages, stepped descriptors and setmaxnreg. Where every CTA runs at once (one wave)
#: over a long loop it is 8.5-10% faster than 4 stages (512x4096x4096 28.1 against 30.7 µs, cuBLAS 26.0;
#: 512x11008x4096 67.6 against 75.1, cuBLAS 64.9): the loads of all CTAs compete, and with 4 stages the ring is
#: latency-bound (loads alone: 26.5 µs with 4 stages, 22.3 with 6; wgmma_run11.json, wgmma_run13_ablate.json).
#: Elsewhere it lost: 2-8% slower at the three 2048-row Llama shapes (several waves) and at 2048x3072x768 (K 3072)
DEEP_RING = WgmmaTile(128, 6, dual=True, stepped_desc=True, setmaxnreg=True)
#: two accumulator sets of m64n168 (setmaxnreg's 232 registers hold them): cuBLAS's width at Llama-2-7B's gate / up
#: projection, 4 x 66 = 264 tiles in two full waves at 512 rows, 1056 in eight at 2048. On the H200 (wgmma_run18.json)
#: 73.0 µs at 512x4096 @ 11008 against 75.0 for 128x176 (one set), and 305.1 at 2048 rows against 323.2 for
#: 192x192 (no stepped descriptors) and 334.1 for the 128x128 dual tile; 0.541 µs a k-step fitted on that run, where
#: 128x176 fits 0.600 (0.62 here), so 0.56 on this table's scale. In the Llama layer on an H100 (models_run45.json)
#: gate and up took 81.7 and 84.1 µs at 512 rows, where 128x176 took 80.9 and 82.3 in run 44: no gain there at 512
WIDE_DUAL = WgmmaTile(168, 4, dual=True, stepped_desc=True, setmaxnreg=True)
TILE_COSTS[DEEP_RING] = 0.425
TILE_COSTS[WIDE_DUAL] = 0.56
DEEP_RING_MIN_K = 4096
TILE_FIXED_US = 1.0
#: environment switch: "1" merges every sibling group, where the estimate (which times each GEMM alone, its weight
#: L2-resident) would not: in the Llama layer at 512 rows each 4096x4096 projection took 32.9 µs against 27.5-28.4
#: alone (models_run36_pdl.json, wgmma_run16_release.json); at decode rows the 4096-wide GEMVs streamed their
#: weights at 3.3 TB/s, the 11008-wide ones at 3.6-3.7 (generate_run7.json), so one 12288-wide GEMV may beat three.
#: Off by default: with it the Llama layer's decode b1 took 184.2 µs against 187.7, its prefill 512 459.2 against
#: 445.4 (models_run41_merge.json, H100; `bench/models.py --before merge_siblings`)
MERGE_SWITCH = "TVMFUSE_MERGE_SIBLINGS"
SPLIT_BYTES_PER_US = 3.3e6  # a copy kernel's bytes per µs on the H200 (copy bandwidth 3.3-4.3 TB/s in the bench runs)

#: analysis outcomes that mean "not a matmul kernel at all" (not logged)
NOT_A_GEMM = ("not a single reduction", "unexpected block structure", "a producer of the matmul", "work before",
              "operands are not matrices")


def is_hopper(target: tvm.target.Target) -> bool:
    """True for CUDA targets with wgmma and TMA (arch sm_90a)."""
    return target.kind.name == "cuda" and str(target.attrs.get("arch", "")) == "sm_90a"


def output_tiles(m: int, n: int, tile: WgmmaTile) -> int:
    """How many bm x bn output tiles (CTAs) an m x n output takes."""
    return -(-m // tile.bm) * -(-n // tile.bn)


def estimate_us(m: int, n: int, k: int, tile: WgmmaTile, costs: dict | None = None) -> float:
    """TILE_COSTS' (or `costs`') estimate of an m x n x k GEMM with `tile`: waves of SMS CTAs, each k-steps x cost
    + fixed."""
    waves = -(-output_tiles(m, n, tile) // SMS)
    return waves * (-(-k // tile.bk) * (costs or TILE_COSTS)[tile] + TILE_FIXED_US)


def check_deep_ring(m: int, n: int, k: int, tile: WgmmaTile) -> str | None:
    """Why the rules do not pick `tile` at this shape (DEEP_RING where its CTAs make more than one wave, or K is
    below DEEP_RING_MIN_K), or None."""
    if tile != DEEP_RING:
        return None
    tiles = output_tiles(m, n, tile)
    if tiles > SMS or k < DEEP_RING_MIN_K:
        return f"{tiles} tiles over K={k}: the 6-stage ring pays in one wave over K >= {DEEP_RING_MIN_K} only"
    return None


def choose_tile(m: int, n: int, k: int) -> WgmmaTile | None:
    """The tile of TILE_COSTS with the lowest estimate (wave quantization included) among those that fit and
    `check_deep_ring` lets through; None when none fits."""
    fits = [t for t in TILE_COSTS if check_wgmma_shape(m, n, k, t) is None and check_deep_ring(m, n, k, t) is None]
    return min(fits, key=lambda t: estimate_us(m, n, k, t)) if fits else None


def merges_siblings_always() -> bool:
    """Whether MERGE_SWITCH asks every sibling group to be merged, whatever the estimate."""
    return os.environ.get(MERGE_SWITCH) == "1"


def sibling_merge_pays(m: int, n: int, k: int, count: int) -> bool:
    """Whether `count` sibling m x n x k GEMMs (one input, weights of one width) run faster as one m x (count n) x k
    GEMM and the split after it: the wgmma kernel takes both (m > 64), and `estimate_us` of the merged GEMM plus the
    split's copy (`SPLIT_BYTES_PER_US` each way, and a launch) is below the siblings' one after the other (or
    MERGE_SWITCH is on). BERT-base's Q, K and V at 512 rows: 3 x 3.5 µs against 6.6 + 2.4 (measured apart,
    wgmma_run6.json: 3 x 4.9-6.2 against 8.8); at 2048 rows, with the 192x192 tile for the merged GEMM: 3 x 6.6
    against 11.9 + 6.7 (not measured apart). Llama-2-7B's at 512 (each fills its wave already): the merge would not
    pay by the estimate, which times each GEMM alone with its weight in L2."""
    if merges_siblings_always():
        return True
    if m <= MAX_M:  # decode rows: the GEMV and small-M kernels, bandwidth-bound either way
        return False
    one, merged = choose_tile(m, n, k), choose_tile(m, n * count, k)
    if one is None or merged is None:
        return False
    split_us = 2 * m * n * count * 2 / SPLIT_BYTES_PER_US + TILE_FIXED_US  # 16-bit parts read and written
    return estimate_us(m, n * count, k, merged) + split_us < count * estimate_us(m, n, k, one)


def choose_smallm_tile(m: int, n: int, k: int) -> SmallMTile:
    """Columns per block: 32, else 16, else 8, the widest that still makes 256 blocks; warps (K split): the
    fewest of 4, 8, 16 that make 2560 in all (more weight bytes in flight), 4 above M = 16 (4 m16 tiles of
    accumulators per warp). On the H200 (smallm_tc_run1.json in the results archive, 10 tiles per shape) this picks the
    measured best, or a tile within 3% of it, at 8 of the 10 shapes; at M = 4 one 13% slower; at M x K x N =
    16x3072x768 a tile not measured (1x16: the 2x16 tile was the best). With `mma_smallm.RING_SWITCH` at S: a
    weight ring of the most stages up to S that fits RING_BUDGET (none where not even 2 do); with
    `mma_smallm.BULK_SWITCH` at S, a ring filled by bulk copies (`with_bulk_ring`) instead."""
    n8 = next((c for c in (4, 2) if -(-n // (8 * c)) >= 256), 1)
    blocks = -(-n // (8 * n8))
    warps = 4 if m > 16 else next((w for w in (4, 8) if blocks * w >= 2560), 16)
    tile = SmallMTile(n8=n8, warps=warps, vec=1, unroll=2 if warps == 16 else 4)
    if bulk_stages():
        return with_bulk_ring(tile, bulk_stages()) or tile
    return with_ring(tile, ring_stages()) or tile


def weight_params(mod: tvm.IRModule) -> dict[str, set[int]]:
    """For each PrimFunc the Relax functions of `mod` call (call_tir, call_tir_inplace): the positions of its
    parameters that every call fills with a constant (a bound weight, which no kernel writes)."""
    seen: dict[str, set[int]] = {}
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        consts = set()  # the function's variables bound to a constant
        for binding in (b for block in func.body.blocks for b in block.bindings):
            call = binding.value
            if isinstance(call, tvm.ir.GenericConst):
                consts.add(binding.var)
            if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
                    and call.op.name in ("relax.call_tir", "relax.call_tir_inplace")):
                continue
            args = call.args[1].fields if isinstance(call.args[1], relax.Tuple) else [call.args[1]]
            here = {i for i, a in enumerate(args) if isinstance(a, tvm.ir.GenericConst) or a in consts}
            name = call.args[0].name_hint
            seen[name] = seen[name] & here if name in seen else here
    return seen


def gemm_kernel_from_fused(func: tirx.PrimFunc, name: str, tile: WgmmaTile | SmallMTile | None = None,
                           weights: set[int] = frozenset()) -> tuple[tirx.PrimFunc | None, str]:
    """The TIRx kernel computing what `func` computes (same parameters): mma.sync for 2 <= M <= 64, wgmma
    above, with `tile` (default: the rules' pick, `choose_smallm_tile` / `choose_tile`); or (None, why not).
    `weights`: the positions of `func`'s parameters that hold weights (`weight_params`): with
    `kernels.dependent_launch.early_weights()`, a GEMM whose B is one loads its first weights before waiting for the
    kernel before it."""
    info, why = analyze_gemm(func)
    if info is None:
        return None, why
    m, n, k = info["m"], info["n"], info["k"]
    if m == 1 and not takes_m1():  # measured in the models (decode b1); this kernel at M = 1 alone only
        return None, f"1x{n}x{k}: M=1 stays with the GEMV schedule"
    early = early_weights() and next(i for i, p in enumerate(func.params) if p.same_as(info["b"])) in weights
    if m <= MAX_M:
        small = tile or choose_smallm_tile(m, n, k)
        if early:
            small = replace(small, early_weights=True)
        why = check_smallm_shape(m, n, k, small)
        unroll = f", unroll {small.unroll}" if small.unroll != 4 else ""
        tile, make = small, smallm_kernel
        desc = (f"mma.sync small-M {m}x{n}x{k}, {small.warps} warps x {small.bn} columns{unroll}"
                + (f", a weight ring of {small.stages} stages" if small.stages else "")
                + (" (bulk copies)" if small.bulk else "")
                + ((", weights prefetched" + (" and the ring's first rounds copied" if small.stages else "")
                    + " before the wait") if small.early_weights else ""))
    else:
        tile = tile or choose_tile(m, n, k)
        if tile and early and not tile.persistent and tile.cluster == 1:
            tile = replace(tile, early_weights=True)
        why = check_wgmma_shape(m, n, k, tile or WgmmaTile())
        make = wgmma_kernel
        desc = tile and (f"wgmma {m}x{n}x{k}, tile {tile.bm}x{tile.bn}, {tile.stages} stages"
                        + (", two accumulator sets" if tile.dual else "") + _knob_notes(tile))
    if why:
        return None, f"{m}x{n}x{k}: {why}"
    # the kernel declares its own parameter buffers (same names, shapes, dtypes): the TIRx pipeline's FlattenBuffer
    # does not see an s_tir function's parameters as definitions ("used before its definition")
    fresh = {p: tirx.decl_buffer(p.shape, p.dtype, p.name, data_alignment=16) for p in func.params}
    a, b, out = (next(v for k, v in fresh.items() if k.same_as(info[r])) for r in ("a", "b", "out"))
    finish, place, setup = epilogue(info, fresh)
    try:  # once outside the kernel's script, so an epilogue it cannot take is a reason, not a parse error
        finish(tirx.const(0.0, "float32"), tirx.Var("row", "int32"), tirx.Var("col", "int32"))
    except ValueError as err:
        return None, str(err)
    return make(m, n, k, tile, a, b, out, finish, place, list(fresh.values()), name, setup=setup), desc


def _knob_notes(tile: WgmmaTile) -> str:
    """The tile's knobs that differ from WgmmaTile's defaults, for the log line (', CTA groups of 4 rows')."""
    notes = {"group_m": f"CTA groups of {tile.group_m} rows", "inflight": "one group in flight",
             "cluster": f"clusters of {tile.cluster}", "multicast": f"sharing {tile.multicast.upper()}",
             "stepped_desc": "stepped descriptors",
             "persistent": "persistent CTAs", "setmaxnreg": "setmaxnreg", "wg_release": "one release a warpgroup",
             "early_weights": "weights loaded before the wait",
             "l2_ahead": f"B prefetched {tile.l2_ahead} k-tiles ahead"}
    return "".join(f", {text}" for key, text in notes.items() if getattr(tile, key) != getattr(WgmmaTile, key))


#: tile_for(kernel, name) -> (tile, note): the tile a GEMM takes and a note for its log line; (None, None) for the
#: rules' pick, (None, why) to keep its generic schedule
TileFor = Callable[[tirx.PrimFunc, str], tuple]


def _hopper_kernel(func: tirx.PrimFunc, name: str, tile_for: TileFor | None, weights: set[int]) -> tuple:
    """(the TIRx kernel in the place of `func`, its log line), or (None, why a GEMM keeps its generic schedule), or
    (None, None) for a kernel neither the GEMM nor the row kernel is for."""
    tile, note = tile_for(func, name) if tile_for else (None, None)
    if tile is None and note:
        return None, note
    for make, args in ((gemm_kernel_from_fused, (tile, weights)), (row_kernel_from_fused, ())):
        try:
            new, why = make(func, name, *args)
        except Exception as err:  # noqa: BLE001  (an unexpected kernel keeps its generic schedule)
            new, why = None, f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:120]}"
            record_failure(name, HOPPER, f"{make.__name__}: {why}")
        if new is not None:
            return new, why + (f" ({note})" if note and make is gemm_kernel_from_fused else "")
        if make is gemm_kernel_from_fused and not why.startswith(NOT_A_GEMM):
            return None, why
    return None, None


def apply_hopper_kernels(mod: tvm.IRModule, target: tvm.target.Target, log: Callable[[str], None],
                         tile_for: TileFor | None = None) -> tvm.IRModule:
    """On sm_90a, replace each fused GEMM kernel a GEMM kernel takes (with the tile `tile_for` gives: the measured
    best, `gemm_tiles.measured_tiles`; else the rules' pick), and each fused row reduction (LayerNorm, RMSNorm, their
    epilogues) the row kernel takes; the rest is untouched."""
    if not is_hopper(target):
        return mod
    out, weights = {}, weight_params(mod)
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or TIRX_ATTR in (func.attrs or {}):
            continue
        new, why = _hopper_kernel(func, gv.name_hint, tile_for, weights.get(gv.name_hint, set()))
        if new is not None:
            out[gv] = new
            log(f"{gv.name_hint}: {why}")
        elif why:  # a GEMM left alone: say why
            log(f"{gv.name_hint}: generic GEMM schedule ({why})")
    if not out:
        return mod
    return tvm.IRModule({gv: out.get(gv, func) for gv, func in mod.functions.items()}, attrs=mod.attrs,
                        global_infos=mod.global_infos)
