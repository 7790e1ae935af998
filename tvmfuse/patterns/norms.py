"""Normalization entries: LayerNorm+GELU, skip-LayerNorm (with or without bias), RMSNorm (with residual)."""

from __future__ import annotations

from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.relax.transform import PatternCheckContext

from tvmfuse.patterns import activations as act
from tvmfuse.patterns.builders import Annotated, cast, upcast
from tvmfuse.patterns.common import finish, only_cast_follows, reject
from tvmfuse.patterns.readers import dim_str, last_axis, ndim, same_dim, shape_of


def _layer_norm(x: DFPattern) -> DFPattern:
    return is_op("relax.nn.layer_norm")(x, wildcard(), wildcard())


def make_layer_norm_gelu_pattern() -> Annotated:
    """y = gelu(layer_norm(x)): GELU as the op (erf or tanh) or decomposed by the exporter. In bf16 the
    layer_norm computes in fp32 between casts (`gelu(astype(layer_norm(astype(x, "float32"))))`): both
    casts optional, the one in an upcast to fp32 only."""
    ln = _layer_norm(upcast(wildcard()))
    ln_out = cast(ln)
    y = act.gelu_erf(ln_out) | act.gelu_tanh(ln_out)
    return y, {"ln": ln, "ln_out": ln_out, "y": y}


def make_skip_layer_norm_pattern() -> Annotated:
    """y = layer_norm(a + b); the sum stays available to later ops (the residual stream). In bf16 the layer_norm
    computes in fp32 between casts: `astype(layer_norm(astype(a + b)))`, both casts optional."""
    s = is_op("relax.add")(wildcard(), wildcard())
    ln = _layer_norm(upcast(s))
    return cast(ln), {"sum": s, "ln": ln}


def make_skip_layer_norm_bias_pattern() -> Annotated:
    """y = layer_norm((x + bias) [reshaped] [-> fp32] + residual) [-> cast]; the sum stays available. The upcast:
    mixed precision adds the bias in the compute dtype and the residual in fp32; the cast: its fp32 result cast
    to the compute dtype for the next matmul."""
    biased = is_op("relax.add")(wildcard(), wildcard())
    pre = is_op("relax.reshape")(biased, wildcard()) | biased
    s = is_op("relax.add")(upcast(pre), wildcard())
    ln = _layer_norm(upcast(s))
    return cast(ln), {"biased": biased, "sum": s, "ln": ln}


def _rms(h: DFPattern) -> tuple[DFPattern, dict]:
    """h [->fp32] -> square [->fp32] -> mean -> +eps -> sqrt/rsqrt -> divide/multiply [-> cast back] -> * weight
    [-> cast] (mixed precision: the fp32 result cast to the compute dtype for the next matmul).

    Every cast is optional. An exporter's upcast of h (`h.to(float32)`) is one cast shared by the square and
    the divide; mixed precision (ToMixedPrecision) squares in the compute dtype and casts the square up for the
    fp32 mean (`mean(astype(h*h))`), and casts h up separately for the divide: two casts of the same h."""
    square_in, norm_in = upcast(h), upcast(h)
    square = is_op("relax.power")(square_in, is_const()) | is_op("relax.multiply")(square_in, square_in)
    mean = is_op("relax.mean")(upcast(square))
    var_eps = is_op("relax.add")(mean, is_const())
    sqrt = is_op("relax.sqrt")(var_eps)
    norm = (is_op("relax.divide")(norm_in, sqrt) | is_op("relax.multiply")(norm_in, is_op("relax.rsqrt")(var_eps))
            | is_op("relax.multiply")(norm_in, is_op("relax.divide")(is_const(), sqrt)))
    y = is_op("relax.multiply")(cast(norm), wildcard())
    return cast(y), {"square": square, "mean": mean, "var_eps": var_eps, "norm": norm, "y": y}


def make_rms_norm_residual_pattern() -> Annotated:
    """h = x + r; y = h / sqrt(mean(h*h, -1) + eps) * w  (h stays available)."""
    h = is_op("relax.add")(wildcard(), wildcard())
    y, ann = _rms(h)
    return y, {"h": h, **ann}


def make_rms_norm_pattern() -> Annotated:
    """y = x / sqrt(mean(x*x, -1) + eps) * w, decomposed as exporters emit it."""
    y, ann = _rms(wildcard())
    return y, ann


def check_layer_norm_gelu(ctx: PatternCheckContext) -> bool:
    name = "tvmfuse.layer_norm_gelu"
    if not _ln_last_axis(ctx):
        return reject(ctx, name, "layer_norm is not over the last axis only")
    problem = act.gelu_erf_problem(ctx) if "tanh" not in _ops(ctx) and "gelu_tanh" not in _ops(ctx) \
        else act.gelu_tanh_problem(ctx)
    if problem:
        return reject(ctx, name, f"not a GELU: {problem}")
    return finish(ctx, name, {"hidden": dim_str(shape_of(ctx.annotated_expr["ln"])[-1])})


def check_skip_layer_norm(ctx: PatternCheckContext) -> bool:
    return _check_skip(ctx, "tvmfuse.skip_layer_norm")


def check_skip_layer_norm_bias(ctx: PatternCheckContext) -> bool:
    name = "tvmfuse.skip_layer_norm_bias"
    biased = ctx.annotated_expr["biased"]
    hidden = shape_of(biased)[-1]
    if not any(ndim(a) == 1 and same_dim(shape_of(a)[0], hidden) for a in biased.args):
        return reject(ctx, name, "the first add is not a bias add (no 1-D operand of the hidden size)")
    return _check_skip(ctx, name)


def _check_skip(ctx: PatternCheckContext, name: str) -> bool:
    s = ctx.annotated_expr["sum"]
    if not _ln_last_axis(ctx):
        return reject(ctx, name, "layer_norm is not over the last axis only")
    if any(ndim(a) != ndim(s) for a in s.args):
        return reject(ctx, name, "the add broadcasts: not a residual add of two same-rank tensors")
    if only_cast_follows(ctx):
        return reject(ctx, name, "its result is only cast to another dtype: the kernel ends at the cast")
    return finish(ctx, name, {"hidden": dim_str(shape_of(s)[-1])}, exposed=("sum",))


def check_rms_norm_residual(ctx: PatternCheckContext) -> bool:
    return _check_rms(ctx, "tvmfuse.rms_norm_residual", exposed=("h",))


def check_rms_norm(ctx: PatternCheckContext) -> bool:
    return _check_rms(ctx, "tvmfuse.rms_norm")


def _check_rms(ctx: PatternCheckContext, name: str, exposed: tuple[str, ...] = ()) -> bool:
    mean = ctx.annotated_expr["mean"]
    rank = ndim(mean.args[0])
    if not last_axis(mean.attrs.axis or [], rank) or not mean.attrs.keepdims:
        return reject(ctx, name, f"mean over axes {list(mean.attrs.axis or [])}, not the last axis with keepdims")
    square = ctx.annotated_expr["square"]
    if square.op.name == "relax.power" and abs(float(square.args[1].value.numpy()) - 2.0) > 1e-6:
        return reject(ctx, name, "power exponent is not 2")
    weight = ctx.annotated_expr["y"].args
    hidden = shape_of(mean.args[0])[-1]
    if not any(ndim(w) == 1 and same_dim(shape_of(w)[0], hidden) for w in weight):
        return reject(ctx, name, "the final multiply is not by a weight vector of the hidden size")
    if only_cast_follows(ctx):
        return reject(ctx, name, "its result is only cast to another dtype: the kernel ends at the cast")
    return finish(ctx, name, {"hidden": dim_str(hidden)}, exposed=exposed)


def _ln_last_axis(ctx: PatternCheckContext) -> bool:
    ln = ctx.annotated_expr["ln"]
    return last_axis(list(ln.attrs.axes), ndim(ln.args[0]))


def _ops(ctx: PatternCheckContext) -> set[str]:
    return {c.op.name.split(".")[-1] for c in ctx.matched_bindings.values()}
