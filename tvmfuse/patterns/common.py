"""What every table entry shares: match recording, rejection with a reason, the private-intermediate check."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op
from tvm.relax.transform import PatternCheckContext

Annotated = tuple[DFPattern, dict[str, DFPattern]]
Const = tvm.ir.GenericConst  # relax.Constant in older TVM
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class Match:
    """One match of a table entry: the bindings it covers (in program order), its inputs/outputs, facts."""

    pattern: str
    root: str
    bindings: list[tuple[relax.Var, relax.Call]]
    inputs: list[relax.Expr]
    outputs: list[relax.Var]
    info: dict = field(default_factory=dict)
    reason: str | None = None  # set when the check rejected it

    @property
    def key(self) -> tuple[str, str]:
        return (self.pattern, self.root)


@dataclass
class Recorder:
    """How checks behave: dry run (record every match, fuse none) or accept only `chosen` (None: all)."""

    dry_run: bool = False
    chosen: set | None = None
    order: dict[str, int] = field(default_factory=dict)     # var name -> position in main
    producers: dict[str, relax.Call] = field(default_factory=dict)  # var name -> bound call
    matches: list[Match] = field(default_factory=list)
    rejections: list = field(default_factory=list)
    accepted: list = field(default_factory=list)             # (root call, key) of fused matches


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("tvmfuse_recorder", default=None)


def start(recorder: Recorder) -> contextvars.Token:
    return _RECORDER.set(recorder)


def stop(token: contextvars.Token) -> None:
    _RECORDER.reset(token)


def current() -> Recorder | None:
    return _RECORDER.get()


def root_var(ctx: PatternCheckContext):
    return ctx.value_to_bound_var.get(ctx.matched_expr)


def _match(ctx: PatternCheckContext, pattern: str, info: dict | None, reason: str | None) -> Match:
    rec = current()
    order = rec.order if rec else {}
    bound = sorted(ctx.matched_bindings.items(), key=lambda kv: order.get(kv[0].name, 0))
    matched = {v for v, _ in bound}
    inputs = []
    for _, call in bound:
        for arg in _leaf_args(call):
            if arg in matched or any(arg.same_as(x) for x in inputs):
                continue
            inputs.append(arg)
    root = root_var(ctx)
    outputs = [v for v, _ in bound if v.same_as(root) or _used_outside(ctx, v, matched)]
    return Match(pattern, root.name if root is not None else "?", bound, inputs, outputs, dict(info or {}), reason)


def _leaf_args(call: relax.Call):
    for arg in call.args:
        if isinstance(arg, relax.Tuple):
            yield from (f for f in arg.fields if isinstance(f, (relax.Var, Const)))
        elif isinstance(arg, (relax.Var, Const)):
            yield arg


def _used_outside(ctx: PatternCheckContext, var, matched) -> bool:
    users = ctx.var_usages.get(var, None)
    if users is None:
        return False
    return not users or any(u not in matched for u in users)


def accept(ctx: PatternCheckContext, pattern: str, info: dict | None = None) -> bool:
    """A match that passed its check: recorded in a dry run, fused when chosen (or when nothing decides)."""
    rec = current()
    if rec is None:
        return True
    if rec.dry_run:
        rec.matches.append(_match(ctx, pattern, info, None))
        return False
    key = (pattern, root_var(ctx).name)
    ok = rec.chosen is None or key in rec.chosen
    if ok:
        rec.accepted.append((ctx.matched_expr, key))
    return ok


def reject(ctx: PatternCheckContext, pattern: str, reason: str) -> bool:
    """The check failed: record why (with the match, in a dry run) and keep the module unchanged there."""
    rec = current()
    if rec is not None:
        root = root_var(ctx)
        rec.rejections.append((pattern, root.name if root is not None else "?", reason))
        if rec.dry_run:
            rec.matches.append(_match(ctx, pattern, None, reason))
    return False


def check_private_intermediates(ctx: PatternCheckContext, pattern: str, exposed: tuple[str, ...] = ()) -> bool:
    """Reject when a value inside the match (other than the root and `exposed`) is used outside it."""
    matched = set(ctx.matched_bindings.keys())
    root = root_var(ctx)
    allowed = {root} | {ctx.value_to_bound_var.get(ctx.annotated_expr[n]) for n in exposed
                        if n in ctx.annotated_expr}
    for var in matched - allowed:
        if _used_outside(ctx, var, matched):
            return reject(ctx, pattern, f"intermediate {var.name} is used outside the match")
    return True


def check_dtypes(ctx: PatternCheckContext, pattern: str) -> bool:
    """Every tensor the match computes must be float32/float16/bfloat16 (bool/int masks inside are fine), and
    every cast in it (the optional `astype`s mixed precision puts around fp32 ops) must be float to float."""
    for var, call in ctx.matched_bindings.items():
        dtype = dtype_of(var)
        if dtype is not None and dtype not in SUPPORTED_DTYPES and dtype != "bool":
            return reject(ctx, pattern, f"{var.name} has dtype {dtype}; the kernel supports {', '.join(SUPPORTED_DTYPES)}")
        if getattr(getattr(call, "op", None), "name", "") == "relax.astype":
            src = dtype_of(call.args[0])
            if src not in SUPPORTED_DTYPES or dtype not in SUPPORTED_DTYPES:
                return reject(ctx, pattern, f"{var.name} casts {src} to {dtype}: only casts between "
                              f"{', '.join(SUPPORTED_DTYPES)} belong in the kernel")
    return True


def only_cast_follows(ctx: PatternCheckContext) -> bool:
    """The root's value is used, and only by values of another dtype: its casts (a binary op or a norm takes
    equal dtypes), which a match ending at the cast (the pattern's optional trailing `cast`) takes in."""
    if getattr(getattr(ctx.matched_expr, "op", None), "name", "") == "relax.astype":
        return False  # the match took its trailing cast already
    root = root_var(ctx)
    users = ctx.var_usages.get(root, None) if root is not None else None
    return bool(users) and all(dtype_of(u) in SUPPORTED_DTYPES and dtype_of(u) != dtype_of(root) for u in users)


def finish(ctx: PatternCheckContext, pattern: str, info: dict | None = None, exposed: tuple[str, ...] = ()) -> bool:
    """The common tail of every check: dtypes, private intermediates, then accept."""
    if not check_dtypes(ctx, pattern) or not check_private_intermediates(ctx, pattern, exposed):
        return False
    return accept(ctx, pattern, info)


# ---- sub-patterns for the casts mixed precision (ToMixedPrecision) puts around fp32 ops ---------------

def cast(p: DFPattern) -> DFPattern:
    """`p`, optionally followed by an `astype` (where mixed precision casts around an op computing in fp32)."""
    return is_op("relax.astype")(p) | p


def const() -> DFPattern:
    """A constant, or a scalar constant cast to the compute dtype: ToMixedPrecision writes fp16 ops' scalar
    operands as `astype(const)`, and FoldConstant (TVM 0.27) folds that cast for tensors but not for 0-d ones."""
    return is_const() | is_op("relax.astype")(is_const())


def upcast(p: DFPattern) -> DFPattern:
    """`p`, optionally cast from a float dtype to float32: the cast into an op that computes in fp32. Only a
    float-to-fp32 cast: a cast to the compute dtype that feeds other ops too (the model's input cast to fp16)
    and a cast from int stay outside the match (the kernel's input)."""
    src = p.has_dtype("float16") | p.has_dtype("bfloat16") | p.has_dtype("float32")
    return is_op("relax.astype")(src).has_dtype("float32") | p


# ---- small readers used by the checks -------------------------------------------------------------

def shape_of(expr) -> list | None:
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    return None if shape is None else list(shape)


def dtype_of(expr) -> str | None:
    return getattr(getattr(expr, "ty", None), "dtype", None)


def ndim(expr) -> int:
    shape = shape_of(expr)
    return -1 if shape is None else len(shape)


def dim_str(d) -> str:
    """A dim as text: "64" for constants (not "T.int64(64)"), the expression for symbolic ones."""
    value = getattr(d, "value", None)
    return str(value) if isinstance(value, int) else str(d)


def same_dim(a, b) -> bool:
    """Two PrimExprs known equal (ints, or the same symbolic expression)."""
    return dim_str(a) == dim_str(b)


def scalar(expr) -> float | None:
    """The value of a scalar (or one-element) constant, else None."""
    if not isinstance(expr, Const):
        return None
    value = expr.value.numpy()
    return float(value.reshape(-1)[0]) if value.size == 1 else None


#: relative rounding error of a constant stored in a dtype (half its epsilon): a bf16 0.044715 is 0.0446777
ROUNDING = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def constants(ctx: PatternCheckContext) -> list[tuple[float, str]]:
    """All scalar constants read by the matched bindings, each with its dtype."""
    out = []
    for call in ctx.matched_bindings.values():
        for arg in _leaf_args(call):
            value = scalar(arg)
            if value is not None:
                out.append((value, str(arg.value.dtype)))
    return out


def has_constants(ctx: PatternCheckContext, wanted: list[tuple[float, ...]], tol: float = 1e-3) -> str | None:
    """None when, for every group of alternatives, one value appears (within `tol`, or the rounding error of
    the constant's dtype if larger); else what is missing."""
    got = constants(ctx)
    for alts in wanted:
        if not any(abs(g - a) <= max(tol, ROUNDING.get(dt, 0.0)) * max(1.0, abs(a)) for g, dt in got for a in alts):
            return f"constant {alts[0]:.6g} not found (constants: {', '.join(f'{g:.6g}' for g, _ in got)})"
    return None


def last_axis(axis, rank: int) -> bool:
    values = [int(a) for a in (axis if isinstance(axis, (list, tuple)) or hasattr(axis, "__len__") else [axis])]
    return values in ([-1], [rank - 1])


def producer(name: str):
    """The call that defines var `name` in main (filled by the decide stage), or None."""
    rec = current()
    return rec.producers.get(name) if rec else None


def as_int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


__all__ = ["Annotated", "Match", "Recorder", "accept", "reject", "finish", "check_private_intermediates",
           "cast", "const", "upcast", "only_cast_follows",
           "dim_str", "shape_of", "dtype_of", "ndim", "same_dim", "scalar", "has_constants", "last_axis", "producer",
           "as_int", "np"]
