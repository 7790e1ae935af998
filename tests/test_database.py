"""The tuning database: records survive reopening, corrupt lines and foreign records are skipped, writers don't clash."""

import json
import multiprocessing
import os

import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from onnx import TensorProto, helper

from db_writer import record_for, write_records
from tvmfuse.records.database import FILE, TuningDatabase
from tvmfuse.fuse.fusion import lower
from tvmfuse.frontend.importer import import_model
from tvmfuse.tune.search import tunable_tasks


def two_kernels(rows=8, d=32, one=False) -> onnx.ModelProto:
    """y = x @ W1 + b1 and z = relu(x @ W2): two distinct MatMul kernels, each quick to tune (`one`: just y)."""
    rng = np.random.default_rng(0)

    def init(name, shape):
        return helper.make_tensor(name, TensorProto.FLOAT, shape, rng.standard_normal(shape).astype(np.float32).ravel())

    def vi(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["y"]),
             helper.make_node("MatMul", ["x", "w2"], ["m2"]), helper.make_node("Relu", ["m2"], ["z"])]
    outputs, inits = [vi("y", [rows, d]), vi("z", [rows, 2 * d])], [init("w1", [d, d]), init("b1", [d]), init("w2", [d, 2 * d])]
    if one:
        nodes, outputs, inits = nodes[:2], outputs[:1], inits[:2]
    graph = helper.make_graph(nodes, "two", [vi("x", [rows, d])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def kernel_mods(target, one=False):
    """(fused module, [task IRModule per kernel]) of `two_kernels`, exactly as the pipeline tunes them."""
    from tvmfuse.decide.decision import decide
    from tvmfuse.prepare import prepare_module

    bound = prepare_module(import_model(two_kernels(one=one)))  # bind, precision, weight layout
    fused = lower(bound, plan=decide(bound, target))
    return fused, [t.dispatched[0] for t in tunable_tasks(fused.mod, target)]


def fill(work_dir, target, mod, secs_list):
    db = TuningDatabase(str(work_dir), target)
    for secs in secs_list:
        db.commit_tuning_record(record_for(mod, target, secs))
    return db


def test_records_survive_reopen_and_best_is_found(tmp_path, llvm):
    _, (mod, _) = kernel_mods(llvm)
    fill(tmp_path, llvm, mod, [3e-5, 1e-5, 2e-5, 1e10])
    db = TuningDatabase(str(tmp_path), llvm)
    assert (db.loaded, dict(db.skipped), len(db)) == (4, {}, 4)
    assert db.spent == {str(tvm_ffi.structural_hash(mod)): 4}
    best = db.query_tuning_record(mod, llvm, "main")
    assert [float(s) for s in best.run_secs] == [1e-5]


def test_corrupt_foreign_and_truncated_lines_are_skipped_and_named(tmp_path, llvm, capsys):
    _, (mod, _) = kernel_mods(llvm)
    fill(tmp_path, llvm, mod, [3e-5, 2e-5, 4e-5])
    path = tmp_path / FILE
    lines = path.read_text().splitlines()  # 1 workload + 3 records
    cuda = tvm.target.Target("nvidia/nvidia-h100")
    other_target = json.loads(lines[1]) | {"target": json.loads(json.dumps(cuda.export(), default=str))}
    other_target["record"][1] = [1e-9]  # faster than everything: must still never be applied
    other_version = json.loads(lines[2]) | {"tvm": "0.19.0"}
    other_version["record"][1] = [1e-9]
    text = "\n".join([lines[0], lines[1], "{garbage", json.dumps(other_target), lines[2], "\x00\x01 not json",
                      json.dumps(other_version), lines[3][: len(lines[3]) // 2]])  # torn last line, no newline
    path.write_text(text)
    db = TuningDatabase(str(tmp_path), llvm)
    err = capsys.readouterr().err
    assert db.loaded == 2  # lines[1] and lines[2]; lines[3] was torn
    assert dict(db.skipped) == {"corrupt": 3, "other target": 1, "other TVM version": 1}
    for number in (3, 6, 8):
        assert f"{path}:{number}: skipped corrupt or truncated line" in err
    assert [float(s) for s in db.query_tuning_record(mod, llvm, "main").run_secs] == [2e-5]
    assert "skipped 3 corrupt, 1 other TVM version, 1 other target" in db.summary()
    # a record appended after the torn line is not glued onto it, and nothing valid is lost
    db.commit_tuning_record(record_for(mod, llvm, 5e-6))
    again = TuningDatabase(str(tmp_path), llvm, warn=lambda m: None)
    assert again.loaded == 3 and dict(again.skipped) == dict(db.skipped)
    assert [float(s) for s in again.query_tuning_record(mod, llvm, "main").run_secs] == [5e-6]


def test_two_writers_at_once_lose_nothing(tmp_path, llvm):
    _, (mod, _) = kernel_mods(llvm)
    ctx = multiprocessing.get_context("spawn")  # each child imports only db_writer (TVM, tvmfuse.records)
    procs = [ctx.Process(target=write_records, args=(str(tmp_path), mod, 60, tag)) for tag in (1e-3, 2e-3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    raw = (tmp_path / FILE).read_text().splitlines()
    assert all(json.loads(line) for line in raw)  # every line parses
    db = TuningDatabase(str(tmp_path), llvm)
    assert (db.loaded, dict(db.skipped)) == (120, {})
    secs = sorted(float(r.run_secs[0]) for r in db.get_all_tuning_records())
    assert sum(s < 1.5e-3 for s in secs) == 60 and sum(s > 1.5e-3 for s in secs) == 60
    assert len({json.loads(line)["pid"] for line in raw if "pid" in line}) == 2


def test_metaschedule_json_files_are_read_only_with_a_known_version(tmp_path, llvm):
    _, (mod, _) = kernel_mods(llvm)
    db = fill(tmp_path / "a", llvm, mod, [3e-5, 2e-5])
    assert db.export_ms_json(str(tmp_path / "ms")) == 2
    with open(tmp_path / "ms" / "database_tuning_record.json", "a", encoding="utf-8") as f:
        f.write('[0, [["bad"]')  # torn
    unknown = TuningDatabase(str(tmp_path / "ms"), llvm, warn=lambda m: None)
    assert unknown.loaded == 0 and unknown.skipped["no TVM version"] == 2 and unknown.skipped["corrupt"] == 1
    known = TuningDatabase(str(tmp_path / "ms"), llvm, warn=lambda m: None, ms_tvm_version=tvm.__version__)
    assert known.loaded == 2


def test_missing_work_dir_is_an_empty_database(tmp_path, llvm):
    db = TuningDatabase(str(tmp_path / "nope"), llvm)
    assert (db.loaded, len(db), os.path.exists(tmp_path / "nope")) == (0, 0, False)


@pytest.fixture(scope="session")
def llvm():
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    return resolve_target("llvm")


def _split_record(mod, target, factor: int, secs: float):
    """A real record splitting the matmul's first loop by `factor` (records with other factors are other schedules)."""
    from tvm.s_tir import meta_schedule as ms

    sch = tvm.s_tir.Schedule(mod)
    sch.split(sch.get_loops(sch.get_sblock("matmul"))[0], [factor, None])
    return ms.database.TuningRecord(sch.trace, ms.database.Workload(mod), [secs], target,
                                    ms.arg_info.ArgInfo.from_prim_func(mod["main"]))


def test_a_rejected_record_is_left_out_from_then_on_and_its_reason_kept(tmp_path, llvm):
    """`reject` (a record whose output check failed): left out of `records_of` and `best` at once, written to the
    file with its reason, skipped (and counted) on every later load; its trial stays spent; the other schedule of
    the workload stays."""
    _, (mod, _) = kernel_mods(llvm)
    db = TuningDatabase(str(tmp_path), llvm)
    for factor, secs in ((2, 1e-5), (4, 2e-5)):
        db.commit_tuning_record(_split_record(mod, llvm, factor, secs))
    fastest = db.records_of(mod)[0]
    db.reject(fastest, "tuned schedule gave wrong output (max abs err 2.18)")
    db.reject(fastest, "again")  # once only
    kept = lambda d: [float(r.run_secs[0]) for r in d.records_of(mod)]  # noqa: E731
    assert kept(db) == [2e-5] and [float(r.run_secs[0]) for _, _, r in db.best()] == [2e-5]
    again = TuningDatabase(str(tmp_path), llvm)
    assert kept(again) == [2e-5] and sum(again.spent.values()) == 2
    assert again.skipped["rejected (wrong output)"] == 1 and "1 rejected (wrong output)" in again.summary()
    with open(tmp_path / FILE, encoding="utf-8") as fh:
        reasons = [json.loads(line).get("reason") for line in fh if '"rejected"' in line]
    assert reasons == ["tuned schedule gave wrong output (max abs err 2.18)"]
