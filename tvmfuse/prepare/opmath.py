"""Opmath: fp32 arithmetic inside fp16/bf16 modules (ops between casts, scalars' fp32 values)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvmfuse.prepare.interface import is_cast

FLOAT32, FLOAT16, BFLOAT16 = "float32", "float16", "bfloat16"
Const = tvm.ir.GenericConst

#: ops that compute in fp32 between casts in fp16/bf16 (torch's "opmath" does the same): x**2 of a hidden state
#: overflows fp16 past 256 (RMSNorm's mean of squares: Llama's RMSNorm upcasts to fp32 itself, but an fp32 export
#: no longer says so). tanh needs nothing: CUDA computes half tanh in float, and tanh(inf) = 1
OPMATH_FP32 = ("relax.power",)


def mutate_functions(mod: tvm.IRModule, mutator_cls) -> tvm.IRModule:
    """A copy of `mod` with every Relax function rewritten by a fresh `mutator_cls(copy)`."""
    out = mod.clone()
    for gv, fn in mod.functions.items():
        if isinstance(fn, relax.Function):
            out[gv] = mutator_cls(out).visit_expr(fn)
    return out


def opmath_fp32(mod: tvm.IRModule) -> tvm.IRModule:
    return mutate_functions(mod, _OpmathFp32)


@relax.expr_functor.mutator
class _OpmathFp32(relax.PyExprMutator):
    """`op(x: fp16)` -> `astype(op(astype(x, fp32)), fp16)` for OPMATH_FP32 ops; where that result is only cast
    back up (`astype(astype(y32, fp16), fp32)`: the mean of RMSNorm's squares), the fp32 value is used."""

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        if call.op.name == "relax.astype" and str(call.attrs.dtype) == FLOAT32 and isinstance(call.args[0], relax.Var):
            down = self.lookup_binding(call.args[0])  # astype(astype(y: fp32, fp16), fp32) of an opmath op: y
            if _is_op(down, "relax.astype") and str(down.attrs.dtype) == FLOAT16:
                src = down.args[0]
                value = self.lookup_binding(src) if isinstance(src, relax.Var) else src
                if _is_opmath(value) and dtype_of(value) == FLOAT32:
                    return src
        if _is_opmath(call) and any(dtype_of(a) == FLOAT16 for a in call.args):
            args = [relax.op.astype(a, FLOAT32) if dtype_of(a) == FLOAT16 else a for a in call.args]
            return relax.op.astype(self.builder_.normalize(relax.Call(call.op, args, call.attrs)), FLOAT16)
        return call


def _is_opmath(expr) -> bool:
    return _is_op(expr, *OPMATH_FP32)


def dtype_of(expr) -> str:
    """The dtype of a Relax expression ('' where its type has none)."""
    return str(getattr(getattr(expr, "ty", None), "dtype", ""))


def _is_op(expr, *names) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in names


#: module attribute: {repr of a rounded scalar constant: the fp32 value it was rounded from}, for kernels that
#: compute in fp32 with such a constant (the attention template's softmax scale): they use the model's value
EXACT_SCALARS = "tvmfuse.exact_scalars"


def fold_scalar_casts(mod: tvm.IRModule) -> tvm.IRModule:
    """`astype(scalar const)` -> a constant of the cast's dtype (FoldConstant leaves 0-d casts); CanonicalizeBindings
    then puts the constant into its uses, where the patterns look for constants. The fp32 values the rounding
    changed are recorded in the module attribute EXACT_SCALARS (a rounded value two fp32 values share is left out)."""
    exact: dict[str, set] = {}
    out = mutate_functions(mod, lambda m: _FoldScalarCasts(m, exact))
    kept = {k: float(next(iter(v))) for k, v in exact.items() if len(v) == 1}
    return out.with_attr(EXACT_SCALARS, kept) if kept else out


def exact_scalar(mod: tvm.IRModule, value: float) -> float:
    """The fp32 value the precision stage rounded the scalar constant `value` from (`value` itself if none)."""
    table = mod.attrs.get(EXACT_SCALARS) if mod.attrs is not None else None
    return float(table[repr(float(value))]) if table is not None and repr(float(value)) in table else float(value)


@mutator
class _FoldScalarCasts(PyExprMutator):
    def __init__(self, mod, exact: dict[str, set]):
        super().__init__(mod)
        self.exact = exact

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        arg = call.args[0] if is_cast(call) else None
        arg = self.lookup_binding(arg) if isinstance(arg, relax.Var) else arg  # a cast of a folded cast
        value = getattr(arg, "value", None) if isinstance(arg, Const) else None
        if value is None or value.numpy().ndim != 0:
            return call
        dtype, src = str(call.attrs.dtype), value.numpy()
        if dtype == BFLOAT16:
            import ml_dtypes  # pylint: disable=import-outside-toplevel

            low = src.astype(np.float32).astype(ml_dtypes.bfloat16)
            folded = relax.const(tvm.runtime.tensor(low), dtype)
        else:
            low = src.astype(dtype)
            folded = relax.const(low, dtype)
        if src.dtype == np.float32 and dtype in (FLOAT16, BFLOAT16) and float(low) != float(src):
            self.exact.setdefault(repr(float(low)), set()).add(float(src))
        return folded
