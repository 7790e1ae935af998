"""The fusion pattern table: one entry (name, pattern maker, check) per fusion, most specific first."""

from __future__ import annotations

import contextvars
from typing import Callable

from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.relax.transform import FusionPattern, PatternCheckContext

Annotated = tuple[DFPattern, dict[str, DFPattern]]

#: Checks append (pattern, root binding, reason) here when they reject a match; see `collect_rejections`.
_REJECTIONS: contextvars.ContextVar[list | None] = contextvars.ContextVar("tvmfuse_rejections", default=None)


def make_rms_norm_residual_pattern() -> Annotated:
    """h = x + r; y = h / sqrt(mean(h*h, -1) + eps) * w  (h may be used downstream too)."""
    h = is_op("relax.add")(wildcard(), wildcard())
    square = is_op("relax.multiply")(h, h) | is_op("relax.power")(h, is_const())
    mean = is_op("relax.mean")(square)
    var_eps = is_op("relax.add")(mean, is_const())
    rms = is_op("relax.sqrt")(var_eps)
    norm = is_op("relax.divide")(h, rms) | is_op("relax.multiply")(h, is_op("relax.rsqrt")(var_eps))
    y = is_op("relax.multiply")(norm, wildcard())
    return y, {"h": h, "square": square, "mean": mean, "var_eps": var_eps, "norm": norm, "y": y}


def make_layer_norm_gelu_pattern() -> Annotated:
    """y = gelu(layer_norm(x, gamma, beta)), erf or tanh GELU."""
    ln = is_op("relax.nn.layer_norm")(wildcard(), wildcard(), wildcard())
    y = is_op("relax.nn.gelu")(ln) | is_op("relax.nn.gelu_tanh")(ln)
    return y, {"ln": ln, "y": y}


def check_rms_norm_residual(ctx: PatternCheckContext) -> bool:
    mean = ctx.annotated_expr["mean"]
    axes = [int(a) for a in (mean.attrs.axis or [])]
    ndim = len(mean.args[0].ty.shape)
    if axes not in ([-1], [ndim - 1]) or not mean.attrs.keepdims:
        return reject(ctx, "tvmfuse.rms_norm_residual", f"mean over axes {axes}, not the last axis with keepdims")
    return check_private_intermediates(ctx, "tvmfuse.rms_norm_residual", exposed=("h",))


def check_layer_norm_gelu(ctx: PatternCheckContext) -> bool:
    return check_private_intermediates(ctx, "tvmfuse.layer_norm_gelu")


#: The table. FuseOpsByPattern gives earlier entries priority, so the most specific come first.
PATTERN_TABLE: list[tuple[str, Callable[[], Annotated], Callable[[PatternCheckContext], bool]]] = [
    ("tvmfuse.rms_norm_residual", make_rms_norm_residual_pattern, check_rms_norm_residual),
    ("tvmfuse.layer_norm_gelu", make_layer_norm_gelu_pattern, check_layer_norm_gelu),
]


def fusion_patterns(names: list[str] | None = None) -> list[FusionPattern]:
    """The table as FusionPatterns for FuseOpsByPattern, optionally only the named entries."""
    out = []
    for name, make, check in PATTERN_TABLE:
        if names is None or name in names:
            root, annotations = make()
            out.append(FusionPattern(name, root, annotations, check))
    return out


def check_private_intermediates(ctx: PatternCheckContext, pattern: str, exposed: tuple[str, ...] = ()) -> bool:
    """Reject when a value inside the match (other than the root and `exposed`) is used outside it."""
    matched = set(ctx.matched_bindings.keys())
    root = ctx.value_to_bound_var.get(ctx.matched_expr)
    allowed = {root} | {ctx.value_to_bound_var.get(ctx.annotated_expr[n]) for n in exposed}
    for var in matched - allowed:
        outside = [u for u in ctx.var_usages.get(var, []) if u not in matched]
        if outside or _is_function_output(ctx, var):
            return reject(ctx, pattern, f"intermediate {var.name} is used outside the match")
    return True


def _is_function_output(ctx: PatternCheckContext, var) -> bool:
    # A value returned by the dataflow block has a usage outside any binding of the match.
    return var in ctx.var_usages and not ctx.var_usages[var] and var is not None


def reject(ctx: PatternCheckContext, pattern: str, reason: str) -> bool:
    log = _REJECTIONS.get()
    if log is not None:
        root = ctx.value_to_bound_var.get(ctx.matched_expr)
        log.append((pattern, root.name if root is not None else "?", reason))
    return False


def collect_rejections() -> tuple[list, contextvars.Token]:
    """Start recording rejections; returns the list that fills and the token to stop."""
    log: list = []
    return log, _REJECTIONS.set(log)


def stop_collecting(token: contextvars.Token) -> None:
    _REJECTIONS.reset(token)
