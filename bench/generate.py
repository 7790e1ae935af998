"""Issue 24's acceptance bench: greedy generation like an inference engine. Llama-2-7B's shapes (hidden 4096,
intermediate 11008, 32 heads, 32 KV heads, vocab 32000) with --layers N and random weights (seed 0), exported by
torch.onnx as one decoder step with a KV cache, built by the product with the in-place cache and CUDA graphs for the
decode steps, and its `generate` against torch.compile on the same weights (HF StaticCache +
torch.compile(mode="reduce-overhead"), the gpt-fast recipe), greedy, on the same prompts.

    python3 bench/generate.py --layers 8 --work /tmp/gen --out $OUT/gen --budget-s 560
    python3 bench/generate.py --smoke --work /tmp/gen-smoke --out /tmp/gen-smoke/res    # CPU, llvm, fp32: seconds

Phases, each in its own process (the GPU and the memory are the next one's):
  export  the model (fp32, seed 0) on the GPU, exported as a step with input_ids [batch, seq], attention_mask
          [batch, total] and past_key_<i> / past_value_<i> [batch, kv heads, past, head dim] in, logits and the
          presents out (dynamic batch, seq, past; the dynamo exporter, weights as external data);
  build   `python -m tvmfuse tune MODEL --target cuda --dtype fp16 --trials 0 --max-seq 2176 --cuda-graph
          --buckets seq=1,<the prompts> --buckets batch=<the batches>` (a static decode function per batch, which
          CUDA graphs capture, and a static prefill per prompt length, which gets the GEMM and attention templates);
  run     the export's generate for each batch x prompt: prefill ms, ms per token, tokens/s, the function the decode
          ran in and its CUDA graphs; the bytes-moved roofline per token at the copy bandwidth this phase measures;
          --profile: the GPU's kernels (CUPTI via torch.profiler) of the prefill and of 8 decode steps, per step;
  torch   the same weights in fp16: prefill eager, decode steps compiled (reduce-overhead: CUDA graphs), timed without
          a sync per step; its greedy tokens, and per row the leading tokens identical to tvmfuse's.
Results merge into OUT/generate.json after every phase and row (a phase that fails or runs out of time leaves the
others' results and its own error).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")  # (for the build and the run phases, as bench/models.py)

from bench.big_model import LLAMA2_7B, SMOKE  # noqa: E402

PHASES = ("export", "build", "run", "torch")
FULL_RUN = {"layers": 8, "batches": "1,16", "prompts": "512,2048", "new_tokens": 128, "max_seq": 2176}
SMOKE_RUN = {"layers": 2, "batches": "1,2", "prompts": "8,16", "new_tokens": 8, "max_seq": 32}
NOTES = ("ms_per_token: mean wall time of one decode step for the whole batch (tvmfuse: the export's generate, argmax on "
         "the GPU by the export's greedy sampler, each step's tokens fed to the next where they lie, the host waiting "
         "for the GPU once every 16 steps; torch: the compiled steps back to back, argmax on the GPU, one sync at the "
         "end); tokens_per_s = batch / step; roofline_ms: the bytes one "
         "decode step must read at least, the fp16 weights except the input embedding (one row of it per token) plus "
         "the fp16 K and V of every layer at the mean cache length (prompt + new_tokens / 2), over the copy bandwidth "
         "the run phase measured; fraction_of_roofline = roofline_ms / ms_per_token; identical_leading_tokens: per "
         "row, how many greedy tokens agree before the first difference; profile: per kernel its duration (us, which "
         "under dependent launch counts its wait for the kernel before) and its exposed_us (the time it ran past "
         "the kernels started before it: bench/model_timing.exposed_time)")


def _shape(args) -> dict:
    return SMOKE if args.smoke else LLAMA2_7B


def _paths(args) -> dict:
    w = args.work
    return {"onnx": os.path.join(w, "onnx", "llama_step.onnx"), "out": os.path.join(w, "out"),
            "logs": os.path.join(w, "logs"),
            "export": os.path.join(w, "out", "llama_step-llvm" if args.smoke else "llama_step-cuda-sm_90a")}


def _load(out: str) -> dict:
    path = os.path.join(out, "generate.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _merge(out: str, keys: tuple, value) -> None:
    """Set `value` at the nested `keys` of OUT/generate.json (written atomically)."""
    os.makedirs(out, exist_ok=True)
    data = _load(out)
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    path = os.path.join(out, "generate.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def _rows(args) -> list[tuple[int, int]]:
    return [(b, p) for b in args.batches for p in args.prompts]


def _key(batch: int, prompt: int) -> str:
    return f"b{batch}_p{prompt}"


def prompt_ids(batch: int, prompt: int, vocab: int):
    """The seeded prompt of a row (the same in every phase)."""
    import numpy as np
    return np.random.default_rng(1000 * batch + prompt).integers(0, vocab, (batch, prompt), dtype=np.int64)


def roofline(config: dict, batch: int, prompt: int, new_tokens: int, copy_bw: float) -> dict:
    """The bytes a decode step reads at least (NOTES) and the time they take at `copy_bw` bytes/s."""
    shape = config["shape"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    weights = 2 * (config["parameters"] - shape["vocab_size"] * shape["hidden_size"])
    mean_len = prompt + new_tokens / 2
    kv = 2 * 2 * config["layers"] * batch * shape["num_key_value_heads"] * head_dim * mean_len
    return {"weight_bytes": weights, "kv_bytes_at_mean_length": kv, "mean_cache_length": mean_len,
            "roofline_ms": (weights + kv) / copy_bw * 1e3}


def _leading_equal(a, b) -> list[int]:
    """Per row, the number of leading tokens `a` and `b` share."""
    import numpy as np
    a, b = np.asarray(a), np.asarray(b)
    differ = a != b
    return [int(np.argmax(row)) if row.any() else len(row) for row in differ]


# ----------------------------------------------------------------------------------------------------------- phases

def decoder_step(model):
    """`model` as one exported step: (input_ids, attention_mask, past k0, v0, k1, ...) -> (logits, present k0, v0,
    ...), each present the past with this step's K/V appended (the cache idiom the product recognises)."""
    import torch
    import transformers as tf

    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *past):
            cache = tf.DynamicCache()
            for i in range(0, len(past), 2):
                cache.update(past[i], past[i + 1], i // 2)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, return_dict=True,
                             **{cache_kw: cache})
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            return (out.logits, *[t for layer in cache.layers for t in (layer.keys, layer.values)])

    return Step().eval()


def _llama(args, device: str):
    """The fp32 model with random weights from seed 0, on `device`."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=args.layers, **_shape(args))
    cfg._attn_implementation = "sdpa"  # pylint: disable=protected-access  (what a user gets by default)
    with torch.device(device):
        return tf.LlamaForCausalLM(cfg).eval()


def _checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def phase_export(args) -> dict:
    """The model on the GPU, exported as a decoder step with a cache (dynamic batch, seq, past)."""
    import warnings

    import torch

    p = _paths(args)
    device = "cpu" if args.smoke else "cuda"
    t = time.time()
    model = _llama(args, device)
    info = {"parameters": sum(x.numel() for x in model.parameters()), "init_s": round(time.time() - t, 1),
            "checksum": _checksum(model)}
    _merge(args.out, ("config", "parameters"), info["parameters"])
    os.makedirs(args.work, exist_ok=True)
    with open(os.path.join(args.work, "export.json"), "w", encoding="utf-8") as f:  # beside the ONNX file it counts
        json.dump({"parameters": info["parameters"], "checksum": info["checksum"]}, f)
    layers, shape = args.layers, _shape(args)
    kv_heads, head_dim = shape["num_key_value_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    batch, seq, past = 2, 3, 4
    example = (torch.zeros(batch, seq, dtype=torch.int64, device=device),
               torch.ones(batch, past + seq, dtype=torch.int64, device=device),
               *[torch.randn(batch, kv_heads, past, head_dim, device=device) for _ in range(2 * layers)])
    kv = [f"{part}_{i}" for i in range(layers) for part in ("key", "value")]
    names, outs = ["input_ids", "attention_mask"] + [f"past_{n}" for n in kv], ["logits"] + [f"present_{n}" for n in kv]
    os.makedirs(os.path.dirname(p["onnx"]), exist_ok=True)
    step = decoder_step(model)
    info["exporter"] = args.exporter
    print(f"export: {info['parameters'] / 1e9:.2f} B parameters, {args.exporter} exporter", flush=True)
    t = time.time()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if args.exporter == "dynamo":
            try:
                b, s, pl, total = (torch.export.Dim(n) for n in ("batch", "seq", "past", "total"))
                dims = ({0: b, 1: s}, {0: b, 1: total}, tuple({0: b, 2: pl} for _ in range(2 * layers)))
                torch.onnx.export(step, example, p["onnx"], input_names=names, output_names=outs, dynamo=True,
                                  dynamic_shapes=dims, external_data=True)
            except Exception as err:  # pylint: disable=broad-except
                info["exporter"], info["dynamo_error"] = "legacy", f"{type(err).__name__}: {str(err)[:300]}"
        if info["exporter"] == "legacy":
            dynamic = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
                       "logits": {0: "batch", 1: "seq"}, **{n: {0: "batch", 2: "past"} for n in names[2:]},
                       **{n: {0: "batch", 2: "total"} for n in outs[1:]}}
            torch.onnx.export(step, example, p["onnx"], input_names=names, output_names=outs, opset_version=17,
                              dynamic_axes=dynamic, dynamo=False)
    if args.smoke:  # small enough to stay inline: store it as a big model is (weights as external data)
        import onnx
        onnx.save_model(onnx.load(p["onnx"]), p["onnx"], save_as_external_data=True, location="llama_step.onnx.data",
                        size_threshold=1024)
    info["export_s"] = round(time.time() - t, 1)
    folder = os.path.dirname(p["onnx"])
    info["onnx_bytes"] = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return info


def _stream(cmd: list[str]) -> tuple[int, str]:
    """Run `cmd`, echoing its output line by line; returns its exit code and the last 3000 characters."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    tail = ""
    for line in proc.stdout:
        print("  | " + line, end="", flush=True)
        tail = (tail + line)[-3000:]
    return proc.wait(), tail


def phase_build(args) -> dict:
    """The product's build of the exported step, as a user runs it."""
    p = _paths(args)
    target = (["--target", "llvm", "--dtype", "fp32"] if args.smoke else
              ["--target", "cuda", "--dtype", "fp16"] + ([] if args.no_cuda_graph else ["--cuda-graph"]))
    # the decode steps' static functions (seq 1, each batch), which only CUDA captures; on llvm one static batch
    # took 2 minutes more to compile (2 cores), so the smoke run buckets seq alone
    # and on CUDA the prompts' lengths too: a prefill in the generic function gets no GEMM or attention template
    # (run 1: 29 ms for 512 tokens on 8 layers, torch eager 10.9)
    batches = ",".join(map(str, args.batches))
    seqs = ",".join(map(str, [1] + ([] if args.smoke else sorted(set(args.prompts)))))
    buckets = ["--buckets", f"seq={seqs}"] + ([] if args.smoke else ["--buckets", f"batch={batches}"])
    flags = [*target, "--trials", "0", "--max-seq", str(args.max_seq), *buckets, "--tolerance", args.tolerance]
    cmd = [sys.executable, "-m", "tvmfuse", "tune", p["onnx"], *flags, "--out", p["out"], "--logs", p["logs"]]
    t = time.time()
    rc, tail = _stream(cmd)
    info = {"command": " ".join(["python", "-m", "tvmfuse", "tune", "MODEL", *flags]), "rc": rc,
            # the kernel switches the build read (TVMFUSE_SMALLM_BULK=4, ...): a run beside one without them
            "switches": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TVMFUSE_")},
            "wall_s": round(time.time() - t, 1), "log_tail": tail}
    manifest_path = os.path.join(p["export"], "manifest.json")
    if os.path.exists(manifest_path):
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        info.update({key: manifest.get(key) for key in ("build", "verification", "latency_us", "cuda_graphs")},
                    kv_cache={k: manifest["kv_cache"][k] for k in ("mode", "capacity", "dtype")},
                    buckets=[f["function"] for f in (manifest.get("buckets") or {}).get("functions", [])],
                    failures=len(manifest.get("failures") or []),
                    so_bytes=os.path.getsize(os.path.join(p["export"], "model.so")))
    return info


def copy_bandwidth(smoke: bool) -> dict:
    """Copy bandwidth in bytes/s (and the matmul peak) as bench/run.py measures them; the smoke run: a numpy copy."""
    if not smoke:
        import torch
        from bench.run import ceilings
        bw, peak = ceilings()
        return {"copy_bw": bw, "matmul_peak_flops": peak, "gpu": torch.cuda.get_device_name()}
    import numpy as np
    a = np.ones(2 ** 24, np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return {"copy_bw": 2 * a.nbytes / min(times), "device": "cpu (numpy copy)"}


def phase_run(args) -> dict:
    """The export's generate on every row; each row merged into the JSON as it finishes."""
    from tvmfuse.export.runtime import load

    p = _paths(args)
    config = _load(args.out)["config"]
    if "parameters" not in config:  # --phase run into another --out than the export's: the count beside the ONNX file
        with open(os.path.join(args.work, "export.json"), encoding="utf-8") as f:
            config["parameters"] = json.load(f)["parameters"]
        _merge(args.out, ("config", "parameters"), config["parameters"])
    ceilings = copy_bandwidth(args.smoke)
    _merge(args.out, ("ceilings",), ceilings)
    t = time.time()
    model = load(p["export"])
    info = {"load_s": round(time.time() - t, 1)}
    print(f"run: loaded in {info['load_s']} s; copy bandwidth {ceilings['copy_bw'] / 1e12:.2f} TB/s", flush=True)
    cache = None
    for batch, prompt in _rows(args):
        key = _key(batch, prompt)
        if time.time() > args.deadline:
            _merge(args.out, ("rows", key, "tvmfuse"), {"skipped": "out of time"})
            continue
        try:
            ids = prompt_ids(batch, prompt, config["shape"]["vocab_size"])
            if cache is None or cache.batch != batch:
                cache = None  # the last batch's cache goes before this one's is allocated
                cache = model.kv_cache(batch)
            model.generate(ids, 3, cache=cache)  # warm: the kernels load, the decode function's graphs are captured
            out = model.generate(ids, args.new_tokens, cache=cache)
            ideal = roofline(config, batch, prompt, args.new_tokens, ceilings["copy_bw"])
            row = {"prefill_ms": round(out.prefill_ms, 3), "ms_per_token": round(out.ms_per_token, 4),
                   "median_ms_per_token": round(sorted(out.step_ms)[len(out.step_ms) // 2], 4),
                   "tokens_per_s": round(out.tokens_per_s, 1), "decode": out.decode, "prefill": out.prefill,
                   "fraction_of_roofline": round(ideal["roofline_ms"] / out.ms_per_token, 4),
                   "tokens": out.tokens.tolist()}
            _merge(args.out, ("rows", key, "roofline"), ideal)
            if args.profile and not args.smoke:
                row["profile"] = profile_rows(model, ids, cache)
        except Exception:  # pylint: disable=broad-except  (one row's failure must not lose the others)
            row = {"error": traceback.format_exc()[-3000:]}
        _merge(args.out, ("rows", key, "tvmfuse"), row)
        print(f"run {key}: " + (f"prefill {row['prefill_ms']:.1f} ms, {row['ms_per_token']:.3f} ms/token, "
                                f"{row['tokens_per_s']:.0f} tokens/s, {row['fraction_of_roofline']:.0%} of the "
                                f"roofline, decode in {row['decode']['function']} "
                                f"({row['decode'].get('graphs', 0)} graphs)"
                                if "error" not in row else "FAILED " + row["error"].strip().splitlines()[-1]),
              flush=True)
    return info


def profile_rows(model, ids, cache, steps: int = 8) -> dict:
    """The GPU's own record (CUPTI through torch.profiler) of the prefill and of the decode steps from the end of the
    first window of `steps` to the end of the fourth (run as generate runs them: each window read once the next is
    queued; recorded until the third window is read, which waits for the fourth, so that no window is the last:
    the last two are read back to back, which no steady step does), per step, with the host's wall time per decode
    step of the second and third windows while profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.model_timing import gpu_kernels, kernel_summary
    prefill = gpu_kernels(lambda: model.generate(ids, 1, cache=cache), calls=2)
    prof = profile(activities=[ProfilerActivity.CUDA])
    walls = []

    def on_token(i: int, ms: float) -> None:  # called for each step of a window once the next one is queued
        if i == steps:  # the first window has run and the second runs: recorded from here, as generate runs it
            prof.start()
        elif steps < i <= 3 * steps:
            walls.append(ms)
            if i == 3 * steps:  # the third window is read: its copy waited for the fourth, which has run too
                torch.cuda.synchronize()
                prof.stop()

    model.generate(ids, 4 * steps + 1, cache=cache, on_token=on_token, sync_every=steps)
    # steps counted by the sampler's kernel, each step's last (the recording starts inside the second window)
    decode = kernel_summary(prof, steps, top=24, synced=False, timeline=True, marker="greedy_tokens")
    decode["wall_ms_per_step"] = round(sum(walls) / len(walls), 4)
    return {"prefill": prefill, "decode": decode}


def profile_torch_decode(ids, cache, prefill, step, steps: int = 8) -> dict:
    """torch's side of `profile_rows`: the GPU's record (CUPTI) of `steps` compiled decode steps after a prefill and
    3 warm steps from a reset cache, queued back to back as `greedy` runs them, per step, with one step's launches
    in order; {"error": ...} where the profiler fails (the row's timing stands)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.model_timing import kernel_summary
    try:
        cache.reset()
        token = prefill(ids, cache)
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            token = step(token, cache).clone()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                torch.compiler.cudagraph_mark_step_begin()
                token = step(token, cache).clone()
            torch.cuda.synchronize()
        return {"decode": kernel_summary(prof, steps, top=24, synced=False, timeline=True)}
    except Exception:  # pylint: disable=broad-except
        return {"error": traceback.format_exc()[-2000:]}


def phase_torch(args) -> dict:
    """The same weights in torch fp16 (smoke: fp32, CPU, eager): StaticCache, prefill eager, decode steps compiled
    with mode="reduce-overhead" (CUDA graphs); greedy tokens against tvmfuse's."""
    import math

    import torch
    from transformers import StaticCache

    from bench import hf_models

    data = _load(args.out)
    cuda = not args.smoke
    model = _llama(args, "cuda" if cuda else "cpu")
    info = {"same_weights_as_onnx": math.isclose(_checksum(model), data.get("export", {}).get("checksum", math.nan),
                                                 rel_tol=1e-9),
            "dtype": "float16" if cuda else "float32",
            "decode": 'torch.compile(mode="reduce-overhead", fullgraph=True)' if cuda else "eager"}
    if cuda:
        hf_models.to_low_precision(model, torch.float16)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ceilings = data.get("ceilings") or copy_bandwidth(args.smoke)

    def prefill(ids, cache):
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache}).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    def decode(token, cache):
        return model(input_ids=token, use_cache=True, **{cache_kw: cache}).logits[:, -1].argmax(-1, keepdim=True)

    def greedy(ids, cache, steps: int, step) -> tuple[list, float, float]:
        """(tokens, prefill ms, decode ms per step) of one generation from a reset cache."""
        cache.reset()
        sync()
        t = time.perf_counter()
        token = prefill(ids, cache)
        sync()
        prefill_ms = (time.perf_counter() - t) * 1e3
        tokens = [token]
        t = time.perf_counter()
        for _ in range(steps - 1):
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            token = step(token, cache).clone()
            tokens.append(token)
        sync()
        return tokens, prefill_ms, (time.perf_counter() - t) * 1e3 / max(steps - 1, 1)

    torch.set_grad_enabled(False)
    for batch in args.batches:
        if time.time() > args.deadline:
            for prompt in args.prompts:
                _merge(args.out, ("rows", _key(batch, prompt), "torch"), {"skipped": "out of time"})
            continue
        try:
            torch.compiler.reset()  # static shapes: one compile per batch
            step = torch.compile(decode, mode="reduce-overhead", fullgraph=True) if cuda else decode
            cache = StaticCache(config=model.config, max_cache_len=args.max_seq)
            ids = torch.from_numpy(prompt_ids(batch, args.prompts[0], model.config.vocab_size)).to(model.device)
            t = time.time()
            greedy(ids, cache, 4, step)  # compiles (twice: warm-up, then the CUDA-graph recording) and records
            info[f"compile_s_b{batch}"] = round(time.time() - t, 1)
        except Exception:  # pylint: disable=broad-except
            for prompt in args.prompts:
                _merge(args.out, ("rows", _key(batch, prompt), "torch"), {"error": traceback.format_exc()[-3000:]})
            continue
        for prompt in args.prompts:
            key = _key(batch, prompt)
            if time.time() > args.deadline:
                _merge(args.out, ("rows", key, "torch"), {"skipped": "out of time"})
                continue
            try:
                ids = torch.from_numpy(prompt_ids(batch, prompt, model.config.vocab_size)).to(model.device)
                greedy(ids, cache, 3, step)  # warm at this prompt length (the eager prefill's kernels)
                tokens, prefill_ms, ms = greedy(ids, cache, args.new_tokens, step)
                tokens = torch.cat(tokens, 1).cpu().numpy()
                ideal = roofline(data["config"], batch, prompt, args.new_tokens, ceilings["copy_bw"])
                row = {"prefill_ms_eager": round(prefill_ms, 3), "ms_per_token": round(ms, 4),
                       "tokens_per_s": round(batch / ms * 1e3, 1),
                       "fraction_of_roofline": round(ideal["roofline_ms"] / ms, 4), "tokens": tokens.tolist()}
                if args.profile and cuda:
                    row["profile"] = profile_torch_decode(ids, cache, prefill, step)
                ours = data.get("rows", {}).get(key, {}).get("tvmfuse", {}).get("tokens")
                if ours is not None:
                    same = _leading_equal(ours, tokens)
                    _merge(args.out, ("rows", key, "agreement"),
                           {"identical_leading_tokens": same, "min": min(same), "all_rows_identical":
                            min(same) == args.new_tokens})
            except Exception:  # pylint: disable=broad-except
                row = {"error": traceback.format_exc()[-3000:]}
            _merge(args.out, ("rows", key, "torch"), row)
            print(f"torch {key}: " + (f"{row['ms_per_token']:.3f} ms/token, {row['tokens_per_s']:.0f} tokens/s"
                                      if "error" not in row else "FAILED " + row["error"].strip().splitlines()[-1]),
                  flush=True)
    return info


# ------------------------------------------------------------------------------------------------------------- main

def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: expected positive integers separated by commas")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with --smoke's tiny run for whatever is not given; bad values raise ValueError."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, help=f"decoder layers (default {FULL_RUN['layers']}; 32: all of Llama-2-7B)")
    ap.add_argument("--batches", help=f"batch sizes (default {FULL_RUN['batches']})")
    ap.add_argument("--prompts", help=f"prompt lengths (default {FULL_RUN['prompts']})")
    ap.add_argument("--new-tokens", type=int, help=f"tokens generated per row (default {FULL_RUN['new_tokens']})")
    ap.add_argument("--max-seq", type=int, help=f"the KV caches' capacity (default {FULL_RUN['max_seq']})")
    ap.add_argument("--work", default="/tmp/genbench", help="where the ONNX file and the export go (GBs)")
    ap.add_argument("--out", required=True, help="where generate.json goes")
    ap.add_argument("--exporter", default="dynamo", choices=["dynamo", "legacy"],
                    help="torch.onnx exporter (dynamo falls back to legacy, opset 17, if it fails)")
    ap.add_argument("--tolerance", default="5e-2,5e-2",
                    help="the build's verification tolerance (ATOL,RTOL; bench/big_model.py says why fp16 needs it)")
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU (llvm, fp32, torch eager)")
    ap.add_argument("--profile", action="store_true", help="per row, the GPU's kernels of the prefill and of 8 decode "
                    "steps (CUDA only)")
    ap.add_argument("--no-cuda-graph", action="store_true",
                    help="build without --cuda-graph: every kernel of a decode step launched from the host, chained by "
                         "the dependent launch, no graph <-> outside transitions (the windows let the host run ahead); "
                         "with --phase build then --phase run into another --out, beside a run with the graphs")
    ap.add_argument("--phase", default="all", choices=["all", *PHASES])
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no phase or row after this many seconds")
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # the phases' copy of the budget (epoch s)
    args = ap.parse_args(argv)
    for key, value in (SMOKE_RUN if args.smoke else FULL_RUN).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.batches, args.prompts = _positive_ints(args.batches, "--batches"), _positive_ints(args.prompts, "--prompts")
    if args.layers < 1 or args.new_tokens < 2 or args.budget_s <= 0:
        raise ValueError("--layers must be >= 1, --new-tokens >= 2 and --budget-s > 0")
    if max(args.prompts) + args.new_tokens - 1 > args.max_seq:
        raise ValueError(f"the longest prompt ({max(args.prompts)}) and {args.new_tokens} new tokens need "
                         f"{max(args.prompts) + args.new_tokens - 1} positions; --max-seq is {args.max_seq}")
    return args


def run_config(args, argv: list[str]) -> dict:
    """The JSON's `config`: the run's shapes and sizes, its command line and the versions it ran with."""
    from importlib.metadata import version

    import tvmfuse
    return {"layers": args.layers, "shape": _shape(args), "batches": args.batches, "prompts": args.prompts,
            "new_tokens": args.new_tokens, "max_seq": args.max_seq, "smoke": args.smoke,
            "command": "python3 bench/generate.py " + " ".join(argv),
            "versions": {**{name: version(name) for name in ("torch", "transformers", "apache-tvm")},
                         "tvmfuse": tvmfuse.__version__},
            "notes": NOTES}


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    argv = sys.argv[1:] if argv is None else list(argv)
    if args.phase == "all" and os.path.exists(os.path.join(args.out, "generate.json")):
        os.remove(os.path.join(args.out, "generate.json"))  # a new run: no rows of an older one
    if "config" not in _load(args.out):
        _merge(args.out, ("config",), run_config(args, argv))
    if args.phase != "all":
        args.deadline = args.deadline or time.time() + args.budget_s
        info = {"export": phase_export, "build": phase_build, "run": phase_run, "torch": phase_torch}[args.phase](args)
        _merge(args.out, (args.phase,), info)
        return 1 if info.get("rc", 0) else 0
    deadline = time.time() + args.budget_s
    for phase in PHASES:
        left = deadline - time.time()
        if left < 10:
            _merge(args.out, (phase + "_error",), {"error": "not started: out of time"})
            continue
        t = time.time()
        try:
            rc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--phase", phase,
                                 "--deadline", str(deadline)], timeout=left, check=False, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"phase {phase}: rc {rc}, {time.time() - t:.0f} s", flush=True)
        if rc != 0:
            _merge(args.out, (phase + "_error",), {"rc": rc, "s": round(time.time() - t, 1)})
            if phase in ("export", "build"):
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
