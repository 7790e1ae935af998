"""Build stage: apply tuning records, give every other kernel a default schedule, compile for the target."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir import meta_schedule as ms

from .baseline import default_rules
from .errors import TvmfuseError

TUNED, DEFAULT = "tuned", "default"


def apply_database(mod: tvm.IRModule, target: tvm.target.Target, database: ms.Database | None,
                   keep_default=()) -> tvm.IRModule:
    """Schedule each kernel that has a record, except those in `keep_default` (their default schedule
    measured faster); the module must be exactly the one that was tuned."""
    if database is None:
        return mod
    with target, database:
        tuned = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
    for name in keep_default:
        tuned[name] = mod[name]
    return tuned


def apply_default_schedules(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """Give every kernel without a schedule TVM's default one (dlight), kernel by kernel, on a copy.

    dlight's rules are tried in order; a rule that cannot handle a fused kernel (they raise on some
    multi-output reductions) is skipped. On CPUs an unscheduled kernel is still valid code; on GPUs
    dlight's Fallback must succeed, else the kernel could not run and we say which one.
    """
    gpu = "gpu" in target.keys
    # the same rules the baseline measured (tvmfuse.baseline), so a kept default is the one built here
    rule_sets = [default_rules(target), [dl.gpu.Fallback()]] if gpu else [default_rules(target)]
    out = mod.clone()  # ApplyDefaultSchedule mutates its input (notes pitfall 12)
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or (func.attrs and func.attrs.get("tirx.is_scheduled", False)):
            continue
        for rules in rule_sets:
            try:
                with target:
                    scheduled = dl.ApplyDefaultSchedule(*rules)(tvm.IRModule({gv: func}))
                out[gv] = scheduled[gv]
                break
            except Exception as err:  # pylint: disable=broad-except  (dlight raises many kinds)
                last = err
        else:
            if gpu:
                raise TvmfuseError(f"kernel {gv.name_hint}: no default GPU schedule applies "
                                   f"({type(last).__name__}: {str(last).strip().splitlines()[-1]})")
    return out


def schedule_kinds(mod: tvm.IRModule) -> dict[str, str]:
    """Which kernels carry a tuned schedule (after `apply_database`) and which do not."""
    return {gv.name_hint: TUNED if fn.attrs and fn.attrs.get("tirx.is_scheduled", False) else DEFAULT
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
    passes = backend.dataflow_lower_passes(target) + backend.finalize_passes(target)
    pipeline = tvm.transform.Sequential(passes)
    # `with target`: TVM's CUDA compile callback takes the arch from Target.current() and otherwise asks the GPU,
    # so a process that sees no GPU (a build worker) failed with "No CUDA architecture was specified".
    if not (cuda_graph and cuda):
        with target:
            return tvm.compile(mod, target=target, relax_pipeline=pipeline)
    outer = tvm.transform.PassContext.current()  # keep the caller's settings, add the one option
    with target, tvm.transform.PassContext(opt_level=outer.opt_level, required_pass=list(outer.required_pass),
                                           disabled_pass=list(outer.disabled_pass),
                                           config={**dict(outer.config), "relax.backend.use_cuda_graph": True}):
        return tvm.compile(mod, target=target, relax_pipeline=pipeline)


def build(mod: tvm.IRModule, target: tvm.target.Target, database: ms.Database | None = None):
    """Apply the database, then defaults; returns (executable, {kernel: "tuned" | "default"})."""
    tuned = apply_database(mod, target, database)
    kinds = schedule_kinds(tuned)
    return compile_module(apply_default_schedules(tuned, target), target), kinds
