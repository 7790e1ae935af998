"""Tune stage: only static kernels are tuned; records land in the database; progress is reported."""

from tvm.s_tir import meta_schedule as ms

import onnx_models
from tvmfuse.build.compile import TUNED, build
from tvmfuse.fuse.fusion import lower
from tvmfuse.frontend.importer import import_model
from tvmfuse.tune.progress import kernel_records
from tvmfuse.tune.search import tunable_tasks


def test_tune_records_progress_and_build_uses_them(tuned_rms, llvm):
    fused, progress, seen, work_dir = tuned_rms  # conftest: one 4-trial tune, shared with test_baseline
    (kernel,) = fused.kernels()
    assert progress[kernel].trials == 4 and progress[kernel].best_us > 0
    assert seen and seen[-1] == 4
    db = ms.database.JSONDatabase(work_dir=work_dir)
    trials, best_us = kernel_records(fused.mod, db)[kernel]
    assert trials == 4 and best_us == progress[kernel].best_us
    _, kinds = build(fused.mod, llvm, db)
    assert kinds[kernel] == TUNED


def test_symbolic_kernels_are_not_tuned(llvm):
    imp = import_model(onnx_models.layer_norm_gelu(dyn=True))
    assert tunable_tasks(lower(imp.mod, imp.params).mod, llvm) == []
    imp = import_model(onnx_models.layer_norm_gelu(dyn=True), {"batch": [4]})
    assert len(tunable_tasks(lower(imp.mod, imp.params).mod, llvm)) == 1


def test_loggers_survive_an_unnamed_handler(tmp_path):
    """A handler without a name on MetaSchedule's logger (e.g. a test runner's) must not break tuning."""
    import logging  # pylint: disable=import-outside-toplevel

    from tvmfuse.tune.search import task_loggers  # pylint: disable=import-outside-toplevel

    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    foreign = logging.NullHandler()
    logger.addHandler(foreign)
    try:
        assert len(task_loggers(str(tmp_path), ["a", "b"])) == 2
        assert foreign in logger.handlers
    finally:
        logger.removeHandler(foreign)


def test_one_builder_and_runner_per_process_whose_workers_import_no_tensor_intrinsics(llvm):
    """tune.pool: make_builder / make_runner hand out one of each per configuration (their workers start once);
    a builder worker that unpickles fast_build, as LocalBuilder sends it, imports neither tvmfuse.spaces nor TVM's
    tensor intrinsics (10-15 s of CPU per worker when tvmfuse.tune imported its stage eagerly)."""
    # pylint: disable=import-outside-toplevel
    import os

    from tvmfuse.tune.builder import fast_build
    from tvmfuse.tune.search import evaluator_config, make_builder, make_runner

    builder = make_builder(os.cpu_count() or 1)
    assert builder is make_builder(os.cpu_count() or 1)
    assert make_runner(None, evaluator_config(False)) is make_runner(None, evaluator_config(False))

    def heavy_modules(f_build):  # runs in the worker (pickled by value); f_build is unpickled there by reference
        import sys  # pylint: disable=import-outside-toplevel,redefined-outer-name,reimported

        assert f_build.__name__ == "fast_build"
        return sorted(m for m in sys.modules if m.startswith(("tvmfuse.spaces", "tvm.s_tir.tensor_intrin")))

    assert builder._workers().submit(heavy_modules, fast_build).result() == []  # pylint: disable=protected-access


def test_the_tuning_builder_builds_the_wgmma_attention_knob_sets():
    """`--trials N` on an sm_90a target builds each knob set of the TIRx attention template with the tuning builder:
    fast_build sends a module of TIRx kernels through the tirx pipeline (the s_tir one refuses its TMA and wgmma
    calls, and every knob set would be recorded as failed)."""
    # pylint: disable=import-outside-toplevel
    import os

    from tvmfuse.kernels import ATTENTION_PREFILL_WGMMA
    from tvmfuse.kernels.attention.common import normalize
    from tvmfuse.kernels.hopper import TIRX_ATTR
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target
    from tvmfuse.tune import builder as tuning_builder
    from tvmfuse.tune.search import make_builder
    from tvmfuse.tune.templates import candidate_knobs, variant_workload

    assert tuning_builder.TIRX_ATTR == TIRX_ATTR
    target = hopper_target()
    shapes = normalize(dict(batch=1, heads=2, kv_heads=2, seq_q=128, seq_k=128, head_dim=64, causal=True,
                            dtype="float16", arch="sm_90a"))
    knob_sets = candidate_knobs(ATTENTION_PREFILL_WGMMA, shapes)[:2]
    mods = [variant_workload(ATTENTION_PREFILL_WGMMA, shapes, k, "attention_0", target) for k in knob_sets]
    built = make_builder(os.cpu_count() or 1).build([ms.builder.BuilderInput(m, target) for m in mods])
    assert [b.error_msg for b in built] == [None, None]
    source = tuning_builder.fast_build(mods[0], target, None).imports[0].inspect_source()
    assert "wgmma.mma_async" in source and "cp.async.bulk.tensor" in source
