"""Reshape kernels as views (tvmfuse.fuse.views): TVM's RewriteDataflowReshape, guarded against its analysis."""

import pytest
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from checks import cuda_sources
from tvmfuse.build.compile import compile_module
from tvmfuse.fuse.fusion import launches
from tvmfuse.fuse.views import analysis_raises, is_view, rewrite_dataflow_reshape
from tvmfuse.targets import resolve_target


@T.prim_func(private=True, s_tir=True)
def _transpose(a: T.handle, past: T.int64, b: T.handle):
    """The fp32 K transpose of the 8-layer Llama's seq-2048 bucket as dlight's Fallback scheduled it (1024 threads):
    TVM's reshape analysis raised on it, which failed the generation build on the H200."""
    T.func_attr({"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True})
    A = T.match_buffer(a, (T.int64(32), past + T.int64(2048), T.int64(128)), "float32")
    B = T.match_buffer(b, (T.int64(32), T.int64(128), past + T.int64(2048)), "float32")
    for f0 in T.thread_binding(past * T.int64(4) + T.int64(8192), thread="blockIdx.x"):
        for f1 in T.thread_binding(T.int64(1024), thread="threadIdx.x"):
            with T.sblock("T_transpose"):
                v0 = T.axis.spatial(T.int64(32), (f0 * T.int64(1024) + f1) // (past * T.int64(128) + T.int64(262144)))
                v1 = T.axis.spatial(T.int64(128), (f0 * T.int64(1024) + f1) % (past * T.int64(128) + T.int64(262144))
                                    // (past + T.int64(2048)))
                v2 = T.axis.spatial(past + T.int64(2048), (f0 * T.int64(1024) + f1) % (past + T.int64(2048)))
                T.reads(A[v0, v2, v1])
                T.writes(B[v0, v1, v2])
                B[v0, v1, v2] = A[v0, v2, v1]


def _module(with_reshape: bool) -> tvm.IRModule:
    """main(x: [32, total, 128]) -> the transpose at past = total - 2048 (and a reshape of it, legalized)."""
    total = tirx.Var("total", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((32, total, 128), "float32"))
    gv = bb.add_func(_transpose, "transpose")
    with bb.function("main", [x]):
        with bb.dataflow():
            t = bb.emit(relax.call_tir(gv, [x, relax.prim_value(total - 2048)],
                                       relax.TensorType((32, 128, total), "float32")))
            if with_reshape:
                t = bb.emit(relax.op.reshape(t, (32 * 128, total)))
            out = bb.emit_output(t)
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())


def _call_tir_callees(mod: tvm.IRModule) -> list[str]:
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and e.op.same_as(tvm.ir.Op.get("relax.call_tir")):
            found.append(e.args[0].name_hint)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return found


def test_the_stock_pass_raises_and_the_guarded_one_keeps_that_kernel_a_launch_and_still_makes_views():
    mod = _module(with_reshape=True)
    with pytest.raises(tvm.error.InternalError, match="CanProveDivisible"):
        relax.transform.RewriteDataflowReshape()(mod)
    assert analysis_raises(mod["transpose"]) and not is_view(mod["transpose"])
    reshape = next(gv.name_hint for gv in mod.functions if gv.name_hint.startswith("reshape"))
    assert is_view(mod[reshape])
    viewed = rewrite_dataflow_reshape(mod)
    assert _call_tir_callees(viewed) == ["transpose"]  # the reshape became a view
    assert viewed["transpose"].same_as(mod["transpose"])  # put back as it was
    assert launches(mod) == 1


def test_compile_module_builds_a_cuda_module_with_that_kernel():
    """The build's relax pipeline runs the guarded pass: the module compiles for CUDA (no GPU needed)."""
    cuda = resolve_target("cuda")
    (src,) = cuda_sources(compile_module(_module(with_reshape=False), cuda))
    assert "transpose_kernel" in src and "__launch_bounds__(1024)" in src
