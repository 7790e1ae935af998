"""Flash-attention prefill template: mma.sync tensor cores, fp32 online softmax, causal/additive mask, GQA.

Q, K, V and out may each be stored BHSD or BSHD (`q_layout`, ...): BSHD is read in place with strided loads,
as the ONNX exports leave the tensors, so no transpose kernel runs. K and V may have different head counts
(`kv_heads`, `v_heads`: a GQA repeat inside the fused group for one of them only).

Fully masked rows (additive mask): a query row whose every logit is -inf gets 0, as the exports' isnan -> where
guard gives (softmax of all -inf is NaN, replaced by 0); a row of finite but huge negative logits (a
finfo.min mask) still gets the mean of V, as the graph's softmax does. Without a where guard in the graph
such a -inf row would be NaN there; the template still gives 0."""

from __future__ import annotations

from tvmfuse.kernels.attention.common import Template
from tvmfuse.kernels.attention.prefill_cpu import cpu_kernel
from tvmfuse.kernels.attention.prefill_gpu import gpu_kernel
from tvmfuse.kernels.attention.prefill_knobs import MAX_SMEM, STATIC_SMEM, check, default_knobs, knob_space, smem_bytes
from tvmfuse.kernels.attention.prefill_logits import mask_index


def build(s: dict, knobs: dict, target: str = "cuda"):
    """The CPU variant (target 'llvm') or the CUDA kernel; without an additive mask, without the mask parameter."""
    return cpu_kernel(s, knobs) if target == "llvm" else gpu_kernel(s, knobs)


TEMPLATE = Template("attention_prefill", build, check, knob_space, default_knobs)

__all__ = ["MAX_SMEM", "STATIC_SMEM", "TEMPLATE", "build", "check", "default_knobs", "knob_space", "mask_index",
           "smem_bytes"]
