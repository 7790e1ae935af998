"""Knob tuning of the templates: records in the tuning database, resume, best knobs back, schedules/ warm start."""

from __future__ import annotations

import json

import numpy as np
import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo

from test_kernels import _attention_module, rand, ref
from tvmfuse.database import FILE, TuningDatabase
from tvmfuse.kernels import ATTENTION_PREFILL, substitute, template_sites
from tvmfuse.kernels.tuning import best_knobs, candidate_knobs, tune_templates, variant_workload
from tvmfuse.progress import kernel_records
from tvmfuse.schedules import add_from_database, open_database


def _site(fused):
    (_, name, tmpl, shapes, _), = template_sites(fused.mod, fused.kernel_patterns, target="llvm")
    return name, tmpl, shapes


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in open(path, encoding="utf-8") if x.strip()]


def _kernel_knobs(mod, name) -> dict:
    return json.loads(str(mod[name].attrs["tvmfuse.knobs"]))


def test_enumeration_records_resume_and_best_knobs(tmp_path, llvm):
    """Every knob set is measured once (the default first) and stored as a record whose workload carries the
    knobs; a second run measures nothing; substitute(database=...) applies the fastest; the record matches
    the substituted kernel, so the manifest's trial counts see it."""
    fused = _attention_module(False)
    name, tmpl, shapes = _site(fused)
    space = candidate_knobs(tmpl, shapes)
    assert tmpl is ATTENTION_PREFILL and len(space) == 2 and space[0] == tmpl.default_knobs(shapes)
    db, seen = TuningDatabase(str(tmp_path), llvm), []
    progress = tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=8, on_progress=seen.append)
    assert (progress[name].budget, progress[name].trials, progress[name].failed) == (2, 2, 0) and seen
    records = [x for x in _lines(tmp_path / FILE) if "record" in x]
    assert len(records) == 2 and progress[name].best_us > 0

    again, seen = TuningDatabase(str(tmp_path), llvm), []
    progress = tune_templates(fused.mod, fused.kernel_patterns, llvm, again, trials=8, on_progress=seen.append)
    assert (progress[name].trials, progress[name].resumed, seen) == (2, 2, [])
    assert len(_lines(tmp_path / FILE)) == 4  # 2 workloads + 2 records, nothing new

    knobs, us = best_knobs(again, tmpl, shapes, "llvm")
    secs = {json.dumps(r.workload.mod["main"].attrs["tvmfuse.knobs"]): float(np.mean([float(s) for s in r.run_secs]))
            for r in again.get_all_tuning_records()}
    assert knobs in space and abs(us - min(secs.values()) * 1e6) < 1e-6
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", database=again, log=log)
    assert _kernel_knobs(new, name) == knobs and "measured knobs" in log[0][1], log
    assert kernel_records(new, again)[name][0] == 1  # the substituted kernel is the recorded workload
    args = [rand(np.random.default_rng(2), (1, 4, 64, 64), "float16") for _ in range(3)]
    got = relax_run(new, args)
    assert np.abs(got - ref(*args)).max() < 2e-3


def relax_run(mod, args):
    from tvm import relax
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy().astype("f4")


def test_budget_measures_the_default_first_and_zero_measures_nothing(tmp_path, llvm):
    fused = _attention_module(False)
    name, tmpl, shapes = _site(fused)
    db = TuningDatabase(str(tmp_path), llvm)
    assert tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=0)[name].trials == 0
    assert not (tmp_path / FILE).exists()
    assert best_knobs(db, tmpl, shapes, "llvm") == (None, None)
    log = []
    substitute(fused.mod, fused.kernel_patterns, target="llvm", database=db, log=log)
    assert "default knobs (none measured)" in log[0][1]
    tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=1)
    assert best_knobs(db, tmpl, shapes, "llvm")[0] == tmpl.default_knobs(shapes)


def _record(mod, target, secs):
    sch = s_tir.Schedule(mod)
    sch.get_sblock("root")
    return ms.database.TuningRecord(sch.trace, ms.database.Workload(mod), [secs], target,
                                    ArgInfo.from_prim_func(mod["main"]))


def test_schedules_library_record_chooses_the_knobs_without_measuring(tmp_path, llvm):
    """A schedules/ file holding a template record (the non-default knob set, measured fastest elsewhere) makes
    a fresh job's substitute choose those knobs, with --trials 0 (nothing measured, nothing written)."""
    fused = _attention_module(False)
    name, tmpl, shapes = _site(fused)
    default, other = candidate_knobs(tmpl, shapes)
    elsewhere = TuningDatabase(str(tmp_path / "elsewhere"), llvm)
    for knobs, secs in ((default, 3e-4), (other, 1e-4)):
        mod = variant_workload(tmpl, shapes, knobs, name, llvm)
        elsewhere.commit_tuning_record(_record(mod, llvm, secs))
    lib = str(tmp_path / "lib")
    assert add_from_database(elsewhere, lib)["added"] == 2

    work_dir = tmp_path / "job"
    db = open_database(str(work_dir), llvm, lib, say=lambda s: None, mod=fused.mod)
    assert tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=0)[name].trials == 0
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", database=db, log=log)
    assert _kernel_knobs(new, name) == other and "100.0 us" in log[0][1], log
    assert not work_dir.exists()  # seeds live in memory: nothing measured, nothing written
