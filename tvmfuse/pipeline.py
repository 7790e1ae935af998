"""The pipeline: the one place that decides stage order. Each phase takes what the one before returned and hands a
typed value on; `run_job` chains them:

    frontend -> prepare -> fuse (match + decide) -> kernels -> tune -> build -> verify -> export

A job lowers its module once and compiles it once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import tvm
from tvm import relax

from tvmfuse.build.compile import (RECORD_US_ATTR, TUNED, apply_database, compile_module, cuda_graph_captures,
                                   schedule_kinds)
from tvmfuse.build.library import LinkedLibrary
from tvmfuse.decide import Settings, decide, fusion_report, report_files
from tvmfuse.errors import TvmfuseError, VerificationError
from tvmfuse.export import MANIFEST, export, export_dir, make_manifest
from tvmfuse.export import weights as weight_files
from tvmfuse.export.generate import cuda_graph_summary
from tvmfuse.frontend.onnx_io import has_external_data, weights_nbytes
from tvmfuse.frontend import DEFAULT_MODEL, Imported, import_model, load_onnx, make_tiny_block
from tvmfuse.fuse import (Bucketed, Fused, add_dispatch, bucket_shapes, check_buckets, kernel_calls, lower,
                          lower_buckets)
from tvmfuse.fuse import verification_dims
from tvmfuse.isolation import VERIFICATION, collecting
from tvmfuse.isolation import current as failures_so_far
from tvmfuse.isolation import record as record_failure
from tvmfuse.jobs import Job
from tvmfuse.kernels import (GREEDY, add_greedy_tokens, apply_hopper_kernels, hopper_gemm_sites, is_hopper,
                             measured_tiles, sibling_merge_pays, substitute)
from tvmfuse.kernels.dependent_launch import dependent_launch_off
from tvmfuse.kernels.split_reads import read_split_parts
from tvmfuse.prepare import prepare_module
from tvmfuse.prepare.dtypes import parse_dtype
from tvmfuse.prepare.decoder_mask import one_kernel_decoder_mask
from tvmfuse.prepare.kv_cache import POSITION, CacheLayout, find_cache_sites, in_place_kv_cache
from tvmfuse.prepare.names import unique_binding_names
from tvmfuse.prepare.precision import has_low_lookups
from tvmfuse.records import SCHEDULES_DIR, TuningDatabase, open_database
from tvmfuse.spaces import apply_default_schedules, space_for
from tvmfuse.targets import check_compute_dtype, device_for, has_device, resolve_target, target_name
from tvmfuse.tune import (TaskProgress, TuningInterrupted, kernel_records, kernels_keeping_default, tune, tune_sites,
                          tune_templates)
from tvmfuse.verify import VariantCheck, Verification, compare_at_dims, compare_kv_step, latency_us, random_inputs
from tvmfuse.verify import schedule_check, step_dims
from tvmfuse.verify.reference import reference_model

DEFAULT_TRIALS = {"llvm": 16, "cuda": 64}
DEFAULT_MAX_SEQ = 256  # the in-place KV cache's capacity without --max-seq or buckets
UNTUNED_AFTER_VERIFICATION = "default (the build with tuned schedules failed verification)"
Say = Callable[[str], None]


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


@dataclass
class Lowered:
    """The fuse phase's result: the fused module (with the bucket functions, if any) and its kernels."""

    fused: Fused
    bucketed: Bucketed | None
    weights: list = field(default_factory=list)  # main's trailing weight params (weights outside the library)
    cache: CacheLayout | None = None  # the KV cache updated in place (prepare.kv_cache), None: the ONNX interface
    past_inputs: list[str] = field(default_factory=list)  # the exported step's past K/V inputs, if any

    @property
    def kernels(self) -> list[str]:
        return self.bucketed.kernels() if self.bucketed else self.fused.kernels()

    def with_dispatch(self, mod: tvm.IRModule) -> tvm.IRModule:
        """`mod` with `main` dispatching to the bucket functions (unchanged without buckets)."""
        return add_dispatch(mod, self.bucketed.shapes) if self.bucketed else mod


@dataclass
class Built:
    """The build phase's result: the linked library and, per kernel, how it is scheduled and what was measured."""

    library: LinkedLibrary
    kinds: dict[str, str]  # kernel -> "tuned", "default", a TIRx kernel, ...
    records: dict[str, tuple[int, float | None]]  # kernel -> (trials recorded, best µs)
    defaults_us: dict[str, float]  # kernel -> its default schedule's measured µs (tuned kernels only)
    cuda_graphs: dict[str, dict[str, int]] | None = None  # --cuda-graph on CUDA: build.cuda_graph_captures

    @property
    def tuned(self) -> list[str]:
        return [k for k, kind in self.kinds.items() if kind == TUNED]


@dataclass
class Verified:
    """The verify phase's result: the manifest's `verification`, the summary's text and the measured latency."""

    verification: dict
    text: str
    latency_us: float | None = None
    before_us: float | None = None  # estimated: the tuned kernels at their default schedules' measured times


# ---------------------------------------------------------------------------------------------------------- phases

def frontend_phase(job: Job) -> Imported:
    """Read the job's ONNX file (or build the embedded default model) and import it into Relax; a big model built
    in fp16/bf16 has its matmul weights read in that dtype (never all of them in fp32 at once)."""
    source = job.path or f"<embedded {DEFAULT_MODEL}>"
    model = load_onnx(job.path) if job.path else make_tiny_block()  # external data: the graph only
    folder = os.path.dirname(os.path.abspath(job.path)) if job.path else None  # external data lies there
    dtype = parse_dtype(job.dtype, "dtype")
    big = weight_files.outside(has_external_data(model), weights_nbytes(model), job.weights)
    return import_model(model, job.shapes, source, folder, weight_dtype=dtype if big and dtype != "float32" else None)


def kv_cache_phase(bound: tvm.IRModule, imported: Imported, job: Job, say: Say) -> tuple[tvm.IRModule,
                                                                                     CacheLayout | None]:
    """A decoder step with past K/V inputs: unless --kv-cache onnx, its caches become preallocated tensors of
    --max-seq positions (else the largest bucket of the past or total length, else DEFAULT_MAX_SEQ, or the longest
    step plus DEFAULT_MAX_SEQ where the step's own length is bucketed or fixed at DEFAULT_MAX_SEQ or more) written in
    place (prepare.kv_cache); returns the module and the cache layout (or None). A step longer than the cache (a seq
    bucket or size over --max-seq) is a TvmfuseError."""
    sites = find_cache_sites(bound)
    if job.kv_cache == "onnx" or (job.kv_cache is None and not sites):
        return bound, None
    mask = next((t for t in imported.inputs if "mask" in t.name), None)  # attention_mask [batch, past + seq]
    lengths = {str(p.ty.shape.values[2]) for p, _, _ in sites} | {  # the past dim, and the mask's past + seq
        d for d in (mask.shape[-1:] if mask else []) if isinstance(d, str)}
    steps = [kv.ty.shape.values[2] for _, _, kv in sites]  # the step's own length: its tokens (seq)
    names = {str(d) for d in steps if not isinstance(d, tvm.tirx.IntImm)}
    longest = max([max(v) for d, v in job.buckets.items() if d in names]
                  + [int(d) for d in steps if isinstance(d, tvm.tirx.IntImm)], default=1)
    capacity = job.max_seq or max((max(v) for d, v in job.buckets.items() if d in lengths),
                                  default=DEFAULT_MAX_SEQ if longest < DEFAULT_MAX_SEQ else longest + DEFAULT_MAX_SEQ)
    if longest > capacity:
        dim = "".join(f" ({d})" for d in sorted(names))  # the bucketed dim, by name
        raise TvmfuseError(f"a step of {longest} tokens{dim} does not fit the in-place KV cache of {capacity} "
                           f"positions: raise --max-seq to the longest prompt plus the tokens to generate, or drop "
                           f"that size")
    mod, layout = in_place_kv_cache(bound, capacity, [t.name for t in imported.outputs],
                                    parse_dtype(job.dtype, "dtype"))
    say(f"KV cache in place: {len(layout.sites)} caches of {capacity} positions ({layout.dtype}), written at "
        f"past_len, read where they lie (--kv-cache onnx: the exported past -> present copy)")
    if mask:
        seqs = sorted({v for values in job.buckets.values() for v in values if 1 < v <= capacity})
        mod, notes = one_kernel_decoder_mask(mod, mask.name, POSITION, capacity, seqs)
        for note in notes:
            say(f"decoder mask: {note}")
    return mod, layout


def fuse_phase(bound: tvm.IRModule, target: tvm.target.Target, settings: Settings | None = None) -> Fused:
    """Match the pattern table, decide with the cost model which candidates to fuse, fuse them (one PrimFunc each)."""
    bound = unique_binding_names(bound)  # once here: decide and lower then find no name repeated
    return lower(bound, plan=decide(bound, target, settings))


def kernels_phase(fused: Fused, target: tvm.target.Target, database: TuningDatabase, trials: int, rpc,
                  on_progress: Callable[[TaskProgress], None], log: Say) -> Fused:
    """On CUDA: the hand-written templates where they take a kernel's shapes (their knobs measured into the
    database first, each checked against the generic kernel; the best measured applied), then on sm_90a the TIRx
    GEMM kernels (their tiles measured and checked the same way; the fastest, else the rules' pick) and row kernels
    where they fit. One log line per kernel considered."""
    if target.kind.name != "cuda":
        return fused

    def log_choice(line: str) -> None:  # "kernel: what it runs as", kept for the manifest too
        kernel, _, choice = line.partition(": ")
        fused.kernel_choices[kernel] = choice
        log(line)

    tune_templates(fused.mod, fused.kernel_patterns, target, database, trials, rpc=rpc, on_progress=on_progress,
                   say=log, make_check=VariantCheck)  # wrong knob sets, one line each
    outcomes: list = []
    fused.mod = substitute(fused.mod, fused.kernel_patterns, target=target, log=outcomes, database=database)
    packing: list = []
    fused.mod = read_split_parts(fused.mod, target, log=packing)  # Q, K and V where the split would cut them
    choices = dict(outcomes)
    for kernel, outcome in packing:  # one line a kernel: what it runs as, then how it reads its input
        choices[kernel] = f"{choices[kernel]}; {outcome}" if kernel in choices else outcome
    for kernel, outcome in choices.items():
        log_choice(f"{kernel}: {outcome}")
    if trials > 0:  # with --trials 0 nothing is measured: the tiles come from the records and rules alone
        tune_sites(hopper_gemm_sites(fused.mod, target), fused.mod, target, database, trials, rpc=rpc,
                   on_progress=on_progress, say=log, make_check=VariantCheck)
    fused.mod = apply_hopper_kernels(fused.mod, target, log_choice, tile_for=measured_tiles(database, target))
    return fused


def buckets_phase(bound: tvm.IRModule, fused: Fused, job: Job, target, database, trials: int, rpc,
                  say: Say) -> Bucketed:
    """Static copies of `main` for the named bucket sizes, each fused and given its kernels like `main`."""
    def fuse_static(mod: tvm.IRModule, name: str) -> Fused:
        return kernels_phase(fuse_phase(mod, target), target, database, trials, rpc, _progress_printer(job.name, say),
                             lambda s: say(f"[{job.name}] {name}: {s}"))

    return lower_buckets(bound, fused, job.buckets, fuse_static)


def tune_phase(lowered: Lowered, target, database, work_dir: str, trials: int, job: Job, rpc,
               say: Say) -> dict[str, TaskProgress]:
    """MetaSchedule + XGBoost over every static-shape kernel (function by function with buckets); records go to the
    database as they are measured, so an interrupted job resumes."""
    progress: dict[str, TaskProgress] = {}
    if trials <= 0:
        return progress
    say(f"[{job.name}] tuning, {trials} trials per kernel, records in {work_dir}")
    views = lowered.bucketed.tuning_views() if lowered.bucketed else [lowered.fused.mod]
    try:
        for view in views:
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
    return progress


def build_phase(lowered: Lowered, target, database, progress: dict[str, TaskProgress], cuda_graph: bool,
                check: Callable | None = None, untuned: tuple[str, ...] = (), say: Say | None = None) -> Built:
    """Each kernel takes its best record unless its default schedule measured faster or `check` (the verify stage's
    `schedule_check`) finds the replayed record's output wrong; every other kernel, and those in `untuned`, gets its
    default schedule; then one compile to a VM executable, linked into a library."""
    mod = lowered.fused.mod
    records = kernel_records(mod, database) if database is not None else {}
    defaults = {p.workload: p.default_us for p in progress.values() if p.default_us is not None}
    keep = kernels_keeping_default(mod, records, defaults)
    tuned_mod = apply_database(mod, target, database, keep_default=[*keep, *untuned], check=check, say=say)
    kinds = {**schedule_kinds(tuned_mod, target), **{k: "default (measured faster than every tuned schedule)"
                                                      for k in keep},
             **{k: UNTUNED_AFTER_VERIFICATION for k in untuned}}
    records = {**records, **{k: (records.get(k, (0, None))[0], us) for k, us in keep.items()},
               **{gv.name_hint: (records.get(gv.name_hint, (0, None))[0], float(f.attrs[RECORD_US_ATTR]))
                  for gv, f in tuned_mod.functions.items() if f.attrs and RECORD_US_ATTR in f.attrs}}
    final = lowered.with_dispatch(apply_default_schedules(tuned_mod, target))
    if lowered.past_inputs:  # a decoder step: generate samples on the device
        final = add_greedy_tokens(final, target)
    executable = compile_module(final, target, cuda_graph=cuda_graph)
    defaults_us = {name: p.default_us for name, p in progress.items()
                   if p.default_us is not None and kinds.get(name) == TUNED}
    graphs = None
    if cuda_graph and target.kind.name == "cuda":
        graphs = cuda_graph_captures(executable.as_text(), {gv.name_hint for gv, f in final.functions.items()
                                                            if isinstance(f, tvm.tirx.PrimFunc)})
    return Built(LinkedLibrary(executable), kinds, records, defaults_us, graphs)


def verify_phase(built: Built, lowered: Lowered, imported: Imported, job: Job, target, bound,
                 weight_bytes: int = 0, say: Say = print) -> Verified:
    """Run the build and onnxruntime on the same seeded inputs (with buckets: at the first bucket's shape and at a
    shape no bucket covers) and time the build; a failed comparison raises VerificationError. A model whose fp32
    reference would not fit in the free memory (weights outside the library) is not verified, and says why."""
    if not has_device(target):
        return Verified({"status": "skipped", "reason": f"no {target.kind.name} device here"}, "skipped")
    need, free = weight_files.reference_memory(weight_bytes), weight_files.available_memory()
    if lowered.weights and free is not None and free < need:
        reason = (f"too little free memory for the fp32 onnxruntime reference (needs ~{need / 2**30:.1f} GiB beside "
                  f"the build, {free / 2**30:.1f} GiB available)")
        say(f"[{job.name}] verification skipped: {reason}")
        return Verified({"status": "skipped", "reason": reason}, "skipped (memory)")
    device = device_for(target)
    vm = relax.VirtualMachine(built.library.module, device)
    weights = [w if w.device == device else w.copyto(device) for w in lowered.weights]  # (the build's are on the CPU)
    if lowered.cache is not None:  # the in-place step against onnxruntime's past -> present step
        check, args = compare_kv_step(vm, device, job.path or imported.onnx_model, imported.inputs,
                                      [t.name for t in imported.outputs], lowered.cache.as_dict(),
                                      verification_dims(imported.symbolic_dims, {})[0], job.dtype, job.tolerance,
                                      weights)
        if not check.ok:
            raise VerificationError(_failed(job, check, {}), False, _errors(check))
        timer = vm.time_evaluator("main", device, number=5, repeat=3, min_repeat_ms=50)
        after = float(sorted(timer(*args).results)[1] * 1e6)
        return Verified(check.as_dict(), f"ok {check.max_abs_err:.1e}", after,
                        after + _tuning_gain_us(built, lowered, "main"))
    dims_list = verification_dims(imported.symbolic_dims, job.buckets)
    if lowered.past_inputs:  # the mask covers past + seq
        dims_list = [step_dims(imported.inputs, lowered.past_inputs, d) for d in dims_list]
    reference, reference_name = reference_model(job.path or imported.onnx_model, imported.onnx_model)
    child: dict = {}  # a big model's reference runs in a child process: its peak RSS
    checks = compare_at_dims(vm, device, reference, imported.inputs, dims_list, job.io_dtype, job.dtype,
                             job.tolerance, weights, child)
    dims, check = max(checks, key=lambda c: (not c[1].ok, c[1].max_abs_err))
    if not check.ok:
        raise VerificationError(_failed(job, check, dims), job.low_lookups and has_low_lookups(bound), _errors(check))
    feeds = random_inputs(imported.inputs, seed=0, dims=checks[0][0], io_dtype=job.io_dtype)
    after = latency_us(vm, device, feeds, job.io_dtype, weights)
    shapes = lowered.bucketed.shapes if lowered.bucketed else {}
    function = next((fn for fn, shape in shapes.items() if shape == checks[0][0]), "main")  # the one timed
    extra = {"reference_peak_rss_bytes": child["peak_rss_bytes"]} if child else {}
    return Verified({**check.as_dict(), "reference": reference_name,
                     **({"dims": [d for d, _ in checks]} if job.buckets else {}), **extra},
                    f"ok {check.max_abs_err:.1e}", after, after + _tuning_gain_us(built, lowered, function))


def verified_build(built: Built, lowered: Lowered, imported: Imported, job: Job, target, bound, database,
                   progress: dict[str, TaskProgress], weight_bytes: int, say: Say) -> tuple[Built, Verified]:
    """`verify_phase` on the build; when a build with tuned kernels fails it, the build again with every tuned
    kernel on its default schedule, verified in turn (each such kernel a warning and a line in the manifest's
    failures); a VerificationError only when that build fails too."""
    try:
        return built, verify_phase(built, lowered, imported, job, target, bound, weight_bytes, say)
    except VerificationError as err:
        if not built.tuned:
            raise
        first = err
    tuned = tuple(built.tuned)
    say(f"[{job.name}] verification against onnxruntime failed with tuned schedules ({first.errors}); "
        f"building again with its {len(tuned)} tuned kernel(s) on their default schedules")
    default = build_phase(lowered, target, database, progress, job.cuda_graph, untuned=tuned)
    try:
        verified = verify_phase(default, lowered, imported, job, target, bound, weight_bytes, say)
    except VerificationError as err:
        raise VerificationError(f"{err} (with every kernel on its default schedule too)", err.low_lookups,
                                err.errors) from None
    why = (f"the build with tuned schedules failed verification against onnxruntime ({first.errors}); "
           f"with default schedules it passed ({verified.text})")
    for kernel in tuned:
        record_failure(kernel, VERIFICATION, why)
    return default, verified


def export_phase(built: Built, lowered: Lowered, verified: Verified, imported: Imported, bound, job: Job, target,
                 work_dir: str, dest: str, started: float, weight_bytes: int) -> tuple[str, dict]:
    """Write `model.so` (with weights outside it: `weights/`, a raw tensor cache), `manifest.json` and the fusion
    report into `dest`, atomically; returns the folder and the manifest as written."""
    fused = lowered.fused
    manifest = make_manifest(job, target, imported.source, imported, bound, fused, lowered.kernels, built.kinds,
                             built.records, verified.verification,
                             {"tuned": verified.latency_us, "default_schedules_estimated": verified.before_us},
                             work_dir, lowered.bucketed)
    report = fusion_report(fused.plan, fused, {k: us for k, (_, us) in built.records.items() if us is not None})
    manifest["fusion"] = report["totals"]
    manifest["failures"] = failures_so_far()  # kernels that fell back to their default schedule, and why
    manifest.update(_cache_interface(manifest, lowered))
    if built.cuda_graphs is not None:
        manifest["cuda_graphs"] = built.cuda_graphs
    output = export(built.library, manifest, dest, extra_files=report_files(report),
                    weights=lowered.weights if lowered.weights else None,
                    late=lambda: {"build": weight_files.build_stats(started, weight_bytes)})
    with open(os.path.join(output, MANIFEST), encoding="utf-8") as f:
        return output, json.load(f)  # as written: the library's and weights' sha256s, the build's stats


# ------------------------------------------------------------------------------------------------------------- jobs

def run_job(job: Job, target: tvm.target.Target, out: str, logs_root: str = "tuning_logs",
            say: Say = print, rpc: tuple[str, str] | None = None,
            schedules: str | None = SCHEDULES_DIR) -> JobResult:
    """Run one job end to end; user errors become a failed JobResult, never a traceback."""
    try:
        with dependent_launch_off(not job.dependent_launch):  # the job may only turn it off (TVMFUSE_DEPENDENT_LAUNCH)
            try:
                with collecting(lambda s: say(f"[{job.name}] {s}")):  # per-kernel failures: warned, in the manifest
                    return _run(job, target, out, logs_root, say, rpc, schedules)
            except VerificationError as err:
                if not err.low_lookups:
                    raise
                say(f"[{job.name}] {err}; building again with the embedding lookups in fp32 (an fp32 residual stream)")
                with collecting(lambda s: say(f"[{job.name}] {s}")):
                    return _run(dataclasses.replace(job, low_lookups=False), target, out, logs_root, say, rpc,
                                schedules)
    except TvmfuseError as err:
        return JobResult(job.name, ok=False, error=str(err), details={"exit_code": err.exit_code})
    except Exception as err:  # pylint: disable=broad-except  (one job's crash must not lose the others)
        say(traceback.format_exc())
        return JobResult(job.name, ok=False, error=f"internal error: {type(err).__name__}: {err}",
                         details={"exit_code": 1})


def _run(job: Job, target, out: str, logs_root: str, say: Say, rpc, schedules) -> JobResult:
    tname = target_name(target)
    dest = export_dir(out, job.name, tname)
    trials = job.trials if job.trials is not None else DEFAULT_TRIALS.get(target.kind.name, 16)
    work_dir = os.path.join(logs_root, f"{job.name}-{tname}")
    if trials > 0 and not has_device(target) and rpc is None:
        raise TvmfuseError(f"{job.name}: no {target.kind.name} device on this machine to measure on; "
                           "run on a machine with one, measure remotely with --rpc, or pass --trials 0 to build "
                           "with default schedules")
    check_compute_dtype(target, job.dtype)
    log = lambda s: say(f"[{job.name}] {s}")  # noqa: E731
    started = time.time()

    imported = frontend_phase(job)
    weight_bytes = weights_nbytes(imported.onnx_model)
    outside = weight_files.outside(has_external_data(imported.onnx_model), weight_bytes, job.weights)
    check_buckets(job.buckets, imported, imported.source)
    if imported.symbolic_dims:
        log(f"symbolic dims {', '.join(imported.symbolic_dims)} kept symbolic: kernels that use them get default "
            "schedules (fix them with --shape NAME=VALUE, or name sizes to tune with --buckets)")
    merged: list = []
    bound = prepare_module(imported, job.dtype, job.io_dtype, job.low_lookups, one_copy=outside,
                           merge_pays=_merge_rule(target, job.dtype), merged=merged,
                           merge_sizes=bucket_shapes(job.buckets) if job.buckets else None)
    for (m, n, k, count), times in Counter(merged).items():
        rows = m if isinstance(m, int) else f"({m})"  # symbolic rows: the buckets' range
        log(f"sibling projections: {times} group(s) of {count} x {rows}x{n}x{k} GEMMs (one input, weights of one "
            f"width) merged into one {rows}x{n * count}x{k} GEMM and a split each")
    past_inputs = [p.name for p, _, _ in find_cache_sites(bound)]
    bound, cache = kv_cache_phase(bound, imported, job, log)
    fused = fuse_phase(bound, target)
    kernels = fused.kernels()
    log(f"{len(kernels)} kernels, {len(fused.kernel_patterns)} fused by pattern: "
        + ", ".join(sorted(set(fused.kernel_patterns.values())))
        if fused.kernel_patterns else f"{len(kernels)} kernels, none fused by pattern")

    database = open_database(work_dir, target, schedules, log, fused.mod)
    fused = kernels_phase(fused, target, database, trials, rpc, _progress_printer(job.name, say), log)
    bucketed = buckets_phase(bound, fused, job, target, database, trials, rpc, say) if job.buckets else None
    lowered = Lowered(bucketed.fused if bucketed else fused, bucketed, cache=cache, past_inputs=past_inputs)
    if outside:  # main's large constants (the weights as the kernels read them) become its trailing params
        lowered.fused.mod, lowered.weights = weight_files.unbind_weights(lowered.fused.mod)
    if bucketed:
        log(f"buckets: {', '.join(bucketed.shapes)}, {len(lowered.kernels)} kernels in all; other sizes run "
            "main_generic")
        left = [d for d in imported.symbolic_dims if d not in job.buckets]
        if left:
            log(f"{', '.join(left)} stay symbolic in the bucket functions too: their kernels that use them get "
                f"default schedules (bucket them too, e.g. --buckets {left[0]}=1, to tune those)")

    progress = tune_phase(lowered, target, database, work_dir, trials, job, rpc, say)
    built = build_phase(lowered, target, database, progress, job.cuda_graph, check=_schedule_check(target, log),
                        say=log)
    built, verified = verified_build(built, lowered, imported, job, target, bound, database, progress, weight_bytes,
                                     say)
    output, manifest = export_phase(built, lowered, verified, imported, bound, job, target, work_dir, dest, started,
                                    weight_bytes)
    if built.cuda_graphs is not None:
        log(cuda_graph_summary(manifest))
    log(f"exported {output}")
    return JobResult(job.name, ok=True, kernels=len(lowered.kernels), fused=len(lowered.fused.kernel_patterns),
                     tuned=sum(built.kinds.get(k) == TUNED for k in lowered.kernels),
                     latency_before_us=verified.before_us, latency_after_us=verified.latency_us,
                     verification=verified.text, output=output, details=manifest)


def plan_model(path: str, target: str, settings: Settings, shapes: dict | None = None, dtype: str = "fp32") -> dict:
    """`python -m tvmfuse plan`: the fusion report of a model computing in `dtype` (as a job sees it: sibling
    projections merged where the job would), beside stock TVM fusion."""
    imported = import_model(load_onnx(path), shapes, path, os.path.dirname(os.path.abspath(path)))
    resolved, dtype = resolve_target(target), parse_dtype(dtype, "--dtype")
    check_compute_dtype(resolved, dtype)
    bound = prepare_module(imported, dtype, merge_pays=_merge_rule(resolved, dtype))
    fused = fuse_phase(bound, resolved, settings)
    return fusion_report(fused.plan, fused, stock=lower(bound, patterns=[]))


# ---------------------------------------------------------------------------------------------------------- helpers

def _merge_rule(target, dtype: str):
    """The rule for merging sibling projections (`prepare.siblings`): the wgmma kernel's estimate on sm_90a in fp16
    and bf16 (the dtypes it takes), none elsewhere (nothing measured there)."""
    return sibling_merge_pays if is_hopper(target) and parse_dtype(dtype, "dtype") != "float32" else None


def _cache_interface(manifest: dict, lowered: Lowered) -> dict:
    """The manifest's `kv_cache` (how generate drives the step) and, in place, the step's own inputs and
    outputs: the past inputs replaced by past_len and the caches, the present outputs gone."""
    if not lowered.past_inputs:
        return {}
    inputs = {t["name"]: t for t in manifest["inputs"]}
    if lowered.cache is None:
        outputs = [t["name"] for t in manifest["outputs"]]
        caches = [{"past": p, "present": outputs[1 + i] if 1 + i < len(outputs) else None,
                   "kv_heads": inputs[p]["shape"][1], "head_dim": inputs[p]["shape"][3]}
                  for i, p in enumerate(lowered.past_inputs)]
        return {"kv_cache": {"mode": "onnx", "caches": caches, "greedy": GREEDY}}
    cache = {**lowered.cache.as_dict(), "greedy": GREEDY}
    pasts, presents = {s["past"] for s in cache["caches"]}, {s["present"] for s in cache["caches"]}
    past_dim = inputs[cache["caches"][0]["past"]]["shape"][2]
    step_inputs = [t for t in manifest["inputs"] if t["name"] not in pasts]
    step_inputs.append({"name": cache["position"], "shape": [1], "dtype": "shape", "dims": [past_dim]})
    for s in cache["caches"]:
        batch = inputs[s["past"]]["shape"][0]
        step_inputs.append({"name": s["cache"], "shape": [cache["capacity"], batch, s["kv_heads"], s["head_dim"]],
                            "dtype": cache["dtype"]})
    return {"inputs": step_inputs, "outputs": [t for t in manifest["outputs"] if t["name"] not in presents],
            "kv_cache": cache}


def _schedule_check(target, log: Say) -> Callable | None:
    """The build's output check of replayed records (verify.schedule_check), where the target's device is here;
    elsewhere (measured over RPC) the job's verification alone checks them."""
    return schedule_check(target, log) if has_device(target) else None


def _errors(check: Verification) -> str:
    return f"max abs err {check.max_abs_err:.3g}, max rel err {check.max_rel_err:.3g}"


def _failed(job: Job, check: Verification, dims: dict) -> str:
    return (f"{job.name}: verification against onnxruntime FAILED ({_errors(check)}"
            + (f" at {dims}" if job.buckets else "")
            + f"; tolerance {check.tolerance_text()}: pass --tolerance ATOL,RTOL or set `tolerance` in the jobs "
            "file if the model needs more)")


def _tuning_gain_us(built: Built, lowered: Lowered, function: str) -> float:
    """What tuning saved per run of `function`: each tuned kernel's measured default minus its best record, times
    the calls to it (the "before" column is the build's measured latency plus this, not a second build)."""
    calls = kernel_calls(lowered.fused.mod, function)
    return sum(calls.get(k, 0) * (default - built.records[k][1]) for k, default in built.defaults_us.items()
               if built.records.get(k, (0, None))[1] is not None)


def _progress_printer(name: str, say: Say) -> Callable[[TaskProgress], None]:
    def report(task: TaskProgress) -> None:
        elapsed = time.time() - task.started
        eta = elapsed / max(task.trials - task.resumed, 1) * max(task.budget - task.trials, 0)
        best = f"{task.best_us:.1f} us" if task.best_us is not None else "-"
        failed = f", {task.failed} failed" if task.failed else ""
        say(f"[{name}]   {task.name}: {task.trials}/{task.budget} trials{failed}, best {best}, ETA {eta:.0f} s")

    return report


__all__ = ["Built", "JobResult", "Lowered", "Verified", "build_phase", "buckets_phase", "export_phase",
           "frontend_phase", "fuse_phase", "kernels_phase", "plan_model", "run_job", "tune_phase", "verified_build",
           "verify_phase"]
