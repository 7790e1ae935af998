"""Build stage: default schedules for every kernel; CUDA code compiles here (nvcc) and runs on a GPU."""

import shutil

import pytest
import tvm
from tvm import relax

import onnx_models
from checks import cuda_sources
from tvmfuse.build.compile import DEFAULT, build
from tvmfuse.spaces import apply_default_schedules
from tvmfuse.fuse.fusion import lower
from tvmfuse.frontend.importer import import_model
from tvmfuse.verify import random_inputs
from tvmfuse.targets import resolve_target
from tvmfuse.verify.outputs import compare, onnxruntime_outputs, run_vm


def _fused(model):
    imp = import_model(model)
    return imp, lower(imp.mod, imp.params)


def test_without_database_every_kernel_is_default(llvm):
    _, fused = _fused(onnx_models.rms_norm_residual())
    _, kinds = build(fused.mod, llvm)
    assert set(kinds.values()) == {DEFAULT}


def test_default_schedules_bind_every_gpu_kernel():
    cuda = resolve_target("cuda")
    _, fused = _fused(onnx_models.rms_norm_residual(rows=64, hidden=256))
    scheduled = apply_default_schedules(fused.mod, cuda)
    assert all(fn.attrs.get("tirx.is_scheduled", False) for fn in scheduled.functions.values()
               if isinstance(fn, tvm.tirx.PrimFunc))
    assert not any(fn.attrs.get("tirx.is_scheduled", False) for fn in fused.mod.functions.values()
                   if isinstance(fn, tvm.tirx.PrimFunc)), "the input module must not be mutated"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("make", [onnx_models.rms_norm_residual, onnx_models.layer_norm_gelu])
def test_fused_module_cuda_code_compiles_with_nvcc(make):
    cuda = resolve_target("cuda")
    _, fused = _fused(make(rows=64, hidden=256))
    executable, _ = build(fused.mod, cuda)
    sources = cuda_sources(executable)
    assert sources and "__global__" in sources[0]
    with cuda:
        fatbin = tvm.support.nvcc.compile_cuda(sources[0], target_format="fatbin", compiler="nvcc")
    assert len(fatbin) > 1000


@pytest.mark.gpu
def test_fused_module_runs_on_gpu_and_matches_onnxruntime():
    cuda = resolve_target("cuda")
    model = onnx_models.rms_norm_residual(rows=64, hidden=256)
    imp, fused = _fused(model)
    executable, _ = build(fused.mod, cuda)
    feeds = random_inputs(imp.inputs)
    dev = tvm.cuda(0)
    check = compare(run_vm(relax.VirtualMachine(executable, dev), dev, list(feeds.values())),
                    onnxruntime_outputs(model, feeds))
    assert check.ok, check


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_cuda_graph_option_captures_kernel_launches(cuda_graph):
    from tvmfuse.build.compile import compile_module, compiler_errors
    from tvmfuse.frontend.default_model import make_tiny_block

    cuda = resolve_target("cuda")
    imp = import_model(make_tiny_block())  # 4 kernels: after the first, they read only planned memory
    fused = lower(imp.mod, imp.params)
    text = compile_module(apply_default_schedules(fused.mod, cuda), cuda, cuda_graph=cuda_graph).as_text()
    assert ("vm.builtin.cuda_graph.run_or_capture" in text) is cuda_graph
    assert ("main_cuda_graph_capture" in text) is cuda_graph
    llvm_text = compile_module(apply_default_schedules(fused.mod, resolve_target("llvm")), resolve_target("llvm"),
                               cuda_graph=True).as_text()
    assert "cuda_graph" not in llvm_text  # CPU targets ignore the option


def test_compile_module_scopes_the_target(monkeypatch):
    """TVM's CUDA compile callback reads the arch from Target.current() (else it asks the GPU): compile_module must
    push its target, or a build worker that sees no GPU fails ("No CUDA architecture was specified")."""
    import tvm as _tvm

    from tvmfuse.build.compile import compile_module, compiler_errors
    from tvmfuse.targets import resolve_target

    seen = []
    monkeypatch.setattr(_tvm, "compile", lambda *a, **k: seen.append(_tvm.target.Target.current(allow_none=True)))
    target = resolve_target("cuda")
    for graph in (False, True):
        compile_module(_tvm.IRModule(), target, cuda_graph=graph)
    assert [str(t.attrs["arch"]) for t in seen] == ["sm_90a", "sm_90a"]


def _skip_layer_norm(rows: int, hidden: int, lead: tuple = ()):
    """h = x + r; y = LayerNorm(h); both are outputs (GPT-2's fused skip-LayerNorm: two outputs)."""
    import numpy as np
    from onnx import TensorProto, helper

    rng = np.random.default_rng(4)
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [*lead, rows, hidden]) for n in ("x", "r", "y", "h")]
    weights = [helper.make_tensor(n, TensorProto.FLOAT, [hidden], (rng.standard_normal(hidden) * s + m).tolist())
               for n, s, m in (("g", 0.1, 1.0), ("b", 0.1, 0.0))]
    nodes = [helper.make_node("Add", ["x", "r"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    graph = helper.make_graph(nodes, "skip_ln", io[:2], io[2:], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def _fused_fp16(model):
    from tvmfuse.prepare import bind_params
    from tvmfuse.prepare.precision import to_compute_dtype

    imp = import_model(model)
    return lower(to_compute_dtype(bind_params(imp.mod, imp.params), "float16", "float16"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_skip_layer_norm_gets_the_row_reduction_default_on_cuda():
    """dlight's reduction rules give up on the two-output skip-LayerNorm (its Fallback ran one thread per row and
    took 427 us at 512 x 768 fp16 on the H200): tvmfuse's row schedule takes it, 192 threads x 4-wide vectors."""
    from tvmfuse.spaces.defaults import ROW_DEFAULT
    from tvmfuse.build.compile import compile_module, compiler_errors

    cuda = resolve_target("cuda")
    fused = _fused_fp16(_skip_layer_norm(512, 768))
    (kernel,) = fused.kernels()
    executable, kinds = build(fused.mod, cuda)
    assert kinds == {kernel: ROW_DEFAULT}
    (src,) = cuda_sources(executable)
    assert "__launch_bounds__(192)" in src and "__shfl_down_sync" in src  # one row per block, reduced across threads
    assert "*(half4*)(T_layer_norm_intermediate_ptr" in src  # 4 x fp16 vector stores
    with cuda:
        fatbin = tvm.support.nvcc.compile_cuda(src, target_format="fatbin", compiler="nvcc")
    assert len(fatbin) > 1000
    # stock TVM's rules (what it got before, and the benchmarks' "TVM default"): dlight's Fallback, no cross-thread
    # reduction (one thread walks a whole row)
    (stock_src,) = cuda_sources(compile_module(apply_default_schedules(fused.mod, cuda, stock=True), cuda))
    assert "__shfl_down_sync" not in stock_src and "__launch_bounds__(192)" not in stock_src


def test_row_default_takes_a_batch_of_one_fp32_skip_layer_norm():
    """GPT-2's real skip-LayerNorm: [1, 512, 768], fp32 (the residual stream stays fp32 under --dtype fp16). The
    staging buffer keeps its full (1, 512, 768) shape until lowering compacts it to one row: sized per row, it fits
    (sized whole it did not, and the kernel fell back to dlight's Fallback: 434 us per call on the H200)."""
    from tvmfuse.spaces.defaults import ROW_DEFAULT
    from tvmfuse.build.compile import schedule_kinds

    imp, fused = _fused(_skip_layer_norm(512, 768, lead=(1,)))
    assert set(schedule_kinds(fused.mod, resolve_target("cuda")).values()) == {ROW_DEFAULT}


def test_skip_layer_norm_on_llvm_keeps_dlight_and_matches_onnxruntime(llvm):
    model = _skip_layer_norm(64, 768)
    imp, fused = _fused(model)
    executable, kinds = build(fused.mod, llvm)
    assert set(kinds.values()) == {DEFAULT}  # row schedules are GPU-only
    feeds = random_inputs(imp.inputs)
    dev = tvm.cpu()
    check = compare(run_vm(relax.VirtualMachine(executable, dev), dev, list(feeds.values())),
                    onnxruntime_outputs(model, feeds))
    assert check.ok and check.max_abs_err < 1e-4, check


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", [(512, 768), (64, 100), (8, 4096)])
def test_row_reduction_default_runs_on_gpu_and_matches_onnxruntime(rows, hidden):
    from tvmfuse.spaces.defaults import ROW_DEFAULT

    cuda = resolve_target("cuda")
    model = _skip_layer_norm(rows, hidden)
    fused = _fused_fp16(model)
    executable, kinds = build(fused.mod, cuda)
    assert set(kinds.values()) == {ROW_DEFAULT}
    feeds = random_inputs(import_model(model).inputs, io_dtype="float16")
    dev = tvm.cuda(0)
    check = compare(run_vm(relax.VirtualMachine(executable, dev), dev, list(feeds.values()), "float16"),
                    onnxruntime_outputs(model, feeds), compute_dtype="float16")
    assert check.ok, check


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_nvccs_errors_are_read_out_of_a_failed_compile_with_the_kernels_name():
    """A kernel whose CUDA source nvcc rejects (it calls a device function that does not exist): the summary a
    failed build raises names the kernel and quotes nvcc's error line, not the warnings around it."""
    from tvm.script import ir as I
    from tvm.script import relax as R
    from tvm.script import tirx as T

    from tvmfuse.build.compile import compile_module, compiler_errors

    @I.ir_module
    class Broken:
        @T.prim_func(private=True)
        def bad_copy(x: T.Buffer((64,), "float32"), y: T.Buffer((64,), "float32")):
            for i in T.thread_binding(64, thread="threadIdx.x"):
                y[i] = T.call_pure_extern("float32", "tvmfuse_no_such_device_fn", x[i])

        @R.function
        def main(x: R.Tensor((64,), "float32")) -> R.Tensor((64,), "float32"):
            cls = Broken
            return R.call_tir(cls.bad_copy, (x,), out_ty=R.Tensor((64,), "float32"))

    # without a GPU TVM keeps the CUDA source uncompiled (nvcc runs at build time only where a GPU is): compile
    # what it generated with nvcc as a GPU machine's build does, and read the failure as compile_module does
    (src,) = cuda_sources(compile_module(Broken, resolve_target("cuda")))
    with resolve_target("cuda"), pytest.raises(RuntimeError) as caught:
        tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")
    summary = compiler_errors(str(caught.value))
    assert compiler_errors("an FFI traceback\nof a few lines\n" + str(caught.value)) == summary  # text before it
    first, second = summary.splitlines()[:2]
    assert first == "1 error(s) from nvcc:"
    assert second.startswith("in kernel bad_copy_kernel: ") and ": error: " in second
    assert "tvmfuse_no_such_device_fn" in second and "warning" not in summary
    assert compiler_errors("Compilation error:\nx.cu(3): warning #177-D: variable unused") is None
