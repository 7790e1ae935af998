"""Tensor intrinsics TVM 0.27 does not register: wmma 16x16x16 with bf16 operands and fp32 accumulation (sm_80+).

TVM registers wmma loads and syncs for fp16 and int8 only (`get_wmma_intrin_group` asserts `in_dtype in
["float16", "int8"]`), and dlight's and MetaSchedule's tensor-core rules never ask for bf16. Its generators are
dtype-generic, though, and its CUDA codegen prints a bf16 fragment as
`nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, nv_bfloat16, nvcuda::wmma::row_major>`, which nvcc
compiles for sm_80 and newer (HMMA.16816.F32.BF16). This module registers the bf16 loads (A row-major, B
transposed, from shared and shared.dyn) and the bf16 x bf16 -> fp32 sync under names that follow TVM's
(`wmma_load_16x16x16_bf16_a_shared_dyn`, `wmma_sync_16x16x16_bf16bf16f32_trans`); the fp32 fill and store are
TVM's own. `register()` registers them (and TVM's own, by importing `tvm.s_tir.tensor_intrin.cuda`) once per
process, on first use: that import parses some 500 TVMScript functions (7-10 s), which a CPU job never needs. The
wmma schedules call it, and so does `build.compile.replay_record` for a CUDA target, so a tuning record whose trace
names them replays in any process.
"""

from __future__ import annotations

import contextlib
import functools

#: the operand dtypes tvmfuse's wmma GEMM takes, and the short names TVM's intrinsic names use for them
WMMA_IN_DTYPES = {"float16": "f16", "bfloat16": "bf16"}
SCOPES = ("shared", "shared.dyn")


@functools.cache
def register():
    """Register TVM's CUDA tensor intrinsics and the bf16 wmma ones above (once a process); TVM's
    `tvm.s_tir.tensor_intrin.cuda` module, every intrinsic registered."""
    from tvm.s_tir import TensorIntrin  # pylint: disable=import-outside-toplevel
    from tvm.s_tir.tensor_intrin import cuda  # pylint: disable=import-outside-toplevel  (TVM's fp16/int8, fp32 fill)

    for scope in SCOPES:
        suffix = scope.replace(".", "_")
        for is_b, col_major, part in ((False, False, "a"), (True, False, "b"), (False, True, "a_trans"),
                                      (True, True, "b_trans")):
            TensorIntrin.register(f"wmma_load_16x16x16_bf16_{part}_{suffix}",
                                  *cuda.get_wmma_load_intrin(16, 16, 16, "bfloat16", scope, is_b, col_major),
                                  override=True)
    for trans, tail in ((False, ""), (True, "_trans")):
        TensorIntrin.register(f"wmma_sync_16x16x16_bf16bf16f32{tail}",
                              *cuda.get_wmma_sync_intrin(16, 16, 16, "bfloat16", "float32", trans), override=True)
    return cuda


def wmma_intrin_group(in_dtype: str, load_scope: str = "shared.dyn", store_scope: str = "shared.dyn",
                      trans_b: bool = True) -> dict[str, str]:
    """The names of the wmma 16x16x16 intrinsics {init, load_a, load_b, compute, store} for `in_dtype` operands
    (float16 or bfloat16) accumulating in fp32: TVM's `get_wmma_intrin_group` for fp16, the ones registered here
    for bf16. Other dtypes raise ValueError."""
    if in_dtype not in WMMA_IN_DTYPES:
        raise ValueError(f"no wmma intrinsics for {in_dtype!r} operands (tvmfuse has {sorted(WMMA_IN_DTYPES)})")
    if in_dtype == "float16":
        return register().get_wmma_intrin_group(load_scope=load_scope, store_scope=store_scope, in_dtype=in_dtype,
                                                out_dtype="float32", trans_b=trans_b)
    register()
    load, store, b = load_scope.replace(".", "_"), store_scope.replace(".", "_"), "_trans" if trans_b else ""
    return {"init": "wmma_fill_16x16x16_f32", "load_a": f"wmma_load_16x16x16_bf16_a_{load}",
            "load_b": f"wmma_load_16x16x16_bf16_b{b}_{load}", "compute": f"wmma_sync_16x16x16_bf16bf16f32{b}",
            "store": f"wmma_store_16x16x16_f32_{store}"}


@contextlib.contextmanager
def wmma_operands(in_dtype: str):
    """While it lasts, TVM's `get_wmma_intrin_group` answers a request for fp16 operands with the `in_dtype` (bf16)
    intrinsics registered here: dlight's MatmulTensorization asks for fp16 by name, and is otherwise
    dtype-generic. A request for an fp16 accumulator raises (there is no bf16 one), which dlight reads as "does
    not tensorize". Not thread-safe: it patches a module attribute for the duration of one schedule."""
    if in_dtype == "float16":
        yield
        return
    cuda = register()
    stock = cuda.get_wmma_intrin_group

    wanted = in_dtype

    def patched(load_scope, store_scope, in_dtype, out_dtype, trans_b):  # TVM's signature (dlight passes keywords)
        if in_dtype != "float16" or out_dtype != "float32":
            raise ValueError(f"no {wanted} wmma intrinsics accumulating in {out_dtype}")
        return wmma_intrin_group(wanted, load_scope, store_scope, trans_b)

    cuda.get_wmma_intrin_group = patched
    try:
        yield
    finally:
        cuda.get_wmma_intrin_group = stock
