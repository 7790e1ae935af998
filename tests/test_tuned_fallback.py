"""A tuned schedule that computes the wrong thing never fails a job: the build checks each replayed record against
the kernel's default schedule (verify.schedules) and keeps the default where it is wrong; a build whose tuned
kernels pass that check but fail the job's verification is built again with them on their default schedules. A
wrong schedule is injected by the build's record replay (build.compile.replay_record), so nothing is tuned here."""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm

import tvmfuse.build.compile as build_mod
import tvmfuse.pipeline as pipeline_mod
from test_isolation import _mlp
from tvmfuse import isolation
from tvmfuse.cli.tune import main
from tvmfuse.decide import decide
from tvmfuse.export.runtime import load
from tvmfuse.frontend import import_model
from tvmfuse.fuse import lower
from tvmfuse.prepare import prepare_module
from tvmfuse.spaces.defaults import ROW_DEFAULT, default_schedule
from tvmfuse.targets import resolve_target
from tvmfuse.verify.schedules import schedule_check

WRONG, RIGHT = "softmax", "layer_norm"  # kernels of test_isolation's _mlp: [16, 64] -> [16, 32]
ATOL, RTOL = 1e-5, 1e-4


def wrong_schedule(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """`func` marked scheduled (as a replayed record is) with its last store multiplied by 1.5: a wrong schedule."""
    lines = func.script().splitlines()
    last = max(i for i, line in enumerate(lines) if re.match(r"\s+\w+\[.*\] = ", line))
    lines[last] = re.sub(r" = (.*)$", r" = (\1) * T.float32(1.5)", lines[last])
    return tvm.script.from_source("\n".join(lines)).with_attr("tirx.is_scheduled", True)


def _replay_wrong_and_right(monkeypatch, gpu=None):
    """Replay WRONG's 'record' as `wrong_schedule`, RIGHT's as the kernel itself marked scheduled (a right one); on
    a GPU target (`gpu`) both start from the kernel under its default schedule (a GPU kernel needs its threads)."""
    real = build_mod.replay_record

    def scheduled(func):
        sch = default_schedule(func, gpu) if gpu is not None else None
        return sch.mod["main"] if sch is not None else func

    def replay(gv, func, *args):
        if gv.name_hint == WRONG:
            return wrong_schedule(scheduled(func))
        if gv.name_hint == RIGHT:
            return scheduled(func).with_attr("tirx.is_scheduled", True)
        return real(gv, func, *args)

    monkeypatch.setattr(build_mod, "replay_record", replay)


def _job(tmp_path, capsys, *extra, target="llvm") -> tuple[int, dict | None, str]:
    """Build _mlp with --trials 0 (the replayed records are the injected ones); (exit code, manifest, log)."""
    path = _mlp(str(tmp_path / "mlp.onnx"))
    code = main([path, "--target", target, "--trials", "0", "--out", str(tmp_path / "o"),
                 "--logs", str(tmp_path / "l"), "--schedules", "none", *extra])
    text = capsys.readouterr()
    found = glob.glob(os.path.join(tmp_path, "o", "mlp-*", "manifest.json"))  # mlp-llvm, mlp-cuda-sm_90a
    manifest = None
    if found:
        with open(found[0], encoding="utf-8") as f:
            manifest = json.load(f)
    return code, manifest, text.out + text.err


def _matches_onnxruntime(tmp_path, atol=ATOL) -> float:
    """The export's max abs error against onnxruntime on fresh inputs (asserted within ATOL + RTOL * |ref|)."""
    x = np.random.default_rng(1).standard_normal((16, 64)).astype("float32")
    ref = ort.InferenceSession(str(tmp_path / "mlp.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    (export,) = glob.glob(os.path.join(tmp_path, "o", "mlp-*"))
    got = load(export)(x)[0]
    np.testing.assert_allclose(got, ref, atol=atol, rtol=RTOL)
    return float(np.abs(got - ref).max())


@pytest.mark.parametrize("target", ["llvm", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_wrong_tuned_schedule_keeps_its_default_and_the_job_passes(target, tmp_path, monkeypatch, capsys):
    """On the CPU, and on a GPU (the check runs the kernels where the target's device is; there the fp32 build
    is held to 1e-4 of onnxruntime's CPU outputs, its fast exponentials)."""
    _replay_wrong_and_right(monkeypatch, resolve_target(target) if target != "llvm" else None)
    code, manifest, log = _job(tmp_path, capsys, target=target)
    assert code == 0, log[-2000:]
    assert [(f["kernel"], f["step"]) for f in manifest["failures"]] == [(WRONG, isolation.OUTPUT_CHECK)]
    why = manifest["failures"][0]["reason"]
    assert re.fullmatch(r"tuned schedule gave wrong output \(max abs err [0-9.e+-]+ > tol 0\.0001 \+ 0\.0001 \* "
                        r"\|ref\| against the default schedule\)", why), why
    assert float(why.split("max abs err ")[1].split()[0]) > 0.1  # 1.5x a softmax row: far outside fp32's 1e-4
    kinds = {k["name"]: k["schedule"] for k in manifest["kernels"]}
    assert kinds[WRONG] in ("default", ROW_DEFAULT) and kinds[RIGHT] == "tuned"  # the right one is kept
    warnings = [ln for ln in log.splitlines() if "warning: kernel" in ln]
    assert warnings == [f"[mlp] warning: kernel {WRONG}: output check failed, keeping its default schedule ({why})"]
    atol = ATOL if target == "llvm" else 1e-4
    assert manifest["verification"]["status"] == "passed" and manifest["verification"]["max_abs_err"] < atol
    assert "building again" not in log  # the per-kernel check caught it: one build
    assert _matches_onnxruntime(tmp_path, atol) < atol


def test_verification_failure_rebuilds_the_tuned_kernels_on_default_schedules(tmp_path, monkeypatch, capsys):
    """The per-kernel check off (as where it cannot run, or a schedule wrong only in the whole model): the job's
    verification fails, the build again with both tuned kernels on default schedules passes, both are listed."""
    _replay_wrong_and_right(monkeypatch)
    monkeypatch.setattr(pipeline_mod, "_schedule_check", lambda target, log: None)
    code, manifest, log = _job(tmp_path, capsys)
    assert code == 0, log[-2000:]
    failures = {f["kernel"]: f for f in manifest["failures"]}
    assert sorted(failures) == sorted([WRONG, RIGHT])
    assert {f["step"] for f in failures.values()} == {isolation.VERIFICATION}
    why = failures[WRONG]["reason"]
    assert failures[RIGHT]["reason"] == why
    assert re.fullmatch(r"the build with tuned schedules failed verification against onnxruntime \(max abs err "
                        r"[0-9.e+-]+, max rel err [0-9.e+-]+\); with default schedules it passed \(ok [0-9.e+-]+\)",
                        why), why
    assert float(why.split("max abs err ")[1].split(",")[0]) > 100 * ATOL  # half a softmax row's largest value
    kinds = {k["name"]: k["schedule"] for k in manifest["kernels"]}
    assert kinds[WRONG] == kinds[RIGHT] == pipeline_mod.UNTUNED_AFTER_VERIFICATION
    assert sum("building again with its 2 tuned kernel(s) on their default schedules" in ln
               for ln in log.splitlines()) == 1
    assert sum(f"warning: kernel {k}: verification failed, keeping its default schedule" in log
               for k in (WRONG, RIGHT)) == 2
    assert manifest["verification"]["status"] == "passed" and manifest["verification"]["max_abs_err"] < ATOL
    assert _matches_onnxruntime(tmp_path) < ATOL


def test_a_build_wrong_on_default_schedules_too_fails_the_job(tmp_path, monkeypatch, capsys):
    """The fallback is not a way around verification: wrong with default schedules too, the job fails (exit 2),
    once, and nothing is exported."""
    _replay_wrong_and_right(monkeypatch)
    monkeypatch.setattr(pipeline_mod, "_schedule_check", lambda target, log: None)
    real = pipeline_mod.apply_default_schedules

    def defaults(mod, target, *args):  # WRONG's default schedule is wrong too
        out = real(mod, target, *args)
        if not (mod[WRONG].attrs and mod[WRONG].attrs.get("tirx.is_scheduled", False)):
            out[WRONG] = wrong_schedule(mod[WRONG])
        return out

    monkeypatch.setattr(pipeline_mod, "apply_default_schedules", defaults)
    code, manifest, log = _job(tmp_path, capsys)
    assert code == 2 and manifest is None
    errors = [ln for ln in log.splitlines() if ln.startswith("error:") or "FAILED" in ln]
    assert any("verification against onnxruntime FAILED" in ln
               and ln.endswith("(with every kernel on its default schedule too)") for ln in errors), log[-2000:]
    assert log.count("building again with its 2 tuned kernel(s)") == 1


def test_schedule_check_names_wrong_and_passes_right_schedules(tmp_path, llvm, monkeypatch):
    """The check alone, kernel by kernel: every _mlp kernel made wrong is caught with its error; the kernel itself
    (and a real split + parallel schedule of it) passes; a kernel with no reference is not checked, and says so."""
    bound = prepare_module(import_model(onnx.load(_mlp(str(tmp_path / "mlp.onnx")))))
    mod = lower(bound, plan=decide(bound, llvm)).mod
    said: list[str] = []
    check = schedule_check(llvm, said.append)
    kernels = [(gv.name_hint, f) for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 4
    for name, func in kernels:
        assert check(name, wrong_schedule(func), func).startswith("tuned schedule gave wrong output (max abs err ")
        assert check(name, func.with_attr("tirx.is_scheduled", True), func) is None
    sch = tvm.s_tir.Schedule(mod[WRONG])
    outer, _ = sch.get_loops(sch.get_sblock("T_softmax_norm"))
    sch.parallel(outer)
    assert check(WRONG, sch.mod["main"].with_attr("tirx.is_scheduled", True), mod[WRONG]) is None
    assert said == []
    import tvmfuse.verify.schedules as schedules_mod

    monkeypatch.setattr(schedules_mod, "default_schedule", lambda f, t: (_ for _ in ()).throw(ValueError("no rule")))
    assert check(WRONG, wrong_schedule(mod[WRONG]), mod[WRONG]).startswith("tuned schedule gave wrong output")
    check = schedule_check(llvm, said.append)  # a check with no reference yet (one check keeps each kernel's)
    assert check(WRONG, wrong_schedule(mod[WRONG]), mod[WRONG]) is None
    assert said == [f"{WRONG}: tuned schedule not checked (no reference: ValueError: no rule)"]


def _records_of(mod, name, target, times_us):
    """A database holding, for kernel `name`, one real record per time: its outer loop made parallel."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    key = _normalize_mod(mod[name])
    db = ms.database.MemoryDatabase()
    workload = db.commit_workload(key)
    sch = tvm.s_tir.Schedule(key)
    sch.parallel(sch.get_loops(sch.get_sblock("T_softmax_norm"))[0])
    for us in times_us:
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [us * 1e-6], target,
                                                         ArgInfo.from_prim_func(mod[name])))
    return db


def _softmax_module(tmp_path, llvm):
    bound = prepare_module(import_model(onnx.load(_mlp(str(tmp_path / "mlp.onnx")))))
    return lower(bound, plan=decide(bound, llvm)).mod


def _apply_with_a_wrong_fastest(mod, llvm, db, monkeypatch) -> tuple[tvm.IRModule, list, list[str]]:
    """apply_database with the fastest record of WRONG in `db` replaying wrong (every other replay real): (the
    module, the failures, the lines said)."""
    real = build_mod.replay_record
    monkeypatch.setattr(build_mod, "replay_record", lambda gv, func, target, database: wrong_schedule(func)
                        if database is db and gv.name_hint == WRONG else real(gv, func, target, database))
    said: list[str] = []
    with isolation.collecting(said.append) as failures:
        out = build_mod.apply_database(mod, llvm, db, check=schedule_check(llvm, said.append), say=said.append)
    monkeypatch.setattr(build_mod, "replay_record", real)
    return out, failures.items, said


def test_a_wrong_fastest_record_gives_way_to_the_next_right_one(tmp_path, llvm, monkeypatch):
    """The fastest record of WRONG replays wrong; the next (2 µs) is a real, right schedule: it is kept, with one
    warning naming it, its time on the kernel, and no failure (the kernel stays tuned)."""
    mod = _softmax_module(tmp_path, llvm)
    out, failures, said = _apply_with_a_wrong_fastest(mod, llvm, _records_of(mod, WRONG, llvm, [1.0, 2.0, 3.0]),
                                                      monkeypatch)
    assert failures == []
    assert out[WRONG].attrs["tirx.is_scheduled"] and float(out[WRONG].attrs[build_mod.RECORD_US_ATTR]) == 2.0
    assert "T.parallel" in out[WRONG].script()
    assert len(said) == 1 and said[0].startswith(f"warning: kernel {WRONG}: its fastest record failed its output "
                                                 "check (tuned schedule gave wrong output (max abs err ")
    assert said[0].endswith("record 2 by time (2.0 us) is right and kept")


def test_a_kernel_whose_records_are_all_wrong_keeps_its_default(tmp_path, llvm, monkeypatch):
    """Every record of WRONG replays wrong (the fastest and the NEXT_RECORDS after it): its default schedule, one
    failure at the output check; a kernel without records is left alone."""
    mod = _softmax_module(tmp_path, llvm)
    db = _records_of(mod, WRONG, llvm, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    tried = []

    def replay(gv, func, target, database):
        tried.append(gv.name_hint)
        return wrong_schedule(func) if gv.name_hint == WRONG else func

    monkeypatch.setattr(build_mod, "replay_record", replay)
    said: list[str] = []
    with isolation.collecting(said.append) as failures:
        out = build_mod.apply_database(mod, llvm, db, check=schedule_check(llvm, said.append), say=said.append)
    assert [(f["kernel"], f["step"]) for f in failures.items] == [(WRONG, isolation.OUTPUT_CHECK)]
    assert tried.count(WRONG) == 1 + build_mod.NEXT_RECORDS  # the fastest, then the next 4 of the 5 left
    assert out[WRONG].same_as(mod[WRONG])


def test_the_build_rejects_a_wrong_record_in_the_tuning_database_for_good(tmp_path, llvm, monkeypatch):
    """A TuningDatabase (the job's `tuning_logs/`): the fastest record of WRONG replays wrong, the next (another
    schedule: split, then parallel) is right and kept; the wrong one is rejected on disk, so a reopened database
    holds only the right one and a build from it keeps it with no warning."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    from tvmfuse.records.database import TuningDatabase

    mod = _softmax_module(tmp_path, llvm)
    key = _normalize_mod(mod[WRONG])
    db = TuningDatabase(str(tmp_path / "logs"), llvm)
    for split, us in ((False, 1.0), (True, 2.0)):
        sch = tvm.s_tir.Schedule(key)
        outer = sch.get_loops(sch.get_sblock("T_softmax_norm"))[0]
        sch.parallel(sch.split(outer, [2, None])[0] if split else outer)
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, ms.database.Workload(key), [us * 1e-6], llvm,
                                                         ArgInfo.from_prim_func(mod[WRONG])))
    out, failures, said = _apply_with_a_wrong_fastest(mod, llvm, db, monkeypatch)
    assert failures == [] and float(out[WRONG].attrs[build_mod.RECORD_US_ATTR]) == 2.0
    assert [ln.split(": ")[1] for ln in said] == [f"kernel {WRONG}"]
    again = TuningDatabase(str(tmp_path / "logs"), llvm)
    assert [float(r.run_secs[0]) for r in again.records_of(key)] == [2e-6]
    said = []
    with isolation.collecting(said.append) as failures:
        out = build_mod.apply_database(mod, llvm, again, check=schedule_check(llvm, said.append), say=said.append)
    assert failures.items == [] and said == [] and out[WRONG].attrs["tirx.is_scheduled"]
