"""Knob tuning of the templates: records in the tuning database, resume, best knobs back, schedules/ warm start,
every knob set's output checked against the generic kernel (locally and through RPC)."""

from __future__ import annotations

import json
import shutil
import types

import numpy as np
import pytest
import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo

from test_kernels import _attention_module
from tvmfuse.records.database import FILE, TuningDatabase
from tvmfuse.kernels import ATTENTION_PREFILL, substitute, template_sites
from tvmfuse.tune import templates as tuning
from tvmfuse.verify.kernels import VariantCheck
from tvmfuse.records.knobs import best_knobs, failed_knobs, measured
from tvmfuse.tune.templates import FAILED_SECS, candidate_knobs, variant_workload
from tvmfuse.tune.templates import tune_templates as _tune_templates
from tvmfuse.tune.progress import kernel_records
from tvmfuse.records.library import open_database
from tvmfuse.records.upkeep import add_from_database
from tvmfuse.tune.search import evaluator_config as _evaluator, make_builder as _builder, make_runner as _runner


def tune_templates(*args, **kwargs):
    """The kernels phase's call: every knob set checked against the generic kernel (the verify stage's check)."""
    return _tune_templates(*args, make_check=VariantCheck, **kwargs)


@pytest.fixture(scope="module")
def builder():
    """tune.py's local builder with one worker, made once for the module (each one made runs a sanity check in a
    fresh worker process, ~3 s); it keeps no state between builds."""
    return _builder(1)


def _site(fused):
    (_, name, tmpl, shapes, _), = template_sites(fused.mod, fused.kernel_patterns, target="llvm")
    return name, tmpl, shapes


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in open(path, encoding="utf-8") if x.strip()]


def _kernel_knobs(mod, name) -> dict:
    return json.loads(str(mod[name].attrs["tvmfuse.knobs"]))


def _spy_checks(monkeypatch) -> list:
    """Every VariantCheck made and what each `check` call returned: [(check, [[outcome per variant], ...])]."""
    made, init, check = [], VariantCheck.__init__, VariantCheck.check

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append((self, []))

    def spy_check(self, artifacts):
        out = check(self, artifacts)
        next(calls for c, calls in made if c is self).append(out)
        return out
    monkeypatch.setattr(VariantCheck, "__init__", spy_init)
    monkeypatch.setattr(VariantCheck, "check", spy_check)
    return made


def test_enumeration_records_resume_and_best_knobs(tmp_path, llvm, monkeypatch, builder):
    """--trials 0 measures nothing; 1 measures the default; 2 resumes (the default counts) and measures one
    more knob set; each passes its output check against the generic kernel and is a record, with its time, whose
    workload carries the knobs; a second run measures nothing; substitute(database=...) applies the fastest; the
    record is the substituted kernel's workload, so the manifest's trial counts see it."""
    checks, said = _spy_checks(monkeypatch), []
    fused = _attention_module(False)
    name, tmpl, shapes = _site(fused)
    space = candidate_knobs(tmpl, shapes)
    tools = dict(builder=builder, runner=_runner(None, _evaluator(False)))  # tune.py's, made once here
    assert tmpl is ATTENTION_PREFILL and len(space) == len(tmpl.knob_space(shapes)) >= 2
    assert space[0] == tmpl.default_knobs(shapes)
    db = TuningDatabase(str(tmp_path), llvm)
    assert tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=0)[name].trials == 0
    assert not (tmp_path / FILE).exists() and best_knobs(db, tmpl, shapes, "llvm") == (None, None)
    log = []
    substitute(fused.mod, fused.kernel_patterns, target="llvm", database=db, log=log)
    assert "default knobs (none measured)" in log[0][1]
    tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=1, say=said.append, **tools)
    assert best_knobs(db, tmpl, shapes, "llvm")[0] == space[0]
    seen = []
    progress = tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=2, on_progress=seen.append,
                              say=said.append, **tools)
    assert (progress[name].budget, progress[name].trials, progress[name].resumed, progress[name].failed) == (2, 2, 1, 0)
    assert [calls for _, calls in checks] == [[[None]], [[None]]] and said == []  # both checked, both right
    assert all(0 < secs < FAILED_SECS for secs in measured(db, tmpl, shapes, "llvm").values())
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
    assert add_from_database(elsewhere, lib)["added"] == 1  # the fastest knob set alone (each is its own workload)

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
    from tvmfuse.build import apply_database, compile_module, schedule_kinds
    from tvmfuse.spaces import apply_default_schedules
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


def _wrong_for(tmpl, shapes, bad_knobs: list, monkeypatch) -> None:
    """variant_workload gives a wrong kernel for each of `bad_knobs` (softmax scale doubled), under the right record
    key."""
    right = tuning.variant_workload

    def variant(tmpl_, shapes_, knobs, name, target):
        mod = right(tmpl_, shapes_, knobs, name, target)
        if knobs not in bad_knobs:
            return mod
        bad = right(tmpl_, dict(shapes_, scale=2 * shapes_["scale"]), knobs, name, target)
        return tvm.IRModule({"main": bad["main"].with_attr("tvmfuse.template", mod["main"].attrs["tvmfuse.template"])})
    monkeypatch.setattr(tuning, "variant_workload", variant)


class _FirstIsFastest:
    """A runner that times the first candidate it is given 1 us and the others 100 us (so a wrong variant that
    reached it first would win), and keeps what it was given."""

    def __init__(self):
        self.given = []

    def run(self, inputs):
        self.given += inputs
        return [types.SimpleNamespace(result=lambda s=s: ms.runner.RunnerResult(run_secs=[s], error_msg=None))
                for s in [1e-6] + [1e-4] * (len(inputs) - 1)]


def test_wrong_variant_is_recorded_failed_and_never_chosen(tmp_path, llvm, monkeypatch, builder):
    """The default knob set builds a kernel with the wrong output: it is not timed, its record is a failure
    (progress counts it, the log says it once), best_knobs and substitute take the right one, a rerun measures
    nothing again."""
    fused = _attention_module(False)
    name, tmpl, shapes = _site(fused)
    space = candidate_knobs(tmpl, shapes)
    _wrong_for(tmpl, shapes, [space[0]], monkeypatch)
    db, runner, said = TuningDatabase(str(tmp_path), llvm), _FirstIsFastest(), []
    progress = tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=2, builder=builder,
                              runner=runner, say=said.append)[name]
    assert (progress.trials, progress.failed, progress.best_us) == (2, 1, pytest.approx(1.0))
    assert len(runner.given) == 1  # only the right variant was timed
    assert len(said) == 1 and said[0].startswith(f"{name}: knobs {space[0]} gave wrong output (max abs err "), said
    assert float(said[0].split("max abs err ")[1].split()[0]) > 0.1 and "> tol 0.01 + 0.01 * |ref|)" in said[0]
    assert measured(db, tmpl, shapes, "llvm") == {json.dumps(space[0], sort_keys=True): float("inf"),
                                                   json.dumps(space[1], sort_keys=True): pytest.approx(1e-6)}
    assert best_knobs(db, tmpl, shapes, "llvm") == (space[1], pytest.approx(1.0))
    again = tune_templates(fused.mod, fused.kernel_patterns, llvm, TuningDatabase(str(tmp_path), llvm), trials=2,
                           runner=runner, say=said.append)[name]
    assert (again.trials, again.resumed, len(runner.given), len(said)) == (2, 2, 1, 1)
    assert _kernel_knobs(substitute(fused.mod, fused.kernel_patterns, target="llvm", database=db), name) == space[1]


def test_every_knob_set_wrong_keeps_the_generic_kernel(tmp_path, llvm, monkeypatch, builder):
    """Every measured knob set gives the wrong output: none is timed, each is a failed record, and substitute keeps
    the generic kernel (not the template with its default knobs), saying why in the job's log line."""
    fused = _attention_module(False)
    name, tmpl, shapes = _site(fused)
    space = candidate_knobs(tmpl, shapes)
    assert len(space) > 2  # two measured, the rest never: "every measured", not every knob set
    _wrong_for(tmpl, shapes, space, monkeypatch)
    db, runner, said = TuningDatabase(str(tmp_path), llvm), _FirstIsFastest(), []
    progress = tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=2, builder=builder,
                              runner=runner, say=said.append)[name]
    assert (progress.trials, progress.failed, progress.best_us, runner.given) == (2, 2, None, [])
    assert len(said) == 2 and all("gave wrong output" in line for line in said), said
    assert best_knobs(db, tmpl, shapes, "llvm") == (None, None) and failed_knobs(db, tmpl, shapes, "llvm") == 2
    log = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", database=db, log=log)
    assert [f"{kernel}: {outcome}" for kernel, outcome in log] == \
        [f"{name}: generic: every measured knob set failed (2)"]  # as templates.apply_templates logs it
    assert new[name].same_as(fused.mod[name]) and "tvmfuse.knobs" not in new[name].attrs
    log = []  # nothing measured (a fresh database): the template with its default knobs, as before
    fresh = substitute(fused.mod, fused.kernel_patterns, target="llvm", database=TuningDatabase(None, llvm), log=log)
    assert log == [(name, "template attention_prefill, default knobs (none measured)")]
    assert _kernel_knobs(fresh, name) == space[0]


def test_variants_are_checked_in_the_runners_rpc_session(tmp_path, llvm, monkeypatch, builder):
    """With an RPC runner the check runs where it measures: in a session its `rpc_config` opens (here TVM's
    in-process LocalSession, standing in for the tracker's server: the same upload/load_module/device calls),
    one per round; the wrong variant fails there too."""
    checks, sessions, runner = _spy_checks(monkeypatch), [], _FirstIsFastest()

    def connect_server():
        sessions.append(tvm.rpc.LocalSession())
        return sessions[-1]
    runner.rpc_config = types.SimpleNamespace(connect_server=connect_server)
    fused = _attention_module(False)
    name, tmpl, shapes = _site(fused)
    space = candidate_knobs(tmpl, shapes)
    _wrong_for(tmpl, shapes, [space[1]], monkeypatch)
    db, said = TuningDatabase(str(tmp_path), llvm), []
    progress = tune_templates(fused.mod, fused.kernel_patterns, llvm, db, trials=2, builder=builder,
                              runner=runner, say=said.append)[name]
    (_, calls), = checks
    assert len(sessions) == 1 and [[w is not None for w in c] for c in calls] == [[False, True]]
    assert (progress.trials, progress.failed, len(runner.given)) == (2, 1, 1)
    assert len(said) == 1 and f"knobs {space[1]} gave wrong output" in said[0]
    assert best_knobs(db, tmpl, shapes, "llvm") == (space[0], pytest.approx(1.0))


@pytest.mark.gpu
def test_gpu_variants_are_checked_on_the_gpu(tmp_path, monkeypatch):
    """On a GPU, tune.py's local builder and runner: every CUDA knob set runs against the dlight-scheduled generic
    kernel on the GPU (additive mask); the right ones pass and are timed, a wrong one (the last) fails and is never
    chosen."""
    from tvmfuse.targets import resolve_target

    cuda, checks = resolve_target("cuda"), _spy_checks(monkeypatch)
    fused = _attention_module(True)
    (_, name, tmpl, shapes, _), = template_sites(fused.mod, fused.kernel_patterns, target="cuda")
    space = candidate_knobs(tmpl, shapes)
    _wrong_for(tmpl, shapes, [space[-1]], monkeypatch)
    db, said = TuningDatabase(str(tmp_path), cuda), []
    progress = tune_templates(fused.mod, fused.kernel_patterns, cuda, db, trials=len(space), say=said.append)[name]
    (_, calls), = checks
    outcomes = [w for c in calls for w in c]
    assert outcomes[:-1] == [None] * (len(space) - 1) and "gave wrong output" in (outcomes[-1] or ""), outcomes
    assert progress.failed == 1 and len(said) == 1, said
    assert best_knobs(db, tmpl, shapes, cuda)[0] in space[:-1]


def test_half_precision_reference_computes_in_float32(tmp_path, llvm, monkeypatch):
    """An all-fp16 graph's generic decode kernel (softmax sum over seq_k 4096 in fp16) is itself off by more than
    fp16's tolerance: run as it is, it would fail the right variant; run in float32 (`in_float32`), it passes it."""
    from tvm.support.tar import tar

    from checks import decode_attention
    from tvmfuse.kernels.substitution import call_sites as _call_sites
    from tvmfuse.verify import kernels as check

    fused = decode_attention(4096)
    (gv, name, tmpl, shapes, perm), = template_sites(fused.mod, fused.kernel_patterns, target="llvm")
    artifact = str(tmp_path / "variant.tar")
    tvm.compile(variant_workload(tmpl, shapes, None, name, llvm), target=llvm).export_library(artifact, fcompile=tar)
    args = (fused.mod[gv], _call_sites(fused.mod)[name], perm, llvm)
    assert "float16" not in check.in_float32(fused.mod[gv]).script()
    assert check.VariantCheck(*args).check([artifact]) == [None]
    monkeypatch.setattr(check, "in_float32", lambda fn: fn)
    assert "gave wrong output" in check.VariantCheck(*args).check([artifact])[0]
