"""bench/models.py --smoke in-process: a tiny GPT-2 at decode (KV cache) through the product, stock TVM and torch."""

import json
import os
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import models  # noqa: E402


def test_smoke_gpt2_decode_rows(tmp_path):
    out = tmp_path / "out"
    res = models.main(["--smoke", "--models", "gpt2", "--cases", "decode_b2", "--jobs", "0",
                       "--contenders", "tvmfuse,tvmfuse_cuda_graph,torch_eager,tvm_default",
                       "--out", str(out), "--work", str(tmp_path / "work")])
    saved = json.loads((out / "models.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(res["rows"], default=str))
    assert {"torch", "transformers", "tvm"} <= set(saved["versions"])
    rows = {r["contender"]: r for r in saved["rows"]}
    assert set(rows) == {"tvmfuse", "tvmfuse_cuda_graph", "torch_eager", "tvm_default"}, saved["rows"]
    assert rows["tvmfuse_cuda_graph"]["skipped"] == "CUDA graphs: CUDA only"
    for key in ("tvmfuse", "torch_eager", "tvm_default"):
        row = rows[key]
        assert "error" not in row, row.get("error")
        assert (row["batch"], row["seq"], row["kv_len"]) == (2, 1, 16)
        assert math.isfinite(row["us"]) and row["us"] > 0
        assert row["max_abs_err"] < 1e-4 and row["within_tol"], row  # fp32 everywhere in the smoke
        assert 0 <= row["rms_err"] <= row["max_abs_err"] and row["violations"] == 0, row
        assert row["same_weights_as_onnx"]
    fused, stock = rows["tvmfuse"], rows["tvm_default"]
    assert fused["run_job_ok"] and fused["verification_vs_onnxruntime"].startswith("ok")
    assert fused["patterns"].get("tvmfuse.attention") == 1  # one attention kernel, shared by both layers
    assert fused["launches"] < stock["launches"]  # pattern fusion: fewer kernel launches than stock TVM
    assert not list((tmp_path / "work").rglob("*.so")) and not list((tmp_path / "work").rglob("*.onnx"))


def test_smoke_fp32_and_bf16_rows_side_by_side(tmp_path):
    """--dtypes fp32,bf16: every contender once per dtype in one run (torch in that dtype too), each row checked
    against torch fp32 at its own dtype's tolerance with the count of elements outside it."""
    out = tmp_path / "out"
    res = models.main(["--smoke", "--models", "gpt2", "--cases", "decode_b2", "--jobs", "0", "--dtypes", "fp32,bf16",
                       "--contenders", "tvmfuse,torch_eager", "--out", str(out), "--work", str(tmp_path / "work")])
    saved = json.loads((out / "models.json").read_text())
    assert saved["dtypes"] == ["fp32", "bf16"]
    rows = {(r["dtype"], r["contender"]): r for r in saved["rows"]}
    assert set(rows) == {(d, c) for d in ("fp32", "bf16") for c in ("tvmfuse", "torch_eager")}, saved["rows"]
    for row in rows.values():
        assert "error" not in row, row.get("error")
        assert row["within_tol"] and row["violations"] == 0, row
    fused32, fused16 = rows["fp32", "tvmfuse"], rows["bf16", "tvmfuse"]
    assert fused16["run_job_ok"] and fused16["verification_vs_onnxruntime"].startswith("ok")
    assert fused16["io"]["float_inputs"] == ["bfloat16"]  # the past K/V go in as bf16 (--io-dtype bf16)
    assert rows["bf16", "torch_eager"]["io"] == {"dtype": "bfloat16"}
    assert 1e-4 < fused16["max_abs_err"] < 5e-2 and fused32["max_abs_err"] < 1e-4  # it really computed in bf16
    assert set(res["summary"]) == {"gpt2/decode_b2/fp32", "gpt2/decode_b2/bf16"}
    assert list((tmp_path / "work").glob("gpt2-decode_b2-bf16"))  # one work folder per dtype


def test_bad_dtypes_is_one_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="--dtypes 'int8' is not supported: use fp32, fp16 or bf16"):
        models.main(["--smoke", "--dtypes", "int8", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="name each of fp32, fp16, bf16 at most once"):
        models.main(["--smoke", "--dtypes", "bf16,bfloat16", "--out", str(tmp_path)])


def test_smoke_llama3_has_grouped_query_attention(tmp_path):
    """--models llama3: a Llama layer with fewer KV heads than query heads (Llama-3-8B's 32 / 8 at full size), built
    by the product and checked against torch."""
    from bench import hf_models

    assert hf_models.config("llama3", False).num_key_value_heads == 8
    out = tmp_path / "out"
    models.main(["--smoke", "--models", "llama3", "--cases", "prefill_512", "--jobs", "0", "--contenders", "tvmfuse",
                 "--out", str(out), "--work", str(tmp_path / "work")])
    (row,) = json.loads((out / "models.json").read_text())["rows"]
    assert "error" not in row and row["within_tol"] and row["run_job_ok"], row
    assert row["patterns"].get("tvmfuse.attention") == 1


@pytest.mark.parametrize("name, rotary", [("phi3", "tvmfuse.slice_rotary_embedding"),
                                          ("pythia", "tvmfuse.slice_partial_rotary_embedding")])
def test_smoke_phi3_and_pythia_layers_build_and_match_torch(tmp_path, name, rotary):
    """--models phi3 / pythia: a layer of Phi-3-mini's shapes (Q, K, V one projection) and of Pythia-1.4B's (GPT-NeoX,
    a quarter of each head rotated), built by the product at prefill and checked against torch; their Q and K rotary
    kernels read their slices of the QKV projection (and Pythia's pass the rest of each head through)."""
    from bench import hf_models

    full = hf_models.config(name, False)
    assert (full.hidden_size // full.num_attention_heads, full.num_hidden_layers) == ((96, 1) if name == "phi3"
                                                                                      else (128, 1))
    out = tmp_path / "out"
    models.main(["--smoke", "--models", name, "--cases", "prefill_512", "--jobs", "0", "--contenders", "tvmfuse",
                 "--out", str(out), "--work", str(tmp_path / "work")])
    (row,) = json.loads((out / "models.json").read_text())["rows"]
    assert "error" not in row and row["within_tol"] and row["run_job_ok"], row
    assert row["patterns"].get(rotary) == 2 and row["patterns"].get("tvmfuse.attention") == 1, row["patterns"]


def test_without_templates_leaves_a_template_out_of_the_table_for_the_build_only():
    """`--without-templates attention_prefill_wgmma`: the build's table lacks it (the mma.sync prefill comes next);
    the table is whole again afterwards."""
    from bench.model_builds import without_templates
    from tvmfuse.kernels import TABLE

    names = lambda: [t.name for t in TABLE["tvmfuse.attention"].templates]  # noqa: E731
    whole = names()
    assert "attention_prefill_wgmma" in whole
    with without_templates(("attention_prefill_wgmma",)):
        assert names() == [n for n in whole if n != "attention_prefill_wgmma"]
    assert names() == whole


def test_without_dependent_launch_builds_kernels_that_do_not_wait_and_restores_the_switch(monkeypatch):
    """`--before dependent_launch`: the before build has the switch off, the other keeps it (on by default)."""
    from bench.model_builds import DEPENDENT_LAUNCH, without_templates
    from tvmfuse.kernels.dependent_launch import SWITCH, dependent_launch

    monkeypatch.setenv(SWITCH, "1")
    with without_templates((DEPENDENT_LAUNCH,)):
        assert not dependent_launch()
    assert dependent_launch()
    monkeypatch.delenv(SWITCH)
    with without_templates((DEPENDENT_LAUNCH,)):
        assert not dependent_launch()
    assert SWITCH not in os.environ


@pytest.mark.parametrize("before", [None, "1"])
def test_without_early_weights_turns_the_switch_off_and_restores_it(before, monkeypatch):
    """`--before early_weights`: the before build loads no weight early; the switch is as it was after."""
    from bench.model_builds import EARLY_WEIGHTS, without_templates
    from tvmfuse.kernels.dependent_launch import EARLY_WEIGHTS_SWITCH, SWITCH, early_weights

    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.delenv(EARLY_WEIGHTS_SWITCH, raising=False)
    if before:
        monkeypatch.setenv(EARLY_WEIGHTS_SWITCH, before)
    with without_templates((EARLY_WEIGHTS,)):
        assert not early_weights()
    assert os.environ.get(EARLY_WEIGHTS_SWITCH) == before and early_weights() is (before == "1")


def test_without_the_smallm_ring_the_rules_tiles_take_none_and_the_switch_is_restored(monkeypatch):
    """`--before smallm_ring`: the before build's small-M tiles have no ring; the switch is as it was after."""
    from bench.model_builds import SMALLM_RING, without_templates
    from tvmfuse.kernels.hopper.mma_smallm import RING_SWITCH
    from tvmfuse.kernels.hopper.select import choose_smallm_tile

    monkeypatch.setenv(RING_SWITCH, "4")
    with without_templates((SMALLM_RING,)):
        assert choose_smallm_tile(16, 4096, 4096).stages == 0
    assert os.environ[RING_SWITCH] == "4" and choose_smallm_tile(16, 4096, 4096).stages == 4


def test_without_smallm_m1_gemvs_keep_the_gemv_schedule(monkeypatch):
    """`--before smallm_m1`: the before build leaves M = 1 to the GEMV schedule; after it the switch is back."""
    from bench.model_builds import SMALLM_M1, without_templates
    from tvmfuse.kernels.hopper.mma_smallm import M1_SWITCH, takes_m1

    monkeypatch.delenv(M1_SWITCH, raising=False)
    assert takes_m1()  # on by default
    with without_templates((SMALLM_M1,)):
        assert not takes_m1()
    assert takes_m1() and M1_SWITCH not in os.environ


def test_without_wgmma_waits_the_wgmma_gemms_do_not_wait(monkeypatch):
    """`--before wgmma_waits` (bench/models.py sets the switch to 1 for the measured build): the before build's
    wgmma GEMMs launch after the kernel before them; after it the switch is back."""
    from bench.model_builds import WGMMA_WAITS, without_templates
    from tvmfuse.kernels.dependent_launch import SWITCH, WGMMA_SWITCH, wgmma_waits

    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.delenv(WGMMA_SWITCH, raising=False)
    assert not wgmma_waits()  # off by default
    monkeypatch.setenv(WGMMA_SWITCH, "1")
    assert wgmma_waits()
    with without_templates((WGMMA_WAITS,)):
        assert not wgmma_waits()
    assert wgmma_waits() and os.environ[WGMMA_SWITCH] == "1"


def test_without_merge_siblings_the_estimate_decides_again(monkeypatch):
    """`--before merge_siblings`: the before build merges Llama's 512-row Q, K and V only where the estimate says
    so (it does not), the measured one merges them; after the block the switch is back."""
    from bench.model_builds import MERGE_SIBLINGS, without_templates
    from tvmfuse.kernels.hopper.select import MERGE_SWITCH, sibling_merge_pays

    monkeypatch.setenv(MERGE_SWITCH, "1")
    with without_templates((MERGE_SIBLINGS,)):
        assert not sibling_merge_pays(512, 4096, 4096, 3)
    assert sibling_merge_pays(512, 4096, 4096, 3)


def test_without_generic_waits_only_the_kernels_that_wait_themselves_are_launched_dependent(monkeypatch):
    """`--before generic_waits`: a generic kernel gets no wait (nor the launch tag), a TIRx kernel that waits keeps
    its tag; after the block the generic kernels wait again."""
    from bench.model_builds import GENERIC_WAITS, without_templates
    from test_dependent_launch import _kernel, _launch_params
    from tvmfuse.build.dependent_launch import TAG
    from tvmfuse.kernels.dependent_launch import SWITCH

    monkeypatch.delenv(SWITCH, raising=False)
    with without_templates((GENERIC_WAITS,)):
        assert _launch_params(_kernel(False)) == {"main_kernel": ["blockIdx.x", "threadIdx.x"]}
        assert _launch_params(_kernel(True)) == {"main_kernel": ["blockIdx.x", "threadIdx.x", TAG]}
    assert _launch_params(_kernel(False)) == {"main_kernel": ["blockIdx.x", "threadIdx.x", TAG]}


def test_an_unknown_name_to_leave_out_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        models.main(["--smoke", "--before", "attention_prefil", "--out", str(tmp_path / "o")])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("error: --before: unknown name 'attention_prefil' (a template of tvmfuse.kernels.table or "
                        "one of dependent_launch, generic_waits, early_weights, smallm_ring, smallm_bulk, smallm_m1, "
                        "wgmma_waits, merge_siblings, split_reads, untuned)"), err
    assert not (tmp_path / "o").exists()


def test_before_untuned_builds_the_export_again_with_no_trials_and_its_own_database(tmp_path, monkeypatch):
    """`--trials N --before untuned` (issue 26: one model with --trials 0 and --trials N in one run): the before
    build is the same export at --trials 0 with an empty tuning database of its own (the tuned records would
    otherwise reach it), every template kept; the row says which kernels the tuned build changed."""
    from bench import model_builds

    calls = []

    def product(name, case, opts, path, folder, target, left_out):
        calls.append((opts["trials"], opts.get("logs"), left_out))
        kernel = "wgmma 512x4096x4096, tile 128x128" + ("" if opts["trials"] == 0 else ", 6 stages")
        return {"schedules": {"gemm": {"schedule": "wgmma (TIRx kernel)", "kernel": kernel},
                              "norm": {"schedule": "row (TIRx kernel)", "kernel": "row"}}}, None, {}

    monkeypatch.setattr(model_builds, "_product", product)
    opts = {"work": str(tmp_path), "target": "llvm", "graph": False, "default": False, "dtype": "float16",
            "trials": 8, "before": ["untuned", "attention_prefill"]}
    info = model_builds.build("llama", "prefill_512", opts, "m.onnx", {})
    (tuned, untuned) = calls
    assert tuned == (8, None, ()) and untuned[0] == 0 and untuned[2] == ("attention_prefill",)
    assert untuned[1].startswith(str(tmp_path)) and untuned[1] != os.path.join(str(tmp_path), "logs")
    assert info["tvmfuse_before"]["changed_kernels"] == ["gemm"]
    assert model_builds.changed_kernels({"schedules": {"a": {"schedule": "x"}}}, {}) == ["a"]


def test_before_builds_each_case_again_without_the_templates_from_the_same_export(tmp_path):
    """--before attention_prefill: one export, two product builds measured side by side (tvmfuse, and tvmfuse_before
    built with the template table lacking it), both right against torch. (The smoke runs on llvm, where no template
    is substituted: which kernels differ shows on CUDA alone, `without_templates` here.)"""
    out = tmp_path / "out"
    models.main(["--smoke", "--models", "llama3", "--cases", "prefill_512", "--jobs", "0", "--contenders", "tvmfuse",
                 "--before", "attention_prefill", "--out", str(out), "--work", str(tmp_path / "work")])
    saved = json.loads((out / "models.json").read_text())
    rows = {r["contender"]: r for r in saved["rows"]}
    assert set(rows) == {"tvmfuse", "tvmfuse_before"} and saved["before"] == ["attention_prefill"]
    for row in rows.values():
        assert "error" not in row and row["within_tol"] and row["run_job_ok"], row
    assert rows["tvmfuse_before"]["without_templates"] == ["attention_prefill"]
    schedules = rows["tvmfuse"]["schedules"]  # the manifest's kernels: what a --trials N build changed shows here
    assert schedules and {v["schedule"] for v in schedules.values()} == {"default"}, schedules
    assert rows["tvmfuse"]["export_s"] == rows["tvmfuse_before"]["export_s"]  # one export
