"""Decode template's index and logit helpers, shared by its CPU and GPU variants: which keys lie below L (no guard
when the splits tile a static L), where a query head sits in Q or out, and a key's base-2 logit with the additive
mask (after the soft cap of a model that caps its scores)."""

from __future__ import annotations

from tvm.script import tirx as T

from tvmfuse.kernels.attention.common import LOG2E, NEG, at, f32, soft_capped
from tvmfuse.kernels.attention.decode_knobs import PAST, chunk_of
from tvmfuse.kernels.attention.prefill_logits import mask_index


def guards(s: dict, knobs: dict, length, rows: int):
    """(has, qo, score, alive) for these shapes and knobs, L as the kernel has it (`length`) and `rows` query
    rows: Python functions the kernels' TVMScript calls."""
    split, masked = knobs["split"], s["mask"] == "additive"
    even = isinstance(length, int) and chunk_of(s, knobs, length) * split == length
    mi = mask_index(s)

    def has(pos):
        """Whether key `pos` is below L: always (a Python True, so no guard is emitted) when the splits tile L."""
        return True if even else pos < length

    def qo(layout, b, h, d):
        """Index of (query head h, dim d) in Q or out, stored [B,H,SQ,D] or [B,SQ,H,D] (row h % rows of head
        h // rows)."""
        return at(layout, b, h // rows, h % rows, d) if rows > 1 else at(layout, b, h, 0, d)

    def bias(mask, b, h, pos):
        """The mask value of (query head h, key pos) in fp32; 0 past L (never read there)."""
        value = f32(mask[mi(b, h // rows, h % rows if rows > 1 else 0, pos)])
        return value if even else T.if_then_else(pos < length, value, T.float32(0))

    def score(x, mask, b, h, pos):
        """The base-2 logit of a key from its scaled dot product x: soft-capped where the model caps its scores,
        plus the mask (kept above NEG, so a -inf mask gives no NaN); PAST at or past L."""
        x = soft_capped(s, x)
        if masked:
            x = T.max(x + bias(mask, b, h, pos) * T.float32(LOG2E), T.float32(NEG))
        return x if even else T.Select(pos < length, x, T.float32(PAST))

    def alive(mask, b, h, pos):
        """1 when the key counts for the row (below L, its mask value not -inf), else 0; a row with none gets 0,
        as the exports' isnan -> where guard gives."""
        if not masked:
            return T.float32(1)
        live = T.Select(T.isinf(bias(mask, b, h, pos)), T.float32(0), T.float32(1))
        return live if even else T.Select(pos < length, live, T.float32(0))

    return has, qo, score, alive
