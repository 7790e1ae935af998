"""bench/hf_models.py: the torch contender in fp16/bf16 computes the reference's model (its rotary frequencies fp32)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hf_models  # noqa: E402


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_keeps_the_rotary_frequencies_fp32(dtype):
    """`model.to(fp16)` rounds `inv_freq`: at 2048 positions the rotary cos/sin are off by ~0.5 (why torch.compile's
    Llama rows were outside tolerance in every models run before 2026-12-06's ninth session); `to_low_precision`
    keeps them fp32, so cos/sin are off by their own rounding only, and every weight is in the low dtype."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    low = getattr(torch, dtype)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=256, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=32, max_position_embeddings=4096)
    model = tf.LlamaForCausalLM(cfg).eval()
    pos, x = torch.arange(2048)[None], torch.zeros(1, 2048, 256)
    with torch.no_grad():
        ref = model.model.rotary_emb(x, pos)
        rounded = copy.deepcopy(model).to(low).model.rotary_emb(x.to(low), pos)
        kept = hf_models.to_low_precision(copy.deepcopy(model), low)
        got = kept.model.rotary_emb(x.to(low), pos)
    err = lambda out: max(float((o.float() - r).abs().max()) for o, r in zip(out, ref))  # noqa: E731
    assert err(rounded) > 0.1 and err(got) < (1e-3 if dtype == "float16" else 8e-3), (err(rounded), err(got))
    assert {str(b.dtype) for n, b in kept.named_buffers() if n.endswith("inv_freq")} == {"torch.float32"}
    assert {p.dtype for p in kept.parameters()} == {low}
