"""Opmath pass: in fp16/bf16 modules, power ops compute in fp32 between casts, as torch's opmath does."""

from __future__ import annotations

import tvm
from tvm import relax

FLOAT32, FLOAT16 = "float32", "float16"

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
                if _is_opmath(value) and _dtype(value) == FLOAT32:
                    return src
        if _is_opmath(call) and any(_dtype(a) == FLOAT16 for a in call.args):
            args = [relax.op.astype(a, FLOAT32) if _dtype(a) == FLOAT16 else a for a in call.args]
            return relax.op.astype(self.builder_.normalize(relax.Call(call.op, args, call.attrs)), FLOAT16)
        return call


def _is_opmath(expr) -> bool:
    return _is_op(expr, *OPMATH_FP32)


def _dtype(expr) -> str:
    return str(getattr(getattr(expr, "ty", None), "dtype", ""))


def _is_op(expr, *names) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name in names
