"""Flash-decoding attention template: one query token over KV length L, split across blocks, then combined.

Any L: each split takes chunk = ceil(L / split) keys rounded up to whole steps; keys from L on (the tail of
the last split with keys, and whole splits past it) are not loaded (zeros) and weigh nothing, a split with no
key gives running max NEG, sum 0, so the combine gives it weight 0. When split x chunk == L there are no guards.
L may be symbolic (an in-place KV cache's past + seq: one kernel for every past length, always guarded), and so
may the batch. Q and out ([B,1,H,D]: BHSD and BSHD are the same memory) and K and V (BHSD, or BSHD or SBHD read
in place) are taken in the layout the call passes them (`q_layout`, ...); Q may be fp32 (it is read as fp32
anyway). An additive mask is added to each logit; a row none of whose keys it lets through gets 0, as the exports'
isnan -> where guard gives. Without causality a few query rows (seq_q > 1) are more heads of their KV
head's group, as transformers' GQA decode passes Q ([B, kv_heads, G, D])"""

from __future__ import annotations

from tvmfuse.kernels.attention.common import Template
from tvmfuse.kernels.attention.decode_cpu import cpu_kernel
from tvmfuse.kernels.attention.decode_gpu import gpu_kernel
from tvmfuse.kernels.attention.decode_knobs import check, chunk_of, default_knobs, group, knob_space


def build(s: dict, knobs: dict, target: str = "cuda"):
    """The CPU variant (target 'llvm') or the CUDA kernel."""
    return cpu_kernel(s, knobs) if target == "llvm" else gpu_kernel(s, knobs)


TEMPLATE = Template("attention_decode", build, check, knob_space, default_knobs)

__all__ = ["TEMPLATE", "build", "check", "chunk_of", "default_knobs", "group", "knob_space"]
