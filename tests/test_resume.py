"""Tuning that never loses work: kill -9 and Ctrl-C mid-run, resume, concurrent tunes on one database, safe exports."""

import json
import os
import signal
import subprocess
import sys
import time

import onnx
import pytest

from test_database import kernel_mods, record_for, two_kernels
from tvmfuse.cli.tune import main as tune_main
from tvmfuse.records.database import FILE, TuningDatabase
from tvmfuse.export.library import export
from tvmfuse.export.runtime import load
from tvmfuse.tune.search import tune

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUNE = os.path.join(ROOT, "scripts", "tune.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "two.onnx"
    onnx.save(two_kernels(), path)
    return str(path)


@pytest.fixture(scope="module")
def one_kernel_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("m1") / "two.onnx"  # same job name, one kernel: half the tuning time
    onnx.save(two_kernels(one=True), path)
    return str(path)


def command(model, tmp_path, out="out", trials=8):
    # rounds of 4 candidates per kernel, so records land in steps small enough to kill between them
    return [sys.executable, TUNE, "--target", "llvm", model, "--trials", str(trials), "--out", str(tmp_path / out),
            "--logs", str(tmp_path / "logs"), "--schedules", "none", "--batch", "4"]


def record_lines(tmp_path) -> list[str]:
    path = tmp_path / "logs" / "two-llvm" / FILE
    return [ln for ln in path.read_text().splitlines() if '"record"' in ln] if path.exists() else []


def start_and_wait(cmd, tmp_path, at_least, log):
    """Start a tune in its own process group; return it once `at_least` records are on disk."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 300
    while len(record_lines(tmp_path)) < at_least:
        assert proc.poll() is None, f"tune ended early: {open(log.name).read()[-2000:]}"
        assert time.time() < deadline, "no records after 300 s"
        time.sleep(0.2)
    return proc


def test_kill_9_then_rerun_finishes_with_the_remaining_budget_only(model, tmp_path, capsys):
    # 2 kernels x 4 trials: both defaults are measured and stored first, then one search round of 3 per kernel
    # (their 6 records land together); killed -9 in that round, the rerun runs only those 6
    with open(tmp_path / "run1.log", "w") as log:
        proc = start_and_wait(command(model, tmp_path, trials=4), tmp_path, 2, log)
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its builder/runner workers: "machine gone"
        assert proc.wait() == -signal.SIGKILL
    before = record_lines(tmp_path)
    kept = len(before)
    assert 2 <= kept < 8
    # the rerun in this process (a fresh process adds nothing to what is checked: the killed one is the point)
    code = tune_main(command(model, tmp_path, trials=4)[2:])
    rerun = capsys.readouterr()
    assert code == 0, rerun.out + rerun.err
    assert f"{kept} stored records for this target and TVM version" in rerun.out
    assert f"resumed: {kept} trials were already recorded and counted toward the budget; {8 - kept} run now" \
        in rerun.out
    after = record_lines(tmp_path)
    assert len(after) == 8 and after[:kept] == before  # 2 kernels x 4 trials; nothing from before is lost
    manifest = json.loads((tmp_path / "out" / "two-llvm" / "manifest.json").read_text())
    assert [(k["schedule"], k["trials"]) for k in manifest["kernels"]] == [("tuned", 4), ("tuned", 4)]
    assert load(str(tmp_path / "out" / "two-llvm")) is not None  # sha256 checked at load

    # now damage the database: torn last line, garbage, a record for another target and one for another
    # TVM version (both "faster" than anything real); the next build uses only the valid matching records
    path = tmp_path / "logs" / "two-llvm" / FILE
    lines = path.read_text().splitlines()
    foreign = json.loads(after[0])
    foreign["record"][1] = [1e-9]
    other_target = dict(foreign, target={"kind": "llvm", "keys": ["cpu"], "mtriple": "aarch64-linux-gnu", "tag": ""})
    other_version = dict(foreign, tvm="0.20.0")
    path.write_text("\n".join(lines[:3] + ["garbage {", json.dumps(other_target), json.dumps(other_version)]
                              + lines[3:-1] + [lines[-1][:40]]))
    assert tune_main(command(model, tmp_path, trials=0)[2:]) == 0
    out, err = capsys.readouterr()
    assert "7 stored records for this target and TVM version; skipped 2 corrupt, 1 other TVM version, " \
           "1 other target" in out
    assert f"{path}:4: skipped corrupt" in err and f"{path}:{len(lines) + 3}: skipped corrupt" in err
    manifest = json.loads((tmp_path / "out" / "two-llvm" / "manifest.json").read_text())
    assert sorted(k["trials"] for k in manifest["kernels"]) == [3, 4]
    assert all(k["schedule"] == "tuned" and k["best_us"] > 0.1 for k in manifest["kernels"])  # not the 0.001 us fakes


def test_ctrl_c_stops_cleanly_and_says_how_to_resume(one_kernel_model, tmp_path):
    # one kernel, 12 trials: its default and a round of 4 are on disk, Ctrl-C comes in the next round (not the last)
    with open(tmp_path / "run.log", "w") as log:
        proc = start_and_wait(command(one_kernel_model, tmp_path, trials=12), tmp_path, 5, log)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends to the foreground group
        rc = proc.wait(timeout=120)
    text = (tmp_path / "run.log").read_text()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # any worker left behind
    except ProcessLookupError:
        pass
    kept = len(record_lines(tmp_path))
    assert rc == 130, text[-3000:]
    assert f"interrupted: {kept} records kept in {tmp_path / 'logs' / 'two-llvm'}; rerun the same command to resume" \
        in text
    assert "Traceback" not in text
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []  # nothing half-exported


def test_two_concurrent_tunes_on_one_database(one_kernel_model, tmp_path):
    procs = [subprocess.Popen(command(one_kernel_model, tmp_path, out=f"out{i}", trials=2), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in (1, 2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    lines = (tmp_path / "logs" / "two-llvm" / FILE).read_text().splitlines()
    objs = [json.loads(line) for line in lines]  # every line parses
    pids = {o["pid"] for o in objs if "record" in o}
    assert pids == {p.pid for p in procs}  # records from both runs are there
    db = TuningDatabase(str(tmp_path / "logs" / "two-llvm"), _llvm())
    assert dict(db.skipped) == {} and db.loaded == sum("record" in o for o in objs) >= 4


def test_budget_counts_stored_trials_and_cost_model_is_retrained(tmp_path, monkeypatch):
    import tvmfuse.tune.search as tune_mod  # pylint: disable=import-outside-toplevel

    target = _llvm()
    fused, (task,) = kernel_mods(target, one=True)
    db = TuningDatabase(str(tmp_path), target)
    for secs in (3e-5, 2e-5):  # two trials "measured" before an interruption
        db.commit_tuning_record(record_for(task, target, secs))
    warmed = []
    real = tune_mod.warm_start
    monkeypatch.setattr(tune_mod, "warm_start", lambda *a: warmed.append(real(*a)) or warmed[-1])
    reopened = TuningDatabase(str(tmp_path), target)
    second = tune(fused.mod, target, str(tmp_path), 4, database=reopened)
    assert [(p.resumed, p.trials) for p in second.values()] == [(2, 4)]
    assert len(warmed) == 1 and warmed[0] >= 2  # the XGBoost model was trained on the stored records first
    assert TuningDatabase(str(tmp_path), target).loaded == 4  # a budget of 4 in all, not 2 + 4
    assert tune(fused.mod, target, str(tmp_path), 4, database=TuningDatabase(str(tmp_path), target)) \
        and len(warmed) == 1  # nothing left to do: no search, no retraining
    assert TuningDatabase(str(tmp_path), target).loaded == 4


def test_a_jobs_file_name_outside_out_is_refused(tmp_path, model, capsys):
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f'[[model]]\nname = "../../etc/x"\npath = "{model}"\n')
    assert tune_main(["--target", "llvm", "--jobs", str(jobs), "--out", str(tmp_path / "out")]) == 2
    assert "../../etc/x" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_failed_export_keeps_the_previous_one(tmp_path):
    class Broken:
        def export_library(self, path):
            open(path, "w").close()
            raise RuntimeError("disk full")

    class Fine:
        def export_library(self, path):
            with open(path, "w") as f:
                f.write("lib")

    dest = str(tmp_path / "m-llvm")
    export(Fine(), {"v": 1}, dest)
    with pytest.raises(RuntimeError):
        export(Broken(), {"v": 2}, dest)
    assert json.loads((tmp_path / "m-llvm" / "manifest.json").read_text())["v"] == 1
    assert sorted(os.listdir(tmp_path)) == ["m-llvm"]  # no temporary folder left behind


def _llvm():
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    return resolve_target("llvm")
