"""Baseline records: measure each kernel's default schedule and store it, so tuning never ends worse."""

from __future__ import annotations

import json

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

from tvmfuse.spaces.defaults import default_schedule
from tvmfuse.tune.progress import FAILED


def _trace_key(trace) -> str:
    return json.dumps(trace.as_json(), sort_keys=True, default=str)


def measure_baselines(task_mods: list[tvm.IRModule], target, database, builder, runner) -> dict[int, tuple]:
    """Ensure `database` holds each task's default schedule as a record.

    Returns {task index: (latency µs, stored now?)} for the tasks whose default could be measured.

    A default already stored (an earlier or interrupted run) is not measured again. Since the best
    record is what the build applies, a search that finds nothing faster leaves the default in place.
    """
    latency: dict[int, tuple] = {}
    todo = []
    for i, mod in enumerate(task_mods):
        sch = default_schedule(mod["main"], target)
        if sch is None:
            continue
        key = _trace_key(sch.trace)
        workload = database.commit_workload(mod)
        stored = [r for r in database.get_top_k(workload, 1 << 30) if _trace_key(r.trace) == key]
        if stored:
            latency[i] = (_mean_us(stored[0].run_secs), False)
        else:
            todo.append((i, mod, sch, workload))
    if not todo:
        return latency
    built = builder.build([ms.builder.BuilderInput(sch.mod, target) for _, _, sch, _ in todo])
    inputs, live = [], []
    for (i, mod, sch, workload), result in zip(todo, built):
        if result.error_msg is None:
            inputs.append(ms.runner.RunnerInput(result.artifact_path, _device_type(target),
                                                ArgInfo.from_prim_func(mod["main"])))
            live.append((i, mod, sch, workload))
    for (i, mod, sch, workload), future in zip(live, runner.run(inputs)):
        result = future.result()
        secs = [float(s) for s in (result.run_secs or [])]
        if result.error_msg is None and secs and min(secs) < FAILED:
            record = ms.database.TuningRecord(sch.trace, workload, secs, target, ArgInfo.from_prim_func(mod["main"]))
            stored = _round_trips(record, workload)
            if stored:
                database.commit_tuning_record(record)
            latency[i] = (_mean_us(secs), stored)
    return latency


def _round_trips(record, workload) -> bool:
    """Whether the record survives JSON. dlight traces with IndexMap inputs do not in TVM 0.27
    (TuningRecord.from_json expects a string there), so those defaults are compared at build time instead."""
    try:
        ms.database.TuningRecord.from_json(record.as_json(), workload)
        return True
    except Exception:  # pylint: disable=broad-except
        return False


def kernels_keeping_default(mod: tvm.IRModule, records: dict, defaults: dict[str, float]) -> dict[str, float]:
    """{kernel: default µs} for kernels whose measured default beat every stored record (or has none)."""

    keep = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            default = defaults.get(str(tvm_ffi.structural_hash(_normalize_mod(func))))
            best = records.get(gv.name_hint, (0, None))[1]
            if default is not None and (best is None or best > default):
                keep[gv.name_hint] = default
    return keep


def _mean_us(run_secs) -> float:
    secs = [float(s) for s in run_secs]
    return sum(secs) / len(secs) * 1e6


def _device_type(target: tvm.target.Target) -> str:
    return "cpu" if target.kind.name in ("llvm", "c") else target.kind.name
