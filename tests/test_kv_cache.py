"""The KV cache updated in place (issue 24): a tiny 2-layer Llama step exported with past_key_values, built on llvm
with the in-place cache and with --kv-cache onnx; greedy tokens equal to onnxruntime's greedy loop for 32 steps;
the in-place step copies no cache; a prompt the cache cannot hold is one error line."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import tvm

pytest.importorskip("transformers")
import hf_export  # noqa: E402  (tests/ is on sys.path)

from tvmfuse.cli import main as cli_main  # noqa: E402
from tvmfuse.cli.tune import main as tune_main  # noqa: E402
from tvmfuse.errors import TvmfuseError  # noqa: E402
from tvmfuse.export.runtime import load  # noqa: E402

CAPACITY, STEPS, BATCH, PROMPT = 48, 32, 2, 5


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory):
    return hf_export.export_with_cache("llama", str(tmp_path_factory.mktemp("kv_onnx")))


@pytest.fixture(scope="module")
def kv_exports(kv_model, tmp_path_factory):
    """{mode: export folder}: the step built once in place (capacity 48) and once with --kv-cache onnx."""
    folders = {}
    for mode in ("inplace", "onnx"):
        out = tmp_path_factory.mktemp(f"kv_{mode}")
        code = tune_main([kv_model, "--target", "llvm", "--trials", "0", "--schedules", "none", "--out", str(out),
                          "--logs", str(out / "logs"), "--kv-cache", mode, "--max-seq", str(CAPACITY)])
        assert code == 0
        folders[mode] = str(out / "llama_kv-llvm")
    return folders


def _onnxruntime_greedy(path: str, ids: np.ndarray, steps: int) -> np.ndarray:
    """Greedy decoding with onnxruntime over the original step: past -> present, fed back each step."""
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    pasts = [i for i in sess.get_inputs() if i.name.startswith("past_")]
    presents = [o.name for o in sess.get_outputs() if o.name.startswith("present")]  # in the pasts' order
    feeds = {p.name: np.zeros((ids.shape[0], p.shape[1], 0, p.shape[3]), np.float32) for p in pasts}
    tokens, step_ids, total = [], ids, 0
    for _ in range(steps):
        total += step_ids.shape[1]
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {
            "input_ids": step_ids, "attention_mask": np.ones((ids.shape[0], total), np.int64), **feeds})))
        step_ids = out["logits"][:, -1].argmax(-1).astype(np.int64)[:, None]
        tokens.append(step_ids[:, 0])
        feeds = {p.name: out[present] for p, present in zip(pasts, presents)}
    return np.stack(tokens, axis=1)


@pytest.mark.parametrize("mode", ["inplace", "onnx"])
def test_greedy_tokens_match_onnxruntime_for_32_steps(kv_model, kv_exports, mode):
    ids = np.random.default_rng(3).integers(0, hf_export.VOCAB, (BATCH, PROMPT), dtype=np.int64)
    model = load(kv_exports[mode])
    assert model.manifest["kv_cache"]["mode"] == mode
    assert model.manifest["verification"]["status"] == "passed"
    got = model.generate(ids, new_tokens=STEPS)
    want = _onnxruntime_greedy(kv_model, ids, STEPS)
    np.testing.assert_array_equal(got.tokens, want)
    assert len(got.step_ms) == STEPS - 1 and got.prefill_ms > 0 and got.tokens_per_s > 0
    if mode == "inplace":  # a cache handed in is reused after a reset: the same tokens again
        cache = model.kv_cache(BATCH)
        np.testing.assert_array_equal(model.generate(ids, STEPS, cache=cache).tokens, want)
        assert cache.length == PROMPT + STEPS - 1 and cache.capacity == CAPACITY
        np.testing.assert_array_equal(model.generate(ids, STEPS, cache=cache).tokens, want)
        (logits,) = model(ids[:, :1], np.ones((BATCH, PROMPT + STEPS), np.int64), PROMPT + STEPS - 1, *cache.tensors)
        assert logits.shape == (BATCH, 1, hf_export.VOCAB)  # one more step by hand, past_len as an int


@pytest.mark.parametrize("mode", ["inplace", "onnx"])
def test_generate_samples_on_the_device_in_windows_or_on_the_host_alike(kv_model, kv_exports, mode):
    ids = np.random.default_rng(5).integers(0, hf_export.VOCAB, (BATCH, PROMPT), dtype=np.int64)
    model = load(kv_exports[mode])
    assert model.manifest["kv_cache"]["greedy"] == "greedy_tokens"
    want = _onnxruntime_greedy(kv_model, ids, 12)
    seen = []
    got = model.generate(ids, 12, sync_every=5, on_token=lambda i, ms: seen.append((i, ms)))
    np.testing.assert_array_equal(got.tokens, want)
    assert [i for i, _ in seen] == list(range(1, 12))  # every step reported, in order, in windows of 5, 5 and 1
    assert len({ms for _, ms in seen[:5]}) == 1 and got.step_ms == [ms for _, ms in seen]
    np.testing.assert_array_equal(model.generate(ids, 12, sync_every=1).tokens, want)
    del model.manifest["kv_cache"]["greedy"]  # an export from before the sampler: the host's argmax
    np.testing.assert_array_equal(model.generate(ids, 12).tokens, want)
    with pytest.raises(TvmfuseError, match="sync_every >= 1"):
        model.generate(ids, 4, sync_every=0)


def test_generate_reads_a_window_once_the_next_is_queued(kv_model, kv_exports, monkeypatch):
    """The host copies a window's tokens only after it has queued the next window's steps (so the GPU never waits
    for those copies and the launches after them), in one copy to the host a window; the last window once it is the
    last. 12 tokens in windows of 5: the prefill and steps 1-5 are 6 calls of the step; steps 1-5 are read after
    call 11, 6-10 after call 12; the host copies the prefill's token and three windows (a copy to the host waits for
    everything queued before it: one a step idled the GPU 4% of a step, generate_run9_h100.json)."""
    ids = np.random.default_rng(5).integers(0, hf_export.VOCAB, (BATCH, PROMPT), dtype=np.int64)
    model = load(kv_exports["inplace"])
    calls, copies = [], []
    to_host = tvm.runtime.Tensor.numpy
    monkeypatch.setattr(tvm.runtime.Tensor, "numpy", lambda self: (copies.append(tuple(self.shape)), to_host(self))[1])

    class CountingVM:  # the export's VM, counting the calls of its step
        def __init__(self, vm):
            self.vm = vm

        def __getitem__(self, name):
            fn = self.vm[name]
            return (lambda *args: (calls.append(name), fn(*args))[1]) if name == "main" else fn

    model.vm = CountingVM(model.vm)
    seen = []
    got = model.generate(ids, 12, sync_every=5, on_token=lambda i, ms: seen.append((i, len(calls))))
    assert seen == [(i, 11) for i in range(1, 6)] + [(i, 12) for i in range(6, 12)]
    assert copies == [(BATCH, 1), (5, BATCH), (5, BATCH), (1, BATCH)], copies
    np.testing.assert_array_equal(got.tokens, _onnxruntime_greedy(kv_model, ids, 12))
    assert len(got.step_ms) == 11 and all(ms > 0 for ms in got.step_ms)


def test_a_prompt_padded_to_a_longer_prefill_gives_the_same_tokens(kv_model, kv_exports):
    """The prefill run at more tokens than the prompt (as it is padded to a seq bucket): the last prompt position's
    logits and the cache entries the decode steps read are the prompt's alone, so onnxruntime's greedy tokens; the
    ONNX-semantics step (its presents would keep the pads) refuses padding."""
    ids = np.random.default_rng(3).integers(0, hf_export.VOCAB, (BATCH, PROMPT), dtype=np.int64)
    want = _onnxruntime_greedy(kv_model, ids, 16)
    got = load(kv_exports["inplace"]).generate(ids, 16, prefill_to=PROMPT + 6)
    np.testing.assert_array_equal(got.tokens, want)
    assert got.prefill == {"function": "main", "length": PROMPT + 6}
    with pytest.raises(TvmfuseError, match="only with the in-place KV cache"):
        load(kv_exports["onnx"]).generate(ids, 4, prefill_to=PROMPT + 6)
    with pytest.raises(TvmfuseError, match=f"cannot pad a {PROMPT}-token prompt to {CAPACITY + 1} tokens"):
        load(kv_exports["inplace"]).generate(ids, 4, prefill_to=CAPACITY + 1)


def test_prefill_length_is_the_shortest_seq_bucket_of_the_batch_that_holds_the_prompt():
    from tvmfuse.export.generate import prefill_length

    def manifest(shapes, mode="inplace"):
        return {"inputs": [{"name": "input_ids", "shape": ["batch", "seq"]},
                           {"name": "attention_mask", "shape": ["batch", "total"]}, {"name": "past_len", "shape": []},
                           {"name": "cache_key_0", "shape": [CAPACITY, "batch", 2, 16]}],
                "kv_cache": {"mode": mode, "capacity": 2176, "position": "past_len",
                             "caches": [{"cache": "cache_key_0"}]},
                "buckets": {"functions": [{"function": "f", "shape": s} for s in shapes],
                            "generic": {"function": "main_generic"}}}

    grid = [{"seq": s, "batch": b} for s in (1, 512, 2048) for b in (1, 16)]
    assert prefill_length(manifest(grid), 1, 300) == 512
    assert prefill_length(manifest(grid), 16, 512) == 512
    assert prefill_length(manifest(grid), 16, 513) == 2048
    assert prefill_length(manifest(grid), 4, 300) == 300  # no bucket of batch 4: the generic function as it is
    assert prefill_length(manifest(grid), 1, 3000) == 3000
    assert prefill_length(manifest([{"seq": 1}, {"seq": 4096}]), 1, 300) == 300  # 4096 > the cache's 2176
    assert prefill_length(manifest([{"seq": 1}, {"seq": 64}]), 7, 30) == 64  # seq alone bucketed: any batch
    assert prefill_length(manifest(grid, mode="onnx"), 1, 300) == 300


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "opt", "qwen2", "gemma", "gemma2", "qwen3", "phi3", "gemma3"])
def test_more_decoders_inplace_greedy_tokens_match_onnxruntime(tmp_path, arch):
    """GPT-2 (no GQA, K^T as a permute of the cache's view), GPT-NeoX (fused QKV split by torch.split, partial
    rotary: its present K/V lost their dims at import, an internal error) and OPT (learned positions sliced
    [past:] from the mask's cumsum: total - past, which FuseTIR could not pass, until the mask's `total` became
    past + seq), Qwen2 (QKV bias) and Gemma (GeGLU, scaled embeddings), Gemma 2 (soft-capped scores, sliding-window
    layers), Qwen3 (Q/K norms), Phi-3 (one QKV projection, its V written into the cache from the projection's rows,
    not through a slice's copy), Gemma 3: in place, no cache copy, onnxruntime's tokens."""
    path = hf_export.export_with_cache(arch, str(tmp_path))
    fused = _lowered(path, "inplace")
    assert _cache_copies(fused) == []
    from_rows = [k for k in fused.kernels() if k.startswith("kv_cache_write") and "_of_rows_" in k]
    assert bool(from_rows) == (arch == "phi3"), from_rows
    out = tmp_path / "out"
    assert tune_main([path, "--target", "llvm", "--trials", "0", "--schedules", "none", "--out", str(out),
                      "--logs", str(out / "logs"), "--max-seq", str(CAPACITY)]) == 0  # in place by default
    ids = np.random.default_rng(5).integers(0, hf_export.VOCAB, (BATCH, PROMPT), dtype=np.int64)
    model = load(str(out / f"{arch}_kv-llvm"))
    assert model.manifest["kv_cache"]["mode"] == "inplace"
    np.testing.assert_array_equal(model.generate(ids, STEPS).tokens, _onnxruntime_greedy(path, ids, STEPS))


@pytest.mark.parametrize("arch, scale", [("llama", 0.25), ("gpt2", 0.25), ("gpt_neox", 0.25), ("opt", 1.0),
                                         ("qwen2", 0.25), ("gemma", 0.25), ("gemma2", 256 ** -0.5),
                                         ("qwen3", 0.25), ("phi3", 0.25), ("gemma3", 256 ** -0.5)])
def test_every_decoders_step_attention_takes_the_step_template(tmp_path, arch, scale):
    """One attention kernel per step for each architecture, the step template's, with the softmax scale of the
    graph: 1/sqrt(16) for the tiny models' head dim 16, and 1 for OPT, which scales Q in its projection before the
    head split (and casts K^T down without a scale: it ran as ~17 generic kernels a layer before); Gemma 2's and 3's
    1/sqrt(query_pre_attn_scalar), and Gemma 2's soft cap of its scores (attn_logit_softcapping, 50)."""
    from tvmfuse.kernels import substitute  # pylint: disable=import-outside-toplevel

    fused = _lowered(hf_export.export_with_cache(arch, str(tmp_path)), "inplace", "llvm", "fp16")
    log: list = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    assert [outcome for _, outcome in log] == ["template attention_step"], log
    ((name, _),) = log
    shapes = json.loads(str(new[name].attrs["tvmfuse.template"]))["shapes"]
    assert shapes["scale"] == pytest.approx(scale)
    assert shapes.get("softcap") == (50.0 if arch == "gemma2" else None)


@pytest.mark.parametrize("cache", ["onnx", "inplace"])
def test_an_opt_step_of_fixed_length_builds_and_verifies(tmp_path, cache):
    """OPT (learned positions from the mask's cumsum, sliced [past:] with end INT64_MAX): a step of 1 token
    (--shape seq=1 --shape batch=1) builds and matches onnxruntime, with the exported cache copy and in place (the
    slice's length was INT64_MAX - past: an int64 overflow in a Reshape, or the sum with the embeddings lost its
    dims)."""
    path = hf_export.export_with_cache("opt", str(tmp_path))
    out = tmp_path / "out"
    assert tune_main([path, "--target", "llvm", "--trials", "0", "--schedules", "none", "--kv-cache", cache,
                      "--max-seq", str(CAPACITY), "--shape", "seq=1", "--shape", "batch=1", "--out", str(out),
                      "--logs", str(out / "logs")]) == 0
    manifest = json.loads((out / "opt_kv-llvm" / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "passed" and manifest["kv_cache"]["mode"] == cache


def test_an_opt_prompt_padded_to_its_bucket_generates_onnxruntimes_tokens(tmp_path):
    """OPT with --buckets seq=1,16: a 5-token prompt runs in main_seq16, padded with mask zeros; its positions come
    from the mask's cumsum, so the padding must not shift them: onnxruntime's greedy tokens (unpadded)."""
    path = hf_export.export_with_cache("opt", str(tmp_path))
    out = tmp_path / "out"
    assert tune_main([path, "--target", "llvm", "--trials", "0", "--schedules", "none", "--out", str(out),
                      "--logs", str(out / "logs"), "--max-seq", str(CAPACITY), "--buckets", "seq=1,16"]) == 0
    model = load(str(out / "opt_kv-llvm"))
    ids = np.random.default_rng(7).integers(0, hf_export.VOCAB, (BATCH, 5), dtype=np.int64)
    result = model.generate(ids, 12)
    assert result.prefill == {"function": "main_seq16", "length": 16}, result.prefill
    np.testing.assert_array_equal(result.tokens, _onnxruntime_greedy(path, ids, 12))


def test_inplace_with_a_decode_bucket_matches_onnxruntime(kv_model, tmp_path):
    """--buckets seq=1: a static decode copy of the in-place step (dispatched for seq 1), the prefill on the
    generic one; onnxruntime's greedy tokens. (The cost model used to fail on the bucket's "past + 1".)"""
    out = tmp_path / "out"
    assert tune_main([kv_model, "--target", "llvm", "--trials", "0", "--schedules", "none", "--out", str(out),
                      "--logs", str(out / "logs"), "--max-seq", str(CAPACITY), "--buckets", "seq=1"]) == 0
    model = load(str(out / "llama_kv-llvm"))
    assert [f["function"] for f in model.manifest["buckets"]["functions"]] == ["main_seq1"]
    ids = np.random.default_rng(6).integers(0, hf_export.VOCAB, (1, PROMPT), dtype=np.int64)
    np.testing.assert_array_equal(model.generate(ids, 16).tokens, _onnxruntime_greedy(kv_model, ids, 16))


def test_optimum_style_cache_names_verify_and_generate(tmp_path):
    """past_key_values.0.key / present.0.key (renamed by TVM's importer to past_key_values_0_key): verification
    feeds onnxruntime by the ONNX names (it raised "Required inputs ... are missing"), the tokens match."""
    path = hf_export.export_with_cache("llama", str(tmp_path), hf_names=True)
    out = tmp_path / "out"
    assert tune_main([path, "--target", "llvm", "--trials", "0", "--schedules", "none", "--out", str(out),
                      "--logs", str(out / "logs"), "--max-seq", str(CAPACITY)]) == 0
    model = load(str(out / "llama_kv_hf-llvm"))
    assert model.manifest["verification"]["status"] == "passed"
    assert [s["cache"] for s in model.manifest["kv_cache"]["caches"]][:2] == ["cache_key_values_0_key",
                                                                              "cache_key_values_0_value"]
    ids = np.random.default_rng(7).integers(0, hf_export.VOCAB, (1, PROMPT), dtype=np.int64)
    np.testing.assert_array_equal(model.generate(ids, 8).tokens, _onnxruntime_greedy(path, ids, 8))


def test_inplace_manifest_describes_the_step_and_its_cache(kv_exports):
    with open(os.path.join(kv_exports["inplace"], "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    cache = manifest["kv_cache"]
    assert cache["capacity"] == CAPACITY and cache["dtype"] == "float32" and cache["position"] == "past_len"
    assert [s["cache"] for s in cache["caches"]] == ["cache_key_0", "cache_value_0", "cache_key_1", "cache_value_1"]
    assert [t["name"] for t in manifest["inputs"]] == ["input_ids", "attention_mask", "past_len", "cache_key_0",
                                                       "cache_value_0", "cache_key_1", "cache_value_1"]
    assert manifest["inputs"][3]["shape"] == [CAPACITY, "batch", 2, 16]
    assert [t["name"] for t in manifest["outputs"]] == ["logits"]


def _lowered(path: str, mode: str, target: str = "llvm", dtype: str = "fp32"):
    """The step as the pipeline fuses it for `target`, computing in `dtype`."""
    from tvmfuse.jobs import Job  # pylint: disable=import-outside-toplevel
    from tvmfuse.pipeline import frontend_phase, fuse_phase, kv_cache_phase  # pylint: disable=import-outside-toplevel
    from tvmfuse.prepare import prepare_module  # pylint: disable=import-outside-toplevel
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    job = Job(name="kv", path=path, kv_cache=mode, max_seq=CAPACITY, dtype=dtype)
    imported = frontend_phase(job)
    bound, _ = kv_cache_phase(prepare_module(imported, job.dtype), imported, job, lambda s: None)
    return fuse_phase(bound, resolve_target(target))


def _cache_copies(fused) -> list[str]:
    """Kernels of main that copy a cache-sized tensor: a concatenation, or any kernel other than the attention
    reading a cache (the write kernel aside), or a copy of a past/cache parameter."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    main = fused.mod["main"]
    caches = {p for p in main.params if p.name.startswith(("cache_", "past_"))}
    bound = {b.var: b.value for blk in main.body.blocks for b in blk.bindings}
    views = {v for v, c in bound.items()
             if isinstance(c, relax.Call) and getattr(c.op, "name", "") == "relax.memory.view"}
    copies = []
    for var, call in bound.items():
        if not isinstance(call, relax.Call) or getattr(call.op, "name", "") not in ("relax.call_tir",
                                                                                   "relax.call_tir_inplace"):
            continue
        kernel, args = call.args[0].name_hint, list(call.args[1].fields)
        reads_cache = any(a in caches or a in views for a in args)
        if "concat" in kernel and reads_cache:
            copies.append(kernel)
        elif reads_cache and fused.pattern_of(kernel) != "tvmfuse.attention" \
                and not kernel.startswith("kv_cache_write"):
            copies.append(kernel)
    return copies


def test_cache_write_reads_past_exact_casts_the_heads_major_transpose_and_a_slice_of_rows_only():
    """_write_source: a cast to fp32 of a value already in the cache's dtype (exact back), one transpose of
    [batch, seq, heads, dim] to heads-major, and under that transpose a head split of a unit-stride slice of the last
    axis of [batch, seq, width] in the cache's dtype (Phi-3's V: the write reads those rows where they lie) are
    skipped; a rounding cast, any other permutation, a strided slice and a slice in another dtype are not."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from tvmfuse.prepare.kv_cache import _write_source  # pylint: disable=import-outside-toplevel

    def chain(dtype, *ops, shape=(2, 3, 4, 8)):
        """([x, each op's var], {var: value}) of a function applying `ops` in turn to x of `shape`."""
        x = relax.Var("x", relax.TensorType(list(shape), dtype))
        bb, last = relax.BlockBuilder(), x
        with bb.function("f", [x]):
            with bb.dataflow():
                for op in ops:
                    last = bb.emit(op(last))
                out = bb.emit_output(last)
            bb.emit_func_output(out)
        fn = bb.get()["f"]
        bindings = [b for blk in fn.body.blocks for b in blk.bindings if not isinstance(b.value, relax.Var)]
        return [fn.params[0]] + [b.var for b in bindings], {b.var: b.value for b in bindings}

    up = lambda v: relax.op.astype(v, "float32")  # noqa: E731
    down = lambda v: relax.op.astype(v, "float16")  # noqa: E731
    heads_major = lambda v: relax.op.permute_dims(v, [0, 2, 1, 3])  # noqa: E731
    v, bound = chain("float16", heads_major, up)  # V as exported: transpose, then the cast for the fp32 past
    assert _write_source(v[-1], bound, "float16") == (v[0], True, None)
    v, bound = chain("float16", up, heads_major)
    assert _write_source(v[-1], bound, "float16") == (v[0], True, None)
    v, bound = chain("float32", down, up)  # fp32 -> fp16 rounds: only the exact cast back up is skipped
    assert _write_source(v[-1], bound, "float16") == (v[1], False, None)
    v, bound = chain("float32", up)
    assert _write_source(v[-1], bound, "float16") == (v[-1], False, None)  # fp32 into an fp16 cache: the write casts
    v, bound = chain("float16", lambda x: relax.op.permute_dims(x, [0, 1, 3, 2]), up)
    assert _write_source(v[-1], bound, "float16") == (v[1], False, None)
    v, bound = chain("float16", heads_major, heads_major)  # one transpose only: the write has one layout of each
    assert _write_source(v[-1], bound, "float16") == (v[1], True, None)
    to_heads = lambda v: relax.op.reshape(v, [2, 3, 4, 8])  # noqa: E731
    for dtype, stride, taken in (("float16", 1, True), ("float16", 2, False), ("float32", 1, False)):
        cut = lambda x, stride=stride: relax.op.strided_slice(x, [2], [32], [32 + 32 * stride], [stride])  # noqa: E731
        casts = (up,) if dtype == "float16" else ()  # fp32 rows into an fp16 cache: the write reads the slice's copy
        v, bound = chain(dtype, cut, to_heads, heads_major, *casts, shape=(2, 3, 96))
        got = _write_source(v[-1], bound, "float16")
        assert got == ((v[0], True, (96, 32)) if taken else (v[2], True, None)), (dtype, stride, got)


def test_inplace_step_has_no_concat_or_copy_of_the_cache(kv_model):
    """In place: each cache is written by the in-place kernel, viewed (no copy) and read only by the attention;
    no kernel concatenates or copies it. The check itself finds the copies of the ONNX-semantics step."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    fused = _lowered(kv_model, "inplace")
    main = fused.mod["main"]
    assert _cache_copies(fused) == []
    calls = [b.value for blk in main.body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)]
    writes = [c for c in calls if getattr(c.op, "name", "") == "relax.call_tir_inplace"]
    assert len(writes) == 4 and all(c.args[0].name_hint.startswith("kv_cache_write") for c in writes)
    assert sum(getattr(c.op, "name", "") == "relax.memory.view" for c in calls) == 4
    assert not any("concatenate" in str(c.args[0]) and any(str(a).startswith("cache_") for a in c.args[1].fields)
                   for c in calls if getattr(c.op, "name", "") == "relax.call_tir")
    assert _cache_copies(_lowered(kv_model, "onnx"))  # the past -> present concatenations


def test_compiled_step_views_the_cache_it_writes(kv_exports):
    """In the exported VM code each cache register is written by kv_cache_write and then viewed as it is
    (runtime.TVMTensorCreateView on the same register): no kernel or copy between the write and the read."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm import relax  # pylint: disable=import-outside-toplevel

    text = relax.VMExecutable(tvm.runtime.load_module(os.path.join(kv_exports["inplace"], "model.so"))).as_text()
    writes = re.findall(r"call\s+kv_cache_write_float32(?:_seq_major)? in: (%\d+),", text)
    views = re.findall(r"call\s+runtime.TVMTensorCreateView in: (%\d+),", text)
    assert len(writes) == 4 and views == writes


def test_prompt_longer_than_the_cache_is_one_error_line(kv_exports, capsys):
    code = cli_main(["generate", kv_exports["inplace"], "--batch", "1", "--prompt-len", str(CAPACITY + 1),
                     "--new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and f"holds {CAPACITY}" in err[0]


def test_generate_bad_input_is_one_error_line(kv_exports, tmp_path, capsys):
    """Not an export, an export without a KV cache, unreadable or ragged ids, a zero count: one error line, exit 2."""
    import shutil  # pylint: disable=import-outside-toplevel

    plain = tmp_path / "plain"
    shutil.copytree(kv_exports["inplace"], plain)
    manifest = json.loads((plain / "manifest.json").read_text())
    del manifest["kv_cache"]
    (plain / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "ragged.txt").write_text("1 2 3\n4 5\n")
    (tmp_path / "words.txt").write_text("one two\n")
    cases = [([str(tmp_path)], "no manifest.json"), ([str(plain)], "not a decoder step with a KV cache"),
             ([kv_exports["inplace"], "--ids", str(tmp_path / "ragged.txt")], "rows of different lengths"),
             ([kv_exports["inplace"], "--ids", str(tmp_path / "words.txt")], "cannot read token ids"),
             ([kv_exports["inplace"], "--new-tokens", "0"], "--new-tokens must be >= 1")]
    for args, message in cases:
        code = cli_main(["generate", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], (args, err)


def test_generate_command_prints_its_times(kv_exports, tmp_path, capsys):
    ids = tmp_path / "ids.txt"
    ids.write_text("1 2 3\n4 5 6\n")
    assert cli_main(["generate", kv_exports["inplace"], "--ids", str(ids), "--new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "ms/token" in out and "tokens/s (batch 2, KV cache inplace)" in out
    assert "6/6 tokens" in out and out.count("tokens[") == 2


@pytest.mark.parametrize("size,named", [(["--buckets", "seq=1,300"], " (seq)"), (["--shape", "seq=300"], "")])
def test_a_step_longer_than_the_cache_is_one_error_line_and_nothing_is_written(kv_model, tmp_path, capsys, size,
                                                                               named):
    """--buckets seq=300 (or --shape seq=300) with --max-seq 64: a prompt of that length cannot fit the cache (it
    was an internal error from a view past the cache's end); one error line naming both sizes, exit 2, no export."""
    code = tune_main([kv_model, "--target", "llvm", "--trials", "0", "--schedules", "none", "--max-seq", "64", *size,
                      "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert f"a step of 300 tokens{named} does not fit" in err[0] and "KV cache of 64 positions" in err[0], err
    assert not (tmp_path / "o" / "llama_kv-llvm").exists()


@pytest.mark.parametrize("batch", [[], ["--shape", "batch=1"]])
def test_a_step_of_a_fixed_length_builds_and_verifies_in_place(kv_model, tmp_path, capsys, batch):
    """--shape seq=8: the decoder mask is probed at that query length and the verification's step has 8 tokens
    (both had probed 1-3 and 2, an internal error); the in-place step matches onnxruntime. With batch 1 too (the
    positions `past + arange(8)` failed in TVM's importer, then the attention's CPU schedule to lower)."""
    code = tune_main([kv_model, "--target", "llvm", "--trials", "0", "--schedules", "none", "--max-seq", "64",
                      "--shape", "seq=8", *batch, "--out", str(tmp_path / "o"), "--logs", str(tmp_path / "l")])
    out = capsys.readouterr().out
    # one mask kernel (since the prepare stage drops reshapes to the same shape it finds one mask, not two of the
    # same values)
    assert code == 0 and re.search(r"decoder mask: the mask \w+: one kernel", out), out
    manifest = json.loads((tmp_path / "o" / "llama_kv-llvm" / "manifest.json").read_text())
    assert manifest["verification"]["status"] == "passed" and manifest["kv_cache"]["capacity"] == 64


def test_without_max_seq_a_long_step_bucket_sizes_the_cache_for_it_and_new_tokens(kv_model, tmp_path):
    """No --max-seq and a seq bucket of 300 (over the default 256): the cache holds that prompt and 256 new tokens
    (556 positions), where it had 256 and the build failed."""
    out = tmp_path / "o"
    code = tune_main([kv_model, "--target", "llvm", "--trials", "0", "--schedules", "none", "--buckets", "seq=1,300",
                      "--out", str(out), "--logs", str(tmp_path / "l")])
    assert code == 0
    assert json.loads((out / "llama_kv-llvm" / "manifest.json").read_text())["kv_cache"]["capacity"] == 300 + 256


def test_inplace_on_a_model_without_a_cache_is_an_error():
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from tvmfuse.prepare.kv_cache import in_place_kv_cache  # pylint: disable=import-outside-toplevel

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 3], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(x, x))
        bb.emit_func_output(out)
    with pytest.raises(TvmfuseError, match="no KV cache"):
        in_place_kv_cache(bb.get(), 16, ["y"])


@pytest.mark.gpu
def test_cuda_inplace_decode_matches_onnxruntime(kv_model, tmp_path):
    """On a GPU: the in-place step built for CUDA (attention templates where they take the cache's view, the
    generic kernel elsewhere) gives onnxruntime's greedy tokens; with CUDA graphs too."""
    ids = np.random.default_rng(4).integers(0, hf_export.VOCAB, (1, PROMPT), dtype=np.int64)
    want = _onnxruntime_greedy(kv_model, ids, STEPS)
    for extra in ([], ["--cuda-graph"]):
        out = tmp_path / f"cuda{len(extra)}"
        assert tune_main([kv_model, "--target", "cuda", "--trials", "0", "--schedules", "none", "--out", str(out),
                          "--logs", str(out / "logs"), "--max-seq", str(CAPACITY), *extra]) == 0
        folder = next(p for p in out.iterdir() if p.name.startswith("llama_kv-"))
        np.testing.assert_array_equal(load(str(folder)).generate(ids, STEPS).tokens, want)


#: the steps the in-place step and onnxruntime both run: the prompt (past 0), one token at a time, then three
#: tokens at once after a past (a prefill after a past), then one at a time again
STEP_LENGTHS = [PROMPT, 1, 1, 1, 3, 1, 1]


def _steps_match_onnxruntime(path: str, run_step, dtype: str) -> list[int]:
    """Run `run_step(ids, mask, past_len) -> logits` (the in-place step, its caches inside) and onnxruntime's
    past -> present step on the same tokens (onnxruntime's greedy choice, so both read the same inputs) for
    STEP_LENGTHS; assert the logits agree within the compute dtype's tolerance at every step; the past lengths."""
    from tvmfuse.verify.outputs import compare  # pylint: disable=import-outside-toplevel

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    pasts = [i for i in sess.get_inputs() if i.name.startswith("past_")]
    names = [o.name for o in sess.get_outputs()]
    feeds = {p.name: np.zeros((BATCH, p.shape[1], 0, p.shape[3]), np.float32) for p in pasts}
    rng = np.random.default_rng(9)
    ids, past, seen = rng.integers(0, hf_export.VOCAB, (BATCH, STEP_LENGTHS[0]), dtype=np.int64), 0, []
    for i, length in enumerate(STEP_LENGTHS):
        mask = np.ones((BATCH, past + length), np.int64)
        out = dict(zip(names, sess.run(None, {"input_ids": ids, "attention_mask": mask, **feeds})))
        check = compare([run_step(ids, mask, past)], [out["logits"]], dtype)
        assert check.ok, (past, length, check.as_dict())
        seen.append(past)
        feeds = {p.name: out[p.name.replace("past_", "present_")] for p in pasts}
        past += length
        nxt = STEP_LENGTHS[i + 1] if i + 1 < len(STEP_LENGTHS) else 1
        ids = np.concatenate([out["logits"][:, -1:].argmax(-1)] + [rng.integers(0, hf_export.VOCAB, (BATCH, nxt - 1))],
                             axis=1).astype(np.int64)
    return seen


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_inplace_step_keeps_the_cache_in_the_compute_dtype(kv_model, dtype):
    """--dtype fp16/bf16: the caches are fp16/bf16 (the past K/V inputs have symbolic shapes, so the precision pass
    left their concatenation in fp32), each written from the step's K/V as they are computed (no cast to fp32 and
    back; V before its transpose to heads-major) and read, through a cast, inside the attention kernel, which takes
    the cache's view in place: no other kernel reads a cache."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    want = {"fp16": "float16", "bf16": "bfloat16"}[dtype]
    fused = _lowered(kv_model, "inplace", "cuda", dtype)
    main = fused.mod["main"]
    assert [str(p.ty.dtype) for p in main.params if p.name.startswith("cache_")] == [want] * 4
    assert _cache_copies(fused) == []
    assert list(fused.kernel_patterns.values()).count("tvmfuse.attention") == 1  # the two layers share it
    writes = [b.value for blk in main.body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)
              and getattr(b.value.op, "name", "") == "relax.call_tir_inplace"]
    assert sorted(c.args[0].name_hint for c in writes) == [f"kv_cache_write_{want}"] * 2 + [
        f"kv_cache_write_{want}_seq_major"] * 2  # K after the rotary (heads-major), V as projected
    bound = {b.var: b.value for blk in main.body.blocks for b in blk.bindings}
    moves = re.compile(r"(fused_)?(reshape\d*_)*((transpose|cast)\d*_?)+")  # a transpose or cast kernel, no more
    producers = [bound[write.args[1].fields[1]].args[0].name_hint for write in writes]
    assert not [p for p in producers if moves.fullmatch(p)], producers  # each write reads what a kernel computed


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_low_precision_inplace_step_verifies_and_generates_on_llvm(kv_model, tmp_path, dtype):
    """`--dtype fp16/bf16` in place on llvm: the manifest's cache dtype is the compute dtype, the step verifies
    against onnxruntime's past -> present step at that dtype's tolerance, and generation runs on the half-size
    cache (its tensors in that dtype)."""
    out = tmp_path / "out"
    assert tune_main([kv_model, "--target", "llvm", "--trials", "0", "--schedules", "none", "--dtype", dtype,
                      "--out", str(out), "--logs", str(out / "logs"), "--max-seq", str(CAPACITY)]) == 0
    model = load(str(out / "llama_kv-llvm"))
    want = {"fp16": "float16", "bf16": "bfloat16"}[dtype]
    assert model.manifest["kv_cache"]["dtype"] == want and model.manifest["verification"]["status"] == "passed"
    cache = model.kv_cache(BATCH)
    ids = np.random.default_rng(8).integers(0, hf_export.VOCAB, (BATCH, PROMPT), dtype=np.int64)
    assert model.generate(ids, 8, cache=cache).tokens.shape == (BATCH, 8)
    assert {str(t.dtype) for t in cache.tensors} == {want} and cache.length == PROMPT + 7
    fresh = model.kv_cache(BATCH)  # zeros, in the cache's dtype
    assert [str(t.dtype) for t in fresh.tensors] == [want] * 4 and not any(
        np.asarray(t.numpy(), np.float32).any() for t in fresh.tensors)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cuda_inplace_step_takes_the_step_template_and_compiles_for_sm_90a(kv_model, dtype):
    """The CUDA build of the in-place step (symbolic batch, seq and past): its attention kernel, reading K/V from
    the caches' [past + seq, batch, kv heads, head dim] view with GQA and the additive mask, is taken by the step
    template (flash-decoding at one token, the prefill kernel otherwise), as the job log would say; the built
    module's CUDA source compiles with nvcc for sm_90a."""
    from checks import cuda_sources  # pylint: disable=import-outside-toplevel

    import tvm  # pylint: disable=import-outside-toplevel

    from tvmfuse.build.compile import apply_default_schedules, compile_module  # pylint: disable=import-outside-toplevel
    from tvmfuse.kernels import substitute  # pylint: disable=import-outside-toplevel
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    cuda = resolve_target("cuda")
    fused = _lowered(kv_model, "inplace", "cuda", dtype)
    log: list = []
    new = substitute(fused.mod, fused.kernel_patterns, target="cuda", log=log)
    assert [outcome for _, outcome in log] == ["template attention_step"], log
    (name,) = [k for k, _ in log]
    shapes = json.loads(str(new[name].attrs["tvmfuse.template"]))["shapes"]
    assert (shapes["k_layout"], shapes["v_layout"], shapes["seq_q"], shapes["seq_k"]) == \
        ("SBHD", "SBHD", "seq", "past + seq")
    assert (shapes["heads"], shapes["kv_heads"], shapes["mask"]) == (4, 2, "additive")
    (src,) = cuda_sources(compile_module(apply_default_schedules(new, cuda), cuda))
    kernel = [k for k in src.split('extern "C" __global__')[1:] if "k_ptr" in k]
    assert len(kernel) >= 3  # the split pass and the combine of the decode branch, and the prefill kernel
    assert "mma.sync.aligned.m16n8k16" in src and "__shfl_xor_sync" in src
    with cuda:
        assert len(tvm.support.nvcc.compile_cuda(src, "fatbin", compiler="nvcc")) > 1000


def test_inplace_step_with_the_step_template_matches_onnxruntime_on_llvm(kv_model):
    """The step template's CPU variant substituted into the fp16 in-place step (the call site as on CUDA: the
    cache's view, the additive mask, the scalars dropped), run on llvm: the logits match onnxruntime's at the
    prompt, at one token after pasts of several lengths, and at three tokens after a past."""
    import tvm  # pylint: disable=import-outside-toplevel

    from tvmfuse.build.compile import build  # pylint: disable=import-outside-toplevel
    from tvmfuse.kernels import substitute  # pylint: disable=import-outside-toplevel
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    llvm = resolve_target("llvm")
    fused = _lowered(kv_model, "inplace", "llvm", "fp16")
    log: list = []
    new = substitute(fused.mod, fused.kernel_patterns, target="llvm", log=log)
    assert [outcome for _, outcome in log] == ["template attention_step"], log
    vm = tvm.relax.VirtualMachine(build(new, llvm)[0], tvm.cpu())
    caches = [tvm.runtime.tensor(np.zeros((CAPACITY, BATCH, 2, 16), "float16")) for _ in range(4)]

    def run_step(ids, mask, past):
        return vm["main"](tvm.runtime.tensor(ids), tvm.runtime.tensor(mask), tvm.runtime.ShapeTuple([past]),
                          *caches).numpy()

    assert _steps_match_onnxruntime(kv_model, run_step, "float16") == [0, 5, 6, 7, 8, 11, 12]


@pytest.mark.gpu
@pytest.mark.parametrize("arch,dtype", [("llama", "fp16"), ("llama", "bf16"), ("opt", "fp16"), ("gpt2", "fp16"),
                                        ("qwen2", "fp16")])
def test_gpu_inplace_step_with_the_step_template_matches_onnxruntime(kv_model, tmp_path, arch, dtype):
    """On a GPU: the in-place step built for CUDA in fp16/bf16 (the step template on its attention, the caches in
    the compute dtype) passes its verification, and its logits match onnxruntime's at the prompt, at decode after
    pasts of several lengths, and at a three-token prefill after a past: Llama in both dtypes, and in fp16 OPT (its
    step attention on the templates with scale 1: OPT scales Q in its projection), GPT-2 and Qwen2 (GQA, QKV
    bias)."""
    path = kv_model if arch == "llama" else hf_export.export_with_cache(arch, str(tmp_path))
    out = tmp_path / "out"
    assert tune_main([path, "--target", "cuda", "--trials", "0", "--schedules", "none", "--dtype", dtype,
                      "--out", str(out), "--logs", str(out / "logs"), "--max-seq", str(CAPACITY)]) == 0
    model = load(str(next(p for p in out.iterdir() if p.name.startswith(f"{arch}_kv-"))))
    assert model.manifest["verification"]["status"] == "passed"
    assert model.manifest["kv_cache"]["dtype"] == {"fp16": "float16", "bf16": "bfloat16"}[dtype]
    cache = model.kv_cache(BATCH)
    compute = model.manifest["precision"]["compute_dtype"]
    assert _steps_match_onnxruntime(path, lambda ids, mask, past: model(ids, mask, past, *cache.tensors)[0],
                                    compute) == [0, 5, 6, 7, 8, 11, 12]
