"""Export tiny random Hugging Face models (GPT-2, BERT, Llama; Qwen2, GPT-NeoX, Gemma, OPT; Qwen3, Phi-3, Gemma 2
and 3) to ONNX with dynamic
batch and sequence; with an attention_mask input, or (`ids_only`) with input_ids alone, as decoders are often
exported (transformers then builds the causal mask inside the graph)."""

from __future__ import annotations

import os
import warnings

import torch

VOCAB, HIDDEN, LAYERS, HEADS = 128, 64, 2, 4
DYNAMIC = {0: "batch", 1: "seq"}


#: decoders whose exports are tested with input_ids alone (besides gpt2 and llama): QKV bias, parallel residual,
#: GeGLU with a scaled embedding, learned positions; per-head Q/K RMSNorms, Q, K, V (and gate, up) as one
#: projection, tanh soft-capped scores with sliding-window layers, pre- and post-norms with Q/K norms
MORE_DECODERS = ("qwen2", "gpt_neox", "gemma", "opt", "qwen3", "phi3", "gemma2", "gemma3")


class _LogitsOnly(torch.nn.Module):
    """Wrap a transformers model so it takes (input_ids, attention_mask) and returns the first output tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


class _IdsOnly(torch.nn.Module):
    """Wrap a transformers model so it takes input_ids alone (no attention mask) and returns the first output."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, use_cache=False, return_dict=True)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def tiny_model(name: str, ids_only: bool = False) -> torch.nn.Module:
    """A tiny randomly initialised model built from a config in code (nothing downloaded)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, num_hidden_layers=LAYERS, num_attention_heads=HEADS)
    if name == "gpt2":
        cfg = tf.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=128, vocab_size=VOCAB)
        model = tf.GPT2LMHeadModel(cfg)
    elif name == "bert":
        cfg = tf.BertConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, max_position_embeddings=128, **common)
        model = tf.BertModel(cfg)
    elif name == "llama":
        cfg = tf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_key_value_heads=2,
                             max_position_embeddings=128, **common)
        model = tf.LlamaForCausalLM(cfg)
    elif name == "qwen2":  # QKV projections with bias
        cfg = tf.Qwen2Config(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_key_value_heads=2,
                             max_position_embeddings=128, **common)
        model = tf.Qwen2ForCausalLM(cfg)
    elif name == "gpt_neox":  # parallel residual, partial rotary
        cfg = tf.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, max_position_embeddings=128,
                               **common)
        model = tf.GPTNeoXForCausalLM(cfg)
    elif name == "gemma":  # GeGLU (tanh-GELU gate), embedding scaled by sqrt(hidden), (1 + w) RMSNorm
        cfg = tf.GemmaConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=128, **common)
        model = tf.GemmaForCausalLM(cfg)
    elif name == "qwen3":  # an RMSNorm on each head of Q and K before the rotary
        cfg = tf.Qwen3Config(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=128, **common)
        model = tf.Qwen3ForCausalLM(cfg)
    elif name == "phi3":  # Q, K, V one projection (qkv_proj) and gate, up one (gate_up_proj), split after
        cfg = tf.Phi3Config(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_key_value_heads=2, pad_token_id=0,
                            max_position_embeddings=128, **common)
        model = tf.Phi3ForCausalLM(cfg)
    elif name == "gemma2":  # scores soft-capped (cap * tanh(s / cap)), every other layer a sliding window
        cfg = tf.Gemma2Config(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_key_value_heads=2, head_dim=16,
                              sliding_window=4, max_position_embeddings=128, **common)
        model = tf.Gemma2ForCausalLM(cfg)
    elif name == "gemma3":  # Q/K RMSNorms, four norms a layer, sliding-window layers
        cfg = tf.Gemma3TextConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_key_value_heads=2,
                                  head_dim=16, sliding_window=4, max_position_embeddings=128, **common)
        model = tf.Gemma3ForCausalLM(cfg)
    elif name == "opt":  # learned positions (offset 2, computed from a cumsum of the mask)
        cfg = tf.OPTConfig(hidden_size=HIDDEN, ffn_dim=4 * HIDDEN, max_position_embeddings=128,
                           word_embed_proj_dim=HIDDEN, **common)
        model = tf.OPTForCausalLM(cfg)
    else:
        raise ValueError(name)
    return wrap(model, ids_only)  # default attention (sdpa), as a new user would export it


def wrap(model, ids_only: bool = False) -> torch.nn.Module:
    """A transformers model in eval mode, taking input_ids alone (`ids_only`) or with an attention mask, returning
    its first output."""
    return (_IdsOnly if ids_only else _LogitsOnly)(model.eval())


def example_inputs(batch: int = 2, seq: int = 7, seed: int = 0, ids_only: bool = False):
    """int64 input_ids and (unless `ids_only`) an all-ones attention_mask, as numpy arrays."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(batch, seq), dtype=np.int64)
    return {"input_ids": ids} if ids_only else {"input_ids": ids, "attention_mask": np.ones((batch, seq), dtype=np.int64)}


def _diff_symbolic(g, x, n, dim, prepend, append):
    """aten::diff (first order) for the legacy exporter, which has none: transformers 5's mask builder takes
    torch.diff of the position ids when no attention mask is given (find_packed_sequence_indices)."""
    from torch.onnx import symbolic_helper as sh

    if sh._parse_arg(n, "i") != 1:  # pylint: disable=protected-access
        raise RuntimeError("only first-order diff is exported")
    dim = sh._parse_arg(dim, "i")  # pylint: disable=protected-access
    parts = [p for p in (prepend, x, append) if not sh._is_none(p)]  # pylint: disable=protected-access
    x = g.op("Concat", *parts, axis_i=dim) if len(parts) > 1 else x
    axes = g.op("Constant", value_t=torch.tensor([dim]))

    def part(start, end):
        return g.op("Slice", x, g.op("Constant", value_t=torch.tensor([start])),
                    g.op("Constant", value_t=torch.tensor([end])), axes)

    return g.op("Sub", part(1, 2 ** 62), part(0, -1))


def _cumsum_symbolic(g, x, dim, dtype):
    """aten::cumsum for the legacy exporter with a bool input cast to int64 first (torch's writes CumSum of a bool
    tensor, which the ONNX checker and onnxruntime reject: the mask builder's `(diff != 1).cumsum(-1)`)."""
    from torch.onnx import symbolic_opset11

    if x.type().scalarType() == "Bool":
        x = g.op("Cast", x, to_i=7)  # INT64, as torch's bool cumsum
    return symbolic_opset11.cumsum(g, x, dim, dtype)


def export(name: str, exporter: str, folder: str, ids_only: bool = False, dtype: str = "float32",
           model: torch.nn.Module | None = None) -> str:
    """Export model `name` through `exporter` ('legacy' opset 17 or 'dynamo' opset 20); return the .onnx path.
    `ids_only`: the model's only input is input_ids. `dtype` "bfloat16": exported after `model.to(torch.bfloat16)`
    (weights and activations stored in bf16; torch 2.13's legacy exporter cannot: "ScalarType ComplexDouble is an
    unexpected tensor scalar type"). `model`: a transformers model to export under `name` instead of
    `tiny_model(name)` (bench/arch_survey.py's)."""
    suffix = ("_ids" if ids_only else "") + ("_bf16" if dtype == "bfloat16" else "")
    path = os.path.join(folder, f"{name}_{exporter}{suffix}.onnx")
    if os.path.exists(path):
        return path
    model = tiny_model(name, ids_only) if model is None else wrap(model, ids_only)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    elif dtype != "float32":
        raise ValueError(dtype)
    args = tuple(torch.from_numpy(v) for v in example_inputs(ids_only=ids_only).values())
    names = ["input_ids"] if ids_only else ["input_ids", "attention_mask"]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.register_custom_op_symbolic("aten::diff", _diff_symbolic, 17)
            torch.onnx.register_custom_op_symbolic("aten::cumsum", _cumsum_symbolic, 17)
            torch.onnx.export(model, args, path, input_names=names, output_names=["out"], opset_version=17,
                              dynamic_axes={n: DYNAMIC for n in names}, dynamo=False)
        elif exporter == "dynamo":
            b, s = torch.export.Dim("batch"), torch.export.Dim("seq", min=2, max=128)
            shapes = {n: {0: b, 1: s} for n in names}
            torch.onnx.export(model, args, path, input_names=names, output_names=["out"], opset_version=20,
                              dynamic_shapes=shapes, dynamo=True, external_data=False)
        else:
            raise ValueError(exporter)
    return path


def export_with_cache(name: str, folder: str, hf_names: bool = False) -> str:
    """Export decoder `name` as one step with a KV cache, as an exporter writes it: inputs input_ids [batch, seq],
    attention_mask [batch, total], past_key_<i> / past_value_<i> [batch, kv heads, past, head dim]; outputs
    logits and present_key_<i> / present_value_<i> [batch, kv heads, total, head dim] (the past concatenated with
    the step's K/V on the sequence axis), total = past + seq. Legacy exporter, opset 17; returns the .onnx path.
    `hf_names`: the cache named as optimum exports it, past_key_values.<i>.key / present.<i>.key (dots, which TVM's
    importer renames)."""
    from bench.generate import decoder_step

    path = os.path.join(folder, f"{name}_kv{'_hf' if hf_names else ''}.onnx")
    if os.path.exists(path):
        return path
    model = tiny_model(name).model
    layers, kv_heads = model.config.num_hidden_layers, getattr(model.config, "num_key_value_heads", HEADS)
    head_dim = HIDDEN // HEADS

    batch, seq, past = 2, 3, 4
    args = (torch.zeros(batch, seq, dtype=torch.int64), torch.ones(batch, past + seq, dtype=torch.int64),
            *[torch.randn(batch, kv_heads, past, head_dim) for _ in range(2 * layers)])
    kv = [f"{part}_{i}" for i in range(layers) for part in ("key", "value")]
    names, outs = ["input_ids", "attention_mask"] + [f"past_{n}" for n in kv], ["logits"] + [f"present_{n}" for n in kv]
    if hf_names:
        kv = [f"{i}.{part}" for i in range(layers) for part in ("key", "value")]
        names, outs = names[:2] + [f"past_key_values.{n}" for n in kv], ["logits"] + [f"present.{n}" for n in kv]
    dims = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
            "logits": {0: "batch", 1: "seq"}, **{n: {0: "batch", 2: "past"} for n in names[2:]},
            **{n: {0: "batch", 2: "total"} for n in outs[1:]}}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(decoder_step(model), args, path, input_names=names, output_names=outs, opset_version=17,
                          dynamic_axes=dims, dynamo=False)
    return path
