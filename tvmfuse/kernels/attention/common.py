"""Shared pieces of the kernel templates: the Template record, shape normalisation and small TIR helpers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable

from tvm.script import tirx as T

from tvmfuse.records.keys import knob_key

LOG2E = 1.4426950408889634
NEG = -1.0e30  # "minus infinity" for running maxima (exp2(NEG - x) == 0 in fp32)


def f32(x):
    return T.Cast("float32", x)


@dataclass(frozen=True)
class Template:
    """A hand-written kernel family: build(shapes, knobs, target) -> PrimFunc, with a shape check and knob space."""

    name: str
    build_fn: Callable
    check_fn: Callable[[dict], "str | None"]
    knob_space_fn: Callable[[dict], list]
    default_knobs_fn: Callable[[dict], dict]

    def check(self, shapes: dict) -> str | None:
        """None when the template accepts these shapes, else the reason it does not."""
        try:
            s = normalize(shapes)
        except (KeyError, TypeError, ValueError) as err:
            return f"bad shapes: {err}"
        return self.check_fn(s)

    def knob_space(self, shapes: dict) -> list[dict]:
        return self.knob_space_fn(normalize(shapes))

    def default_knobs(self, shapes: dict) -> dict:
        return self.default_knobs_fn(normalize(shapes))

    def __call__(self, shapes: dict, knobs: dict | None = None, target: str = "cuda"):
        """The PrimFunc for these shapes and knobs; target 'llvm' gives the schedule-free CPU variant."""
        s = normalize(shapes)
        reason = self.check_fn(s)
        if reason:
            raise ValueError(f"{self.name}: {reason}")
        knobs = {**self.default_knobs_fn(s), **(knobs or {})}
        fn = self.build_fn(s, knobs, target).with_attr("tvmfuse.kernel", f"{self.name}{sorted(knobs.items())}")
        # the tuning records' key: which kernel family and shapes (tvmfuse.template), which knobs (tvmfuse.knobs)
        return fn.with_attr("tvmfuse.template", self.key(s, target)).with_attr("tvmfuse.knobs", knob_key(knobs))

    def key(self, shapes: dict, target: str = "cuda") -> str:
        """The template and its shapes, as stored on every variant: records of one kernel share it."""
        s = {k: v for k, v in normalize(shapes).items() if k != "target"}
        return json.dumps({"template": self.name, "target": "llvm" if str(target) == "llvm" else "cuda",
                           "shapes": s}, sort_keys=True, default=str)


def normalize(shapes: dict) -> dict:
    """Shape dict with ints (the decide stage records dims as strings) and defaults filled in."""
    s = dict(shapes)
    for key in ("batch", "heads", "seq_q", "seq_k", "head_dim"):
        s[key] = int(s[key])
    s["kv_heads"] = int(s.get("kv_heads") or s["heads"])
    s["v_heads"] = int(s.get("v_heads") or s["kv_heads"])
    for key in ("q_layout", "k_layout", "v_layout", "out_layout"):
        s[key] = s.get(key) or "BHSD"
        if s[key] not in ("BHSD", "BSHD"):
            raise ValueError(f"{key} {s[key]} (BHSD or BSHD)")
    s.setdefault("dtype", "float16")
    s["mask"] = s.get("mask") or "none"
    s["causal"] = bool(s.get("causal", False)) and s["mask"] != "additive"
    if s.get("scale") is None:
        s["scale"] = 1.0 / math.sqrt(s["head_dim"])
    s["scale"] = float(s["scale"])
    return s


def dims(s: dict):
    return s["batch"], s["heads"], s["kv_heads"], s["seq_k"], s["head_dim"], s["dtype"], s["scale"]


def tshape(layout: str, b, h, seq, d) -> tuple:
    """The buffer shape of a [B,H,S,D] tensor stored in `layout` (BHSD, or BSHD as exports leave it)."""
    return (b, h, seq, d) if layout == "BHSD" else (b, seq, h, d)


def at(layout: str, b, h, seq, d) -> tuple:
    """The buffer index of element [b, h, seq, d] of a tensor stored in `layout`: BSHD is read in place,
    with strided loads (contiguous along d), instead of a separate transpose kernel."""
    return (b, h, seq, d) if layout == "BHSD" else (b, seq, h, d)
