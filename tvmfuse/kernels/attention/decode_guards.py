"""Decode template's index helpers, shared by its CPU and GPU variants: which keys lie below L (no guard when the
splits tile L), and where a query head sits in Q or out."""

from __future__ import annotations

from tvm.script import tirx as T

from tvmfuse.kernels.attention.common import at
from tvmfuse.kernels.attention.decode_knobs import PAST, chunk_of


def guards(s: dict, knobs: dict):
    """(has, qo, score) for these shapes and knobs: Python functions the kernels' TVMScript calls."""
    L, SQ, split = s["seq_k"], s["seq_q"], knobs["split"]
    even = chunk_of(s, knobs) * split == L

    def has(pos):
        """Whether key `pos` is below L: always (a Python True, so no guard is emitted) when the splits tile L."""
        return True if even else pos < L

    def qo(layout, b, h, d):
        """Index of (query head h, dim d) in Q or out, stored [B,H,SQ,D] or [B,SQ,H,D]."""
        return at(layout, b, h // SQ, h % SQ, d) if SQ > 1 else at(layout, b, h, 0, d)

    def score(x, pos):
        return x if even else T.Select(pos < L, x, T.float32(PAST))

    return has, qo, score
