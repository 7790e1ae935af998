"""CUDA graphs for the in-place KV cache's decode step (issue 24): the tiny Llama step built for CUDA with
--cuda-graph and a static decode bucket (batch 1, seq 1) captures its runs of kernels, and nothing captured depends
on past_len (the compiled VM text, no GPU needed); on a GPU the replayed steps give onnxruntime's greedy tokens."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("transformers")
import hf_export  # noqa: E402  (tests/ is on sys.path)

from tvmfuse import pipeline  # noqa: E402
from tvmfuse.build.compile import RUN_OR_CAPTURE  # noqa: E402
from tvmfuse.cli.generate import decode_graphs_text  # noqa: E402
from tvmfuse.cli.tune import main as tune_main  # noqa: E402
from tvmfuse.export.generate import cuda_graph_summary, decode_function, decode_path  # noqa: E402

CAPACITY = 48
BUCKETS = ["--buckets", "batch=1", "--buckets", "seq=1"]


def _build(kv_model: str, out, extra: list[str], target: str = "cuda") -> str:
    assert tune_main([kv_model, "--target", target, "--trials", "0", "--schedules", "none", "--out", str(out),
                      "--logs", str(out / "logs"), "--max-seq", str(CAPACITY), *extra]) == 0
    return str(next(p for p in out.iterdir() if p.name.startswith("llama_kv-")))


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory):
    return hf_export.export_with_cache("llama", str(tmp_path_factory.mktemp("kv_onnx")))


@pytest.fixture(scope="module")
def graph_build(kv_model, tmp_path_factory):
    """(manifest, VM text per function) of the step built for CUDA with --cuda-graph and the decode bucket."""
    texts = []
    compile_module = pipeline.compile_module

    def keep_text(*args, **kwargs):
        executable = compile_module(*args, **kwargs)
        texts.append(executable.as_text())
        return executable

    mp = pytest.MonkeyPatch()
    mp.setattr(pipeline, "compile_module", keep_text)
    try:
        folder = _build(kv_model, tmp_path_factory.mktemp("cg"), ["--cuda-graph", *BUCKETS])
    finally:
        mp.undo()
    with open(f"{folder}/manifest.json", encoding="utf-8") as f:
        manifest = json.load(f)
    functions, name = {}, None
    for line in texts[-1].splitlines():
        if line.startswith("@"):
            name = line[1:-1] if line.endswith(":") else None
            functions.setdefault(name, [])
        elif name:
            functions[name].append(line)
    return manifest, functions


def _calls(lines: list[str]) -> list[str]:
    return [m.group(1) for line in lines if (m := re.match(r"\s*call\s+(\S+)", line))]


def test_decode_bucket_replays_graphs_and_the_generic_step_does_not(graph_build):
    manifest, _ = graph_build
    graphs = manifest["cuda_graphs"]
    decode, generic = graphs["main_batch1_seq1"], graphs["main_generic"]
    # build.launch_order: each layer's cache writes beside its attention, so one graph before each layer's attention
    # and one after the last (2 layers: 3; in the exported order the writes split each layer in three: 8)
    assert decode["graphs"] == 3 and decode["kernels_in_graphs"] > decode["kernels_outside"] / 2
    assert generic["kernels_in_graphs"] <= 2 < generic["kernels_outside"]  # symbolic batch/seq: launches
    assert all(g["keyed"] == 0 for g in graphs.values())  # no graph recaptured per value of a symbolic var
    # the launches one by one, by kernel: the cache writes and the attention over the cache's view among them
    assert sum(decode["outside"].values()) == decode["kernels_outside"]
    assert any(k.startswith("kv_cache_write") for k in decode["outside"]), decode["outside"]
    assert any("softmax" in k for k in decode["outside"]), decode["outside"]
    assert decode_function(manifest, 1) == "main_batch1_seq1" and decode_function(manifest, 2) == "main_generic"
    assert decode_path(manifest, 1) == {"function": "main_batch1_seq1", **decode}
    assert decode_graphs_text(manifest, decode_path(manifest, 1)).startswith(
        f"main_batch1_seq1 through {decode['graphs']} CUDA graphs")
    assert cuda_graph_summary(manifest).endswith("; decode steps run in main_batch1_seq1 (static shapes)")
    unbucketed = {**manifest, "buckets": None, "cuda_graphs": {"main": generic}}  # as a build without --buckets
    assert cuda_graph_summary(unbucketed).endswith("decode steps run in main, whose symbolic batch, seq keep their "
                                                   "launches out of the graphs: bucket them (e.g. --buckets seq=1 "
                                                   "--buckets batch=1)")


def test_nothing_captured_depends_on_past_len(graph_build):
    """A graph replays the launches it captured with the same scalars and buffers: so no captured function may read
    a symbolic value (the shape heap, where past_len lives) nor the caches (inputs, written at past_len); the
    cache writes and the attention over the cache's view run outside the graphs, at every step."""
    _, functions = graph_build
    captured = {re.search(r"f\[(\S+?)\]", line).group(1) for lines in functions.values() for line in lines
                if RUN_OR_CAPTURE in line}
    assert captured and all(f.startswith("main_batch1_seq1_cuda_graph_capture") for f in captured)
    for fn in captured:
        body = functions[fn]
        assert not any("make_prim_value" in line or "alloc_shape_heap" in line for line in body), fn
        assert all(re.search(r"match_shape in: %\d+, %void", line) for line in body if "match_shape" in line), fn
        assert not any(c.startswith("kv_cache_write") or "softmax" in c for c in _calls(body)), fn
    outside = _calls(functions["main_batch1_seq1"])
    assert sum(c.startswith("kv_cache_write") for c in outside) == 2 * hf_export.LAYERS
    assert sum("softmax" in c for c in outside) == hf_export.LAYERS
    assert all(line.count(",") == 3 for line in functions["main_batch1_seq1"] if RUN_OR_CAPTURE in line)


def test_without_cuda_graph_the_decode_reports_none(kv_model, tmp_path):
    folder = _build(kv_model, tmp_path, BUCKETS[2:], target="llvm")
    with open(f"{folder}/manifest.json", encoding="utf-8") as f:
        manifest = json.load(f)
    assert "cuda_graphs" not in manifest and manifest["cuda_graph"] is False
    assert decode_path(manifest, 1) == {"function": "main_seq1"}
    assert decode_graphs_text(manifest, decode_path(manifest, 1)) == ("main_seq1, no CUDA graphs (built without "
                                                                      "--cuda-graph)")


@pytest.mark.gpu
def test_cuda_graph_decode_matches_onnxruntime_at_every_past_length(kv_model, tmp_path):
    """Replayed at 31 past lengths, with a fresh cache and another prompt length: onnxruntime's greedy tokens."""
    from test_kv_cache import _onnxruntime_greedy  # pylint: disable=import-outside-toplevel

    from tvmfuse.export.runtime import load  # pylint: disable=import-outside-toplevel

    model = load(_build(kv_model, tmp_path, ["--cuda-graph", *BUCKETS]))
    for seed, prompt in ((4, 5), (5, 9)):
        ids = np.random.default_rng(seed).integers(0, hf_export.VOCAB, (1, prompt), dtype=np.int64)
        want = _onnxruntime_greedy(kv_model, ids, 32)
        out = model.generate(ids, 32)
        assert out.decode["function"] == "main_batch1_seq1" and out.decode["graphs"] > 0
        np.testing.assert_array_equal(out.tokens, want)
        np.testing.assert_array_equal(model.generate(ids, 32, cache=model.kv_cache(1)).tokens, want)
    ids = np.random.default_rng(6).integers(0, hf_export.VOCAB, (2, 5), dtype=np.int64)  # the generic step
    np.testing.assert_array_equal(model.generate(ids, 16).tokens, _onnxruntime_greedy(kv_model, ids, 16))
