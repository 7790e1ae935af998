"""Knob tuning of the hand-written kernels: every knob set measured by tune.py's builder and runner, kept as a record."""

from __future__ import annotations

import json
import os
from typing import Callable

import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

from ..database import mean_secs, workload_hash
from ..progress import TaskProgress
from . import template_sites
from .common import Template, knob_key

FAILED_SECS = 1e10  # what MetaSchedule stores for a candidate that failed to build or run
ROUND = 8  # knob sets built and measured per round (one progress line each)


def target_kind(target) -> str:
    """'llvm' (the templates' CPU variants) or 'cuda'."""
    kind = target.kind.name if isinstance(target, tvm.target.Target) else str(target)
    return "llvm" if kind == "llvm" else "cuda"


def candidate_knobs(tmpl: Template, shapes: dict) -> list[dict]:
    """The template's valid knob sets for these shapes, its default first (a budget below the space's size
    still measures the default)."""
    default = tmpl.default_knobs(shapes)
    return [default] + [k for k in tmpl.knob_space(shapes) if k != default]


def variant_workload(tmpl: Template, shapes: dict, knobs: dict, name: str, target) -> tvm.IRModule:
    """The task module of one knob set, as the build and `kernel_records` see the substituted kernel."""
    return _normalize_mod(tmpl(shapes, knobs, target_kind(target)).with_attr("global_symbol", name))


def measured(database, tmpl: Template, shapes: dict, target) -> dict[str, float]:
    """{knob key: best mean seconds (inf: failed)} over the records of this template and shapes in `database`
    (stored, or seeded from the schedules library): the workloads carry `tvmfuse.template` and `tvmfuse.knobs`."""
    key, out = tmpl.key(shapes, target_kind(target)), {}
    for record in database.get_all_tuning_records():
        attrs = next(iter(record.workload.mod.functions.values())).attrs
        if attrs is None or str(attrs.get("tvmfuse.template", "")) != key or "tvmfuse.knobs" not in attrs:
            continue
        knobs = str(attrs["tvmfuse.knobs"])
        out[knobs] = min(out.get(knobs, float("inf")), mean_secs(record))
    return out


def best_knobs(database, tmpl: Template, shapes: dict, target) -> tuple[dict | None, float | None]:
    """The fastest measured knob set still valid for these shapes, and its latency in µs; (None, None) if none."""
    valid = {knob_key(k) for k in tmpl.knob_space(shapes)}
    timed = [(secs, k) for k, secs in measured(database, tmpl, shapes, target).items()
             if k in valid and secs < float("inf")]
    if not timed:
        return None, None
    secs, knobs = min(timed)
    return json.loads(knobs), secs * 1e6


def tune_templates(mod: tvm.IRModule, patterns: dict[str, str], target: tvm.target.Target, database,
                   trials: int, rpc: tuple[str, str] | None = None, info: dict | None = None,
                   on_progress: Callable[[TaskProgress], None] | None = None, builder=None,
                   runner=None) -> dict[str, TaskProgress]:
    """Measure up to `trials` knob sets of every kernel a template takes (`template_sites`) and commit each
    as a record to `database`; knob sets already recorded count toward the budget and are not measured again
    (`trials` 0 measures nothing). `substitute(..., database=database)` then applies the best. The builder
    and runner are tune.py's (local or RPC) unless given."""
    from ..tune import _builder, _evaluator, _runner  # pylint: disable=import-outside-toplevel  (the same ones)

    progress: dict[str, TaskProgress] = {}
    for _gv, name, tmpl, shapes, _perm in template_sites(mod, patterns, info, target_kind(target)):
        space, done = candidate_knobs(tmpl, shapes), measured(database, tmpl, shapes, target)
        budget = min(max(trials, 0), len(space))
        spent = min(sum(knob_key(k) in done for k in space), budget)
        task = progress[name] = TaskProgress(name, budget, trials=spent, resumed=spent)
        _, task.best_us = best_knobs(database, tmpl, shapes, target)
        todo = [k for k in space if knob_key(k) not in done][:budget - spent]
        if todo and builder is None:
            builder = _builder(os.cpu_count() or 1)
        if todo and runner is None:
            runner = _runner(rpc, _evaluator("gpu" in target.keys))
        for start in range(0, len(todo), ROUND):
            _measure_round(todo[start:start + ROUND], tmpl, shapes, name, target, database, builder, runner, task)
            if on_progress:
                on_progress(task)
    return progress


def _measure_round(knob_sets, tmpl, shapes, name, target, database, builder, runner, task) -> None:
    """Build the variants with the builder, time them with the runner, commit one record per knob set
    (failures too, at MetaSchedule's failure time, so a rerun does not measure them again)."""
    mods = [variant_workload(tmpl, shapes, k, name, target) for k in knob_sets]
    names = getattr(database, "names", None)
    if names is not None:
        names.update({workload_hash(m): name for m in mods})
    built = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
    device = "cpu" if target_kind(target) == "llvm" else target.kind.name
    inputs = [(i, ms.runner.RunnerInput(b.artifact_path, device, ArgInfo.from_prim_func(mods[i]["main"])))
              for i, b in enumerate(built) if b.error_msg is None]
    secs: dict[int, list[float]] = {i: [FAILED_SECS] for i in range(len(mods))}
    for (i, _), future in zip(inputs, runner.run([r for _, r in inputs])):
        result = future.result()
        run = [float(s) for s in (result.run_secs or [])]
        if result.error_msg is None and run:
            secs[i] = run
    for i, mod in enumerate(mods):
        sch = s_tir.Schedule(mod)
        sch.get_sblock("root")  # one no-op instruction: MetaSchedule's databases return no empty-trace record
        database.commit_tuning_record(ms.database.TuningRecord(
            sch.trace, database.commit_workload(mod), secs[i], target, ArgInfo.from_prim_func(mod["main"])))
        task.trials += 1
        us = sum(secs[i]) / len(secs[i]) * 1e6
        if secs[i][0] >= FAILED_SECS:
            task.failed += 1
        elif task.best_us is None or us < task.best_us:
            task.best_us = us
