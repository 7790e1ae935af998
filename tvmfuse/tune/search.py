"""Tune stage: MetaSchedule (evolutionary search, XGBoost cost model) over every static-shape kernel."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import types
from typing import Callable

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.cost_model.xgb_model import XGBConfig
from tvm.s_tir.meta_schedule.logging import get_loggers_from_work_dir
from tvm.s_tir.meta_schedule.utils import fork_seed

from tvmfuse.tune.baseline import measure_baselines
from tvmfuse.tune.builder import fast_build
from tvmfuse.fuse.fusion import symbolic_kernels
from tvmfuse.tune.pool import local_builder, local_runner
from tvmfuse.tune.progress import ProgressCallback, TaskProgress
from tvmfuse.tune.remote import rpc_runner
from tvmfuse.tune.isolation import probed_context, tune_isolated

# The XGBoost cost model runs on OpenMP, whose threads spin at every barrier by default: with nthread = cores and
# any other process on a core, fitting a few records took 4-17 s instead of 0.04 s (2-core box, measured). Waiting
# threads that sleep cost nothing measurable there. libgomp reads it when xgboost loads (lazily, on the first fit).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class TuningInterrupted(KeyboardInterrupt):
    """Ctrl-C during tuning: every record measured so far is already on disk."""


def tunable_tasks(mod: tvm.IRModule, target: tvm.target.Target) -> list:
    """The extracted tasks worth tuning: static shapes (MetaSchedule needs them), not yet scheduled."""
    symbolic = symbolic_kernels(mod)
    tasks = ms.relax_integration.extract_tasks(mod, target)
    return [t for t in tasks if t.task_name not in symbolic
            and not t.dispatched[0]["main"].attrs.get("tirx.is_scheduled", False)]


def tune(mod: tvm.IRModule, target: tvm.target.Target, work_dir: str, trials_per_task: int,
         on_progress: Callable[[TaskProgress], None] | None = None, database=None,
         space_for: Callable | None = None, seed: int | None = None, rpc: tuple[str, str] | None = None,
         batch: int | None = None) -> dict[str, TaskProgress]:
    """Tune every tunable kernel of `mod` with `trials_per_task` trials; records go to `database`.

    `rpc=(HOST:PORT, KEY)` measures on the RPC servers registered under KEY (builds stay local);
    `batch` is how many candidates are built and measured per round.
    """
    tasks = tunable_tasks(mod, target)
    if getattr(database, "names", None) is not None:  # kernel names go into the stored workloads
        database.names.update({str(tvm_ffi.structural_hash(t.dispatched[0])): t.task_name for t in tasks})
    spent = {t.task_name: min(_spent(database, t.dispatched[0]), max(trials_per_task, 0)) for t in tasks}
    progress = {t.task_name: TaskProgress(t.task_name, trials_per_task, trials=spent[t.task_name],
                                          resumed=spent[t.task_name],
                                          workload=str(tvm_ffi.structural_hash(t.dispatched[0]))) for t in tasks}
    tasks = [t for t in tasks if spent[t.task_name] < trials_per_task]  # resume: finished kernels are done
    if not tasks or trials_per_task <= 0:
        return progress
    os.makedirs(work_dir, exist_ok=True)
    contexts = []
    loggers = task_loggers(work_dir, [t.task_name for t in tasks])
    for task, logger, rand in zip(tasks, loggers, fork_seed(seed, n=len(tasks))):
        func = task.dispatched[0]["main"]
        space = (space_for(func, target) if space_for else None) or "post-order-apply"

        def context(space_gen, task=task, logger=logger, rand=rand):
            with _no_tensor_intrin(target):
                return ms.TuneContext(mod=task.dispatched[0], target=target, space_generator=space_gen,
                                      search_strategy=search_strategy(trials_per_task), task_name=task.task_name,
                                      logger=logger, rand_state=rand, num_threads="physical").clone()

        ctx = probed_context(task.task_name, context, space, target)  # None: its space raises, tuned no further
        if ctx is not None:
            contexts.append(ctx)
    if not contexts:
        return progress
    cores = os.cpu_count() or 1
    is_gpu = "gpu" in target.keys
    cost_model = ms.cost_model.XGBModel(
        extractor=ms.feature_extractor.PerStoreFeature(), config=XGBConfig(max_depth=10, eta=0.2, nthread=cores),
        num_warmup_samples=min(16, trials_per_task), adaptive_training=True)
    database = database if database is not None else ms.database.JSONDatabase(work_dir=work_dir)
    # the process's builder and local runner (tune.pool: their workers start once, not per tune or round); an RPC
    # runner is made per phase, so it counts the servers free at that time
    builder, local = make_builder(cores), make_runner(None, evaluator_config(is_gpu)) if rpc is None else None

    def runner():
        return local or make_runner(rpc, evaluator_config(is_gpu))

    with _sigint_seen() as seen:
        try:
            _measure_defaults(contexts, target, database, builder, runner(), progress, spent)
            warm_start(cost_model, contexts, database)
            for left, group in _by_remaining(contexts, trials_per_task, spent):
                if seen:
                    raise KeyboardInterrupt
                if left > 0:
                    tune_isolated(group, lambda g, left=left: _tune_group(
                        g, left, work_dir, database, cost_model, builder, runner(), batch, is_gpu,
                        ProgressCallback([progress[c.task_name] for c in g], on_progress, stop=seen)), seen)
        except BaseException:  # Ctrl-C inside a Python callback of the C++ loop arrives as a RuntimeError
            if seen:
                raise TuningInterrupted() from None
            raise
    return progress


#: candidates the evolutionary search keeps per trial of the budget, up to MetaSchedule's default population (512)
POPULATION_PER_TRIAL = 32


def search_strategy(trials_per_task: int):
    """MetaSchedule's evolutionary search, its population (sampled from the space, then mutated and ranked by the cost
    model 4 times per round) at most POPULATION_PER_TRIAL per trial: budgets of 16 and more keep MetaSchedule's 512;
    a budget of 4, which measures 3 candidates, samples 128 (512 cost ~200 s of one core per round for an attention
    kernel)."""
    return ms.search_strategy.EvolutionarySearch(
        population_size=max(64, min(512, POPULATION_PER_TRIAL * trials_per_task)))


def task_loggers(work_dir: str, names: list[str]) -> list:
    """MetaSchedule's per-task loggers, console quiet (its own progress lines are ours).

    MetaSchedule rebuilds its logging config from the handlers on its logger and fails on one without
    a name ('NoneType' object has no attribute 'format'), such as a test runner's capture handler:
    those are detached while it configures and put back after.
    """
    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    logger.setLevel(logging.WARNING)  # MetaSchedule's dictConfig resets it on every call
    unnamed = [h for h in logger.handlers if h.get_name() is None]
    for handler in unnamed:
        logger.removeHandler(handler)
    try:
        return get_loggers_from_work_dir(work_dir, names)
    finally:
        for handler in unnamed:
            logger.addHandler(handler)


@contextlib.contextmanager
def _sigint_seen():
    """Turn the first Ctrl-C into a request to stop after the current round (the progress callback and the
    steps between rounds raise it): an exception thrown into TVM's C++ loop at an arbitrary point can abort
    the process. A second Ctrl-C stops at once."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def handler(signum, _frame):
        seen.append(signum)
        if len(seen) > 1:
            raise KeyboardInterrupt
        print("\ninterrupt: stopping after the current round of measurements (Ctrl-C again to stop now)",
              file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def _measure_defaults(contexts, target, database, builder, runner, progress, spent) -> None:
    """Measure each kernel's default schedule first and store it as a record (one trial of the budget):
    the build applies the best record, so a search that finds nothing faster keeps the default."""
    found = measure_baselines([c.mod for c in contexts], target, database, builder, runner)
    for i, (us, stored_now) in found.items():
        task = progress[contexts[i].task_name]
        task.default_us = us
        task.best_us = us if task.best_us is None else min(task.best_us, us)
        if stored_now:
            task.trials += 1
            spent[task.name] += 1


def make_builder(cores: int):
    """MetaSchedule's local builder with tvmfuse's build function (no tensor-intrinsic import per worker), one per
    process (tune.pool)."""
    return local_builder(cores, 60, fast_build)


def evaluator_config(is_gpu: bool):
    """How each candidate is timed: 3 runs, at least 50 ms (CPU) or 20 ms (GPU) per repeat."""
    return ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=50 if not is_gpu else 20,
                                     enable_cpu_cache_flush=False)


def _tune_group(contexts, left, work_dir, database, cost_model, builder, runner, batch, is_gpu, callback):
    """One MetaSchedule run over kernels that all have `left` trials to go."""
    ms.tune_tasks(
        tasks=contexts, task_weights=[1.0] * len(contexts), work_dir=work_dir,
        max_trials_global=left * len(contexts), max_trials_per_task=left,
        num_trials_per_iter=min(left, batch or (64 if is_gpu else 16)),
        builder=builder, runner=runner, database=database,
        cost_model=cost_model, measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [callback],
        task_scheduler="gradient")


def _spent(database, task_mod: tvm.IRModule) -> int:
    """Trials already recorded for this kernel (a tvmfuse TuningDatabase knows; others count as none)."""
    counts = getattr(database, "spent", None)
    return counts.get(str(tvm_ffi.structural_hash(task_mod)), 0) if counts is not None else 0


def _by_remaining(contexts, budget: int, spent: dict[str, int]):
    """Group the kernels by how many trials each has left, so each gets exactly its remaining budget."""
    groups: dict[int, list] = {}
    for ctx in contexts:
        if budget > spent[ctx.task_name]:
            groups.setdefault(budget - spent[ctx.task_name], []).append(ctx)
    return sorted(groups.items(), reverse=True)


def warm_start(cost_model, contexts, database) -> int:
    """Train the cost model on the records already stored for these kernels; returns how many it saw."""
    records_of = getattr(database, "records_of", None)
    seen = 0
    for ctx in contexts if records_of else []:
        records = records_of(ctx.mod)
        if records:
            candidates = [r.as_measure_candidate() for r in records]
            cost_model.update(ctx, candidates, [ms.runner.RunnerResult(run_secs=r.run_secs, error_msg=None)
                                                for r in records])
            seen += len(records)
    return seen


@contextlib.contextmanager
def _no_tensor_intrin(target: tvm.target.Target):
    """TuneContext imports every tensor intrinsic (15-30 s on a 2-core box: each registers
    TensorIR intrinsics by parsing TVMScript); CPU spaces use none."""
    name = "tvm.s_tir.tensor_intrin"
    if target.kind.name != "llvm" or name in sys.modules:
        yield
        return
    sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        del sys.modules[name]  # a later real import (e.g. a CUDA tensor-core job) still loads them all


def make_runner(rpc: tuple[str, str] | None, evaluator: ms.runner.EvaluatorConfig):
    """Measure locally, or on every free RPC server under the key (a dead server fails only its candidates)."""
    if rpc is None:
        return local_runner(30, evaluator)  # one per process (tune.pool)
    return rpc_runner(rpc[0], rpc[1], evaluator)
