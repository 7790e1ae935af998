"""Knob tuning of the templates: records in the tuning database, resume, best knobs back, schedules/ warm start."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo

from test_kernels import _attention_module
from tvmfuse.database import FILE, TuningDatabase
from tvmfuse.kernels import ATTENTION_PREFILL, substitute, template_sites
from tvmfuse.kernels.tuning import best_knobs, candidate_knobs, tune_templates, variant_workload
from tvmfuse.progress import kernel_records
from tvmfuse.schedules import open_database
from tvmfuse.schedules_upkeep import add_from_database
from tvmfuse.tune import _builder, _evaluator, _runner


def _site(fused):
    (_, name, tmpl, shapes, _), = template_sites(fused.mod, fused.kernel_patterns, target="llvm")
    return name, tmpl, shapes


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in open(path, encoding="utf-8") if x.strip()]


def _kernel_knobs(mod, name) -> dict:
    return json.loads(str(mod[name].attrs["tvmfuse.knobs"]))


def test_enumeration_records_resume_and_best_knobs(tmp_path, llvm):
    """--trials 0 measures nothing; 1 measures the default; 2 resumes (the default counts) and measures one
    more knob set; each is a record whose workload carries the knobs; a second run measures nothing;
    substitute(database=...) applies the fastest; the record is the substituted kernel's workload, so the
    manifest's trial counts see it."""
    fused = _attention_module(False)
    name, tmpl, shapes = _site(fused)
    space = candidate_knobs(tmpl, shapes)
    tools = dict(builder=_builder(1), runner=_runner(None, _evaluator(False)))  # tune.py's, made once here
    assert tmpl is ATTENTION_PREFILL and len(space) == len(tmpl.knob_space(shapes)) >= 2
    assert space[0] == tmpl.default_knobs(shapes)
    db = TuningDatabase(str(tmp_path), llvm)
    assert tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=0)[name].trials == 0
    assert not (tmp_path / FILE).exists() and best_knobs(db, tmpl, shapes, "llvm") == (None, None)
    log = []
    substitute(fused.mod, fused.kernel_patterns, target="llvm", database=db, log=log)
    assert "default knobs (none measured)" in log[0][1]
    tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=1, **tools)
    assert best_knobs(db, tmpl, shapes, "llvm")[0] == space[0]
    seen = []
    progress = tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=2, on_progress=seen.append, **tools)
    assert (progress[name].budget, progress[name].trials, progress[name].resumed, progress[name].failed) == (2, 2, 1, 0)
    assert len(seen) == 1 and progress[name].best_us > 0
    records = [x for x in _lines(tmp_path / FILE) if "record" in x]
    assert len(records) == 2

    again, seen = TuningDatabase(str(tmp_path), llvm), []
    progress = tune_templates(fused.mod, fused.kernel_patterns, llvm, again, trials=2, on_progress=seen.append, **tools)
    assert (progress[name].trials, progress[name].resumed, seen) == (2, 2, [])
    assert len(_lines(tmp_path / FILE)) == 4  # 2 workloads + 2 records, nothing new

    knobs, us = best_knobs(again, tmpl, shapes, "llvm")
    secs = {str(r.workload.mod["main"].attrs["tvmfuse.knobs"]): float(np.mean([float(s) for s in r.run_secs]))
            for r in again.get_all_tuning_records()}
    assert knobs in space[:2] and abs(us - min(secs.values()) * 1e6) < 1e-6
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", database=again, log=log)
    assert _kernel_knobs(new, name) == knobs and "measured knobs" in log[0][1], log
    assert kernel_records(new, again)[name][0] == 1  # the substituted kernel is the recorded workload


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
    default, other = candidate_knobs(tmpl, shapes)[:2]
    elsewhere = TuningDatabase(str(tmp_path / "elsewhere"), llvm)
    for knobs, secs in ((default, 3e-4), (other, 1e-4)):
        mod = variant_workload(tmpl, shapes, knobs, name, llvm)
        elsewhere.commit_tuning_record(_record(mod, llvm, secs))
    lib = str(tmp_path / "lib")
    assert add_from_database(elsewhere, lib)["added"] == 2  # one record per knob set (each its own workload)

    work_dir = tmp_path / "job"
    db = open_database(str(work_dir), llvm, lib, say=lambda s: None, mod=fused.mod)
    assert tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=0)[name].trials == 0
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", database=db, log=log)
    assert _kernel_knobs(new, name) == other and "100.0 us" in log[0][1], log
    assert not work_dir.exists()  # seeds live in memory: nothing measured, nothing written


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_cuda_build_applies_a_template_record():
    """For cuda, the pipeline's order (substitute with the database's best knobs -> apply_database -> build):
    the template record replays on the substituted kernel (kind 'tuned', its latency in kernel_records), the
    kernel keeps the chosen knobs, and the module compiles with nvcc."""
    from tvmfuse.build import apply_database, apply_default_schedules, compile_module, schedule_kinds
    from tvmfuse.targets import resolve_target

    cuda = resolve_target("cuda")
    fused = _attention_module(False)
    (_, name, tmpl, shapes, _), = template_sites(fused.mod, fused.kernel_patterns, target="cuda")
    space = candidate_knobs(tmpl, shapes)
    db = TuningDatabase(None, cuda)
    for i, knobs in enumerate(space):  # the last knob set measured fastest
        db.commit_tuning_record(_record(variant_workload(tmpl, shapes, knobs, name, cuda), cuda, 1e-4 / (i + 1)))
    mod = substitute(fused.mod, fused.kernel_patterns, target="cuda", database=db)
    assert _kernel_knobs(mod, name) == space[-1]
    assert kernel_records(mod, db)[name] == (1, pytest.approx(100.0 / len(space)))
    tuned = apply_database(mod, cuda, db)
    assert schedule_kinds(tuned)[name] == "tuned" and _kernel_knobs(tuned, name) == space[-1]
    assert compile_module(apply_default_schedules(tuned, cuda), cuda) is not None
