"""The decision engine: threshold, resource budgets, and overlaps resolved by total benefit."""

from __future__ import annotations

import pytest
from tvm.target import Target

from test_patterns import attention, matmul_bias, skip_layer_norm
from tvmfuse.decide.decision import KEPT, REJECTED, Candidate, Settings, _resolve_overlaps, decide
from tvmfuse.fuse.fusion import lower
from tvmfuse.prepare import bind_params
from tvmfuse.frontend.importer import import_model
from tvmfuse.patterns import Match


class _V:  # a stand-in binding var: only `.name` is read
    def __init__(self, name):
        self.name = name


def _cand(pattern, root, names, benefit):
    c = Candidate(Match(pattern, root, [(_V(n), None) for n in names], [], []), decision=KEPT)
    c.unfused_us, c.fused_us = benefit, 0.0
    return c


def test_overlaps_resolved_by_total_benefit_not_table_order():
    big = _cand("a.big", "v3", ["v1", "v2", "v3"], 10.0)   # overlaps both small ones
    s1 = _cand("b.small", "v1", ["v0", "v1"], 6.0)
    s2 = _cand("c.small", "v4", ["v3", "v4"], 6.0)
    _resolve_overlaps([big, s1, s2])
    assert (s1.decision, s2.decision, big.decision) == (KEPT, KEPT, REJECTED)  # 12 > 10
    assert "overlaps" in big.reason and "b.small@v1" in big.reason


def _plan(model, target="llvm", **settings):
    imp = import_model(model)
    bound = bind_params(imp.mod, imp.params)
    return bound, decide(bound, Target(target) if target != "llvm" else None, Settings(**settings))


def test_threshold_rejects_small_benefits_and_module_stays_unchanged():
    bound, plan = _plan(matmul_bias("relu"), threshold_us=1e6)
    assert not plan.kept() and all("threshold" in c.reason for c in plan.candidates)
    fused = lower(bound, plan=plan)
    assert not fused.kernel_patterns


def test_shared_memory_budget_rejects_long_attention_on_gpu():
    bound, plan = _plan(attention(b=1, h=2, s=16, d=64, seq_k=4096), target="cuda")
    (att,) = [c for c in plan.candidates if c.match.pattern == "tvmfuse.attention"]
    assert att.decision == REJECTED and "shared-memory budget" in att.reason, att.reason
    assert att.smem > plan.device.smem_per_block
    assert "tvmfuse.attention" not in lower(bound, plan=plan).kernel_patterns.values()
    # the same graph with a short key length fits
    _, ok = _plan(attention(b=1, h=2, s=16, d=64, seq_k=64), target="cuda")
    assert [c.decision for c in ok.candidates if c.match.pattern == "tvmfuse.attention"] == [KEPT]


def test_skip_layer_norm_with_bias_beats_the_smaller_alternatives():
    _, plan = _plan(skip_layer_norm(bias=True))
    kept = [c.match.pattern for c in plan.kept()]
    assert kept == ["tvmfuse.skip_layer_norm_bias"]
    loser = [c for c in plan.candidates if c.match.pattern == "tvmfuse.skip_layer_norm"]
    assert loser and loser[0].decision == REJECTED and "overlaps" in loser[0].reason


@pytest.mark.parametrize("device", ["cpu", "h100", "h200"])
def test_every_kept_candidate_saves_time_on_each_device(device):
    _, plan = _plan(matmul_bias("gelu"), device=device)
    assert plan.kept() and all(c.benefit_us > 0 and c.fused.bytes < c.unfused.bytes for c in plan.kept())


def test_two_matmul_fusions_are_rejected_on_gpus_only():
    """SwiGLU fuses two GEMMs into one kernel: fine on llvm, but on a GPU nothing schedules it (measured 313 ms
    fused vs 3.4 ms as two GEMMs for Llama on the H200), so the cuda decision keeps the GEMMs apart."""
    from test_patterns import swiglu
    from tvmfuse.targets import resolve_target

    _, cpu = _plan(swiglu())
    assert [c.decision for c in cpu.candidates if c.match.pattern == "tvmfuse.swiglu"] == [KEPT]
    imp = import_model(swiglu())
    gpu = decide(bind_params(imp.mod, imp.params), resolve_target("cuda"))
    rejected = [c for c in gpu.candidates if c.match.pattern == "tvmfuse.swiglu"]
    assert [c.decision for c in rejected] == [REJECTED] and "two matmuls in one kernel" in rejected[0].reason
    # instead: the gate GEMM with its SiLU, and the up GEMM with the multiply by that gate in its epilogue
    assert sorted(c.match.pattern for c in gpu.kept()) == ["tvmfuse.matmul_multiply", "tvmfuse.matmul_silu"]
