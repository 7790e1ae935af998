"""The Hopper GEMM kernels as a family `--trials` tunes: each fused GEMM's candidate tiles (the fitted pick first),
the kernel built with any of them, and the key its tuning records carry."""

from __future__ import annotations

import dataclasses
import json

import tvm
import tvm_ffi
from tvm import tirx

from tvmfuse.kernels.hopper.gemm_analysis import analyze_gemm
from tvmfuse.kernels.hopper.mma_smallm import (MAX_M, SmallMTile, check_smallm_shape, takes_m1, with_bulk_ring,
                                              with_ring)
from tvmfuse.kernels.hopper.select import (TILE_COSTS, choose_smallm_tile, choose_tile, estimate_us,
                                           gemm_kernel_from_fused, is_hopper)
from tvmfuse.kernels.hopper.wgmma_tile import DUAL_MAX_BN_SETMAXNREG, WgmmaTile, check_wgmma_shape
from tvmfuse.kernels.substitution import call_sites
from tvmfuse.isolation import HOPPER
from tvmfuse.isolation import record as record_failure
from tvmfuse.records.keys import knob_key
from tvmfuse.records.knobs import best_knobs, failed_knobs
from tvmfuse.targets import SMS

#: CTA orders measured besides the default's 16 row tiles a group (wgmma_run6.json: 4 was best at 2048x11008x4096)
GROUPS = (16, 4)
#: knobs that are measured on the fitted pick alone (each correct on the GPU, gpu_tests_run31_hopper.txt)
PICK_VARIANTS = ({"stepped_desc": True}, {"persistent": True}, {"setmaxnreg": True},
                 {"stepped_desc": True, "setmaxnreg": True})
#: the deepest stage ring measured on the fitted pick (right after it): with 4 stages of the 128x128 tile about 2 are
#: loading while the consumers hold the others, and at 512x4096x4096 the consumers waited for data in 27% of
#: Nsight Compute's samples; 6 stages took it from 30.7 to 29.4 µs, with stepped descriptors and setmaxnreg 28.4
#: (cuBLAS 26.4; wgmma_run12.json, ncu_run1.json, H100)
DEEP_STAGES = 6
#: the most waves of CTAs `whole_wave_tiles` fits a tile width to
WHOLE_WAVES = 8
#: the small-M kernel's candidates: columns (8 * n8) a block, warps splitting K, K chunks loaded ahead
SMALLM_N8, SMALLM_WARPS, SMALLM_UNROLL = (1, 2, 4), (4, 8, 16), (2, 4)
#: the deepest weight ring (`SmallMTile.stages`) each small-M candidate is also measured with, as many stages up to
#: this as fit `mma_smallm.RING_BUDGET` (tuning decides; the rules' tiles with a ring of 4 made the Llama layer's decode
#: b16 14% slower, models_run40_ring.json)
SMALLM_RING = 4
#: weight rounds the rule's small-M tile is also measured with prefetched into L2 ahead (`SmallMTile.l2_ahead`). At
#: M = 1 on an H100, 4 rounds ahead took 42-54 µs where the tiles without took 32-35 (wgmma_run20_smallm.json); 2
#: rounds were timed only by the host-bound run 19 (slower at 11008 x 4096): tuning measures it, the rules never pick it
SMALLM_L2_AHEAD = 2
#: the most stages of a ring of bulk copies (`SmallMTile.bulk`) each small-M candidate is also measured with
#: (`mma_smallm.with_bulk_ring`: its unroll halved until 3 fit); not yet timed on a GPU: tuning decides
SMALLM_BULK = 4


def deepest_ring(m: int, n: int, k: int, tile: WgmmaTile, above: int = 1) -> WgmmaTile | None:
    """`tile` with the most stages above `above`, up to DEEP_STAGES, that fit the m x n x k GEMM, or None."""
    return next((dataclasses.replace(tile, stages=d) for d in range(DEEP_STAGES, above, -1)
                 if check_wgmma_shape(m, n, k, dataclasses.replace(tile, stages=d)) is None), None)


def deeper_rings(m: int, n: int, k: int, pick: WgmmaTile) -> list[WgmmaTile]:
    """The pick with the most stages up to DEEP_STAGES that fit, alone and with stepped descriptors (and setmaxnreg
    where it has two computing warpgroups); none where the pick's ring cannot grow."""
    deep = deepest_ring(m, n, k, pick, pick.stages)
    if deep is None:
        return []
    return list(dict.fromkeys([deep, dataclasses.replace(deep, stepped_desc=True, setmaxnreg=pick.bm >= 128)]))


def whole_wave_tiles(m: int, n: int, k: int) -> list[WgmmaTile]:
    """128-row tiles, for each w of 1 .. WHOLE_WAVES the narrowest width (a multiple of 8 above 128, at most 256)
    whose output tiles fit in w waves of SMS CTAs, with the deepest ring up to DEEP_STAGES that fits, stepped
    descriptors and setmaxnreg, and two accumulator sets where they fit (`DUAL_MAX_BN_SETMAXNREG`) (no wave partly
    empty where a narrower width would fill it). cuBLAS takes a 168-wide tile at 512x4096 @ 11008 (4 x 66 = 264
    tiles, two full waves of 132; wgmma_run13_llama.json), where the 176-wide one makes 252 tiles."""
    rows, found = -(-m // 128), []
    for waves in range(1, WHOLE_WAVES + 1):
        cols = waves * SMS // rows
        bn = -(-n // cols // 8) * 8 if cols else 0
        if not 128 < bn <= 256:
            continue
        tile = deepest_ring(m, n, k, WgmmaTile(bn, DEEP_STAGES, dual=bn <= DUAL_MAX_BN_SETMAXNREG,
                                               stepped_desc=True, setmaxnreg=True))
        if tile is not None:
            found.append(tile)
    return found


def wgmma_space(m: int, n: int, k: int) -> list[WgmmaTile]:
    """The fitted pick (`choose_tile`) first, then its deeper rings (`deeper_rings`), then the whole-wave tiles
    (`whole_wave_tiles`), then every TILE_COSTS tile in each CTA order of GROUPS that fits, cheapest estimate
    first, then the pick with each of PICK_VARIANTS: what `--trials N` measures, in that order."""
    pick = choose_tile(m, n, k)
    if pick is None:
        return []
    tiles = [dataclasses.replace(t, group_m=g) for t in TILE_COSTS for g in GROUPS]
    ranked = sorted((t for t in tiles if check_wgmma_shape(m, n, k, t) is None),
                    key=lambda t: (estimate_us(m, n, k, dataclasses.replace(t, group_m=WgmmaTile.group_m)),
                                   GROUPS.index(t.group_m)))
    variants = [dataclasses.replace(pick, **v) for v in PICK_VARIANTS]
    variants = [t for t in variants if check_wgmma_shape(m, n, k, t) is None]
    space = [pick] + deeper_rings(m, n, k, pick) + whole_wave_tiles(m, n, k) + ranked + variants
    return list(dict.fromkeys(space))


def ringed(tile: SmallMTile) -> SmallMTile | None:
    """`tile` with a weight ring of the most stages up to SMALLM_RING that fit (`mma_smallm.with_ring`), or None."""
    return with_ring(tile, SMALLM_RING)


def smallm_space(m: int, n: int, k: int) -> list[SmallMTile]:
    """The rule's tile (`choose_smallm_tile`) first, then every other columns x warps x unroll set, each also with a
    weight ring (`ringed`) and with a ring of bulk copies (`with_bulk_ring`), then the rule's tile with its weights
    prefetched into L2 SMALLM_L2_AHEAD rounds ahead (where it has no ring)."""
    pick = choose_smallm_tile(m, n, k)
    plain = [SmallMTile(n8=c, warps=w, vec=1, unroll=u) for c in SMALLM_N8 for w in SMALLM_WARPS
             for u in SMALLM_UNROLL]
    tiles = plain + [r for r in map(ringed, plain) if r is not None]
    tiles += [b for b in (with_bulk_ring(t, SMALLM_BULK) for t in plain) if b is not None]
    tiles += [dataclasses.replace(pick, l2_ahead=SMALLM_L2_AHEAD)] if not pick.stages else []
    return list(dict.fromkeys([pick] + [t for t in tiles if check_smallm_shape(m, n, k, t) is None]))


def _tile(shapes: dict, knobs: dict):
    return (SmallMTile if shapes["m"] <= MAX_M else WgmmaTile)(**knobs)


class HopperGemms:
    """The fused GEMMs the Hopper kernels take, as a template-like family (name, key, knob_space, default_knobs,
    call): shapes are {"m", "n", "k", "kernel": the generic kernel's structural hash, "func": it, "name"}, knobs a
    tile's fields. The records of `tune.templates` then hold one tile each, keyed by the GEMM (its epilogue
    included), whatever the kernel is named in another build."""

    name = "hopper_gemm"

    def key(self, shapes: dict, target: str = "cuda") -> str:
        s = {k: shapes[k] for k in ("m", "n", "k", "kernel")}
        return json.dumps({"template": self.name, "target": str(target), "shapes": s}, sort_keys=True)

    def knob_space(self, shapes: dict) -> list[dict]:
        m, n, k = shapes["m"], shapes["n"], shapes["k"]
        tiles = smallm_space(m, n, k) if m <= MAX_M else wgmma_space(m, n, k)
        return [dataclasses.asdict(t) for t in tiles]

    def default_knobs(self, shapes: dict) -> dict:
        return self.knob_space(shapes)[0]

    def __call__(self, shapes: dict, knobs: dict | None = None, target: str = "cuda") -> tirx.PrimFunc:
        """The TIRx kernel of this GEMM with the tile `knobs` (the default tile when None)."""
        knobs = knobs or self.default_knobs(shapes)
        fn, why = gemm_kernel_from_fused(shapes["func"], shapes["name"], _tile(shapes, knobs))
        if fn is None:
            raise ValueError(f"{self.name}: {why}")
        return fn.with_attr("tvmfuse.template", self.key(shapes, target)).with_attr("tvmfuse.knobs", knob_key(knobs))


HOPPER_GEMMS = HopperGemms()


def gemm_shapes(func: tirx.PrimFunc, name: str) -> dict | None:
    """The family's shapes of a fused kernel the Hopper GEMM kernels take at static sizes (M = 1 unless
    `mma_smallm.M1_SWITCH` keeps it on the GEMV schedule), else None."""
    info, _ = analyze_gemm(func)
    if info is None or not all(isinstance(info[d], int) for d in "mnk") or (info["m"] == 1 and not takes_m1()):
        return None
    shapes = {"m": info["m"], "n": info["n"], "k": info["k"], "func": func, "name": name,
              "kernel": str(tvm_ffi.structural_hash(func.without_attr("global_symbol")))}
    return shapes if HOPPER_GEMMS.knob_space(shapes) else None


def hopper_gemm_sites(mod: tvm.IRModule, target: tvm.target.Target) -> list[tuple]:
    """(global var, kernel name, HOPPER_GEMMS, shapes, argument order) for each fused GEMM of `main` the Hopper
    kernels take with their default tile, as `kernels.template_sites` gives the attention kernels (the order is
    the kernel's own: it keeps its parameters)."""
    if not is_hopper(target):
        return []
    calls, sites = call_sites(mod), []
    for gv, fn in mod.functions.items():
        name = gv.name_hint
        if not isinstance(fn, tirx.PrimFunc) or name not in calls:
            continue
        try:
            shapes = gemm_shapes(fn, name)
            if shapes is None or gemm_kernel_from_fused(fn, name)[0] is None:
                continue
        except Exception:  # noqa: BLE001  (a kernel the analysis trips on is apply_hopper_kernels' to report)
            continue
        sites.append((gv, name, HOPPER_GEMMS, shapes, list(range(len(calls[name].args[1].fields)))))
    return sites


def measured_tiles(database, target: tvm.target.Target):
    """`apply_hopper_kernels`' tile_for: each GEMM's fastest tile in `database` (its tuning records, or the schedules
    library's), else the rules' pick (where every measured tile failed too: a build that cannot measure, say,
    is never slower than --trials 0; a warning and a manifest line say so)."""
    def tile_for(func: tirx.PrimFunc, name: str) -> tuple:
        try:
            shapes = gemm_shapes(func, name)
        except Exception:  # noqa: BLE001  (apply_hopper_kernels analyses it again and reports what is wrong)
            return None, None
        if shapes is None:
            return None, None
        knobs, us = best_knobs(database, HOPPER_GEMMS, shapes, target)
        if knobs is not None:
            return _tile(shapes, knobs), f"the fastest measured tile, {us:.1f} us"
        failed = failed_knobs(database, HOPPER_GEMMS, shapes, target)
        if not failed:
            return None, None
        why = f"every measured tile failed ({failed}): the rules' tile, as --trials 0 builds it"
        record_failure(name, HOPPER, why)  # a warning and a line in the manifest; verification checks the build
        return _tile(shapes, HOPPER_GEMMS.default_knobs(shapes)), why
    return tile_for
