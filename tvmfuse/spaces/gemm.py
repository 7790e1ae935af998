"""Design space for GEMM with an elementwise epilogue on tensor cores: MetaSchedule's tensor-core sketches (wmma with the epilogue fused through static shared memory; mma.sync m16n8k8 with fp32 accumulation, ldmatrix and cp.async software pipelining, whose epilogue runs as a second kernel) with the postprocessors and build config they need."""

from __future__ import annotations

import tvm
from tvm import s_tir
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.postproc import PyPostproc
from tvm.s_tir.meta_schedule.schedule_rule import PyScheduleRule

#: the pass configs a tensor-core candidate needs at build time: cp.async for the pipelined copies
BUILD_CONFIG = {"tirx.use_async_copy": True}


@derived_object
class BindEpilogueAfterMMA(PyScheduleRule):
    """Bind the elementwise epilogue that reads the mma accumulators' write-back as its own kernel of one-warp
    blocks (threadIdx.x = 32, as the mma kernel: TVM unifies each thread tag's extent across a PrimFunc), with
    `vec`-wide vector accesses.

    It stays a separate kernel: in TVM 0.27 the accumulator write-back (`.matrixC` -> global, LowerAutoCopy's
    MmaToGlobal rewrite) accepts no epilogue inlined into it ("Multiple buffer read"), and redirecting it to
    shared memory lowers to a copy that ignores the lane layout (every lane writes the whole warp tile)."""

    def __init__(self, vec: int = 8) -> None:
        super().__init__()
        self.vec = vec

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch, block):
        try:
            producers = sch.get_producers(block)
            if len(producers) != 1 or not sch.get(producers[0]).name_hint.endswith(".matrixC"):
                return [sch]
            trial = sch.copy()
            fused = trial.fuse(*trial.get_loops(block))
            bx, tx, vec = trial.split(fused, [None, 32, self.vec])
            trial.bind(bx, "blockIdx.x")
            trial.bind(tx, "threadIdx.x")
            trial.vectorize(vec)
        except Exception:  # pylint: disable=broad-except
            return [sch]
        return [trial]

    def clone(self):
        return BindEpilogueAfterMMA(self.vec)


#: dynamic shared memory a block may opt into, by compute capability (the CUDA programming guide's table); the
#: H100 target tag says 48 KB (the static limit), which made VerifyGPUCode refuse every deeper staging
DYNAMIC_SMEM = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448}


@derived_object
class VerifyGPUCodeDynamicSmem(PyPostproc):
    """MetaSchedule's VerifyGPUCode with the shared-memory limit a block can opt into on the target's arch (TVM's
    CUDA runtime raises each kernel's dynamic shared memory attribute) instead of the tag's 48 KB."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = None

    def _initialize_with_tune_context(self, context) -> None:
        arch = str(context.target.attrs.get("arch", ""))
        limit = DYNAMIC_SMEM.get(arch.rstrip("a"))
        target = context.target
        if limit is not None:
            spec = {str(k): v for k, v in target.export().items() if str(k) != "host"}
            target = tvm.target.Target({**spec, "max_shared_memory_per_block": limit})
        self.inner = ms.postproc.VerifyGPUCode()
        self.inner._initialize_with_tune_context(ms.TuneContext(target=target))  # pylint: disable=protected-access

    def apply(self, sch) -> bool:
        return self.inner.apply(sch)

    def clone(self):
        return VerifyGPUCodeDynamicSmem()


#: TVM 0.27's s_tir lowering pipeline up to LowerOpaqueBlock (buffers compacted, permuted layouts injected)
LOWER_PASSES = ("CanonicalizeLoop", "LowerCrossThreadReduction", "LowerInitBlock",
                "PlanAndUpdateBufferAllocationLocation", "ConvertBlocksToOpaque", "LiftThreadBinding",
                "ManifestSharedMemoryLocalStage", "CompactBufferAllocation", "LowerAutoCopy", "UnifyThreadBinding",
                "LowerMatchBuffer", "StmtSimplify", "InjectPermutedLayout", "AnnotateIrregularLoop",
                "InjectSoftwarePipeline", "TransformMmaBufferLayout", "LowerOpaqueBlock")


@derived_object
class VerifyBuildable(PyPostproc):
    """Reject the candidates the stock postprocs pass but the build refuses, found by lowering through
    `LOWER_PASSES` (~10 ms a candidate): mma tiles InjectPermutedLayout cannot swizzle (fp16 rows not a multiple of
    32 elements, e.g. a K tile of 16: "Permuted SLayout ... not divisible by 32"), and static shared memory over
    48 KB (the `wmma_rule` write-back tile, where `VerifyGPUCodeDynamicSmem` allows more in all)."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch) -> bool:
        try:
            low = tvm.transform.Sequential([getattr(s_tir.transform, name)() for name in LOWER_PASSES])(sch.mod)
        except Exception:  # noqa: BLE001  (what the build would raise)
            return False
        sizes = s_tir.analysis.calculate_allocated_bytes(low).values()
        return all(int(by_scope.get("shared", 0)) <= 48 * 1024 for by_scope in sizes)

    def clone(self):
        return VerifyBuildable()


def postprocs() -> list:
    """The "cuda-tensorcore" postprocessors and `VerifyBuildable`: the postprocs of a union with these sketches."""
    import tvm.s_tir.tensor_intrin  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel

    return list(ms.Postproc.create("cuda-tensorcore")) + [VerifyBuildable()]


def tensorcore_postprocs() -> list:
    """`postprocs` with `VerifyGPUCodeDynamicSmem` in VerifyGPUCode's place."""
    return [VerifyGPUCodeDynamicSmem() if type(p).__name__ == "VerifyGPUCode" else p for p in postprocs()]


def _tiling(groups, reuse_write, pipeline: bool) -> ms.ScheduleRule:
    """MultiLevelTilingTensorCore as the "cuda-tensorcore" rules configure it."""
    R = ms.schedule_rule
    return R.MultiLevelTilingTensorCore(
        intrin_groups=groups, structure="SSSRRSRS", tile_binds=["blockIdx.y", "blockIdx.x", "threadIdx.y"],
        max_innermost_factor=4, vector_load_lens=[1, 2, 3, 4, 8, 16],
        reuse_read=R.ReuseType(req="must", levels=[4], scope="shared.dyn"), reuse_write=reuse_write,
        use_software_pipeline=pipeline)


def mma_rule() -> ms.ScheduleRule:
    """The stock mma tiling (m16n8k8, cp.async software pipeline) on its own: in the "cuda-tensorcore" list the wmma
    rule tensorizes the matmul first and this rule never sees it, so the stock space has no mma sketch."""
    R = ms.schedule_rule
    mma_f32 = {"init": "mma_init_m16n8k8_f32", "load_a": "mma_load_m16n8k8_f16_A_shared_dyn",
               "load_b": "mma_load_m16n8k8_f16_B_shared_dyn", "compute": "mma_sync_m16n8k8_f16f16f32",
               "store": "mma_store_m16n8k8_f32_global"}
    mma_f16 = {**mma_f32, "init": "mma_init_m16n8k8_f16", "compute": "mma_sync_m16n8k8_f16f16f16",
               "store": "mma_store_m16n8k8_f16_global"}
    return _tiling([mma_f32, mma_f16], R.ReuseType(req="no", levels=[2], scope="shared.dyn"), pipeline=True)


def mma_space():
    """The mma sketch: mma tiling, the stock CUDA rules, the epilogue bound before unrolling and auto-binding
    (without that no candidate with an epilogue builds)."""
    import tvm.s_tir.tensor_intrin  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel

    cuda = list(ms.ScheduleRule.create("cuda"))[1:]  # as the stock tensor-core list: no ApplyCustomRule
    at = [type(r).__name__ for r in cuda].index("ParallelizeVectorizeUnroll")
    rules = [mma_rule()] + cuda[:at] + [BindEpilogueAfterMMA()] + cuda[at:]
    return ms.space_generator.PostOrderApply(sch_rules=rules, postprocs="cuda-tensorcore",
                                             mutator_probs="cuda-tensorcore")


def wmma_rule() -> ms.ScheduleRule:
    """The stock wmma tiling ("cuda-tensorcore"'s first rule, fp16 operands) with the accumulator tile written back
    through static "shared" memory, not "shared.dyn": in TVM 0.27 StorageRewrite may put the fp32 write-back tile
    in a dead fp16 "shared.dyn" operand tile and point store_matrix_sync's tvm_access_ptr(float32) at the fp16
    buffer, which LowerIntrin refuses ("element type must match the source buffer"). Alone in static shared memory
    the tile shares with nothing."""
    groups = [{"init": f"wmma_fill_16x16x16_{acc}", "load_a": "wmma_load_16x16x16_f16_a_shared_dyn",
               "load_b": f"wmma_load_16x16x16_f16_b{tr}_shared_dyn", "compute": f"wmma_sync_16x16x16_f16f16{acc}{tr}",
               "store": f"wmma_store_16x16x16_{acc}_shared"} for acc in ("f32", "f16") for tr in ("", "_trans")]
    return _tiling(groups, ms.schedule_rule.ReuseType(req="must", levels=[2], scope="shared"), pipeline=False)


def wmma_space():
    """The stock "cuda-tensorcore" sketches (wmma, epilogue fused into the write-back) with `wmma_rule`."""
    import tvm.s_tir.tensor_intrin  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel

    rules = list(ms.ScheduleRule.create("cuda-tensorcore"))
    at = [type(r).__name__ for r in rules].index("MultiLevelTilingTensorCore")
    rules[at] = wmma_rule()
    return ms.space_generator.PostOrderApply(sch_rules=rules, postprocs="cuda-tensorcore",
                                             mutator_probs="cuda-tensorcore")


def space():
    """The wmma sketches (`wmma_space`) and the mma sketch; tuning picks."""
    return ms.space_generator.SpaceGeneratorUnion([wmma_space(), mma_space()], sch_rules=[], postprocs=postprocs(),
                                                  mutator_probs="cuda-tensorcore")


def sample_schedule(func, target, seed: int = 1, tiles=None, verify: bool = True, space_gen=None):
    """One schedule of the mma sketch for `func` (IRModule, or None if a postproc rejects it): replayed with random
    decisions, or with the tile decisions `tiles` ([m factors], [n factors], [k factors]) where given."""
    from tvm.s_tir.schedule import Trace  # pylint: disable=import-outside-toplevel

    mod = tvm.IRModule({"main": func})
    ctx = ms.TuneContext(mod=mod, target=target, space_generator=space_gen or mma_space(),
                         search_strategy="replay-trace")
    sketches = [s for s in ctx.generate_design_space() if "mma_sync_m16n8k8" in str(s.trace)]
    if not sketches:
        return None
    trace = sketches[0].trace
    decisions = {}
    if tiles is not None:
        insts = [i for i in trace.insts if i.kind.name in ("SamplePartitionedTile", "SamplePerfectTile")]
        decisions = dict(zip(insts, tiles))
    sch = tvm.s_tir.Schedule(mod, seed=seed)
    Trace(trace.insts, decisions).apply_to_schedule(sch, remove_postproc=True)
    for post in postprocs():
        post._initialize_with_tune_context(ctx)  # pylint: disable=protected-access
        if not verify and type(post).__name__ == "VerifyGPUCode":
            continue
        if not post.apply(sch):
            return None
    return sch.mod

