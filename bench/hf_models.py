"""Random-weight GPT-2, BERT and one layer of Llama (Llama-2-7B's shapes, or Llama-3-8B's with grouped-query
attention), Phi-3-mini and Pythia-1.4B (GPT-NeoX), wrapped for ONNX export at decode (with a KV cache) and prefill
shapes."""

from __future__ import annotations

import inspect
import os
import warnings

import numpy as np

KV_LEN = {"full": 512, "smoke": 16}
PREFILL = {"full": {"prefill_512": 512, "prefill_2048": 2048}, "smoke": {"prefill_512": 8, "prefill_2048": 16}}
NOTES = {
    "gpt2": "GPT2LMHeadModel, GPT2Config() = 124M (n_positions raised to 2048 so prefill_2048 fits)",
    "bert": "BertModel, BertConfig() = base (max_position_embeddings raised to 2048); outputs last_hidden_state; "
            "no KV cache in BERT: its decode rows are sequence 1 without past (the closest the export allows)",
    "llama": "LlamaForCausalLM with 1 decoder layer (hidden 4096, intermediate 11008, 32 heads, 32 KV heads), "
             "vocab 256: embedding + 1 layer + norm + small head",
    "llama3": "LlamaForCausalLM with 1 decoder layer of Llama-3-8B's shapes (hidden 4096, intermediate 14336, 32 "
              "heads, 8 KV heads: grouped-query attention), vocab 256",
    "phi3": "Phi3ForCausalLM with 1 decoder layer of Phi-3-mini's shapes (hidden 3072, intermediate 8192, 32 heads of "
            "96, 32 KV heads; Q, K, V one projection, gate and up one), vocab 256",
    "pythia": "GPTNeoXForCausalLM with 1 layer of Pythia-1.4B's shapes (hidden 2048, intermediate 8192, 16 heads of "
              "128, a quarter of each head rotated, parallel residual), vocab 256",
}


def config(name: str, smoke: bool):
    """The transformers config of model `name` (tiny when `smoke`)."""
    import transformers as tf

    if name == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64) if smoke \
            else tf.GPT2Config(n_positions=2048)
    if name == "bert":
        return tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                             vocab_size=128, max_position_embeddings=64) if smoke \
            else tf.BertConfig(max_position_embeddings=2048)
    if name in ("llama", "llama3"):
        gqa = name == "llama3"
        size = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2 if gqa else 4,
                    max_position_embeddings=64) if smoke else \
            dict(hidden_size=4096, intermediate_size=14336 if gqa else 11008, num_attention_heads=32,
                 num_key_value_heads=8 if gqa else 32, max_position_embeddings=4096)
        return tf.LlamaConfig(num_hidden_layers=1, vocab_size=256, **size)
    if name == "phi3":
        size = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, max_position_embeddings=64) if smoke \
            else dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32, max_position_embeddings=4096)
        return tf.Phi3Config(num_hidden_layers=1, vocab_size=256, num_key_value_heads=size["num_attention_heads"],
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, **size)
    if name == "pythia":
        size = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, max_position_embeddings=64) if smoke \
            else dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, max_position_embeddings=4096)
        return tf.GPTNeoXConfig(num_hidden_layers=1, vocab_size=256, rotary_pct=0.25, **size)
    raise ValueError(f"unknown model {name!r} (gpt2, bert, llama, llama3, phi3, pythia)")


def build(name: str, smoke: bool, seed: int = 0):
    """The HF model in eval mode, fp32, random weights from a fixed seed."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cls = {"gpt2": tf.GPT2LMHeadModel, "bert": tf.BertModel, "llama": tf.LlamaForCausalLM,
           "llama3": tf.LlamaForCausalLM, "phi3": tf.Phi3ForCausalLM, "pythia": tf.GPTNeoXForCausalLM}[name]
    cfg = config(name, smoke)
    try:
        cfg._attn_implementation = "sdpa"  # pylint: disable=protected-access  (what a user gets by default)
    except Exception:  # pylint: disable=broad-except
        pass
    return cls(cfg).eval()


def to_low_precision(model, dtype, device=None):
    """`model` (in place) in `dtype` on `device`, its rotary frequencies (`inv_freq` buffers) kept float32 as
    transformers computes them. `model.to(dtype)` alone rounds them to fp16/bf16, and the angle at position p is off
    by p times that rounding: the torch contender then computes another model than the fp32 reference it is checked
    against (outside fp16's tolerance from a few hundred positions on). The work it does is the same."""
    import torch

    kept = {name: buf.detach().clone() for name, buf in model.named_buffers() if name.endswith("inv_freq")}
    model.to(device=device, dtype=dtype)
    for name, buf in kept.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        setattr(module, attr, buf.to(device=device if device is not None else buf.device, dtype=torch.float32))
    return model


def cache_dims(model) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder's KV cache."""
    c = model.config
    layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    kv = getattr(c, "num_key_value_heads", None) or heads
    return layers, kv, getattr(c, "head_dim", None) or hidden // heads


def has_cache(name: str) -> bool:
    return name != "bert"


def _make_cache(pairs):
    """The HF cache object for past (key, value) pairs: DynamicCache (filled layer by layer), else tuples."""
    try:
        from transformers import DynamicCache

        cache = DynamicCache()
        for i, (k, v) in enumerate(pairs):
            cache.update(k, v, i)
        return cache
    except Exception:  # pylint: disable=broad-except  (old transformers: the legacy tuple format)
        return tuple(pairs)


def _layer_kv(cache, i):
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[i].keys, cache.layers[i].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[i], cache.value_cache[i]
    return cache[i][0], cache[i][1]


def wrap(model, case: str):
    """A torch module for the case: decode takes (input_ids [B,1], past k0, v0, k1, ...) and returns (logits,
    the new token's k0, v0, ...); prefill and BERT take input_ids only and return the first output tensor."""
    import torch

    decoder = hasattr(model, "lm_head") and case.startswith("decode")
    # transformers 5 renames past_key_values to cache (the old name warns, then goes in 5.40)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    class Decode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, *past):
            cache = _make_cache([(past[i], past[i + 1]) for i in range(0, len(past), 2)])
            mask = torch.ones(input_ids.shape[0], past[0].shape[2] + input_ids.shape[1], dtype=input_ids.dtype)
            out = self.model(input_ids=input_ids, attention_mask=mask, use_cache=True, return_dict=True,
                             **{cache_kw: cache})
            new = getattr(out, "cache", None)
            new = getattr(out, "past_key_values", None) if new is None else new
            kv = [t[:, :, -1:, :] for i in range(len(past) // 2) for t in _layer_kv(new, i)]
            return (out.logits, *kv)

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            # an all-ones mask, as a tokenizer gives (without one, transformers 5 traces torch.diff: no ONNX op)
            out = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False,
                             return_dict=True)
            return out.logits if hasattr(out, "logits") else out.last_hidden_state

    return Decode().eval() if decoder else Plain().eval()


def shapes(name: str, case: str, model, smoke: bool) -> dict:
    """Case shapes: batch, sequence, KV length (0 without a cache)."""
    mode = "smoke" if smoke else "full"
    if case.startswith("decode_b"):
        kv = KV_LEN[mode] if has_cache(name) else 0
        return {"batch": int(case[len("decode_b"):]), "seq": 1, "kv_len": kv}
    if case in PREFILL[mode]:
        return {"batch": 1, "seq": PREFILL[mode][case], "kv_len": 0}
    raise ValueError(f"unknown case {case!r} (decode_b<N>, prefill_512, prefill_2048)")


def inputs(name: str, model, s: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """numpy inputs by ONNX input name: int64 ids, fp32 past K/V (standard normal)."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    feeds = {"input_ids": rng.integers(0, vocab, (s["batch"], s["seq"]), dtype=np.int64)}
    if s["kv_len"]:
        layers, kv, hd = cache_dims(model)
        for i in range(layers):
            for part in ("key", "value"):
                feeds[f"past_{part}_{i}"] = rng.standard_normal((s["batch"], kv, s["kv_len"], hd)).astype("float32")
    return feeds


def export(module, feeds: dict[str, np.ndarray], path: str) -> list[str]:
    """Legacy (TorchScript) export, opset 17, fp32, static shapes, ONNX IR version 10; returns output names."""
    import onnx
    import torch

    args = tuple(torch.from_numpy(v) for v in feeds.values())
    with torch.no_grad():
        out = module(*args)
    n_out = len(out) if isinstance(out, tuple) else 1
    names = ["logits" if hasattr(module.model, "lm_head") else "last_hidden_state"]
    names += [f"{('key', 'value')[i % 2]}_{i // 2}" for i in range(n_out - 1)]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, path, input_names=list(feeds), output_names=names, opset_version=17,
                          dynamo=False)
    model = onnx.load(path)
    if model.ir_version > 10:
        model.ir_version = 10
        onnx.save(model, path)
    return names
