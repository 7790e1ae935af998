"""The pipeline: the one place that decides stage order — import, fuse, tune, build, verify, export."""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import tvm
from tvm import relax

from .baseline import kernels_keeping_default
from .buckets import add_dispatch, check_buckets, lower_buckets, verification_dims
from .build import TUNED, apply_database, apply_default_schedules, compile_module, schedule_kinds
from .default_model import NAME as DEFAULT_NAME
from .default_model import make_tiny_block
from .errors import TvmfuseError, VerificationError
from .export import export, export_dir
from .decide import decide
from .fuse import bind_params, lower
from .report import fusion_report, report_files
from .importer import import_model, load_onnx, random_inputs
from .manifest import make_manifest
from .measure import compare_at_dims, latency_us
from .layout import transpose_weights
from .precision import has_fp16_lookups, to_compute_dtype
from .jobs import Job
from .spaces import space_for
from .targets import device_for, has_device, target_name
from .templates import apply_templates
from .schedules import DEFAULT_DIR as SCHEDULES_DIR
from .schedules import open_database
from .progress import TaskProgress, kernel_records
from .tune import TuningInterrupted, tune

DEFAULT_TRIALS = {"llvm": 16, "cuda": 64}


@dataclass
class JobResult:
    """What the summary table and the exit code need to know about one job."""

    name: str
    ok: bool
    error: str | None = None
    kernels: int = 0
    fused: int = 0
    tuned: int = 0
    latency_before_us: float | None = None
    latency_after_us: float | None = None
    verification: str = "-"
    output: str | None = None
    details: dict = field(default_factory=dict)


def run_job(job: Job, target: tvm.target.Target, out: str, logs_root: str = "tuning_logs",
            say: Callable[[str], None] = print, rpc: tuple[str, str] | None = None,
            schedules: str | None = SCHEDULES_DIR) -> JobResult:
    """Run one job end to end; user errors become a failed JobResult, never a traceback."""
    try:
        try:
            return _run(job, target, out, logs_root, say, rpc, schedules)
        except VerificationError as err:
            if not err.fp16_lookups:
                raise
            say(f"[{job.name}] {err}; building again with the embedding lookups in fp32 (an fp32 residual stream)")
            return _run(dataclasses.replace(job, fp16_lookups=False), target, out, logs_root, say, rpc, schedules)
    except TvmfuseError as err:
        return JobResult(job.name, ok=False, error=str(err), details={"exit_code": err.exit_code})
    except Exception as err:  # pylint: disable=broad-except  (one job's crash must not lose the others)
        say(traceback.format_exc())
        return JobResult(job.name, ok=False, error=f"internal error: {type(err).__name__}: {err}",
                         details={"exit_code": 1})


def _run(job: Job, target, out, logs_root, say, rpc, schedules) -> JobResult:
    tname = target_name(target)
    dest = export_dir(out, job.name, tname)
    source = job.path or f"<embedded {DEFAULT_NAME}>"
    model = load_onnx(job.path) if job.path else make_tiny_block()
    imported = import_model(model, job.shapes, source)
    check_buckets(job.buckets, imported, source)
    if imported.symbolic_dims:
        say(f"[{job.name}] symbolic dims {', '.join(imported.symbolic_dims)} kept symbolic: kernels that use them "
            "get default schedules (fix them with --shape NAME=VALUE, or name sizes to tune with --buckets)")
    bound = prepare_module(imported, job.dtype, job.io_dtype, job.fp16_lookups)
    plan = decide(bound, target)  # match, cost model, decision: which candidates get fused
    fused = lower(bound, plan=plan)
    kernels = fused.kernels()
    say(f"[{job.name}] {len(kernels)} kernels, {len(fused.kernel_patterns)} fused by pattern: "
        + ", ".join(sorted(set(fused.kernel_patterns.values()))) if fused.kernel_patterns else
        f"[{job.name}] {len(kernels)} kernels, none fused by pattern")

    trials = job.trials if job.trials is not None else DEFAULT_TRIALS.get(target.kind.name, 16)
    work_dir = os.path.join(logs_root, f"{job.name}-{tname}")
    runnable = has_device(target)
    if trials > 0 and not runnable and rpc is None:
        raise TvmfuseError(f"{job.name}: no {target.kind.name} device on this machine to measure on; "
                           "run on a machine with one, measure remotely with --rpc, or pass --trials 0 to build "
                           "with default schedules")
    database = open_database(work_dir, target, schedules, lambda s: say(f"[{job.name}] {s}"), fused.mod)
    apply_templates(fused, target, database, trials, rpc, _progress_printer(job.name, say),
                    lambda s: say(f"[{job.name}] {s}"))
    bucketed = None
    if job.buckets:  # static copies of main for the named sizes (their kernels tune); main dispatches on the dims
        bucketed = lower_buckets(bound, fused, job.buckets, _fuse_static(job.name, target, database, trials, rpc, say))
        fused, kernels = bucketed.fused, bucketed.kernels()
        say(f"[{job.name}] buckets: {', '.join(bucketed.shapes)}, {len(kernels)} kernels in all; "
            "other sizes run main_generic")
        left = [d for d in imported.symbolic_dims if d not in job.buckets]
        if left:
            say(f"[{job.name}] {', '.join(left)} stay symbolic in the bucket functions too: their kernels that use "
                f"them get default schedules (bucket them too, e.g. --buckets {left[0]}=1, to tune those)")
    with_dispatch = (lambda m: add_dispatch(m, bucketed.shapes)) if bucketed else (lambda m: m)
    progress: dict[str, TaskProgress] = {}
    if trials > 0:
        say(f"[{job.name}] tuning, {trials} trials per kernel, records in {work_dir}")
        try:
            for view in bucketed.tuning_views() if bucketed else [fused.mod]:  # buckets: function by function
                for name, task in tune(view, target, work_dir, trials, on_progress=_progress_printer(job.name, say),
                                       rpc=rpc, database=database, space_for=space_for, batch=job.batch).items():
                    progress.setdefault(name, task)  # a kernel two functions share was tuned with the first
        except TuningInterrupted:
            raise TuningInterrupted(f"interrupted: {sum(database.spent.values())} records kept in {work_dir}; "
                                    "rerun the same command to resume") from None
        resumed = sum(p.resumed for p in progress.values())
        if resumed:
            say(f"[{job.name}] resumed: {resumed} trials were already recorded and counted toward the budget; "
                f"{sum(p.trials - p.resumed for p in progress.values())} run now")

    records = kernel_records(fused.mod, database) if database is not None else {}
    keep = kernels_keeping_default(fused.mod, records, {p.workload: p.default_us for p in progress.values()
                                                        if p.default_us is not None})
    tuned_mod = apply_database(fused.mod, target, database, keep_default=keep)
    kinds = {**schedule_kinds(tuned_mod, target), **{k: "default (measured faster than every tuned schedule)" for k in keep}}
    records = {**records, **{k: (records.get(k, (0, None))[0], us) for k, us in keep.items()}}
    executable = compile_module(with_dispatch(apply_default_schedules(tuned_mod, target)), target,
                                cuda_graph=job.cuda_graph)

    result = JobResult(job.name, ok=True, kernels=len(kernels), fused=len(fused.kernel_patterns),
                       tuned=sum(kinds.get(k) == TUNED for k in kernels))
    verification = {"status": "skipped", "reason": f"no {target.kind.name} device here"}
    if runnable:  # with buckets: at the first bucket's shape (latency too) and at a shape no bucket covers
        device = device_for(target)
        vm = relax.VirtualMachine(executable, device)
        checks = compare_at_dims(vm, device, model, imported.inputs,
                                 verification_dims(imported.symbolic_dims, job.buckets), job.io_dtype, job.dtype,
                                 job.tolerance)
        dims, check = max(checks, key=lambda c: (not c[1].ok, c[1].max_abs_err))
        verification = {**check.as_dict(), **({"dims": [d for d, _ in checks]} if job.buckets else {})}
        feeds = random_inputs(imported.inputs, seed=0, dims=checks[0][0], io_dtype=job.io_dtype)
        result.latency_after_us = latency_us(vm, device, feeds, job.io_dtype)
        if result.tuned:
            untuned = compile_module(with_dispatch(apply_default_schedules(fused.mod, target)), target)
            result.latency_before_us = latency_us(relax.VirtualMachine(untuned, device), device, feeds, job.io_dtype)
        else:
            result.latency_before_us = result.latency_after_us
        if not check.ok:
            raise VerificationError(f"{job.name}: verification against onnxruntime FAILED "
                                    f"(max abs err {check.max_abs_err:.3g}, max rel err {check.max_rel_err:.3g}"
                                    + (f" at {dims}" if job.buckets else "") + f"; tolerance {check.tolerance_text()}: "
                                    "pass --tolerance ATOL,RTOL or set `tolerance` in the jobs file if the model "
                                    "needs more)",
                                    job.fp16_lookups and has_fp16_lookups(bound))
        result.verification = f"ok {check.max_abs_err:.1e}"
    else:
        result.verification = "skipped"

    manifest = make_manifest(job, target, source, imported, bound, fused, kernels, kinds, records, verification,
                             {"default_schedules": result.latency_before_us, "tuned": result.latency_after_us},
                             work_dir, bucketed)
    report = fusion_report(plan, fused, lower(bound, patterns=[]),
                           {k: us for k, (_, us) in records.items() if us is not None})
    manifest["fusion"] = report["totals"]
    result.output = export(executable, manifest, dest, extra_files=report_files(report))
    result.details = manifest
    say(f"[{job.name}] exported {result.output}")
    return result


def prepare_module(imported, dtype: str = "fp32", io_dtype: str | None = None,
                   fp16_lookups: bool = True) -> tvm.IRModule:
    """The imported model as decide and fuse see it: weights bound as constants, precision (fp16/bf16 kernels),
    then the weight layout (constant weights [N, K], read through a permute the kernel absorbs)."""
    bound = bind_params(imported.mod, imported.params)
    return transpose_weights(to_compute_dtype(bound, dtype, io_dtype, fp16_lookups))


def _fuse_static(job_name: str, target, database, trials: int, rpc, say: Callable[[str], None]):
    """How a bucket's static copy of main (`name`) is fused: decide, fuse, and on CUDA the templates that take
    its shapes, their knobs measured like main's (templates logged with the function's name)."""
    def fuse(mod: tvm.IRModule, name: str):
        fused = lower(mod, plan=decide(mod, target))
        apply_templates(fused, target, database, trials, rpc, _progress_printer(job_name, say),
                        lambda s: say(f"[{job_name}] {name}: {s}"))
        return fused

    return fuse


def _progress_printer(name: str, say: Callable[[str], None]) -> Callable[[TaskProgress], None]:
    def report(task: TaskProgress) -> None:
        elapsed = time.time() - task.started
        eta = elapsed / max(task.trials - task.resumed, 1) * max(task.budget - task.trials, 0)
        best = f"{task.best_us:.1f} us" if task.best_us is not None else "-"
        failed = f", {task.failed} failed" if task.failed else ""
        say(f"[{name}]   {task.name}: {task.trials}/{task.budget} trials{failed}, best {best}, ETA {eta:.0f} s")

    return report
