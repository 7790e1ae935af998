"""Kernels stage: hand-written kernels in the place of fused ones where search falls short: the attention templates
(`attention/`, by the template table), on sm_90a the TIRx GEMM and row kernels (`hopper/`), and a decoder step's greedy
sampler (`greedy`)."""

from tvmfuse.kernels.greedy import GREEDY, add_greedy_tokens
from tvmfuse.kernels.hopper import apply_hopper_kernels, hopper_gemm_sites, is_hopper, measured_tiles, sibling_merge_pays
from tvmfuse.kernels.substitution import lookup, substitute, template_sites, templates
from tvmfuse.kernels.table import (ATTENTION_DECODE, ATTENTION_PREFILL, ATTENTION_PREFILL_WGMMA, ATTENTION_STEP, TABLE,
                                   TemplateEntry)

__all__ = ["ATTENTION_DECODE", "ATTENTION_PREFILL", "ATTENTION_PREFILL_WGMMA", "ATTENTION_STEP", "GREEDY", "TABLE", "TemplateEntry",
           "add_greedy_tokens", "apply_hopper_kernels", "hopper_gemm_sites", "is_hopper", "lookup",
           "measured_tiles", "sibling_merge_pays",
           "substitute", "template_sites", "templates"]
