"""Baseline records: the default schedule is measured once, stored, and kept when tuning cannot beat it."""

import os

import pytest
import tvm
from tvm.s_tir import meta_schedule as ms

import onnx_models
from tvmfuse.spaces.defaults import default_schedule
from tvmfuse.tune.baseline import measure_baselines
from tvmfuse.fuse.fusion import lower
from tvmfuse.frontend.importer import import_model
from tvmfuse.targets import resolve_target
from tvmfuse.tune.progress import kernel_records
from tvmfuse.tune.search import evaluator_config, make_builder, make_runner, tunable_tasks


def _tasks(target, model=None):
    imp = import_model(model or onnx_models.rms_norm_residual(rows=16, hidden=64))
    fused = lower(imp.mod, imp.params)
    return fused, [t.dispatched[0] for t in tunable_tasks(fused.mod, target)]


def test_default_is_measured_once_and_stored(tmp_path, llvm):
    _, mods = _tasks(llvm)
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    builder, runner = make_builder(os.cpu_count() or 1), make_runner(None, evaluator_config(False))  # tune's own
    first = measure_baselines(mods, llvm, db, builder, runner)
    assert list(first) == [0] and first[0][1] is True and first[0][0] > 0
    again = measure_baselines(mods, llvm, ms.database.JSONDatabase(work_dir=str(tmp_path)), builder, runner)
    assert again == {0: (first[0][0], False)}
    assert len(ms.database.JSONDatabase(work_dir=str(tmp_path)).get_all_tuning_records()) == 1


def test_tuning_result_is_never_worse_than_the_default(tuned_rms):
    fused, progress, _, work_dir = tuned_rms  # conftest: one 4-trial tune of _tasks' model, shared with test_tune
    (task,) = progress.values()
    assert task.default_us is not None and task.trials == 4  # the default counts as one of the 4 trials
    _, best_us = kernel_records(fused.mod, ms.database.JSONDatabase(work_dir=work_dir))[task.name]
    assert best_us <= task.default_us


def test_every_fused_kernel_has_a_default_gpu_schedule():
    cuda = resolve_target("cuda")
    _, mods = _tasks(cuda, onnx_models.layer_norm_gelu(rows=64, hidden=256))
    assert mods and all(default_schedule(m["main"], cuda) is not None for m in mods)


def test_default_kept_where_it_beat_every_record(llvm):
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod  # pylint: disable=import-outside-toplevel
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    from tvmfuse.tune.baseline import kernels_keeping_default  # pylint: disable=import-outside-toplevel

    fused, _ = _tasks(llvm)
    (kernel,) = fused.kernels()
    key = str(tvm_ffi.structural_hash(_normalize_mod(fused.mod[kernel])))
    assert kernels_keeping_default(fused.mod, {kernel: (8, 12.0)}, {key: 10.0}) == {kernel: 10.0}
    assert kernels_keeping_default(fused.mod, {kernel: (8, 9.0)}, {key: 10.0}) == {}
    assert kernels_keeping_default(fused.mod, {}, {key: 10.0}) == {kernel: 10.0}
    assert kernels_keeping_default(fused.mod, {kernel: (8, 12.0)}, {}) == {}


def test_gpu_default_traces_that_cannot_be_stored_are_not_committed():
    """TVM 0.27 cannot read back traces with IndexMap inputs (dlight's layout transforms): never store them."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo  # pylint: disable=import-outside-toplevel

    from tvmfuse.tune.baseline import _round_trips  # pylint: disable=import-outside-toplevel
    from tvmfuse.frontend.default_model import make_tiny_block  # pylint: disable=import-outside-toplevel

    cuda = resolve_target("cuda")
    _, mods = _tasks(cuda, make_tiny_block())
    stored, index_maps = [], []
    for mod in mods:
        db = ms.database.MemoryDatabase()
        trace = default_schedule(mod["main"], cuda).trace
        record = ms.database.TuningRecord(trace, db.commit_workload(mod), [1e-5], cuda,
                                          ArgInfo.from_prim_func(mod["main"]))
        stored.append(_round_trips(record, record.workload))
        index_maps.append(any(isinstance(a, tvm.tirx.IndexMap) for inst in trace.insts for a in inst.inputs))
    assert any(index_maps), "the tiny block has no default schedule with a layout transform: the test tests nothing"
    assert stored == [not has_map for has_map in index_maps]  # exactly the traces with IndexMap inputs are refused


def test_cuda_default_is_the_row_schedule_the_build_applies(llvm):
    """The default measured before tuning is the one the build gives an untuned kernel: for the two-output
    RMSNorm+residual (dlight's reduction rules give up on it) tvmfuse's row-reduction schedule on CUDA, dlight's
    elsewhere."""
    import tvm  # pylint: disable=import-outside-toplevel

    from tvmfuse.spaces.defaults import ROW_DEFAULT, default_kind  # pylint: disable=import-outside-toplevel
    from tvmfuse.spaces import apply_default_schedules  # pylint: disable=import-outside-toplevel
    from tvmfuse.spaces import rowreduce  # pylint: disable=import-outside-toplevel

    cuda = resolve_target("cuda")
    fused, (task,) = _tasks(cuda)
    (kernel,) = fused.kernels()
    measured = default_schedule(task["main"], cuda)
    assert default_kind(task["main"], cuda) == ROW_DEFAULT and default_kind(task["main"], llvm) == "default"
    assert str(measured.trace) == str(rowreduce.default_schedule(task["main"]).trace)
    assert str(measured.trace) == str(default_schedule(fused.mod[kernel], cuda).trace)
    tvm.ir.assert_structural_equal(apply_default_schedules(fused.mod, cuda)[kernel],
                                   default_schedule(fused.mod[kernel], cuda).mod["main"]
                                   .with_attr("tirx.is_scheduled", True))


def _fp16_matmul_cast(m=512, k=4096, n=4096):
    """ToMixedPrecision's GEMM: fp16 operands, fp32 accumulation, cast back to fp16."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x, w = relax.Var("x", relax.TensorType((1, m, k), "float16")), relax.Var("w", relax.TensorType((k, n), "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.astype(bb.emit(relax.op.matmul(x, w, out_dtype="float32")), "float16"))
        bb.emit_func_output(out)
    return lower(bb.get(), patterns=[]).mod


def _cuda_source(mod, target, stock=False) -> str:
    from checks import cuda_sources
    from tvmfuse.build import compile_module
    from tvmfuse.spaces import apply_default_schedules

    return cuda_sources(compile_module(apply_default_schedules(mod, target, stock=stock), target))[0]


def test_cuda_default_gemm_uses_tensor_cores_on_sm90a():
    """dlight reads "sm_90a" as no tensor cores (str.isdigit on "90a"): stock TVM's default GEMM runs on CUDA cores;
    tvmfuse's default takes dlight's tensor-core (wmma) path."""
    cuda = resolve_target("cuda")
    assert str(cuda.attrs["arch"]) == "sm_90a"
    mod = _fp16_matmul_cast()
    assert "wmma::mma_sync" in _cuda_source(mod, cuda)
    assert "wmma" not in _cuda_source(mod, cuda, stock=True)


@pytest.mark.gpu
@pytest.mark.skipif(not tvm.cuda(0).exist, reason="no GPU")
def test_gpu_default_tensor_core_gemm_matches_numpy():
    import numpy as np
    from tvm import relax

    from tvmfuse.build import compile_module
    from tvmfuse.spaces import apply_default_schedules

    cuda, dev, rng = resolve_target("cuda"), tvm.cuda(0), np.random.default_rng(0)
    for m, k, n in [(512, 4096, 4096), (100, 768, 3072)]:
        x = rng.standard_normal((1, m, k)).astype("float16")
        w = (rng.standard_normal((k, n)) * 0.02).astype("float16")
        vm = relax.VirtualMachine(compile_module(apply_default_schedules(_fp16_matmul_cast(m, k, n), cuda), cuda), dev)
        got = vm["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev)).numpy().astype("float32")
        want = x.astype("float32") @ w.astype("float32")
        assert np.abs(got - want).max() < 2e-2, (m, k, n)


@pytest.mark.parametrize("symbolic", [True, "batch 1", False])
@pytest.mark.parametrize("perm", [[0, 2, 1, 3], [0, 1, 2, 3]])
def test_cpu_reduction_default_skips_a_symbolic_kernel_ending_in_a_transpose(llvm, symbolic, perm):
    """softmax then permute in one kernel (the attention kernel's head merge): dlight's CPU Reduction computes the
    softmax at the transpose's rows, which with symbolic dims gave min/max regions LLVM took ~10 minutes on (the
    tiny Llama export's attention); that kernel stays unscheduled, the static one and the aligned one keep it. At
    batch 1 (its unit dim has no iterator) the transpose is seen too: scheduled, the tiny Llama's decoder step at
    `--shape seq=8 --shape batch=1` failed to lower (`The padding factor (past + 8) * 4 is not divisible`)."""
    from tvm import te, topi

    from tvmfuse.spaces.defaults import AlignedCPUReduction, default_rule

    s = tvm.tirx.Var("s", "int64") if symbolic else 8
    b = tvm.tirx.Var("b", "int64") if symbolic is True else 1 if symbolic else 2
    x = te.placeholder((b, 4, s, 16), "float32", name="x")
    func = te.create_prim_func([x, topi.transpose(topi.nn.softmax(x, axis=-1), perm)])
    rule, _ = default_rule(func, llvm)
    assert (rule is None) == (symbolic and perm != [0, 1, 2, 3]), rule
    assert rule is None or isinstance(rule, AlignedCPUReduction)


@pytest.mark.parametrize("target, stock, names", [
    ("cuda", False, ["SmallBatchMatmul", "TensorCoreGemm", "TensorCoreMatmul", "GEMV", "Reduction",
                     "GeneralReduction", "RowReductionDefault", "VectorizedInjective", "VectorizedRows", "Fallback",
                     "UnsplitInjective"]),
    ("cuda", True, ["Matmul", "GEMV", "Reduction", "GeneralReduction", "Fallback"]),
    ("llvm", False, ["GEMV", "AlignedCPUReduction"]),
    ("llvm", True, ["GEMV", "Reduction"]),
])
def test_default_rules_come_from_the_table_by_target_and_build(target, stock, names):
    """tvmfuse's CUDA rules around dlight's (small-M and tensor-core matmuls first, row and vectorized injective
    schedules before the Fallback); stock builds get dlight's alone; CPUs dlight's two."""
    from tvmfuse.spaces.defaults import default_rules  # pylint: disable=import-outside-toplevel

    assert [type(r).__name__ for r in default_rules(resolve_target(target), stock)] == names
