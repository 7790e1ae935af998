"""Tiny random Hugging Face GPT-2 / BERT / Llama exports (dynamic batch and seq; torch.onnx's legacy and
dynamo exporters): the plan keeps the right
fusions, kernel launches drop versus stock TVM fusion, the built modules match onnxruntime, and the report
is printed by `python -m tvmfuse plan` and saved beside each export."""

from __future__ import annotations

import json
import os

import pytest

from checks import check_against_ort
from tvmfuse.decide.decision import decide
from tvmfuse.fuse.fusion import lower
from tvmfuse.prepare import bind_params
from tvmfuse.frontend.importer import import_model, load_onnx
from tvmfuse.cli.plan import main as plan_main
from tvmfuse.decide import fusion_report

EXPECTED = {
    "gpt2": {"tvmfuse.skip_layer_norm", "tvmfuse.matmul_bias_gelu_tanh", "tvmfuse.attention"},
    "bert": {"tvmfuse.skip_layer_norm_bias", "tvmfuse.matmul_bias_gelu", "tvmfuse.attention"},
    "llama": {"tvmfuse.rms_norm_residual", "tvmfuse.swiglu", "tvmfuse.rotary_embedding", "tvmfuse.attention"},
}
# The dynamo exporter drops an all-zero bias (GPT-2's Conv1D biases start at zero): Gemm without C, no add.
DYNAMO_GPT2 = EXPECTED["gpt2"] - {"tvmfuse.matmul_bias_gelu_tanh"} | {"tvmfuse.matmul_gelu_tanh"}


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hf_model_plan_fuses_and_matches_onnxruntime(name, exporter, hf_exports, llvm):
    model = load_onnx(hf_exports(name, exporter))
    imp = import_model(model)
    assert imp.symbolic_dims  # dynamic batch and sequence stay symbolic
    bound = bind_params(imp.mod, imp.params)
    plan = decide(bound)
    kept = {c.match.pattern for c in plan.kept()}
    assert (DYNAMO_GPT2 if (name, exporter) == ("gpt2", "dynamo") else EXPECTED[name]) <= kept, kept
    fused, stock = lower(bound, plan=plan), lower(bound, patterns=[])
    report = fusion_report(plan, fused, stock=stock)
    totals = report["totals"]
    assert totals["launches_after"] < totals["launches_before"], totals
    assert report["kernels_after"]["distinct"] <= report["kernels_before"]["distinct"]  # layers share PrimFuncs
    assert set(totals["kept_by_pattern"]) == kept
    assert sorted(fused.candidate_kernels) == sorted(f"{c.match.pattern}@{c.match.root}" for c in plan.kept())
    att = [c for c in plan.kept() if c.match.pattern == "tvmfuse.attention"]
    assert att and all(c.match.info["head_dim"] == "16" and c.match.info["heads"] == "4" for c in att)
    if name in ("gpt2", "llama"):
        assert all(c.match.info["causal"] for c in att)
    if name == "llama":
        assert all(c.match.info["kv_heads"] == "2" for c in att)
    check = check_against_ort(model, imp, fused, llvm)
    assert check.ok, check.as_dict()


@pytest.mark.slow
def test_plan_command_prints_text_and_json(hf_exports, capsys):
    assert plan_main([hf_exports("llama"), "--target", "cuda"]) == 0
    text = capsys.readouterr().out
    assert "tvmfuse.swiglu" in text and "kernel launches per run: stock TVM fusion" in text
    gpt2 = hf_exports("gpt2", "dynamo")  # exported first: the exporter prints progress to stdout
    capsys.readouterr()
    assert plan_main([gpt2, "--target", "llvm", "--json", "--threshold-us", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["threshold_us"] == 5.0
    for row in report["candidates"]:
        assert {"pattern", "ops", "decision", "reason"} <= set(row)
        if row["decision"] == "kept" and not row["reason"].startswith("reads its weight"):
            assert row["predicted_saved_us"] > 5.0
        elif "predicted_saved_us" in row and row["reason"].startswith("benefit"):
            assert row["predicted_saved_us"] <= 5.0


def test_plan_shows_the_fusions_of_the_dtype_asked_for(tmp_path, capsys):
    """--dtype fp16: the report of the module an fp16 job fuses: the same group as in fp32, with the casts of its
    fp32 island inside (more ops, other bytes); a dtype tvmfuse has not is one error line, exit 2."""
    import onnx
    import onnx_models

    path = str(tmp_path / "rms.onnx")
    onnx.save(onnx_models.rms_norm_residual(rows=64, hidden=256), path)
    reports = {}
    for dtype in ("fp32", "fp16"):
        capsys.readouterr()
        assert plan_main([path, "--target", "cuda", "--json", "--dtype", dtype]) == 0
        reports[dtype] = json.loads(capsys.readouterr().out)
    kept = {d: [(c["pattern"], c["ops"], c.get("bytes_saved")) for c in r["candidates"] if c["decision"] == "kept"]
            for d, r in reports.items()}
    assert [k[0] for k in kept["fp16"]] == [k[0] for k in kept["fp32"]] == ["tvmfuse.rms_norm_residual"], kept
    assert kept["fp16"][0][1] > kept["fp32"][0][1] and kept["fp16"][0][2] != kept["fp32"][0][2], kept
    assert plan_main([path, "--dtype", "fp8"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --dtype 'fp8' is not supported: use fp32, fp16 or bf16"]


def test_report_is_saved_beside_the_export(tmp_path, llvm):
    from tvmfuse.jobs import Job
    from tvmfuse.pipeline import run_job

    result = run_job(Job(name="tiny", path=None, shapes={}, trials=0), llvm, str(tmp_path), str(tmp_path / "logs"),
                     say=lambda s: None)
    assert result.ok, result.error
    files = os.listdir(result.output)
    assert {"fusion_report.json", "fusion_report.txt", "manifest.json"} <= set(files)
    report = json.loads(open(os.path.join(result.output, "fusion_report.json"), encoding="utf-8").read())
    assert report["totals"]["candidates"] >= 1
    assert json.loads(open(os.path.join(result.output, "manifest.json"), encoding="utf-8").read())["fusion"]
