"""schedules/: best record per kernel, target and TVM version; warm start and --trials 0 builds; prune; verify."""

import json
import os
import shutil

import onnx
import tvm
import tvm_ffi

from conftest import ROOT
from test_database import kernel_mods, record_for, two_kernels
from tvmfuse.cli.tune import main as tune_main
from tvmfuse.records.database import TuningDatabase
from tvmfuse.records.library import lookup
from tvmfuse.records.upkeep import add_from_database, load_index, prune, verify
from tvmfuse.cli.schedules import main
from tvmfuse.targets import resolve_target

LLVM = resolve_target("llvm")


def library(tmp_path, secs=(3e-5, 2e-5)):
    """A library with the best of `secs` for each of the two kernels of `two_kernels`."""
    _, mods = kernel_mods(LLVM)
    db = TuningDatabase(str(tmp_path / "wd"), LLVM)
    for i, mod in enumerate(mods):
        db.names[str(tvm_ffi.structural_hash(mod))] = f"k{i}"
        for s in secs:
            db.commit_tuning_record(record_for(mod, LLVM, s))
    return db, add_from_database(db, str(tmp_path / "lib"), today="2026-11-30")


def test_add_keeps_the_best_per_kernel_and_the_index_says_what_is_there(tmp_path, capsys):
    db, counts = library(tmp_path)
    lib = tmp_path / "lib"
    assert counts == {"added": 2, "improved": 0, "kept": 0}
    entries = load_index(str(lib))
    assert [(e["target"], e["tvm"], e["latency_us"], e["date"], e["file"]) for e in entries] == \
        [("llvm", tvm.__version__, 20.0, "2026-11-30", "llvm.json")] * 2
    assert os.path.getsize(lib / "llvm.json") < 40_000  # compact: workloads stored deflated
    assert add_from_database(db, str(lib)) == {"added": 0, "improved": 0, "kept": 2}
    _, mods = kernel_mods(LLVM)
    db.commit_tuning_record(record_for(mods[0], LLVM, 1e-5))
    assert add_from_database(db, str(lib)) == {"added": 0, "improved": 1, "kept": 1}
    assert main(["--lib", str(lib), "list"]) == 0
    out = capsys.readouterr().out
    assert "2 records in" in out and "10.0 us" in out and "20.0 us" in out


def test_trials_0_builds_from_the_library_without_tuning(tmp_path, capsys):
    library(tmp_path)
    model = tmp_path / "two.onnx"
    onnx.save(two_kernels(), model)
    args = ["--target", "llvm", str(model), "--trials", "0", "--out", str(tmp_path / "out"),
            "--logs", str(tmp_path / "logs")]
    assert tune_main(args + ["--schedules", str(tmp_path / "lib")]) == 0
    assert "schedules library" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / "two-llvm" / "manifest.json").read_text())
    assert [k["schedule"] for k in manifest["kernels"]] == ["tuned", "tuned"]
    assert not (tmp_path / "logs" / "two-llvm").exists()  # seeds are never written as trials spent
    assert tune_main(args + ["--schedules", "none"]) == 0
    manifest = json.loads((tmp_path / "out" / "two-llvm" / "manifest.json").read_text())
    assert [k["schedule"] for k in manifest["kernels"]] == ["default", "default"]


def test_records_for_another_target_or_tvm_version_are_never_used_and_prune_drops_old_ones(tmp_path):
    library(tmp_path)
    lib = tmp_path / "lib"
    shutil.copy(os.path.join(ROOT, "schedules", "cuda-sm_90a.json"), lib)  # the H200 records, simple form
    data = json.loads((lib / "llvm.json").read_text())
    data["records"][0]["tvm"] = "0.19.0"
    data["records"][1]["target_json"]["num-cores"] = 64
    (lib / "llvm.json").write_text(json.dumps(data))
    found, skipped = lookup(str(lib), LLVM)
    h200 = len(json.loads((lib / "cuda-sm_90a.json").read_text())["records"])
    assert found == [] and skipped == {"other target": 1 + h200, "other TVM version": 1, "unreadable": 0}
    assert prune(str(lib)) == {"other TVM version": 1, "slower duplicate": 0}
    assert len(json.loads((lib / "llvm.json").read_text())["records"]) == 1
    assert len(json.loads((lib / "cuda-sm_90a.json").read_text())["records"]) == h200  # kept, same TVM
    assert len(load_index(str(lib))) == 1 + h200


def test_verify_replays_and_builds_each_record(tmp_path, capsys):
    library(tmp_path)
    lib = tmp_path / "lib"
    shutil.copy(os.path.join(ROOT, "schedules", "cuda-sm_90a.json"), lib)
    assert main(["--lib", str(lib), "verify"]) == 0
    data = json.loads((lib / "llvm.json").read_text())
    data["records"][1]["trace"] = json.loads(json.dumps(data["records"][1]["trace"]).replace('"matmul"', '"nosuch"'))
    (lib / "llvm.json").write_text(json.dumps(data))
    verdicts = sorted(v for _, v, _ in verify(str(lib)))
    assert verdicts.count("ok") == 1 and verdicts.count("FAIL") == 1 and verdicts.count("skip") >= 1
    assert main(["--lib", str(lib), "verify"]) == 1
    assert "1 ok, 1 failed" in capsys.readouterr().out
