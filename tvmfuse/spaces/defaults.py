"""Default schedules: the rules every kernel without a tuned record is scheduled by (dlight's, and tvmfuse's own
on CUDA before them or before dlight's Fallback), tried in table order."""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl

from tvmfuse.errors import TvmfuseError
from tvmfuse.isolation import DEFAULT_SCHEDULE
from tvmfuse.isolation import record as record_failure
from tvmfuse.spaces import elementwise, rowreduce, smallm, tcgemm
from tvmfuse.spaces.intrinsics import wmma_operands
from tvmfuse.spaces.table import classify
from tvmfuse.targets import BF16_MIN_ARCH, cuda_arch_number


ROW_DEFAULT = "default (tvmfuse row-reduction)"


class RowReductionDefault(dl.ScheduleRule):
    """tvmfuse's row-reduction schedule (tvmfuse.spaces.rowreduce) with fixed knobs, for the CUDA row reductions
    dlight's reduction rules give up on (multi-output fused norms: h = x + r; y = norm(h)), before its Fallback."""

    def apply(self, func, target, _tunable):  # pylint: disable=missing-function-docstring
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda" or classify(func) != "row":
            return None
        return rowreduce.default_schedule(func)


class VectorizedInjective(dl.ScheduleRule):
    """tvmfuse's injective schedule (tvmfuse.spaces.elementwise): 16-byte vector accesses where dlight's Fallback
    moves one element per thread (KV-cache concatenations, transposes, elementwise chains)."""

    def apply(self, func, target, _tunable):  # pylint: disable=missing-function-docstring
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
            return None
        return elementwise.default_schedule(func)


class VectorizedRows(dl.ScheduleRule):
    """tvmfuse's schedule for injective kernels of symbolic rows over a static row (tvmfuse.spaces.elementwise.
    schedule_rows: the KV-cache writes), 16-byte vectors where dlight's Fallback moves one element per thread."""

    def apply(self, func, target, _tunable):  # pylint: disable=missing-function-docstring
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
            return None
        return elementwise.rows_schedule(func)


class UnsplitInjective(dl.ScheduleRule):
    """tvmfuse's last resort for injective kernels (tvmfuse.spaces.elementwise.schedule_unsplit): no fused loop
    split, for those whose symbolic sizes make dlight's Fallback raise (so that no kernel is left without a
    schedule)."""

    def apply(self, func, target, _tunable):  # pylint: disable=missing-function-docstring
        if not isinstance(func, tirx.PrimFunc):
            return None
        return elementwise.unsplit_schedule(func)


class SmallBatchMatmul(dl.ScheduleRule):
    """tvmfuse's small-M matmul schedule (tvmfuse.spaces.smallm) for M of 2..32 rows over a [N, K] weight, where
    dlight's GEMV (M = 1 only) and Matmul (CUDA-core 32x64 tiles below M = 64) leave most of the GPU idle."""

    def apply(self, func, target, _tunable):  # pylint: disable=missing-function-docstring
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
            return None
        return smallm.default_schedule(func)


class TensorCoreGemm(dl.ScheduleRule):
    """tvmfuse's tensor-core GEMM schedule (tvmfuse.spaces.tcgemm) with its measured default tile, for fp16 and bf16
    matmuls (fp32 accumulation) read K-innermost whose sizes the 128x128x64 tile divides; dlight's Matmul (padding)
    takes the others (on CUDA cores for bf16: dlight has tensor-core rules for fp16 and int8 only)."""

    def apply(self, func, target, _tunable):  # pylint: disable=missing-function-docstring
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
            return None
        return tcgemm.default_schedule(func)


class TensorCoreMatmul(dl.ScheduleRule):
    """dlight's Matmul with its tensor-core path reachable on sm_90a: dlight checks `arch` with str.isdigit, so
    "sm_90a" (the nvidia/nvidia-h100 tag) reads as no tensor cores and every GEMM ran on CUDA cores (no HMMA in the
    SASS, bench/results/sass_mix.json). The rule sees the arch without its suffix; the build keeps the real target."""

    def apply(self, func, target, tunable):  # pylint: disable=missing-function-docstring
        arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else ""
        if arch[:3] == "sm_" and arch[3:-1].isdigit() and arch[-1].isalpha():
            spec = target.export()
            target = tvm.target.Target({**{str(k): v for k, v in spec.items()}, "arch": arch[:-1]})
        with target:
            if isinstance(func, tirx.PrimFunc) and bf16_tensor_cores(func, target):
                with wmma_operands("bfloat16"):  # dlight's padded wmma GEMM with bf16 fragments
                    space = dl.gpu.matmul.MatmulTensorization().apply(func, target, tunable)
                if space is not None:
                    return space
            return dl.gpu.Matmul().apply(func, target, tunable)


def bf16_tensor_cores(func: tirx.PrimFunc, target: tvm.target.Target) -> bool:
    """Whether dlight's padded wmma GEMM should take `func` with bf16 fragments: one bf16 x bf16 -> fp32 matmul
    of M, N, K all above 64 (dlight's own threshold for tensor cores) on sm_80+. dlight's Matmul tensorizes fp16
    and int8 only and would run it on CUDA cores (GPT-2's 768 x 50257 LM head, which tcgemm's tile does not
    divide)."""
    number = cuda_arch_number(target)
    if number is None or number < BF16_MIN_ARCH:
        return False
    try:
        sch = s_tir.Schedule(func)
        from tvm.s_tir.dlight.analysis import get_root_block  # pylint: disable=import-outside-toplevel
        from tvm.s_tir.dlight.gpu.matmul import get_reduction_blocks  # pylint: disable=import-outside-toplevel

        blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if not blocks or len(blocks) != 1:
            return False
        stmt = sch.get(blocks[0])
        extents = [iv.dom.extent for iv in stmt.iter_vars]
    except Exception:  # noqa: BLE001  (not a matmul dlight's analysis reads)
        return False
    if tcgemm.operand_dtype(stmt) != "bfloat16" or len(extents) < 3:
        return False
    return all(not isinstance(e, tirx.IntImm) or int(e) > 64 for e in extents[-3:])


class AlignedCPUReduction(dl.cpu.Reduction):
    """dlight's CPU Reduction, except for a kernel whose last block reads an earlier block's result with its leading
    spatial axes in another order (a fused kernel ending in a transpose: the attention kernel's head merge).

    dlight's rule parallelizes the last block's leading axes and computes every earlier block at that loop, which
    assumes all blocks share those axes. Through a transpose they do not: with symbolic dims the producers' regions
    became min/max expressions over whole rows (each output row recomputed them) and LLVM took ~10 minutes on the
    one kernel (the tiny Llama export's attention at symbolic batch and seq). Such kernels with symbolic extents stay
    unscheduled, as kernels no CPU rule takes do (unscheduled, the same kernel builds in ~1 s)."""

    def apply(self, func, target, tunable):  # pylint: disable=missing-function-docstring
        space = super().apply(func, target, tunable)
        return None if space is not None and _last_block_transposes(func) else space


def _last_block_transposes(func: tirx.PrimFunc) -> bool:
    """Whether `func` has symbolic extents and its last block reads a buffer made inside `func` with one of its
    leading spatial iteration variables at another leading position (the order dlight's CPU Reduction fuses and
    computes the other blocks at)."""
    from tvm.s_tir.dlight.analysis import normalize_prim_func  # pylint: disable=import-outside-toplevel

    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if not infos or all(isinstance(it.dom, (int, tirx.IntImm)) for bi in infos for it in bi.iters):
        return False  # static shapes: the regions stay exact (the Llama attention at seq 64 builds in 0.15 s)
    leading = min(len(k) - len(k.lstrip("S")) for k in (bi.dom_kind() for bi in infos))
    made = [w.source for bi in infos[:-1] for w in sch.get(bi.block_rv).writes]
    axes = [it.var for it in infos[-1].iters[:leading]]
    for read in sch.get(infos[-1].block_rv).reads:
        if not any(read.source.same_as(b) for b in made):
            continue
        starts = [r.min for r in read.region if not isinstance(r.min, tirx.IntImm)]  # unit dims (batch 1) dropped,
        for position, start in enumerate(starts[:leading]):  # as normalize_prim_func drops their iterators
            if any(start.same_as(v) for v in axes) and not start.same_as(axes[position]):
                return True
    return False


#: the default-schedule rules in the order they are tried: (rule, targets: "cuda" / "gpu" (any GPU) / "cpu", builds:
#: "tvmfuse" (tvmfuse's builds only), "stock" (benchmarks' stock TVM only) or "both"). dlight's rules keep the order
#: TVM's own CUDA pipeline tries them; tvmfuse's small-M and tensor-core matmul schedules go first, its row and
#: vectorized injective schedules (static, then symbolic rows of a static row) just before dlight's Fallback, and
#: after it the unsplit one for what Fallback raises on.
DEFAULT_RULES = (
    (SmallBatchMatmul, "cuda", "tvmfuse"),
    (TensorCoreGemm, "cuda", "tvmfuse"),
    (TensorCoreMatmul, "gpu", "tvmfuse"),
    (dl.gpu.Matmul, "gpu", "stock"),
    (dl.gpu.GEMV, "gpu", "both"),
    (dl.gpu.Reduction, "gpu", "both"),
    (dl.gpu.GeneralReduction, "gpu", "both"),
    (RowReductionDefault, "cuda", "tvmfuse"),
    (VectorizedInjective, "cuda", "tvmfuse"),
    (VectorizedRows, "cuda", "tvmfuse"),
    (dl.gpu.Fallback, "gpu", "both"),
    (UnsplitInjective, "gpu", "tvmfuse"),
    (dl.cpu.GEMV, "cpu", "both"),
    (AlignedCPUReduction, "cpu", "tvmfuse"),
    (dl.cpu.Reduction, "cpu", "stock"),
)


def default_rules(target: tvm.target.Target, stock: bool = False) -> list:
    """The DEFAULT_RULES entries for `target` (tvmfuse's builds, or stock TVM's with `stock`), in table order."""
    gpu = "gpu" in target.keys
    where = {"cuda": gpu and target.kind.name == "cuda", "gpu": gpu, "cpu": not gpu}
    builds = ("stock", "both") if stock else ("tvmfuse", "both")
    return [rule() for rule, targets, build in DEFAULT_RULES if where[targets] and build in builds]


def default_rule(func: tirx.PrimFunc, target: tvm.target.Target, stock: bool = False) -> tuple:
    """(the first rule in `default_rules` that schedules `func`, its schedule), or (None, the last rule's error)."""
    last = None
    with target:
        for rule in default_rules(target, stock):
            try:
                space = rule.apply(func, target, False)
            except Exception as err:  # pylint: disable=broad-except  (a rule that cannot handle a fused kernel)
                last = err
                continue
            if isinstance(space, list):
                space = space[0] if space else None
            if space is not None:
                return rule, space
    return None, last


def default_kind(func: tirx.PrimFunc, target: tvm.target.Target) -> str:
    """How the build schedules an untuned kernel: "default" (dlight), or ROW_DEFAULT (CUDA only)."""
    if target.kind.name != "cuda":
        return "default"
    return ROW_DEFAULT if isinstance(default_rule(func, target)[0], RowReductionDefault) else "default"


def default_schedule(func: tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Schedule | None:
    """The first default rule that schedules `func` (its trace replays on the task); CPUs may keep it as is."""
    rule, space = default_rule(func, target)
    if rule is not None:
        return space
    if "gpu" in target.keys:
        return None
    sch = s_tir.Schedule(func)  # CPUs run unscheduled kernels; one no-op instruction makes the trace
    sch.get_sblock("root")  # a record that MetaSchedule's databases return (they skip empty traces)
    return sch


def apply_default_schedules(mod: tvm.IRModule, target: tvm.target.Target, stock: bool = False) -> tvm.IRModule:
    """Give every kernel without a schedule its default one, kernel by kernel, on a copy.

    The rules are the baseline's (tvmfuse.baseline.default_rules: dlight's, and on CUDA tvmfuse's row-reduction
    schedule before dlight's Fallback), tried in order; a rule that cannot handle a fused kernel (dlight's raise on
    some multi-output reductions) is skipped. On CPUs an unscheduled kernel is still valid code; on GPUs some rule
    (at last Fallback) must succeed, else the kernel could not run and we say which one. `stock`: dlight's rules
    only, as stock TVM builds (benchmarks' "TVM default").
    """
    out = mod.clone()  # the input module stays unscheduled (the measured-before build reuses it)
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or (func.attrs and func.attrs.get("tirx.is_scheduled", False)):
            continue
        try:
            rule, got = default_rule(func, target, stock)
        except Exception as err:  # noqa: BLE001  (on CPUs the kernel stays valid unscheduled code)
            if "gpu" in target.keys:
                raise TvmfuseError(f"kernel {gv.name_hint}: no default GPU schedule applies "
                                   f"({str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__})") from None
            record_failure(gv.name_hint, DEFAULT_SCHEDULE, err)
            continue
        if rule is not None:
            out[gv] = got.mod["main"].with_attr("tirx.is_scheduled", True)  # as dlight's ApplyDefaultSchedule
        elif "gpu" in target.keys:
            why = f" ({type(got).__name__}: {str(got).strip().splitlines()[-1]})" if got is not None else ""
            raise TvmfuseError(f"kernel {gv.name_hint}: no default GPU schedule applies{why}")
    return out
