"""Prefill template's logit rules, shared by its CPU and GPU variants: the additive mask's broadcast index, causal
visibility, the base-2 logit, and 0 for a fully masked row."""

from __future__ import annotations

from tvm.script import tirx as T

from tvmfuse.kernels.attention.common import LOG2E, NEG, f32, soft_capped


def mask_index(s: dict):
    """Python index function (b, h, row, col) -> mask indices for the broadcast mask shape."""
    mb, mh, mq, _ = s.get("mask_shape") or (1, 1, s["seq_q"], s["seq_k"])
    return lambda b, h, r, c: (b if mb != 1 else 0, h if mh != 1 else 0, r if mq != 1 else 0, c)


def logit_rules(s: dict, seq_q=None):
    """(bias, visible, alive, logit, final) for these shapes: Python functions the kernels' TVMScript calls.
    `seq_q`: the query length as the kernel has it; a symbolic one clamps the mask's row (the rows of the last
    query tile past it are computed, never stored)."""
    scale, causal, masked = s["scale"], s["causal"], s["mask"] == "additive"
    qs = float(scale * LOG2E)
    index = mask_index(s)
    mi = index if seq_q is None or isinstance(seq_q, int) else \
        (lambda b, h, r, c: index(b, h, T.min(r, seq_q - 1), c))

    def bias(m, b, h, r, c):
        return f32(m[mi(b, h, r, c)]) * LOG2E if masked else T.float32(0)

    def visible(r, c):
        return c <= r if causal else True

    def alive(dot, m, b, h, r, c):
        """1 when the logit dot * scale + mask is finite (a key the row attends to), else 0; always 1 without a
        mask. Tested on the natural-log logit: finfo.min * LOG2E would overflow to -inf."""
        if not masked:
            return T.float32(1)
        return T.Select(T.isinf(dot * T.float32(scale) + f32(m[mi(b, h, r, c)])), T.float32(0), T.float32(1))

    def logit(dot, m, b, h, r, c):
        """The base-2 logit: dot * scale * log2(e), soft-capped where the model caps its scores (+ mask * log2(e),
        kept above NEG so a -inf mask gives no NaN)."""
        x = soft_capped(s, dot * qs)
        return T.max(x + bias(m, b, h, r, c), T.float32(NEG)) if masked else x

    def final(x, flag):
        """x, or 0 for a fully masked row (no finite logit)."""
        return T.Select(flag > T.float32(0), x, T.float32(0)) if masked else x

    return bias, visible, alive, logit, final
