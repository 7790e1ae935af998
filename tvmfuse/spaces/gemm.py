"""Design space for GEMM with an elementwise epilogue on tensor cores: mma.sync (m16n8k8, fp32 accumulation) fed by ldmatrix from shared memory that cp.async fills in a software pipeline, with the epilogue computed from the accumulator registers in the same kernel."""

from __future__ import annotations

from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.schedule_rule import PyScheduleRule
from tvm.ir.utils import derived_object

#: the pass configs a tensor-core candidate needs at build time: cp.async for the pipelined copies
BUILD_CONFIG = {"tirx.use_async_copy": True}

#: fp16 x fp16 -> fp32 on mma.sync m16n8k8 (the only mma group MetaSchedule's tiling rule drives)
MMA_F32 = {"init": "mma_init_m16n8k8_f32", "load_a": "mma_load_m16n8k8_f16_A_shared_dyn",
           "load_b": "mma_load_m16n8k8_f16_B_shared_dyn", "compute": "mma_sync_m16n8k8_f16f16f32",
           "store": "mma_store_m16n8k8_f32_global"}
MMA_F16 = {**MMA_F32, "init": "mma_init_m16n8k8_f16", "compute": "mma_sync_m16n8k8_f16f16f16",
           "store": "mma_store_m16n8k8_f16_global"}


@derived_object
class InlineEpilogueIntoMMAStore(PyScheduleRule):
    """Reverse-inline an elementwise epilogue into the block that writes the mma accumulator out, so the
    epilogue runs on the registers (one kernel) instead of re-reading an fp32 intermediate from global memory."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch, block):
        try:
            producers = sch.get_producers(block)
        except Exception:  # pylint: disable=broad-except
            return [sch]
        if len(producers) != 1 or not sch.get(producers[0]).name_hint.endswith(".matrixC"):
            return [sch]
        trial = sch.copy()
        try:  # the accumulator goes to shared memory per warp; the warp's threads apply the epilogue vectorized
            wb = producers[0]
            warp_loop = trial.get_loops(wb)[-1]
            trial.set_scope(wb, 0, "shared.dyn")
            trial.reverse_compute_at(block, warp_loop, preserve_unit_loops=True)
            inner = trial.get_loops(block)[len(trial.get_loops(wb)):]
            fused = trial.fuse(*inner)
            _, tx, vec = trial.split(fused, [None, 32, 4])
            trial.bind(tx, "threadIdx.x")
            trial.vectorize(vec)
        except Exception:  # pylint: disable=broad-except
            return [sch]
        return [trial]

    def clone(self):
        return InlineEpilogueIntoMMAStore()


def mma_rule(groups=(MMA_F32, MMA_F16)) -> ms.ScheduleRule:
    """MultiLevelTilingTensorCore over the mma groups with software pipelining (cp.async stages) on."""
    R = ms.schedule_rule
    return R.MultiLevelTilingTensorCore(
        intrin_groups=list(groups), structure="SSSRRSRS", tile_binds=["blockIdx.y", "blockIdx.x", "threadIdx.y"],
        max_innermost_factor=4, vector_load_lens=[1, 2, 3, 4, 8, 16],
        reuse_read=R.ReuseType(req="must", levels=[4], scope="shared.dyn"),
        reuse_write=R.ReuseType(req="no", levels=[2], scope="shared.dyn"), use_software_pipeline=True)


def rules() -> list:
    """mma tiling, then the stock CUDA rules with the epilogue inlined before unrolling and binding."""
    import tvm.s_tir.tensor_intrin  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel

    cuda = list(ms.ScheduleRule.create("cuda"))[1:]  # as the stock "cuda-tensorcore" list: no ApplyCustomRule
    names = [type(r).__name__ for r in cuda]
    at = names.index("ParallelizeVectorizeUnroll")
    return [mma_rule()] + cuda[:at] + [InlineEpilogueIntoMMAStore()] + cuda[at:]


def space():
    """PostOrderApply over the mma rules, tensor-core postprocs and mutators."""
    return ms.space_generator.PostOrderApply(sch_rules=rules(), postprocs="cuda-tensorcore",
                                             mutator_probs="cuda-tensorcore")


def sample_schedule(func, target, seed: int = 1, tiles=None, verify: bool = True, space_gen=None):
    """One schedule of this space for `func` (IRModule or None if a postproc rejects it): the sketch replayed with
    random decisions, or with the tile decisions `tiles` ([m factors], [n factors], [k factors]) where given."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm.s_tir.schedule import Trace  # pylint: disable=import-outside-toplevel

    mod = tvm.IRModule({"main": func})
    ctx = ms.TuneContext(mod=mod, target=target, space_generator=space_gen or space(), search_strategy="replay-trace")
    sketches = [s for s in ctx.generate_design_space() if "mma_sync" in str(s.trace)]
    if not sketches:
        return None
    trace = sketches[0].trace
    decisions = {}
    if tiles is not None:
        insts = [i for i in trace.insts if i.kind.name in ("SamplePartitionedTile", "SamplePerfectTile")]
        decisions = dict(zip(insts, tiles))
    sch = tvm.s_tir.Schedule(mod, seed=seed)
    Trace(trace.insts, decisions).apply_to_schedule(sch, remove_postproc=True)
    for post in ms.Postproc.create("cuda-tensorcore"):
        post._initialize_with_tune_context(ctx)  # pylint: disable=protected-access
        if not verify and type(post).__name__ == "VerifyGPUCode":
            continue
        if not post.apply(sch):
            return None
    return sch.mod

