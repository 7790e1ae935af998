"""Which MetaSchedule design space tunes a fused kernel: its family (row reduction, GEMV, GEMM) read off the
PrimFunc, then that family's spaces."""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir import meta_schedule as ms

from tvmfuse.spaces import gemm, gemv, rowreduce, smallm, tcgemm


def _is_gpu(target: tvm.target.Target) -> bool:
    return "gpu" in target.keys


def classify(func: tirx.PrimFunc) -> str | None:
    """'row' (row reduction + epilogue), 'gemv' (matmul, small M), 'gemm' (fp16 or bf16 matmul on tensor cores)
    or None."""
    info = gemv.matmul_shape(func)
    if info is not None:
        m, _n, _k, dtype = info
        if m <= gemv.MAX_M:
            return "gemv"
        if dtype in ("float16", "bfloat16"):
            return "gemm"
        return None
    if rowreduce.is_row_reduction(func):
        return "row"
    return None


def space_for(func: tirx.PrimFunc, target: tvm.target.Target) -> ms.space_generator.SpaceGenerator | None:
    """The design space to tune `func` with on `target`; None means MetaSchedule's default space."""
    if not _is_gpu(target) or target.kind.name != "cuda":
        return None
    kind = classify(func)
    if kind == "row":
        return ms.space_generator.ScheduleFn(rowreduce.space_fn, sch_rules=[], postprocs="cuda", mutator_probs="cuda")
    if kind == "gemv":
        spaces = [ms.space_generator.ScheduleFn(gemv.space_fn, sch_rules=[], postprocs="cuda", mutator_probs="cuda")]
        if smallm.applies(func):  # the small-M default's knobs, sampled
            spaces.append(ms.space_generator.ScheduleFn(smallm.space_fn, sch_rules=[], postprocs="cuda",
                                                        mutator_probs="cuda"))
        m, _n, _k, dtype = gemv.matmul_shape(func)
        tensor_cores = dtype == "float16" and m % 32 == 0  # the mma tiling loads A in 32-row ldmatrix tiles
        if tensor_cores:
            spaces.append(gemm.space())
        if len(spaces) == 1:
            return spaces[0]
        kind = "cuda-tensorcore" if tensor_cores else "cuda"  # tuning picks among the sketches
        posts = gemm.postprocs() if tensor_cores else kind  # a union's postprocs are the ones tuning applies
        return ms.space_generator.SpaceGeneratorUnion(spaces, sch_rules=[], postprocs=posts, mutator_probs=kind)
    if kind == "gemm":
        if gemv.matmul_shape(func)[3] != "float16":  # bf16: MetaSchedule's sketches have fp16/int8 intrinsics only
            return (ms.space_generator.ScheduleFn(tcgemm.space_fn, sch_rules=[], postprocs=gemm.tensorcore_postprocs(),
                                                  mutator_probs="cuda-tensorcore") if tcgemm.applies(func) else None)
        if not tcgemm.applies(func):
            return gemm.space()
        tiles = ms.space_generator.ScheduleFn(tcgemm.space_fn, sch_rules=[], postprocs=gemm.tensorcore_postprocs(),
                                              mutator_probs="cuda-tensorcore")  # the measured tile sets
        return ms.space_generator.SpaceGeneratorUnion([tiles, gemm.space()], sch_rules=[],
                                                      postprocs=gemm.tensorcore_postprocs(),
                                                      mutator_probs="cuda-tensorcore")
    return None
