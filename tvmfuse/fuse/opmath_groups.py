"""Opmath groups: fused fp16/bf16 groups that compute in fp32 between their loads and their one store."""

from __future__ import annotations

import tvm
from tvm import relax

from tvmfuse.patterns import PATTERN_TABLE
from tvmfuse.prepare.opmath import BFLOAT16, FLOAT16, FLOAT32, Const, dtype_of, exact_scalar


#: fused groups whose arithmetic runs in fp32 between their fp16/bf16 loads and their one fp16/bf16 store: the
#: rotary embedding's q*cos + rotate_half(q)*sin rounded its products and its sum to fp16 one by one (with the q/k
#: scale, 25% of the fp16 Llama layer's error variance: bench/fp16_error.py); bf16, 3 significant bits fewer,
#: rounded the same way (one element in 3 of a test rope differed from rounding once: tests/test_opmath.py); every
#: variant of the table's (of a slice, of a head's first dims)
OPMATH_COMPOSITES = tuple(name for name, _, _ in PATTERN_TABLE if name.endswith("rotary_embedding"))


#: the table's matmul groups with an epilogue (bias, activation, a multiply): it runs on the fp32 accumulator and rounds once at the store: the
#: precision stage rounds the matmul's fp32 result to fp16 before the epilogue (so SiLU was fp16(fp16(g) *
#: fp16(sigmoid(fp16(g)))): three roundings, the one kernel of the fp16 Llama layer above its emulated error)
OPMATH_EPILOGUES = tuple(name for name, _, _ in PATTERN_TABLE if name.startswith("tvmfuse.matmul_"))


#: (negation is exact in fp16/bf16 and stays there: CUDA codegen cannot write TVM's fp32x8 broadcast of -1)
_ARITH = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide")


def opmath_composites(mod: tvm.IRModule, names: tuple[str, ...] = OPMATH_COMPOSITES,
                      epilogues: tuple[str, ...] = OPMATH_EPILOGUES) -> tvm.IRModule:
    """Each composite function (FuseOpsByPattern's) named in `names` computes its arithmetic in fp32: fp16 and
    bf16 operands are cast up where an arithmetic op (or an op joining an fp32 value to fp16/bf16 ones) reads
    them, and the result is cast back to the function's output dtype. Loads and stores stay fp16/bf16. In those
    named in `epilogues` the fp32 values are also not cast down to fp16/bf16 on the way (the matmul's
    accumulator)."""
    out = mod.clone()
    for gv, fn in mod.functions.items():
        name = str(fn.attrs.get("Composite", "")) if isinstance(fn, relax.Function) and fn.attrs else ""
        if name in names or name in epilogues:
            body = _ComputeFp32(out, keep_fp32=name in epilogues).visit_expr(fn.body)
            if dtype_of(body) != dtype_of(fn.body):
                body = _cast_result(body, dtype_of(fn.body))
            out[gv] = relax.Function(fn.params, body, fn.ret_ty, fn.is_pure, fn.attrs, fn.span)
    return out


def _cast_result(body, dtype: str):
    """`body` (a SeqExpr ending in an fp32 value) ending in that value cast to `dtype` instead."""
    var = relax.Var("opmath_out", relax.TensorType(body.body.ty.shape, dtype))
    block = relax.BindingBlock([relax.VarBinding(var, relax.op.astype(body.body, dtype))])
    return relax.SeqExpr(list(body.blocks) + [block], var)


@relax.expr_functor.mutator
class _ComputeFp32(relax.PyExprMutator):
    def __init__(self, mod, keep_fp32: bool = False):
        super().__init__(mod)
        self.mod, self.keep_fp32 = mod, keep_fp32

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        if not isinstance(call.op, tvm.ir.Op):
            return super().visit_call_(call)
        concat = call.op.name == "relax.concat"
        fields = [self.visit_expr(a) for a in (call.args[0].fields if concat else call.args)]
        if self.keep_fp32 and call.op.name == "relax.astype" and str(call.attrs.dtype) in (FLOAT16, BFLOAT16) \
                and dtype_of(fields[0]) == FLOAT32:
            return fields[0]
        dts = {dtype_of(a) for a in fields}
        low = {FLOAT16, BFLOAT16}
        if dts & low and (call.op.name in _ARITH or FLOAT32 in dts):
            fields = [self._up(a) if dtype_of(a) in low else a for a in fields]
        args = [relax.Tuple(fields)] + [self.visit_expr(a) for a in call.args[1:]] if concat else fields
        return self.builder_.normalize(relax.Call(call.op, args, call.attrs, call.ty_args))

    def _up(self, arg):
        """`arg` cast to fp32; a 0-d constant (an inlined scalar) becomes the fp32 value it was rounded from."""
        if isinstance(arg, Const) and arg.ty.ndim == 0:
            return relax.const(exact_scalar(self.mod, float(arg.value.numpy().astype(FLOAT32))), FLOAT32)
        return relax.op.astype(arg, FLOAT32)
