"""What every check shares: match recording, accept or reject with a reason, the dtype and private-intermediate checks."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

from tvm import relax
from tvm.relax.transform import PatternCheckContext

from tvmfuse.patterns.readers import dtype_of, leaf_args

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

    def reading(self, mod) -> "Recorder":
        """This recorder with `order` and `producers` read from `mod`'s main (the checks look bindings up there)."""
        for block in mod["main"].body.blocks:
            for i, b in enumerate(block.bindings, start=len(self.order)):
                self.order[b.var.name] = i
                if isinstance(b.value, relax.Call):
                    self.producers[b.var.name] = b.value
        return self


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
        for arg in leaf_args(call):
            if arg in matched or any(arg.same_as(x) for x in inputs):
                continue
            inputs.append(arg)
    root = root_var(ctx)
    outputs = [v for v, _ in bound if v.same_as(root) or _used_outside(ctx, v, matched)]
    return Match(pattern, root.name if root is not None else "?", bound, inputs, outputs, dict(info or {}), reason)


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
    """The root's value is used, and only by casts of it to another dtype, which a match ending at the cast (the
    pattern's optional trailing `cast`) takes in. A matmul reading it into fp32 sums (a model stored in bf16) is no
    cast: the match ends at the root. (Without a recorder's bindings: by the users' dtypes alone.)"""
    if getattr(getattr(ctx.matched_expr, "op", None), "name", "") == "relax.astype":
        return False  # the match took its trailing cast already
    root = root_var(ctx)
    users = ctx.var_usages.get(root, None) if root is not None else None
    rec = current()
    return bool(users) and all(
        dtype_of(u) in SUPPORTED_DTYPES and dtype_of(u) != dtype_of(root)
        and (not rec or getattr(getattr(rec.producers.get(u.name), "op", None), "name", "") == "relax.astype")
        for u in users)


def finish(ctx: PatternCheckContext, pattern: str, info: dict | None = None, exposed: tuple[str, ...] = ()) -> bool:
    """The common tail of every check: dtypes, private intermediates, then accept."""
    if not check_dtypes(ctx, pattern) or not check_private_intermediates(ctx, pattern, exposed):
        return False
    return accept(ctx, pattern, info)


def producer(name: str):
    """The call that defines var `name` in main (filled by the decide stage), or None."""
    rec = current()
    return rec.producers.get(name) if rec else None


__all__ = ["Match", "Recorder", "start", "stop", "current", "accept", "reject", "finish",
           "check_private_intermediates", "check_dtypes", "only_cast_follows", "producer"]
