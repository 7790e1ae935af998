"""MatMul entries: MatMul (+transposed weight) + bias + activation, times a gate, the bare transposed-weight MatMul, SwiGLU and its gated-GELU variant."""

from __future__ import annotations

from typing import Callable

from tvm.relax.dpl import DFPattern, is_op, wildcard
from tvm.relax.transform import PatternCheckContext

from tvmfuse.patterns import activations as act
from tvmfuse.patterns.builders import Annotated, cast
from tvmfuse.patterns.common import finish, reject
from tvmfuse.patterns.readers import dim_str, ndim, same_dim, shape_of

ACTIVATIONS: dict[str, tuple[Callable[[DFPattern], DFPattern], Callable | None]] = {
    "gelu": (act.gelu_erf, act.gelu_erf_problem),
    "gelu_tanh": (act.gelu_tanh, act.gelu_tanh_problem),
    "silu": (act.silu, None),
    "relu": (act.relu, act.relu_problem),
    "tanh": (act.tanh, None),
}


def _linear(x: DFPattern) -> tuple[DFPattern, DFPattern]:
    w = wildcard()
    return is_op("relax.matmul")(x, is_op("relax.permute_dims")(w) | w), w


def _matmul_bias() -> tuple[DFPattern, dict]:
    """x @ W [-> cast] + bias [-> reshape]. The cast: mixed precision's fp32-accumulating matmul is followed by
    a cast to the compute dtype before the bias add (`add(astype(matmul(..)), bias)`)."""
    mm, w = _linear(wildcard())
    mm_out = cast(mm)
    biased = is_op("relax.add")(mm_out, wildcard())
    pre = is_op("relax.reshape")(biased, wildcard()) | biased
    return pre, {"mm": mm, "mm_out": mm_out, "w": w, "biased": biased}


def make_matmul_bias_pattern(activation: str | None = None) -> Callable[[], Annotated]:
    """y = act(x @ W [W transposed] + bias), the add optionally followed by a reshape."""
    def make() -> Annotated:
        pre, ann = _matmul_bias()
        if activation is None:
            return ann["biased"], {**ann, "y": ann["biased"]}
        y = ACTIVATIONS[activation][0](pre)
        return y, {**ann, "y": y}
    make.__name__ = f"make_matmul_bias_{activation or 'none'}_pattern"
    return make


def check_matmul_bias(activation: str | None = None) -> Callable[[PatternCheckContext], bool]:
    name = f"tvmfuse.matmul_bias_{activation}" if activation else "tvmfuse.matmul_bias"

    def check(ctx: PatternCheckContext) -> bool:
        mm, biased = ctx.annotated_expr["mm"], ctx.annotated_expr["biased"]
        weight = ctx.annotated_expr["w"]
        if ndim(weight) != 2:
            return reject(ctx, name, f"weight has rank {ndim(weight)}: not a linear layer (batched matmul)")
        n = shape_of(mm)[-1]
        mm_var = ctx.value_to_bound_var.get(ctx.annotated_expr["mm_out"])  # the matmul or its cast
        bias = [a for a in biased.args if not a.same_as(mm_var)]
        if not bias or not _is_bias(bias[0], n):
            return reject(ctx, name, f"the add is not a bias of size {dim_str(n)} broadcast over rows")
        problem = ACTIVATIONS[activation][1] if activation else None
        if problem and problem(ctx):
            return reject(ctx, name, f"not a {activation}: {problem(ctx)}")
        return finish(ctx, name, {**_linear_info(mm), "activation": activation or "none"})
    check.__name__ = f"check_matmul_bias_{activation or 'none'}"
    return check


def make_matmul_act_pattern(activation: str) -> Callable[[], Annotated]:
    """y = act(x @ W [W transposed]) with no bias add (dynamo exports drop an all-zero bias), the matmul
    optionally followed by a reshape."""
    def make() -> Annotated:
        mm, w = _linear(wildcard())
        mm_out = cast(mm)  # mixed precision: the fp32-accumulating matmul's cast to the compute dtype
        y = ACTIVATIONS[activation][0](is_op("relax.reshape")(mm_out, wildcard()) | mm_out)
        return y, {"mm": mm, "w": w, "y": y}
    make.__name__ = f"make_matmul_{activation}_pattern"
    return make


def check_matmul_act(activation: str) -> Callable[[PatternCheckContext], bool]:
    name = f"tvmfuse.matmul_{activation}"

    def check(ctx: PatternCheckContext) -> bool:
        mm = ctx.annotated_expr["mm"]
        if ndim(ctx.annotated_expr["w"]) != 2:
            return reject(ctx, name, f"weight has rank {ndim(ctx.annotated_expr['w'])}: not a linear layer")
        problem = ACTIVATIONS[activation][1]
        if problem and problem(ctx):
            return reject(ctx, name, f"not a {activation}: {problem(ctx)}")
        return finish(ctx, name, {**_linear_info(mm), "activation": activation, "bias": False})
    check.__name__ = f"check_matmul_{activation}"
    return check


def make_matmul_multiply_pattern() -> Annotated:
    """y = (x @ W [W transposed] [-> cast]) * g, g of the product's shape: SwiGLU's up projection times the gate
    another GEMM made (silu(x @ Wg), a matmul_silu kernel) where the one-kernel SwiGLU is not chosen."""
    mm, w = _linear(wildcard())
    mm_out, g = cast(mm), wildcard()
    y = is_op("relax.multiply")(mm_out, g) | is_op("relax.multiply")(g, mm_out)
    return y, {"mm": mm, "w": w, "g": g, "y": y}


def check_matmul_multiply(ctx: PatternCheckContext) -> bool:
    name, mm, g = "tvmfuse.matmul_multiply", ctx.annotated_expr["mm"], ctx.annotated_expr["g"]
    if ndim(ctx.annotated_expr["w"]) != 2:
        return reject(ctx, name, f"weight has rank {ndim(ctx.annotated_expr['w'])}: not a linear layer")
    if [dim_str(d) for d in shape_of(g)] != [dim_str(d) for d in shape_of(mm)]:
        return reject(ctx, name, "the other factor does not have the product's shape")
    return finish(ctx, name, {**_linear_info(mm), "activation": "multiply", "bias": False})


def make_matmul_pattern() -> Annotated:
    """y = x @ permute_dims(W) [-> cast], no epilogue: a projection whose weight the layout stage stores [N, K]
    (tvmfuse/layout.py); the group puts the permute inside the matmul's kernel, which then reads K contiguously."""
    w = wildcard()
    mm = is_op("relax.matmul")(wildcard(), is_op("relax.permute_dims")(w))
    y = cast(mm)
    return y, {"mm": mm, "w": w, "y": y}


def check_matmul(ctx: PatternCheckContext) -> bool:
    mm = ctx.annotated_expr["mm"]
    if ndim(ctx.annotated_expr["w"]) != 2:
        return reject(ctx, "tvmfuse.matmul", f"weight has rank {ndim(ctx.annotated_expr['w'])}: not a linear layer")
    return finish(ctx, "tvmfuse.matmul", {**_linear_info(mm), "activation": "none", "bias": False})


def _linear_info(mm) -> dict:
    m = shape_of(mm)
    return {"n": dim_str(m[-1]), "k": dim_str(shape_of(mm.args[0])[-1]), "rows": " * ".join(dim_str(d) for d in m[:-1])}


def _is_bias(bias, n) -> bool:
    shape = shape_of(bias)
    return bool(shape) and same_dim(shape[-1], n) and all(dim_str(d) == "1" for d in shape[:-1])


def make_swiglu_pattern() -> Annotated:
    """y = silu(x @ Wg) * (x @ Wu): both projections and the gate in one kernel (each projection optionally cast
    to the compute dtype, as mixed precision writes it)."""
    x = wildcard()
    gate, wg = _linear(x)
    up, wu = _linear(x)
    y = is_op("relax.multiply")(act.silu(cast(gate)), cast(up))
    return y, {"gate": gate, "up": up, "wg": wg, "wu": wu, "y": y}


def make_geglu_pattern() -> Annotated:
    """y = gelu(x @ Wg) * (x @ Wu), GELU erf or tanh, op or decomposed."""
    x = wildcard()
    gate, wg = _linear(x)
    up, wu = _linear(x)
    gate_out = cast(gate)
    y = is_op("relax.multiply")(act.gelu_erf(gate_out) | act.gelu_tanh(gate_out), cast(up))
    return y, {"gate": gate, "up": up, "wg": wg, "wu": wu, "y": y}


def check_swiglu(ctx: PatternCheckContext) -> bool:
    return _check_gated(ctx, "tvmfuse.swiglu", None)


def check_geglu(ctx: PatternCheckContext) -> bool:
    ops = {c.op.name for c in ctx.matched_bindings.values()}
    problem = act.gelu_tanh_problem if ops & {"relax.tanh", "relax.nn.gelu_tanh"} else act.gelu_erf_problem
    return _check_gated(ctx, "tvmfuse.geglu", problem)


def _check_gated(ctx: PatternCheckContext, name: str, problem) -> bool:
    gate, up = ctx.annotated_expr["gate"], ctx.annotated_expr["up"]
    if gate.same_as(up):
        return reject(ctx, name, "gate and up are the same projection")
    if ndim(ctx.annotated_expr["wg"]) != 2 or ndim(ctx.annotated_expr["wu"]) != 2:
        return reject(ctx, name, "gate/up weights are not 2-D")
    if [dim_str(d) for d in shape_of(gate)] != [dim_str(d) for d in shape_of(up)]:
        return reject(ctx, name, "gate and up projections have different shapes")
    if problem and problem(ctx):
        return reject(ctx, name, f"not a GELU: {problem(ctx)}")
    return finish(ctx, name, {"intermediate": dim_str(shape_of(gate)[-1]), "k": dim_str(shape_of(gate.args[0])[-1])})
