"""Kernels stage: hand-written kernels in the place of fused ones where search falls short: the attention templates
(`attention/`, by the template table) and, on sm_90a, the TIRx GEMM and row kernels (`hopper/`)."""

from tvmfuse.kernels.hopper import apply_hopper_kernels, is_hopper
from tvmfuse.kernels.substitution import lookup, substitute, template_sites, templates
from tvmfuse.kernels.table import ATTENTION_DECODE, ATTENTION_PREFILL, ATTENTION_STEP, TABLE, TemplateEntry

__all__ = ["ATTENTION_DECODE", "ATTENTION_PREFILL", "ATTENTION_STEP", "TABLE", "TemplateEntry", "apply_hopper_kernels", "is_hopper", "lookup",
           "substitute", "template_sites", "templates"]
