"""Tuning progress: trials, failures and best latency per kernel, while tuning and from a database."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

from tvmfuse.records.keys import FAILED



@dataclass
class TaskProgress:
    """What tuning one kernel has done so far."""

    name: str
    budget: int
    trials: int = 0
    failed: int = 0
    best_us: float | None = None
    started: float = field(default_factory=time.time)
    resumed: int = 0  # trials found in the database before this run (they count toward the budget)
    default_us: float | None = None  # TVM's default (dlight) schedule, measured as the first trial
    workload: str = ""  # structural hash of the kernel's task module


@derived_object
class ProgressCallback(ms.measure_callback.PyMeasureCallback):
    """Counts trials and the best latency per task after every measured batch, and reports them."""

    def __init__(self, tasks: list[TaskProgress], on_progress: Callable[[TaskProgress], None] | None,
                 stop: list | None = None):
        self.tasks = tasks
        self.on_progress = on_progress
        self.stop = stop if stop is not None else []  # non-empty: Ctrl-C asked to stop after this round

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        task = self.tasks[task_id]
        if not builder_results:  # the search had no new candidate for this kernel: nothing to report
            if self.stop:
                raise KeyboardInterrupt
            return
        for built, ran in zip(builder_results, runner_results):
            task.trials += 1
            secs = [float(s) for s in (ran.run_secs or [])]
            if built.error_msg or ran.error_msg or not secs or min(secs) >= FAILED:
                task.failed += 1
                continue
            us = sum(secs) / len(secs) * 1e6
            task.best_us = us if task.best_us is None else min(task.best_us, us)
        if self.on_progress:
            self.on_progress(task)
        if self.stop:  # raised here, between rounds, where TVM passes it back to the caller as an error
            raise KeyboardInterrupt


def kernel_records(mod: tvm.IRModule, database: ms.Database) -> dict[str, tuple[int, float | None]]:
    """Per kernel of `mod`: (trials recorded in `database`, best measured latency in µs or None)."""
    all_records = database.get_all_tuning_records()
    out = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        key = _normalize_mod(func)
        if not database.has_workload(key):
            continue
        workload = database.commit_workload(key)
        mine = [r for r in all_records if r.workload.same_as(workload)
                or tvm_ffi.structural_equal(r.workload.mod, key)]
        times = [sum(map(float, r.run_secs)) / len(r.run_secs) for r in mine if r.run_secs
                 and min(map(float, r.run_secs)) < FAILED]
        out[gv.name_hint] = (len(mine), min(times) * 1e6 if times else None)
    return out
