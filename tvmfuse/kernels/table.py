"""The template table: for each fusion pattern, the hand-written kernels that may replace its fused groups, tried in
order (each template's own check says which shapes it takes). The Hopper kernels, which take fused GEMMs and row
reductions whatever pattern made them, have their table in `kernels/hopper/select.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tvmfuse.kernels.attention.common import Template
from tvmfuse.kernels.attention.decode import TEMPLATE as ATTENTION_DECODE
from tvmfuse.kernels.attention.prefill import TEMPLATE as ATTENTION_PREFILL
from tvmfuse.kernels.attention.prefill_wgmma import TEMPLATE as ATTENTION_PREFILL_WGMMA
from tvmfuse.kernels.attention.roles import attention_roles
from tvmfuse.kernels.attention.step import TEMPLATE as ATTENTION_STEP


@dataclass(frozen=True)
class TemplateEntry:
    """One row: the analysis that reads a fused kernel of the pattern (PrimFunc -> {"order": argument roles,
    "shapes": the templates' shape keys, "uses": ...}, or None), and the templates tried in order; each template
    carries its own shape check, knob space, default knobs and builders (kernels/attention/common.Template)."""

    analysis: Callable
    templates: tuple[Template, ...]


#: pattern name -> its row: attention's role analysis; decode (one query row), then the step (a symbolic query
#: length: decode or prefill at run time), then prefill: on sm_90a the wgmma template, else (and wherever it refuses
#: the shapes) the mma.sync one
TABLE = {
    "tvmfuse.attention": TemplateEntry(attention_roles, (ATTENTION_DECODE, ATTENTION_STEP, ATTENTION_PREFILL_WGMMA,
                                                         ATTENTION_PREFILL)),
}
