"""The template table: for each fusion pattern, the hand-written kernels that may replace its fused groups, tried in
order (each template's own check says which shapes it takes). The Hopper kernels, which take fused GEMMs and row
reductions whatever pattern made them, have their table in `kernels/hopper/select.py`."""

from tvmfuse.kernels.attention.decode import TEMPLATE as ATTENTION_DECODE
from tvmfuse.kernels.attention.prefill import TEMPLATE as ATTENTION_PREFILL

#: pattern name -> its templates: decode (one query row) before prefill
TEMPLATES = {
    "tvmfuse.attention": (ATTENTION_DECODE, ATTENTION_PREFILL),
}
