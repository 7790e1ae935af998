"""tvmfuse.spaces.gemm: every candidate of the GEMM space builds for CUDA (fp32 accumulation, cast, bias, GELU)."""

import sys
from pathlib import Path

import pytest
import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import cases
from tvmfuse.tune.builder import fast_build
from tvmfuse.spaces import gemm, space_for

H100 = tvm.target.Target("nvidia/nvidia-h100")


def _pf():
    """x[256, 256] @ W[256, 512] in fp16 accumulated in fp32, cast to fp16, + bias, GELU (gemm_m4096's structure)."""
    name, pf = cases.fused_primfunc(*cases.mm_bias_gelu(256, 256, 512))
    assert name == "fused_relax_matmul_relax_astype_relax_add_relax_nn_gelu"
    return pf


def sample_candidates(pf, space, per_sketch=2, tries=60):
    """[(sketch kind, IRModule)]: up to `per_sketch` random replays of each sketch that pass the space's postprocs
    (what the search hands the builder)."""
    mod = tvm.IRModule({"main": pf})
    ctx = ms.TuneContext(mod=mod, target=H100, space_generator=space, search_strategy="replay-trace")
    posts = list(ctx.space_generator.postprocs)
    for post in posts:
        post._initialize_with_tune_context(ctx)  # pylint: disable=protected-access
    out = []
    for sketch in ctx.generate_design_space():
        kind = "wmma" if "wmma" in str(sketch.trace) else "mma" if "mma_sync" in str(sketch.trace) else "other"
        found = 0
        for seed in range(1, tries + 1):
            sch = tvm.s_tir.Schedule(mod, seed=seed)
            Trace(sketch.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
            if all(post.apply(sch) for post in posts):
                out.append((kind, sch.mod))
                found += 1
                if found == per_sketch:
                    break
    return out


def build_errors(candidates):
    """[(kind, last line of the error)] of the candidates fast_build refuses."""
    errors = []
    for kind, mod in candidates:
        try:
            fast_build(mod, H100, None)
        except Exception as err:  # noqa: BLE001  (collected, reported by the assertion)
            errors.append((kind, str(err).strip().splitlines()[-1]))
    return errors


@pytest.fixture(scope="module")
def candidates():
    return sample_candidates(_pf(), space_for(_pf(), H100))


def test_every_sampled_candidate_builds(candidates):
    """Before the fix, 7 of 20 wmma candidates here failed ("tvm_access_ptr element type must match the source
    buffer", StorageRewrite), and mma candidates with a 16-wide K tile failed InjectPermutedLayout."""
    kinds = [kind for kind, _ in candidates]
    assert kinds.count("wmma") >= 2 and kinds.count("mma") >= 1, kinds
    assert build_errors(candidates) == []


def test_verify_buildable_rejects_unswizzlable_mma_tiles():
    """A K tile of 16 fp16 (2 x 8) cannot take the permuted shared layout (VerifyGPUCode skipped: VerifyBuildable
    rejects it); 32 (4 x 8) can."""
    tiles = [[2, 2, 2, 2, 1], [2, 2, 2, 2, 4]]
    assert gemm.sample_schedule(_pf(), H100, tiles=tiles + [[16, 2, 1]], verify=False) is None
    mod = gemm.sample_schedule(_pf(), H100, tiles=tiles + [[8, 2, 2]])
    assert mod is not None and build_errors([("mma", mod)]) == []


@pytest.fixture(scope="module")
def worker_builds(candidates):
    """{kind: error_msg or None}: one wmma and one mma candidate built as the tuner builds them, in a LocalBuilder
    worker process that has not imported tvm.s_tir.tensor_intrin."""
    wmma = next(mod for kind, mod in candidates if kind == "wmma")
    mma = next(mod for kind, mod in candidates if kind == "mma")
    builder = ms.builder.LocalBuilder(max_workers=1, timeout_sec=120, f_build=fast_build)
    results = builder.build([ms.builder.BuilderInput(mod, H100) for mod in (wmma, mma)])
    return {"wmma": results[0].error_msg, "mma": results[1].error_msg}


def test_wmma_candidate_builds_in_a_builder_worker(worker_builds):
    assert worker_builds["wmma"] is None


def test_mma_candidate_builds_in_a_builder_worker(worker_builds):
    assert worker_builds["mma"] is None, worker_builds["mma"]
