"""Design space for GEMM with an elementwise epilogue on tensor cores: MetaSchedule's tensor-core multi-level tiling with mma.sync + ldmatrix intrinsics, shared-memory staging by cp.async and software pipelining."""

from __future__ import annotations

from tvm.s_tir import meta_schedule as ms


def space():
    """PostOrderApply over the tensor-core rules (mma intrinsics, async pipelined shared-memory copies)."""
    import tvm.s_tir.tensor_intrin  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel

    rules = ms.ScheduleRule.create("cuda-tensorcore")
    return ms.space_generator.PostOrderApply(
        sch_rules=rules, postprocs="cuda-tensorcore", mutator_probs="cuda-tensorcore"
    )
