"""bench/generate.py --smoke end to end (its phases in their own processes): a tiny Llama step exported with a KV
cache, built by the product on llvm, its generate against torch's greedy decoding with a StaticCache, in fp32."""

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import generate  # noqa: E402


def test_smoke_generates_torchs_greedy_tokens_and_writes_every_row(tmp_path):
    out = tmp_path / "out"
    assert generate.main(["--smoke", "--exporter", "legacy", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    res = json.loads((out / "generate.json").read_text())
    config = res["config"]
    assert (config["layers"], config["batches"], config["prompts"], config["new_tokens"]) == (2, [1, 2], [8, 16], 8)
    assert config["parameters"] == res["export"]["parameters"] > 0 and res["export"]["exporter"] == "legacy"
    assert not [k for k in res if k.endswith("_error")], res
    build = res["build"]
    assert build["rc"] == 0 and build["verification"]["status"] == "passed", build["log_tail"]
    assert build["kv_cache"]["mode"] == "inplace" and build["kv_cache"]["capacity"] == 32
    assert build["buckets"] == ["main_seq1"] and build["cuda_graphs"] is None  # llvm: no CUDA graphs
    assert res["torch"]["same_weights_as_onnx"] and res["torch"]["dtype"] == "float32"
    bw = res["ceilings"]["copy_bw"]
    shape, n = config["shape"], config["new_tokens"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    assert set(res["rows"]) == {f"b{b}_p{p}" for b in (1, 2) for p in (8, 16)}
    for key, row in res["rows"].items():
        batch, prompt = (int(part[1:]) for part in key.split("_"))
        ours, theirs = row["tvmfuse"], row["torch"]
        assert "error" not in ours and "error" not in theirs, (ours.get("error"), theirs.get("error"))
        assert ours["decode"] == {"function": "main_seq1"}
        assert ours["prefill_ms"] > 0 and ours["ms_per_token"] > 0 and theirs["ms_per_token"] > 0
        assert ours["tokens_per_s"] == pytest.approx(batch / ours["ms_per_token"] * 1e3, rel=1e-2)
        assert len(ours["tokens"]) == batch and {len(r) for r in ours["tokens"]} == {n}
        assert ours["tokens"] == theirs["tokens"], key  # fp32 both: the same greedy tokens
        assert row["agreement"] == {"identical_leading_tokens": [n] * batch, "min": n, "all_rows_identical": True}
        ideal = row["roofline"]
        kv = 2 * 2 * config["layers"] * batch * shape["num_key_value_heads"] * head_dim * (prompt + n / 2)
        assert ideal["weight_bytes"] == 2 * (config["parameters"] - shape["vocab_size"] * shape["hidden_size"])
        assert ideal["kv_bytes_at_mean_length"] == kv
        assert ideal["roofline_ms"] == pytest.approx((ideal["weight_bytes"] + kv) / bw * 1e3)
        for contender in (ours, theirs):
            assert contender["fraction_of_roofline"] == pytest.approx(
                ideal["roofline_ms"] / contender["ms_per_token"], rel=1e-2, abs=1e-4)
    # the run phase alone into another folder (as a second device call does): the parameter count comes from the
    # export's work folder, and the rows are the same tokens
    again = tmp_path / "again"
    assert generate.main(["--smoke", "--exporter", "legacy", "--work", str(tmp_path / "work"), "--out", str(again),
                          "--phase", "run", "--prompts", "8"]) == 0
    rerun = json.loads((again / "generate.json").read_text())
    assert rerun["config"]["parameters"] == config["parameters"]
    assert rerun["rows"]["b1_p8"]["tvmfuse"]["tokens"] == res["rows"]["b1_p8"]["tvmfuse"]["tokens"]


@pytest.mark.parametrize("flags, message", [(["--prompts", "30"], "need 37 positions; --max-seq is 32"),
                                            (["--batches", "1,0"], "--batches '1,0': expected positive integers"),
                                            (["--new-tokens", "1"], "--new-tokens >= 2")])
def test_bad_input_is_one_error_line(tmp_path, capsys, flags, message):
    assert generate.main(["--smoke", "--out", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_torchs_decode_profile_failing_is_an_error_in_the_row_not_a_failed_phase():
    """Without a GPU the profiler cannot sync: the profile says why, and nothing raises (the row's timing stands)."""
    class Cache:
        def reset(self):
            raise RuntimeError("no device here")

    got = generate.profile_torch_decode(None, Cache(), None, None)
    assert list(got) == ["error"] and "no device here" in got["error"]


@pytest.mark.parametrize("flags, graphs", [([], True), (["--no-cuda-graph"], False)])
def test_the_build_takes_cuda_graphs_unless_told_not_to(tmp_path, monkeypatch, flags, graphs):
    """The CUDA build's command line: --cuda-graph by default, none with --no-cuda-graph (the decode steps then
    launch every kernel from the host)."""
    commands = []
    monkeypatch.setattr(generate, "_stream", lambda cmd: (commands.append(cmd), (0, ""))[1])
    args = generate.parse_args(["--work", str(tmp_path), "--out", str(tmp_path / "out"), *flags])
    info = generate.phase_build(args)
    (cmd,) = commands
    assert ("--cuda-graph" in cmd) is graphs and ("--cuda-graph" in info["command"]) is graphs
    assert cmd[cmd.index("--target") + 1] == "cuda"


def test_the_build_records_the_kernel_switches_it_ran_under(tmp_path, monkeypatch):
    """A build under TVMFUSE_SMALLM_BULK=4 says so in its phase's record (and one without records none), so two runs
    side by side say which was which."""
    monkeypatch.setattr(generate, "_stream", lambda cmd: (0, ""))
    args = generate.parse_args(["--work", str(tmp_path), "--out", str(tmp_path / "out")])
    for name in [k for k in os.environ if k.startswith("TVMFUSE_")]:
        monkeypatch.delenv(name)
    assert generate.phase_build(args)["switches"] == {}
    monkeypatch.setenv("TVMFUSE_SMALLM_BULK", "4")
    assert generate.phase_build(args)["switches"] == {"TVMFUSE_SMALLM_BULK": "4"}
