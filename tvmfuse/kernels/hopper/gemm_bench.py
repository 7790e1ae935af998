"""The benchmark GEMMs of bench/wgmma.py: A [m, k] @ B [n, k]^T (+ bias, + GELU) through the TIRx GEMM kernels."""

from __future__ import annotations

import tvm
from tvm import tirx

from tvmfuse.kernels.hopper.wgmma_gemm import wgmma_kernel
from tvmfuse.kernels.hopper.wgmma_tile import WgmmaTile

#: epilogues the benchmark kernel applies to each fp32 accumulator before the fp16/bf16 store
EPILOGUES = ("none", "bias", "bias_gelu")


def bench_operands(m: int, n: int, k: int, epilogue: str, dtype: str = "float16"):
    """The benchmark kernels' parameters (A [m, k], B [n, k], bias [n], C [m, n], all `dtype`) and their epilogue
    `finish(acc, row, col)`: none, + bias, or + bias then GELU (erf)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r} is not one of {EPILOGUES}")
    names, shapes = ("a", "b", "bias", "c"), ((m, k), (n, k), (n,), (m, n))
    bufs = [tirx.decl_buffer(shp, dtype, nm, data_alignment=16) for nm, shp in zip(names, shapes)]
    half, one, rsqrt2 = (tirx.const(v, "float32") for v in (0.5, 1.0, 0.7071067811865476))

    def finish(acc, row, col):
        v = acc if epilogue == "none" else acc + tirx.Cast("float32", bufs[2][col])
        if epilogue == "bias_gelu":
            v = v * half * (one + tirx.erf(v * rsqrt2))
        return v

    return bufs, finish


def make_wgmma_gemm(m: int, n: int, k: int, tile: WgmmaTile = WgmmaTile(), epilogue: str = "none",
                    dtype: str = "float16", ablate: str = ""):
    """C[m, n] = epilogue(A[m, k] @ B[n, k]^T (+ bias[n])) in `dtype` (fp16 or bf16), fp32 accumulation: the
    benchmark's kernel, parameters (A, B, bias, C); `ablate` ("loads", "mma": see `wgmma_kernel`) for diagnostics."""
    bufs, finish = bench_operands(m, n, k, epilogue, dtype)
    suffix = "" if dtype == "float16" else f"_{dtype}"
    return wgmma_kernel(m, n, k, tile, bufs[0], bufs[1], bufs[3], finish, lambda row, col: (row, col), bufs,
                        f"wgmma_gemm_{m}x{n}x{k}_{tile.bm}x{tile.bn}_{tile.stages}_{epilogue}{suffix}", ablate=ablate)


def hopper_target() -> tvm.target.Target:
    """The sm_90a target wgmma and TMA need (the nvidia/nvidia-h100 tag)."""
    return tvm.target.Target("nvidia/nvidia-h100")
