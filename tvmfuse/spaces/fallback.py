"""The design space for kernels whose default MetaSchedule space raises.

MultiLevelTiling's write reuse fuses a tiled block's consumers into it (reverse_compute_at). For the attention kernel
that stores its output through the head-merge transpose ([B, H, S, D] -> [B, S, H, D]) the default llvm space
raised `ScheduleError ... 'reverse-compute-at'` ("requires all the producer(s) of the given block to be present
under the target loop"): the transpose's producer is the second matmul, whose tiling loop nest does not cover it.
This space is the target's default one with MultiLevelTiling's write reuse off (the consumers keep their own loop
nests); the rest of the rules (inlining, rfactor, parallelize/vectorize/unroll, compute locations) are unchanged.
"""

from __future__ import annotations

import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.schedule_rule import MultiLevelTiling, ReuseType


def _tiling(kind: str) -> MultiLevelTiling:
    """TVM's default MultiLevelTiling of `kind` ('llvm' / 'cuda', as DefaultLLVM / DefaultCUDA), no write reuse."""
    no_write = ReuseType(req="no", levels=[], scope="global")
    if kind == "cuda":
        return MultiLevelTiling(structure="SSSRRSRS", tile_binds=["blockIdx.x", "vthread.x", "threadIdx.x"],
                                max_innermost_factor=64, vector_load_lens=[1, 2, 3, 4, 8, 16],
                                reuse_read=ReuseType(req="must", levels=[4], scope="shared"), reuse_write=no_write)
    return MultiLevelTiling(structure="SSRSRS", max_innermost_factor=64, reuse_write=no_write)


def no_write_reuse_space(target: tvm.target.Target) -> ms.space_generator.SpaceGenerator:
    """PostOrderApply with the target's default rules, MultiLevelTiling's write reuse off."""
    kind = "cuda" if target.kind.name == "cuda" else "llvm"
    rules = [_tiling(kind) if type(r).__name__ == "MultiLevelTiling" else r for r in ms.ScheduleRule.create(kind)]
    return ms.space_generator.PostOrderApply(sch_rules=rules, postprocs=kind, mutator_probs=kind)
