"""Tuning records made up for the database tests, in a module that imports only TVM and tvmfuse.records: the
two-writers test's spawned children import it to unpickle their target (test_database imports the tune stage, and
with it every TVM tensor intrinsic: 10-15 s of CPU per child on a 2-core box)."""

import tvm
from tvm.s_tir import meta_schedule as ms

from tvmfuse.records.database import TuningDatabase


def record_for(mod, target, secs):
    """A real, applicable record (split the matmul's first loop in 2) with a made-up run time."""
    sch = tvm.s_tir.Schedule(mod)
    sch.split(sch.get_loops(sch.get_sblock("matmul"))[0], [2, None])  # MetaSchedule ignores empty traces
    return ms.database.TuningRecord(sch.trace, ms.database.Workload(mod), [secs], target,
                                    ms.arg_info.ArgInfo.from_prim_func(mod["main"]))


def write_records(work_dir: str, mod, n: int, tag: float) -> None:
    """Commit `n` records for `mod` (run times tag, tag + 1e-9, ...) to the database in `work_dir` (llvm)."""
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    target = resolve_target("llvm")
    db = TuningDatabase(work_dir, target)
    for i in range(n):
        db.commit_tuning_record(record_for(mod, target, tag + i * 1e-9))
