"""Attention masks at the scores' rank: a rank-2 or rank-3 mask added to rank-4 scores just before a softmax is read through expand_dims with the leading unit dims broadcasting gives it ([1, 1, Sq, Sk], [1, H, Sq, Sk]).

torch.onnx's legacy exporter writes OPT's causal mask as `[seq, seq]` and adds it to the `[B, H, seq, seq]` scores
by broadcasting; the attention pattern (and the templates' mask roles) read a mask of rank 4, so that attention ran
as generic kernels. The leading unit dims are the ones broadcasting adds, so nothing changes but the rank: the
expand_dims is a view, inside or outside the fused kernel.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvmfuse.prepare.opmath import mutate_functions

ADD = tvm.ir.Op.get("relax.add")
ASTYPE = tvm.ir.Op.get("relax.astype")
SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")


def full_rank_masks(mod: tvm.IRModule) -> tvm.IRModule:
    """`add(scores, mask)` feeding a softmax (directly or through casts), the scores of rank 4 and the mask of rank 2
    or 3, becomes `add(scores, expand_dims(mask))` in every Relax function; every other add is left as it is."""
    return mutate_functions(mod, _MaskRank)


def _rank(expr) -> int | None:
    ty = expr.ty
    return ty.ndim if isinstance(ty, relax.TensorType) and ty.ndim >= 0 else None


def _adds_before_softmax(fn: relax.Function) -> list:
    """The add calls whose value reaches a softmax's input through nothing but casts."""
    bindings = [b for block in fn.body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)]
    wanted, adds = set(), []
    for b in reversed(bindings):  # consumers come after their producers
        value = b.value
        if not isinstance(value, relax.Call):
            continue
        if value.op.same_as(SOFTMAX) or (value.op.same_as(ASTYPE) and b.var in wanted):
            if isinstance(value.args[0], relax.Var):
                wanted.add(value.args[0])
        elif value.op.same_as(ADD) and b.var in wanted:
            adds.append(value)
    return adds


@relax.expr_functor.mutator
class _MaskRank(relax.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.adds: list = []

    def visit_function_(self, fn):  # pylint: disable=arguments-renamed
        if isinstance(fn.body, relax.SeqExpr):
            self.adds = _adds_before_softmax(fn)
        return super().visit_function_(fn)

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        is_target = any(call.same_as(a) for a in self.adds)
        call = super().visit_call_(call)
        if not is_target:
            return call
        ranks = [_rank(a) for a in call.args]
        if 4 not in ranks or not ({2, 3} & set(ranks)):
            return call
        args = list(call.args)
        low = 1 - ranks.index(4)  # the mask's position
        axes = list(range(4 - ranks[low]))
        args[low] = self.builder_.emit(relax.op.expand_dims(args[low], axes), name_hint="mask_4d")
        return relax.op.add(*args)
