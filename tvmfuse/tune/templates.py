"""Knob tuning of the hand-written kernels: every knob set checked against the generic kernel, measured by tune.py's
builder and runner, kept as a record."""

from __future__ import annotations

import os
from typing import Callable

import tvm
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

from tvmfuse.records.keys import knob_key, workload_hash
from tvmfuse.records.knobs import best_knobs, measured, target_kind
from tvmfuse.tune.progress import TaskProgress
from tvmfuse.kernels.substitution import call_sites, template_sites
from tvmfuse.kernels.attention.common import Template, normalize, symbolic
from tvmfuse.tune.search import evaluator_config, make_builder, make_runner

FAILED_SECS = 1e10  # what MetaSchedule stores for a candidate that failed to build or run
ROUND = 8  # knob sets built and measured per round (one progress line each)


def candidate_knobs(tmpl: Template, shapes: dict) -> list[dict]:
    """The template's valid knob sets for these shapes, its default first (a budget below the space's size
    still measures the default)."""
    default = tmpl.default_knobs(shapes)
    return [default] + [k for k in tmpl.knob_space(shapes) if k != default]


def variant_workload(tmpl: Template, shapes: dict, knobs: dict, name: str, target) -> tvm.IRModule:
    """The task module of one knob set, as the build and `kernel_records` see the substituted kernel."""
    return _normalize_mod(tmpl(shapes, knobs, target_kind(target)).with_attr("global_symbol", name))


def tune_templates(mod: tvm.IRModule, patterns: dict[str, str], target: tvm.target.Target, database,
                   trials: int, rpc: tuple[str, str] | None = None, info: dict | None = None,
                   on_progress: Callable[[TaskProgress], None] | None = None, builder=None,
                   runner=None, say: Callable[[str], None] | None = None,
                   make_check: Callable | None = None) -> dict[str, TaskProgress]:
    """`tune_sites` over every kernel a template takes (`template_sites`) at static sizes; `substitute(...,
    database=database)` then applies the best."""
    say = say or (lambda _line: None)
    sites = []
    for site in template_sites(mod, patterns, info, target):
        if trials > 0 and symbolic(normalize(site[3])):
            say(f"{site[1]}: {site[2].name} knobs not measured (symbolic sizes: no inputs to time it on); default knobs")
        else:
            sites.append(site)
    return tune_sites(sites, mod, target, database, trials, rpc=rpc, on_progress=on_progress, builder=builder,
                      runner=runner, say=say, make_check=make_check)


def tune_sites(sites: list[tuple], mod: tvm.IRModule, target: tvm.target.Target, database, trials: int,
               rpc: tuple[str, str] | None = None, on_progress: Callable[[TaskProgress], None] | None = None,
               builder=None, runner=None, say: Callable[[str], None] | None = None,
               make_check: Callable | None = None) -> dict[str, TaskProgress]:
    """Measure up to `trials` knob sets of each site ((global var, kernel name, template, shapes, argument order):
    `template_sites`, `kernels.hopper.hopper_gemm_sites`), its default first, and commit each as a record to
    `database`; knob sets already recorded count toward the budget and are not measured again (`trials` 0
    measures nothing). The builder and runner are the tune stage's (local or RPC) unless given. With `make_check`
    (the verify stage's `VariantCheck`: `make_check(generic, call, perm, target, runner)`), each built knob set is
    first run against the generic kernel it replaces on the runner's device (local or an RPC session); a wrong one
    is recorded as failed, not timed, and `say` gets one line for it."""
    progress: dict[str, TaskProgress] = {}
    say = say or (lambda _line: None)
    for gv, name, tmpl, shapes, perm in sites:
        space, done = candidate_knobs(tmpl, shapes), measured(database, tmpl, shapes, target)
        budget = min(max(trials, 0), len(space))
        spent = min(sum(knob_key(k) in done for k in space), budget)
        task = progress[name] = TaskProgress(name, budget, trials=spent, resumed=spent)
        _, task.best_us = best_knobs(database, tmpl, shapes, target)
        todo = [k for k in space if knob_key(k) not in done][:budget - spent]
        if todo and builder is None:
            builder = make_builder(os.cpu_count() or 1)
        if todo and runner is None:
            runner = make_runner(rpc, evaluator_config("gpu" in target.keys))
        check = (_variant_check(make_check, mod[gv], call_sites(mod)[name], perm, target, runner, name, say)
                 if todo and make_check else None)
        for start in range(0, len(todo), ROUND):
            _measure_round(todo[start:start + ROUND], tmpl, shapes, name, target, database, builder, runner, task,
                           check, say)
            if on_progress:
                on_progress(task)
    return progress


def _variant_check(make_check, generic, call, perm, target, runner, name: str, say):
    """The check of this kernel's variants, or None (said once) when the generic kernel cannot serve as reference."""
    try:
        return make_check(generic, call, perm, target, runner)
    except Exception as err:  # pylint: disable=broad-except  (no reference: measure unverified rather than not at all)
        say(f"{name}: knob sets not verified (no reference: {type(err).__name__}: {str(err).strip()[:200]})")
        return None


def _check_outputs(check, artifacts, knob_sets, name: str, say) -> list[str | None]:
    """Per variant: None (right, or not checked), else why it is wrong (said once); [] when nothing was checked.
    A check that fails as a whole (the reference does not run, no RPC session) is said once and not tried again."""
    if check is None or check.unusable:
        return []
    try:
        wrong = check.check(artifacts)
    except Exception as err:  # pylint: disable=broad-except
        check.unusable = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:200]}"
        say(f"{name}: knob sets not verified from here on (the check failed: {check.unusable})")
        return []
    for knobs, why in zip(knob_sets, wrong):
        if why:
            say(f"{name}: knobs {knobs} {why}")
    return wrong


def commit_variant(database, mod: tvm.IRModule, secs: list[float], target) -> None:
    """Store one knob set's `variant_workload` with its measured run times (FAILED_SECS: failed or wrong)."""
    sch = s_tir.Schedule(mod)
    # one no-op instruction: MetaSchedule's databases return no empty-trace record (EnterPostproc, which every tuned
    # trace holds: a TIRx kernel has no root block to look up)
    sch.enter_postproc()
    database.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, database.commit_workload(mod), secs, target, ArgInfo.from_prim_func(mod["main"])))


def _measure_round(knob_sets, tmpl, shapes, name, target, database, builder, runner, task, check, say) -> None:
    """Build the variants with the builder, check their outputs, time the right ones with the runner, commit one
    record per knob set (failures and wrong outputs too, at MetaSchedule's failure time, so a rerun does not
    measure them again and `best_knobs` never picks them)."""
    mods = [variant_workload(tmpl, shapes, k, name, target) for k in knob_sets]
    names = getattr(database, "names", None)
    if names is not None:
        names.update({workload_hash(m): name for m in mods})
    built = builder.build([ms.builder.BuilderInput(m, target) for m in mods])
    device = "cpu" if target_kind(target) == "llvm" else target.kind.name
    wrong = _check_outputs(check, [b.artifact_path if b.error_msg is None else None for b in built], knob_sets,
                           name, say)
    inputs = [(i, ms.runner.RunnerInput(b.artifact_path, device, ArgInfo.from_prim_func(mods[i]["main"])))
              for i, b in enumerate(built) if b.error_msg is None and not (wrong and wrong[i])]
    secs: dict[int, list[float]] = {i: [FAILED_SECS] for i in range(len(mods))}
    for (i, _), future in zip(inputs, runner.run([r for _, r in inputs])):
        result = future.result()
        run = [float(s) for s in (result.run_secs or [])]
        if result.error_msg is None and run:
            secs[i] = run
    for i, mod in enumerate(mods):
        commit_variant(database, mod, secs[i], target)
        task.trials += 1
        us = sum(secs[i]) / len(secs[i]) * 1e6
        if secs[i][0] >= FAILED_SECS:
            task.failed += 1
        elif task.best_us is None or us < task.best_us:
            task.best_us = us
