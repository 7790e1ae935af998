"""The decoder step's attention template: one kernel for a step whose query length is symbolic (the in-place KV
cache's one function for prefill and decode). At run time it takes the flash-decoding passes when the step has one
query token and the prefill kernel otherwise; both read K/V where they lie (the cache's [positions, batch, kv
heads, head dim] view) and take any KV length. Knobs: the decode template's, and the prefill template's prefixed
`prefill_`."""

from __future__ import annotations

from tvm.script import tirx as T

from tvmfuse.kernels.attention import decode_knobs, prefill_knobs
from tvmfuse.kernels.attention.common import Template, dims, extents, template_func
from tvmfuse.kernels.attention.decode_cpu import cpu_body as decode_cpu_body
from tvmfuse.kernels.attention.decode_gpu import gpu_body as decode_gpu_body
from tvmfuse.kernels.attention.prefill_cpu import cpu_body as prefill_cpu_body
from tvmfuse.kernels.attention.prefill_gpu import gpu_body as prefill_gpu_body

PREFIX = "prefill_"


def _one_token(s: dict) -> dict:
    """The shapes the decode branch sees: one query row."""
    return dict(s, seq_q=1)


def _split(knobs: dict) -> tuple[dict, dict]:
    """(decode knobs, prefill knobs) of a step knob set."""
    return ({k: v for k, v in knobs.items() if not k.startswith(PREFIX)},
            {k[len(PREFIX):]: v for k, v in knobs.items() if k.startswith(PREFIX)})


def join_knobs(decode: dict, prefill: dict) -> dict:
    """The step knob set of a decode and a prefill knob set."""
    return {**decode, **{PREFIX + k: v for k, v in prefill.items()}}


def check(s: dict) -> str | None:
    if not isinstance(s["seq_q"], str):
        return "step template is for a symbolic query length (the decode and prefill templates take a static one)"
    if s["causal"]:
        return "step template takes causality through the additive mask only (causal needs seq_q == seq_k)"
    reason = decode_knobs.check(_one_token(s))
    if reason:
        return f"one-token branch: {reason}"
    reason = prefill_knobs.check(s)
    return f"prefill branch: {reason}" if reason else None


def knob_space(s: dict) -> list[dict]:
    return [join_knobs(d, p) for d in decode_knobs.knob_space(_one_token(s)) for p in prefill_knobs.knob_space(s)]


def default_knobs(s: dict) -> dict:
    return join_knobs(decode_knobs.default_knobs(_one_token(s)), prefill_knobs.default_knobs(s))


def build(s: dict, knobs: dict, target: str = "cuda"):
    """One PrimFunc (q, k, v[, mask], out): the decode passes when seq_q is 1, else the prefill kernel; the CPU
    variants for target 'llvm'."""
    ext = extents(s)
    SQ = dims(s, ext)[3]
    dk, pk = _split(knobs)
    cpu = target == "llvm"
    one = (decode_cpu_body if cpu else decode_gpu_body)(_one_token(s), dk, ext, 1)
    many = (prefill_cpu_body if cpu else prefill_gpu_body)(s, pk, ext)

    @T.macro
    def body(q, k, v, mask, out):
        if SQ == 1:
            one(q, k, v, mask, out)
        else:
            many(q, k, v, mask, out)

    return template_func(s, ext, body, "step", gpu=not cpu, v_heads=s["v_heads"])


TEMPLATE = Template("attention_step", build, check, knob_space, default_knobs)

__all__ = ["TEMPLATE", "build", "check", "default_knobs", "join_knobs", "knob_space"]
