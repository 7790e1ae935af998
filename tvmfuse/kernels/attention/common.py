"""Shared pieces of the kernel templates: the Template record, shape normalisation and small TIR helpers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable

from tvm import tirx
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
        """The template and its shapes, as stored on every variant: records of one kernel share it (the target's kind
        and arch, which `template_sites` adds to the shapes for the checks, are not part of it, nor is `packed`: Q, K
        and V read in place from one tensor differ from the kernel measured apart in their row stride alone)."""
        s = {k: v for k, v in normalize(shapes).items() if k not in ("target", "arch", "packed")}
        return json.dumps({"template": self.name, "target": "llvm" if str(target) == "llvm" else "cuda",
                           "shapes": s}, sort_keys=True, default=str)


SIZES = ("batch", "seq_q", "seq_k")  # the sizes that may be symbolic (their TIR text: "batch", "past + seq")
LAYOUTS = ("BHSD", "BSHD", "SBHD")  # SBHD: an in-place KV cache's [positions, batch, kv heads, head dim] view


def normalize(shapes: dict) -> dict:
    """Shape dict with ints (the decide stage records dims as strings; a symbolic size keeps its text) and defaults
    filled in."""
    s = dict(shapes)
    for key in ("batch", "heads", "seq_q", "seq_k", "head_dim"):
        s[key] = _size(s[key]) if key in SIZES else int(s[key])
    s["kv_heads"] = int(s.get("kv_heads") or s["heads"])
    s["v_heads"] = int(s.get("v_heads") or s["kv_heads"])
    for key in ("q_layout", "k_layout", "v_layout", "out_layout"):
        s[key] = s.get(key) or "BHSD"
        if s[key] not in LAYOUTS:
            raise ValueError(f"{key} {s[key]} ({', '.join(LAYOUTS)})")
    s.setdefault("dtype", "float16")
    if s.get("q_dtype") in (None, s["dtype"]):
        s.pop("q_dtype", None)  # only a Q of another dtype is named (the tuning records' keys stay as they were)
    s["mask"] = s.get("mask") or "none"
    s["causal"] = bool(s.get("causal", False)) and s["mask"] != "additive"
    if s.get("scale") is None:
        s["scale"] = 1.0 / math.sqrt(s["head_dim"])
    s["scale"] = float(s["scale"])
    if s.get("softcap"):
        s["softcap"] = float(s["softcap"])
    else:
        s.pop("softcap", None)  # only a capped template names it (the tuning records' keys stay as they were)
    if "mask_shape" in s:
        s["mask_shape"] = tuple(_size(x) for x in s["mask_shape"])
    if s.get("packed"):
        s["packed"] = tuple(int(x) for x in s["packed"])
        _check_packed(s)
    else:
        s.pop("packed", None)
    return s


def packed(s: dict) -> tuple[int, tuple[int, int, int]] | None:
    """(row width W, (Q's, K's, V's offset in a row)) where Q, K and V are read in place from one [batch, seq, W]
    tensor (the input of an equal split the kernel then replaces, `kernels/split_reads.py`), else None."""
    return (s["packed"][0], tuple(s["packed"][1:])) if s.get("packed") else None


def _check_packed(s: dict) -> None:
    """Q, K and V in one [batch, seq, W] tensor: each BSHD, of one length and dtype, the three column ranges inside W
    and apart."""
    if len(s["packed"]) != 4:
        raise ValueError(f"packed {s['packed']}: (row width, Q offset, K offset, V offset)")
    width, offsets = s["packed"][0], s["packed"][1:]
    if any(s[f"{r}_layout"] != "BSHD" for r in "qkv") or s["seq_q"] != s["seq_k"] or "q_dtype" in s:
        raise ValueError("packed Q, K and V: BSHD, one sequence length, one dtype")
    spans = sorted((off, off + heads * s["head_dim"]) for off, heads in
                   zip(offsets, (s["heads"], s["kv_heads"], s["v_heads"])))
    if spans[0][0] < 0 or spans[-1][1] > width or any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise ValueError(f"packed {s['packed']}: Q, K and V must lie apart inside a row of {width}")
    if any(x % 8 for x in s["packed"]):  # the 16-byte loads (cp.async, TMA) of fp16/bf16 rows
        raise ValueError(f"packed {s['packed']}: the row width and offsets must be multiples of 8 elements")


def _size(x) -> int | str:
    """An int, or the text of a symbolic size."""
    return int(x) if isinstance(x, int) or str(x).isdigit() else str(x)


def q_dtype(s: dict) -> str:
    """Q's dtype: the compute dtype, or fp32 (a rotary embedding computed in fp32)."""
    return s.get("q_dtype", s["dtype"])


def symbolic(s: dict) -> bool:
    """Whether any of batch, seq_q, seq_k is symbolic (one kernel for every value: bounds guarded)."""
    return any(isinstance(s[key], str) for key in SIZES)


def extents(s: dict) -> dict:
    """{size name: its extent in the kernel}: the int, or one int32 variable per distinct symbolic size (the
    kernel's buffers define it from the call's shapes)."""
    found: dict[str, tirx.Var] = {}
    return {key: s[key] if isinstance(s[key], int) else found.setdefault(s[key], tirx.Var(key, "int32"))
            for key in SIZES}


def dims(s: dict, ext: dict):
    """(batch, heads, kv heads, seq_q, seq_k, head_dim, dtype, scale), the sizes as `extents` gives them."""
    return ext["batch"], s["heads"], s["kv_heads"], ext["seq_q"], ext["seq_k"], s["head_dim"], s["dtype"], s["scale"]


def soft_capped(s: dict, x):
    """The base-2 logit x (scores * scale * log2(e)) soft-capped as the model caps its scores, cap * tanh(scores /
    cap) (Gemma 2), in the same base: C * tanh(x / C) with C = cap * log2(e); x where the model has no cap."""
    if not s.get("softcap"):
        return x
    c = float(s["softcap"] * LOG2E)
    return T.float32(c) * T.tanh(x * T.float32(1.0 / c))


def mask_extents(s: dict, ext: dict) -> tuple:
    """The additive mask's buffer shape: each axis 1 (broadcast) or the size it has ([B, H, Sq, Sk])."""
    shape = s.get("mask_shape") or (1, 1, s["seq_q"], s["seq_k"])
    named = {s[key]: ext[key] for key in SIZES if isinstance(s[key], str)}
    return tuple(named[x] if isinstance(x, str) else x for x in shape)


def drop_mask(fn: tirx.PrimFunc, s: dict) -> tirx.PrimFunc:
    """Without an additive mask, the variant without the unused mask parameter: the signature (q, k, v, out), or
    (qkv, out) where they are packed."""
    if s["mask"] == "additive":
        return fn
    return tirx.PrimFunc([p for p in fn.params if p.name != "mask"], fn.body, fn.ret_type, fn.attrs)


def ceil_div(a, b):
    """ceil(a / b) of ints or TIR sizes."""
    return (a + b - 1) // b


def tshape(layout: str, b, h, seq, d) -> tuple:
    """The buffer shape of a [B,H,S,D] tensor stored in `layout` (BHSD, BSHD as exports leave it, or SBHD as an
    in-place KV cache's view holds K and V)."""
    return {"BHSD": (b, h, seq, d), "BSHD": (b, seq, h, d), "SBHD": (seq, b, h, d)}[layout]


#: a PrimFunc attribute: lower this kernel without TIR's common-subexpression elimination (the build's TIR
#: pipeline reads it). The CSE pass hoists loop-invariant terms of an index with a symbolic size (`batch * 65536`)
#: into a kernel argument, where TVM's CUDA codegen can no longer prove a 16-byte load aligned; its lane-by-lane
#: fallback for 8 fp16/bf16 lanes then does not compile ("too many arguments in function call" in make_uint4).
#: nvcc eliminates common subexpressions itself.
NO_CSE_ATTR = "tvmfuse.no_cse"


def kernel_attrs(s: dict) -> dict:
    """The CUDA kernel's function attributes; with a symbolic size, NO_CSE_ATTR too (the static kernels' CUDA source
    stays as it was)."""
    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True}
    if symbolic(s):
        attrs[NO_CSE_ATTR] = True
    return attrs


def template_func(s: dict, ext: dict, body, name: str, gpu: bool, v_heads=None):
    """The PrimFunc `name` (q, k, v[, mask], out) running `body`, a TVMScript macro over those five buffers, at
    the shapes `s` with the sizes `ext`; V has `v_heads` heads (default: K's)."""
    B, H, HKV, SQ, L, D, dt, _ = dims(s, ext)
    qshape, kshape, vshape = (tshape(s[f"{r}_layout"], B, heads, n, D) for r, heads, n in
                              (("q", H, SQ), ("k", HKV, L), ("v", HKV if v_heads is None else v_heads, L)))
    oshape, mshape, qdt, mdt = tshape(s["out_layout"], B, H, SQ, D), mask_extents(s, ext), q_dtype(s), \
        s.get("mask_dtype", dt)
    attrs = kernel_attrs(s) if gpu else {"tirx.noalias": True}
    if packed(s):
        return drop_mask(_packed_func(s, (qshape, kshape, vshape), oshape, mshape, mdt, attrs, body)
                         .with_attr("global_symbol", name), s)

    @T.prim_func(s_tir=True)
    def func(q: T.Buffer(qshape, qdt), k: T.Buffer(kshape, dt), v: T.Buffer(vshape, dt), mask: T.Buffer(mshape, mdt),
             out: T.Buffer(oshape, dt)):
        T.func_attr(attrs)
        body(q, k, v, mask, out)

    return drop_mask(func.with_attr("global_symbol", name), s)


def _packed_func(s: dict, qkv_shapes: tuple, oshape, mshape, mdt, attrs: dict, body):
    """`template_func`'s PrimFunc where Q, K and V are column ranges of one parameter, qkv [batch, seq, W]: each a
    BSHD view of it (its offset in a row, rows W apart), so `body` reads them as it reads three tensors."""
    width, (oq, ok, ov) = packed(s)
    B, SQ, dt = qkv_shapes[0][0], qkv_shapes[0][1], s["dtype"]
    strides = (SQ * width, width, s["head_dim"], 1)
    qshape, kshape, vshape = qkv_shapes

    @T.prim_func(s_tir=True)
    def func(qkv: T.Buffer((B, SQ, width), dt), mask: T.Buffer(mshape, mdt), out: T.Buffer(oshape, dt)):
        T.func_attr(attrs)
        q = T.decl_buffer(qshape, dt, data=qkv.data, strides=strides, elem_offset=oq)
        k = T.decl_buffer(kshape, dt, data=qkv.data, strides=strides, elem_offset=ok)
        v = T.decl_buffer(vshape, dt, data=qkv.data, strides=strides, elem_offset=ov)
        body(q, k, v, mask, out)

    return func


def at(layout: str, b, h, seq, d) -> tuple:
    """The buffer index of element [b, h, seq, d] of a tensor stored in `layout`: BSHD and SBHD are read in
    place, with strided loads (contiguous along d), instead of a separate transpose kernel."""
    return tshape(layout, b, h, seq, d)
