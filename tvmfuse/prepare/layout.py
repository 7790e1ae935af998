"""Weight layout stage: constant matmul weights are stored [N, K] and read through a permute_dims that the fused kernel absorbs.

ONNX exports keep a linear layer's weight as [K, N] (`x @ W`), so a kernel reduces K along strided memory and
dlight's GEMV rule (inner reduction only) refuses it: at decode every projection fell to the generic reduction
schedule. Storing W^T and reading it through `permute_dims` inside the matmul's pattern group gives the kernel
`W_T[n, k]`, K contiguous — the layout GEMV and tensor-core GEMM schedules read best. A permute that no pattern
takes is folded back into a [K, N] constant by the fuse stage's FoldConstant, so nothing ever runs it.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir import (
    GenericConst,  # what relax.const builds in TVM 0.27 (relax.Constant before)
)

from tvmfuse.prepare.opmath import mutate_functions

MATMUL = tvm.ir.Op.get("relax.matmul")


def transpose_weights(mod: tvm.IRModule, in_place: bool = False) -> tvm.IRModule:
    """`matmul(x, C)` with C a 2-D constant becomes `matmul(x, permute_dims(C^T))` in every Relax function;
    a constant used by several matmuls is transposed once. `in_place` (big models, weights outside the library:
    no second copy of the weights): a constant that only matmuls read has C^T written over its own buffer, so
    the caller must drop every other reference to the input module's constants (tvmfuse.pipeline does)."""
    transposed: dict = {}
    only_matmul = _only_matmul_weights(mod) if in_place else set()
    return mutate_functions(mod, lambda copy: _Transposer(copy, transposed, only_matmul))


def is_weight(expr) -> bool:
    """A 2-D constant (a bound linear-layer weight)."""
    return isinstance(expr, GenericConst) and len(expr.value.shape) == 2


@relax.expr_functor.mutator
class _Transposer(relax.PyExprMutator):
    def __init__(self, mod, transposed: dict, in_place=frozenset()):
        super().__init__(mod)
        self.transposed = transposed
        self.in_place = in_place
        self.reads = 0

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not (isinstance(call, relax.Call) and call.op.same_as(MATMUL) and is_weight(call.args[1])):
            return call
        weight = call.args[1]
        if weight not in self.transposed:
            data = np.ascontiguousarray(weight.value.numpy().T)
            if weight in self.in_place:  # C^T over C's own buffer, viewed [N, K]: one copy of the weights
                view = weight.value._create_view(data.shape)  # pylint: disable=protected-access
                view.copyfrom(data)
                self.transposed[weight] = relax.const(view)
            else:
                self.transposed[weight] = relax.const(data)
            del data
        self.reads += 1  # a name of its own: the decide stage tells bindings apart by name
        read = self.builder_.emit(relax.op.permute_dims(self.transposed[weight]), name_hint=f"weight_t{self.reads}")
        return relax.op.matmul(call.args[0], read, out_dtype=call.attrs.out_dtype)


@relax.expr_functor.visitor
class _ConstUses(relax.PyExprVisitor):
    def __init__(self):
        super().__init__()
        self.uses: dict = {}
        self.rhs: dict = {}

    def visit_generic_const_(self, op):  # pylint: disable=arguments-renamed
        self.uses[op] = self.uses.get(op, 0) + 1

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        if call.op.same_as(MATMUL) and is_weight(call.args[1]):
            self.rhs[call.args[1]] = self.rhs.get(call.args[1], 0) + 1
        super().visit_call_(call)


def _only_matmul_weights(mod: tvm.IRModule) -> set:
    """The 2-D constants whose every use (in every Relax function) is a matmul's weight operand."""
    uses = _ConstUses()
    for fn in mod.functions.values():
        if isinstance(fn, relax.Function):
            uses.visit_expr(fn)
    return {c for c, n in uses.rhs.items() if uses.uses.get(c) == n}
