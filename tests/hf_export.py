"""Export tiny random Hugging Face GPT-2, BERT and Llama models to ONNX with dynamic batch and sequence."""

from __future__ import annotations

import os
import warnings

import torch

VOCAB, HIDDEN, LAYERS, HEADS = 128, 64, 2, 4
DYNAMIC = {0: "batch", 1: "seq"}


class _LogitsOnly(torch.nn.Module):
    """Wrap a transformers model so it takes (input_ids, attention_mask) and returns the first output tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def tiny_model(name: str) -> torch.nn.Module:
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
    else:
        raise ValueError(name)
    return _LogitsOnly(model.eval())  # default attention (sdpa), as a new user would export it


def example_inputs(batch: int = 2, seq: int = 7, seed: int = 0):
    """int64 input_ids and an all-ones attention_mask, as numpy arrays."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((batch, seq), dtype=np.int64)}


def export(name: str, exporter: str, folder: str) -> str:
    """Export model `name` through `exporter` ('legacy' opset 17 or 'dynamo' opset 20); return the .onnx path."""
    path = os.path.join(folder, f"{name}_{exporter}.onnx")
    if os.path.exists(path):
        return path
    model = tiny_model(name)
    args = tuple(torch.from_numpy(v) for v in example_inputs().values())
    names = ["input_ids", "attention_mask"]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(model, args, path, input_names=names, output_names=["out"], opset_version=17,
                              dynamic_axes={n: DYNAMIC for n in names}, dynamo=False)
        elif exporter == "dynamo":
            b, s = torch.export.Dim("batch"), torch.export.Dim("seq", min=2, max=128)
            shapes = {"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: s}}
            torch.onnx.export(model, args, path, input_names=names, output_names=["out"], opset_version=20,
                              dynamic_shapes=shapes, dynamo=True, external_data=False)
        else:
            raise ValueError(exporter)
    return path
