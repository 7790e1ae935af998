"""Build stage: apply tuning records, give every other kernel a default schedule, compile for the target."""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable

import tvm
from tvm import relax, tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

from tvmfuse.build.dependent_launch import tag_dependent_launch
from tvmfuse.build.launch_order import order_launches
from tvmfuse.fuse.views import rewrite_dataflow_reshape
from tvmfuse.isolation import OUTPUT_CHECK, REPLAY
from tvmfuse.isolation import record as record_failure
from tvmfuse.kernels.attention.common import NO_CSE_ATTR
from tvmfuse.kernels.hopper.wgmma_gemm import TIRX_ATTR
from tvmfuse.spaces.defaults import apply_default_schedules, default_kind
from tvmfuse.spaces.intrinsics import register as register_tensor_intrinsics

TUNED, DEFAULT = "tuned", "default"


def tirx_kind(kernel: str) -> str:
    """The manifest's schedule kind of a TIRx kernel named `kernel` (the value of its TIRX_ATTR)."""
    return f"{kernel} (TIRx kernel)"


WGMMA, MMA_SMALLM = tirx_kind("wgmma"), tirx_kind("mma_smallm")
TIR_PIPELINE = "tvmfuse"  # registered below: TVM's s_tir pipeline, and its tirx pipeline for TIRx kernels


def _marked(func, attr: str) -> bool:
    """Whether `func` is a PrimFunc carrying `attr` (TIRX_ATTR, NO_CSE_ATTR) with a true value."""
    return isinstance(func, tirx.PrimFunc) and bool(func.attrs) and bool(func.attrs.get(attr, False))


def _current_context_with(config: dict) -> tvm.transform.PassContext:
    """The current PassContext's settings (the caller's opt level, passes and options) plus `config`."""
    outer = tvm.transform.PassContext.current()
    return tvm.transform.PassContext(opt_level=outer.opt_level, required_pass=list(outer.required_pass),
                                     disabled_pass=list(outer.disabled_pass), config={**dict(outer.config), **config})


def _mixed_tir_pipeline():
    """TVM lowers a module through one TIR pipeline; the wgmma kernels (tvmfuse.hopper) need the tirx one and
    every scheduled kernel the s_tir one (the kernels marked NO_CSE_ATTR with its CSE switched off), so this runs
    each on its own functions and merges the results. The device passes end with `tag_dependent_launch`."""
    s_pass, host, s_device = tvm.tirx.get_tir_pipeline("s_tir")
    x_pass = tvm.tirx.get_tir_pipeline("tirx")[0]

    @tvm.transform.module_pass(opt_level=0, name="tvmfuse.MixedTIRPipeline")
    def run(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        ours = {gv: f for gv, f in mod.functions.items() if _marked(f, TIRX_ATTR)}
        no_cse = {gv: f for gv, f in mod.functions.items() if gv not in ours and _marked(f, NO_CSE_ATTR)}
        if not ours and not no_cse:
            return s_pass(mod)
        merged = s_pass(tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv not in ours and gv not in no_cse},
                                     attrs=mod.attrs))
        for gv, func in x_pass(tvm.IRModule(ours, attrs=mod.attrs)).functions.items() if ours else ():
            merged[gv] = func
        if no_cse:
            with _current_context_with({"tirx.disable_cse_tir": True}):
                for gv, func in s_pass(tvm.IRModule(no_cse, attrs=mod.attrs)).functions.items():
                    merged[gv] = func
        return merged

    def device() -> tvm.transform.Pass:
        return tvm.transform.Sequential([s_device(), tag_dependent_launch])

    return run, host, device


tvm.tirx.register_tir_pipeline(TIR_PIPELINE, _mixed_tir_pipeline)


#: a kernel whose fastest record gives wrong output tries this many next ones, fastest first, before its default
NEXT_RECORDS = 4
RECORD_US_ATTR = "tvmfuse.record_us"  # on a kernel kept on a record other than its fastest: that record's time


def apply_database(mod: tvm.IRModule, target: tvm.target.Target, database: ms.Database | None,
                   keep_default=(), check: Callable | None = None,
                   say: Callable[[str], None] | None = None) -> tvm.IRModule:
    """Schedule each kernel that has a record, except those in `keep_default` (their default schedule
    measured faster); the module must be exactly the one that was tuned. With `check` (the verify stage's
    `schedule_check`: `check(kernel, tuned, generic)` -> None or why it is wrong), a kernel whose replayed record
    gives wrong output takes the fastest of its next NEXT_RECORDS records that is right (`say` gets a warning line,
    the kernel RECORD_US_ATTR), else keeps its default schedule, with a warning and a line in the manifest's
    failures."""
    if database is None:
        return mod
    tuned = mod.clone()
    for gv, func in mod.functions.items():  # kernel by kernel: a record whose trace no longer applies is skipped
        if isinstance(func, tirx.PrimFunc) and not _marked(func, TIRX_ATTR) and gv.name_hint not in keep_default:
            try:
                tuned[gv] = replay_record(gv, func, target, database)
            except Exception as err:  # noqa: BLE001  (one stale record must not fail the build)
                record_failure(gv.name_hint, REPLAY, err)
                continue
            replayed = check is not None and _is_scheduled(tuned[gv]) and not _is_scheduled(func)
            why = check(gv.name_hint, tuned[gv], func) if replayed else None
            if why:
                right = next_right_record(gv, func, target, database, check, why)
                if right is None:
                    record_failure(gv.name_hint, OUTPUT_CHECK, why)
                    tuned[gv] = func
                    continue
                tuned[gv], rank, us = right
                if say is not None:
                    say(f"warning: kernel {gv.name_hint}: its fastest record failed its output check ({why}); "
                        f"record {rank} by time ({us:.1f} us) is right and kept")
    for name in keep_default:
        tuned[name] = mod[name]
    for gv, func in mod.functions.items():  # TIRx kernels are never scheduled from records
        if _marked(func, TIRX_ATTR):
            tuned[gv] = func
    return tuned


def next_right_record(gv, func: tirx.PrimFunc, target: tvm.target.Target, database: ms.Database,
                      check: Callable, why: str) -> tuple[tirx.PrimFunc, int, float] | None:
    """(`func` scheduled by it, its rank by time from 2, its µs) for the first of the kernel's next NEXT_RECORDS
    records whose replay `check` finds right; None if none is. Each record found wrong (the fastest, for `why`)
    is rejected in a database that keeps such marks (`records.TuningDatabase.reject`), so no later build tries it."""
    key = _normalize_mod(func)
    if not database.has_workload(key):
        return None
    fastest, *rest = database.get_top_k(database.commit_workload(key), NEXT_RECORDS + 1) or [None]
    reject = getattr(database, "reject", lambda record, reason: None)
    if fastest is not None:
        reject(fastest, why)
    for rank, rec in enumerate(rest, start=2):
        one = ms.database.MemoryDatabase()  # this record alone, replayed the way the fastest was
        one.commit_tuning_record(ms.database.TuningRecord(rec.trace, one.commit_workload(key), rec.run_secs,
                                                          rec.target, rec.args_info))
        try:
            candidate = replay_record(gv, func, target, one)
        except Exception:  # noqa: BLE001  (a record that does not replay is no candidate)
            continue
        if not _is_scheduled(candidate):
            continue
        wrong = check(gv.name_hint, candidate, func)
        if wrong is None:
            us = sum(float(t) for t in rec.run_secs) / len(rec.run_secs) * 1e6
            return candidate.with_attr(RECORD_US_ATTR, us), rank, us
        reject(rec, wrong)
    return None


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    """Whether `func` carries a schedule (a replayed record marks it `tirx.is_scheduled`)."""
    return bool(func.attrs) and bool(func.attrs.get("tirx.is_scheduled", False))


def replay_record(gv, func: tirx.PrimFunc, target: tvm.target.Target, database: ms.Database) -> tirx.PrimFunc:
    """`func` scheduled by its best record in `database` (MetaScheduleApplyDatabase on it alone), else `func`."""
    if target.kind.name == "cuda":  # a CUDA record's trace may tensorize with any of them
        register_tensor_intrinsics()
    with target, database:
        one = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(tvm.IRModule({gv: func}))
    return one[gv.name_hint]


def schedule_kinds(mod: tvm.IRModule, target: tvm.target.Target | None = None) -> dict[str, str]:
    """Which kernels carry a tuned schedule (after `apply_database`) and which do not; with `target`, the
    untuned ones that get tvmfuse's row-reduction default say so (baseline.ROW_DEFAULT)."""
    return {gv.name_hint: tirx_kind(str(fn.attrs[TIRX_ATTR])) if _marked(fn, TIRX_ATTR)
            else TUNED if fn.attrs and fn.attrs.get("tirx.is_scheduled", False)
            else default_kind(fn, target) if target is not None else DEFAULT
            for gv, fn in mod.functions.items() if isinstance(fn, tirx.PrimFunc)}


def compile_module(mod: tvm.IRModule, target: tvm.target.Target, cuda_graph: bool = False):
    """Lower the already-fused, scheduled module to a VM executable (no re-fusion: records stay valid).

    `cuda_graph` (CUDA targets only): TVM's `RewriteCUDAGraph` (in the CUDA finalize passes, switched on by the
    pass config `relax.backend.use_cuda_graph`) lifts each run of kernel launches on statically planned memory
    into a function the VM captures as a CUDA graph on the first call and replays afterwards
    (`vm.builtin.cuda_graph.run_or_capture`). Launches that read `main`'s inputs stay outside the graphs.
    """
    cuda = target.kind.name == "cuda"
    backend = relax.backend.cuda.pipeline if cuda else relax.backend.cpu_generic.pipeline
    # TVM's RewriteDataflowReshape raises on some symbolic kernels (fuse.views): the guarded one keeps them launches
    passes = [order_launches] + [rewrite_dataflow_reshape if p.info.name == "RewriteDataflowReshape" else p
                                 for p in backend.dataflow_lower_passes(target) + backend.finalize_passes(target)]
    pipeline = tvm.transform.Sequential(passes)
    # CUDA: cp.async for the software-pipelined shared-memory copies, as the tuning builds (tvmfuse.builder) have
    # them: without it the tensor-core GEMM's 3-deep ring ran as plain loads and stores, and the kernel that was
    # 1.2x faster than dlight's alone made the Llama prefill slower (bench/results/models_run7.json)
    config = {"tirx.use_async_copy": True} if cuda else {}
    if cuda_graph and cuda:
        config["relax.backend.use_cuda_graph"] = True
    # `with target`: TVM's CUDA compile callback takes the arch from Target.current() and otherwise asks the GPU,
    # so a process that sees no GPU (a build worker) failed with "No CUDA architecture was specified".
    with target, _current_context_with(config):
        try:
            return tvm.compile(mod, target=target, relax_pipeline=pipeline, tir_pipeline=TIR_PIPELINE)
        except Exception as err:  # noqa: BLE001  (re-raised with the compiler's errors first)
            summary = compiler_errors(str(err))
            if summary is None:
                raise
            raise RuntimeError(f"CUDA compilation failed: {summary}") from err


_NVCC_ERROR = re.compile(r"^\S*\((\d+)\): (?:catastrophic )?error\b")
_KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\(\s*\d+\s*(?:,\s*\d+\s*)*\)\s+)?(\w+)\s*\(")


def compiler_errors(output: str, context: int = 2, most: int = 10) -> str | None:
    """nvcc's errors out of a failed CUDA compile's message, each named by the kernel its line is in and followed
    by `context` lines (nvcc's copy of the source line and the caret), the first `most` of them. TVM's message is
    the whole generated source, then "Compilation error:" and nvcc's output, where the errors stand among hundreds
    of warnings on generated code, so a failed build's log otherwise ends in warnings. None: no nvcc error in it."""
    source, sep, log = output.partition("\nCompilation error:\n")
    if not sep:
        source, log = "", output
    lines, code = log.splitlines(), source.splitlines()
    found = [(i, int(m.group(1))) for i, m in ((i, _NVCC_ERROR.match(line.strip())) for i, line in enumerate(lines))
             if m]
    if not found:
        return None
    shown = []
    for i, line_no in found[:most]:
        # where the line is in the source the message carries (the error's text may stand before it: the line
        # that nvcc quotes, nearest to its number)
        quoted = lines[i + 1].strip() if i + 1 < len(lines) else ""
        same = [j for j, text in enumerate(code) if quoted and text.strip() == quoted]
        at = min(same, key=lambda j: abs(j - (line_no - 1))) if same else line_no - 1
        kernel = next((m.group(1) for text in reversed(code[:at + 1]) for m in [_KERNEL.search(text)] if m), None)
        where = f"in kernel {kernel}: " if kernel else ""
        shown.append(where + "\n".join(text.rstrip() for text in lines[i:i + 1 + context]))
    more = f"\n(and {len(found) - most} more)" if len(found) > most else ""
    return f"{len(found)} error(s) from nvcc:\n" + "\n".join(shown) + more


RUN_OR_CAPTURE = "vm.builtin.cuda_graph.run_or_capture"
_CALL = re.compile(r"^\s*call\s+(\S+)\s+in:\s*(.*?)\s+dst:")


def cuda_graph_captures(vm_text: str, kernels: set[str]) -> dict[str, dict[str, int]]:
    """What TVM's RewriteCUDAGraph lifted into CUDA graphs, per VM function of an executable's text (`as_text()`)
    that is not itself a lifted one: `graphs` (its run_or_capture calls), `kernels_in_graphs` (the launches they
    replay), `kernels_outside` (the launches the VM makes one by one) and `keyed` (graphs recaptured for each value
    of the symbolic vars passed as their key), and `outside` ({kernel: launches} of those one by one: what keeps a
    decode step out of its graphs); `kernels` are the module's PrimFunc names."""
    bodies: dict[str, list[tuple[str, list[str]]]] = {}
    name = None
    for line in vm_text.splitlines():
        if line.startswith("@"):
            name = line[1:-1] if line.endswith(":") else None
            if name is not None:
                bodies[name] = []
        elif name is not None and (call := _CALL.match(line)):
            bodies[name].append((call.group(1), [a.strip() for a in call.group(2).split(",")]))
    lifted: dict[str, list[tuple[str, bool]]] = {  # function -> its (graph function, keyed by a shape) calls
        fn: [(args[1][2:-1], len(args) > 4) for callee, args in calls if callee == RUN_OR_CAPTURE]
        for fn, calls in bodies.items()}
    graph_functions = {g for calls in lifted.values() for g, _ in calls}

    # {kernel: launches} of each function, in order of first launch
    launches = {fn: Counter(callee for callee, _ in calls if callee in kernels) for fn, calls in bodies.items()}
    return {fn: {"graphs": len(lifted[fn]),
                 "kernels_in_graphs": sum(launches.get(g, Counter()).total() for g, _ in lifted[fn]),
                 "kernels_outside": launches[fn].total(), "keyed": sum(keyed for _, keyed in lifted[fn]),
                 "outside": dict(launches[fn])}
            for fn in bodies if fn not in graph_functions and fn != "cuda_graph_alloc"}


def build(mod: tvm.IRModule, target: tvm.target.Target, database: ms.Database | None = None):
    """Apply the database, then defaults; returns (executable, {kernel: "tuned" | "default" | baseline.ROW_DEFAULT})."""
    tuned = apply_database(mod, target, database)
    kinds = schedule_kinds(tuned, target)
    return compile_module(apply_default_schedules(tuned, target), target), kinds
