"""tvmfuse.kernels.hopper.gemm_tiles: the Hopper GEMM kernels' tile candidates, their tuning sites and records, and
the tile apply_hopper_kernels takes from them (measured by a stand-in builder and runner: no GPU here)."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Future

import pytest
import tvm
import tvm_ffi
from test_hopper import _gelu_projection
from test_smallm import _projection
from tvm.s_tir import meta_schedule as ms

from tvmfuse.kernels.hopper import apply_hopper_kernels, choose_smallm_tile, choose_tile
from tvmfuse.kernels.hopper.gemm_tiles import (DEEP_STAGES, GROUPS, HOPPER_GEMMS, PICK_VARIANTS, SMALLM_BULK,
                                               SMALLM_L2_AHEAD, WHOLE_WAVES, hopper_gemm_sites, measured_tiles, ringed,
                                               smallm_space, whole_wave_tiles, wgmma_space)
from tvmfuse.kernels.hopper.mma_smallm import SmallMTile, check_smallm_shape, with_bulk_ring
from tvmfuse.kernels.hopper.select import TILE_COSTS, gemm_kernel_from_fused
from tvmfuse.kernels.hopper.wgmma_tile import WgmmaTile, check_wgmma_shape
from tvmfuse.records import TuningDatabase
from tvmfuse.records.keys import knob_key
from tvmfuse.targets import SMS, resolve_target
from tvmfuse.tune.templates import FAILED_SECS, tune_sites

SHAPES = [(512, 4096, 4096), (2048, 11008, 4096), (512, 768, 3072), (130, 1000, 256), (2048, 50257, 768)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_wgmma_space_is_the_fitted_pick_first_then_every_tile_that_fits(m, n, k):
    """The rules' pick first (what --trials 0 builds, so a tuned build is never slower), then its deepest ring that
    fits (the 128x128 dual tile: 6 stages, alone and with stepped descriptors + setmaxnreg); every candidate fits the
    shape, none twice; each fitted tile in both CTA orders; the pick's knob variants last."""
    space = wgmma_space(m, n, k)
    pick = space[0]
    assert pick == choose_tile(m, n, k)
    assert len(space) == len(set(space)) and all(check_wgmma_shape(m, n, k, t) is None for t in space)
    assert {t.group_m for t in space} == {4, 16}
    deep = [t for t in space if t.stages > pick.stages and t.bn == pick.bn and t.bm == pick.bm and t.dual == pick.dual]
    if pick.stages < DEEP_STAGES and pick.smem_bytes + (pick.bm + pick.bn) * 128 <= 200 * 1024:  # one more fits
        want = list(dict.fromkeys([dataclasses.replace(pick, stages=deep[0].stages),  # (one where the pick has both)
                                   dataclasses.replace(pick, stages=deep[0].stages, stepped_desc=True,
                                                       setmaxnreg=pick.bm == 128)]))
        assert space[1:1 + len(want)] == deep == want
        deeper = dataclasses.replace(pick, stages=deep[0].stages + 1)
        assert deep[0].stages == DEEP_STAGES or check_wgmma_shape(m, n, k, deeper)  # the deepest that fits
    else:
        assert deep == []
    ranked = [dataclasses.replace(t, group_m=g) for t in TILE_COSTS for g in GROUPS]
    assert {t for t in ranked if check_wgmma_shape(m, n, k, t) is None} <= set(space)  # every rules' tile that fits
    variants = [dataclasses.replace(pick, **v) for v in PICK_VARIANTS]
    assert {t for t in variants if check_wgmma_shape(m, n, k, t) is None} <= set(space)
    assert space.index(pick) == 0 and all(space.index(t) >= len(space) - 4 for t in variants if t in space[1:]
                                          and t not in ranked and t not in deep)  # the pick's variants come last
    assert all(t.bm >= 128 or not t.setmaxnreg for t in space)  # one computing warpgroup: ptxas ignores setmaxnreg
    assert wgmma_space(32, n, k) == []  # below every tile (the family gives such rows the small-M kernel)


@pytest.mark.parametrize("m,n,k,widths", [(512, 11008, 4096, [168]), (2048, 11008, 4096, [232, 200, 168]),
                                          (512, 4096, 4096, []), (512, 22016, 4096, [224, 168, 136])])
def test_whole_wave_tiles_are_the_narrowest_widths_that_fit_each_count_of_waves(m, n, k, widths):
    """cuBLAS's 168-wide tile at Llama's gate / up projection (512 rows, N 11008: 264 tiles, two waves of 132): for
    each count of waves the narrowest multiple of 8 above 128 whose tiles fit, none of 8 narrower would; the
    deepest ring that fits, stepped descriptors and setmaxnreg; after the pick's deeper rings in the space."""
    tiles = whole_wave_tiles(m, n, k)
    assert [t.bn for t in tiles] == widths
    for t in tiles:
        waves = -(-(-(-m // 128) * -(-n // t.bn)) // SMS)
        narrower = -(-m // 128) * -(-n // (t.bn - 8))
        assert waves <= WHOLE_WAVES and (narrower > waves * SMS or t.bn - 8 <= 128), t
        assert t.stepped_desc and t.setmaxnreg and t.bm == 128 and check_wgmma_shape(m, n, k, t) is None
        assert t.stages == DEEP_STAGES or check_wgmma_shape(m, n, k, dataclasses.replace(t, stages=t.stages + 1))
    space = wgmma_space(m, n, k)
    pick = space[0]
    deep = [t for t in space[1:3] if t.bn == pick.bn and t.stages > pick.stages]
    fresh = [t for t in tiles if t not in space[:1 + len(deep)]]
    assert space[1 + len(deep):1 + len(deep) + len(fresh)] == fresh
    assert tiles == [] or (m, n) != (512, 11008) or tiles[0].stages == 5  # (128 + 168) x 128 B x 5 = 189 KB


@pytest.mark.parametrize("m,n,k", [(16, 4096, 4096), (4, 11008, 4096), (64, 768, 768)])
def test_smallm_space_is_the_rule_first_then_every_tile_that_fits(m, n, k):
    """The rule's tile, then each columns x warps x unroll set without and with a weight ring (the most stages up to
    4 within 128 KB: 32 columns x 16 warps x 4 chunks has none, 2 stages of it would take 256 KB) and with a ring of
    bulk copies (3 or 4 stages, the unroll halved until 3 fit: 32 columns x 16 warps at unroll 1)."""
    space = smallm_space(m, n, k)
    assert space[0] == choose_smallm_tile(m, n, k) and len(space) == len(set(space)) > 10
    assert all(check_smallm_shape(m, n, k, t) is None for t in space)
    plain = [t for t in space if t.stages == 0 and t.l2_ahead == 0]
    widest = SmallMTile(n8=4, warps=16, unroll=4)
    assert ringed(widest) is None and ringed(SmallMTile(n8=4, warps=8, unroll=4)).stages == 2
    assert {t for t in space if t.stages and not t.bulk} == {ringed(t) for t in plain if t != widest}
    assert {t.stages for t in space if not t.bulk} == {0, 2, 4}
    bulk = {t for t in space if t.bulk}
    assert bulk == {with_bulk_ring(t, SMALLM_BULK) for t in plain} and {t.stages for t in bulk} <= {3, 4}
    assert dataclasses.replace(widest, unroll=1, stages=3, bulk=True) in bulk
    assert [t for t in space if t.l2_ahead] == [dataclasses.replace(space[0], l2_ahead=SMALLM_L2_AHEAD)]  # the pick


def test_sites_are_the_static_gemms_keyed_by_what_they_compute_not_their_name():
    """One site per fused GEMM the Hopper kernels take on sm_90a (M = 1 and other targets: none); its records'
    key is the GEMM and epilogue, so a renamed kernel finds them and another epilogue does not."""
    cuda = resolve_target("cuda")
    mod = _gelu_projection(256, 512, 384)
    (site,) = hopper_gemm_sites(mod, cuda)
    gv, name, family, shapes, perm = site
    assert family is HOPPER_GEMMS and (shapes["m"], shapes["n"], shapes["k"]) == (256, 384, 512) and perm == [0, 1, 2]
    renamed = mod[gv].with_attr("global_symbol", "another_name")
    other = dict(shapes, func=renamed, name="another_name")
    assert HOPPER_GEMMS.key(other) == HOPPER_GEMMS.key(shapes)
    (plain,) = hopper_gemm_sites(_projection(256, 512, 384), cuda)  # bias, no GELU
    assert HOPPER_GEMMS.key(plain[3]) != HOPPER_GEMMS.key(shapes)
    assert hopper_gemm_sites(mod, resolve_target("llvm")) == []
    assert hopper_gemm_sites(mod, resolve_target('{"kind": "cuda", "arch": "sm_80"}')) == []
    (gemv,) = hopper_gemm_sites(_projection(1, 512, 384), cuda)  # M = 1: the small-M kernel's tiles are tuned too
    assert gemv[3]["m"] == 1
    assert HOPPER_GEMMS.knob_space(gemv[3])[0] == dataclasses.asdict(choose_smallm_tile(1, 384, 512))
    kernel = HOPPER_GEMMS(shapes, HOPPER_GEMMS.knob_space(shapes)[3])
    assert json.loads(kernel.attrs["tvmfuse.template"])["template"] == "hopper_gemm"
    assert kernel.attrs["tvmfuse.knobs"] == knob_key(HOPPER_GEMMS.knob_space(shapes)[3])


class _Builder:
    """Builds nothing: each artifact is the knob set it stands for."""

    def build(self, inputs):
        return [ms.builder.BuilderResult(str(next(iter(i.mod.functions.values())).attrs["tvmfuse.knobs"]), None)
                for i in inputs]


class _Runner:
    """Times each knob set with `secs(knobs)`: None is a failed run."""

    def __init__(self, secs):
        self.secs, self.runs = secs, 0

    def run(self, inputs):
        out = []
        for i in inputs:
            self.runs += 1
            secs = self.secs(json.loads(i.artifact_path))
            future = Future()
            future.set_result(ms.runner.RunnerResult([secs] if secs else None, None if secs else "failed"))
            out.append(future)
        return out


def _tile_line(logged):
    (line,) = [ln for ln in logged if "wgmma" in ln or "generic GEMM" in ln]
    return line


def test_the_fastest_measured_tile_is_built_and_a_rerun_measures_only_the_rest(tmp_path):
    """--trials 3 measures the pick and the two next candidates (records in the database); the build takes the
    fastest of them; rerun with 3 nothing runs again, with 5 two more; a database without records: the pick."""
    cuda = resolve_target("cuda")
    mod = _gelu_projection(256, 512, 384)
    sites = hopper_gemm_sites(mod, cuda)
    space = HOPPER_GEMMS.knob_space(sites[0][3])
    fastest = space[2]
    runner = _Runner(lambda knobs: 5e-6 if knobs == fastest else 9e-6)
    db = TuningDatabase(str(tmp_path / "db"), cuda)
    progress = tune_sites(sites, mod, cuda, db, 3, builder=_Builder(), runner=runner)
    assert runner.runs == 3 and progress[sites[0][1]].trials == 3 and progress[sites[0][1]].best_us == 5.0
    logged = []
    out = apply_hopper_kernels(mod, cuda, logged.append, tile_for=measured_tiles(db, cuda))
    assert "the fastest measured tile, 5.0 us" in _tile_line(logged)
    (kernel,) = [f for f in out.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    want, _ = gemm_kernel_from_fused(mod[sites[0][0]], sites[0][1], WgmmaTile(**fastest))
    assert tvm_ffi.structural_equal(kernel, want)
    again = TuningDatabase(str(tmp_path / "db"), cuda)  # the records on disk
    assert tune_sites(sites, mod, cuda, again, 3, builder=_Builder(), runner=runner)[sites[0][1]].resumed == 3
    assert runner.runs == 3
    tune_sites(sites, mod, cuda, again, 5, builder=_Builder(), runner=runner)
    assert runner.runs == 5
    logged.clear()
    apply_hopper_kernels(mod, cuda, logged.append, tile_for=measured_tiles(TuningDatabase(None, cuda), cuda))
    _, pick = gemm_kernel_from_fused(mod[sites[0][0]], sites[0][1])  # the rules' tile, as --trials 0 has it
    assert _tile_line(logged) == f"{sites[0][1]}: {pick}" and "measured" not in pick


def test_a_gemm_whose_every_measured_tile_failed_keeps_the_rules_tile_with_a_warning(tmp_path):
    """Every measured tile failed (a box that cannot run them, or wrong outputs): the GEMM keeps the tile --trials 0
    builds (a tuned build is never slower), said in the log and as a manifest failure line."""
    from tvmfuse import isolation

    cuda = resolve_target("cuda")
    mod = _gelu_projection(256, 512, 384)
    sites = hopper_gemm_sites(mod, cuda)
    db = TuningDatabase(str(tmp_path / "db"), cuda)
    tune_sites(sites, mod, cuda, db, 2, builder=_Builder(), runner=_Runner(lambda knobs: None))
    records = db.get_all_tuning_records()
    assert len(records) == 2 and all(float(r.run_secs[0]) >= FAILED_SECS for r in records)
    logged, warned = [], []
    with isolation.collecting(warned.append) as failures:
        out = apply_hopper_kernels(mod, cuda, logged.append, tile_for=measured_tiles(db, cuda))
    _, pick = gemm_kernel_from_fused(mod[sites[0][0]], sites[0][1])
    assert _tile_line(logged) == f"{sites[0][1]}: {pick} (every measured tile failed (2): the rules' tile, as " \
                                 "--trials 0 builds it)"
    (kernel,) = [f for f in out.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert tvm_ffi.structural_equal(kernel, gemm_kernel_from_fused(mod[sites[0][0]], sites[0][1])[0])
    (failure,) = failures.items
    assert failure["kernel"] == sites[0][1] and failure["step"] == isolation.HOPPER and "(2)" in failure["reason"]
    assert len(warned) == 1 and sites[0][1] in warned[0]


@pytest.mark.gpu
def test_tiles_are_checked_and_timed_on_the_gpu_and_the_fastest_is_built(tmp_path):
    """The product's builder and runner (tune.search) and its output check (verify.VariantCheck): six tiles of a
    256x384x512 GEMM + bias + GELU each right against the generic kernel and timed; the build takes the fastest."""
    from tvmfuse.verify import VariantCheck

    cuda = resolve_target("cuda")
    mod = _gelu_projection(256, 512, 384)
    sites = hopper_gemm_sites(mod, cuda)
    db = TuningDatabase(str(tmp_path / "db"), cuda)
    said = []
    progress = tune_sites(sites, mod, cuda, db, 6, say=said.append, make_check=VariantCheck)
    task = progress[sites[0][1]]
    assert task.trials == 6 and task.failed == 0 and task.best_us is not None, said
    logged = []
    apply_hopper_kernels(mod, cuda, logged.append, tile_for=measured_tiles(db, cuda))
    assert f"the fastest measured tile, {task.best_us:.1f} us" in _tile_line(logged)


def test_the_schedules_library_keeps_a_gemms_fastest_tile_and_a_fresh_job_builds_it(tmp_path):
    """`schedules add` keeps one record of the three measured tiles (the fastest); a job seeded from that library
    builds the GEMM with it at --trials 0, nothing measured."""
    from tvmfuse.records import open_database
    from tvmfuse.records.upkeep import add_from_database

    cuda = resolve_target("cuda")
    mod = _gelu_projection(256, 512, 384)
    sites = hopper_gemm_sites(mod, cuda)
    fastest = HOPPER_GEMMS.knob_space(sites[0][3])[1]
    db = TuningDatabase(str(tmp_path / "db"), cuda)
    tune_sites(sites, mod, cuda, db, 3, builder=_Builder(), runner=_Runner(lambda k: 4e-6 if k == fastest else 7e-6))
    lib = str(tmp_path / "lib")
    assert add_from_database(db, lib)["added"] == 1
    fresh = open_database(str(tmp_path / "job"), cuda, lib, say=lambda s: None, mod=mod)
    logged = []
    out = apply_hopper_kernels(mod, cuda, logged.append, tile_for=measured_tiles(fresh, cuda))
    assert "the fastest measured tile, 4.0 us" in _tile_line(logged)
    (kernel,) = [f for f in out.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert tvm_ffi.structural_equal(kernel, gemm_kernel_from_fused(mod[sites[0][0]], sites[0][1],
                                                                   WgmmaTile(**fastest))[0])
    assert not (tmp_path / "job").exists()
