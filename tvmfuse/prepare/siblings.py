"""Sibling projections: matmuls of one input by constant weights of one width (BERT's Q, K and V) become one matmul
over the weights side by side, then an equal split, where the caller's rule says the merged GEMM pays."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.ir import GenericConst
from tvm.sym import Analyzer

from tvmfuse.prepare.opmath import mutate_functions

MATMUL, ASTYPE, ADD, RESHAPE = (tvm.ir.Op.get(f"relax.{op}") for op in ("matmul", "astype", "add", "reshape"))

#: (rows M, width N of one sibling, reduction K, siblings) -> whether one GEMM of N x siblings pays
MergeRule = Callable[[int, int, int, int], bool]


@dataclass
class _Chain:
    """One sibling: `matmul(x, weight)`, an optional cast of its sums, an optional `add` of a 1-D constant bias."""

    matmul: relax.Var
    x: relax.Var  # its input
    weight: GenericConst
    cast: relax.Var | None = None
    bias: GenericConst | None = None
    add: relax.Var | None = None
    vars: list = field(default_factory=list)  # the chain's bindings, matmul first

    @property
    def out(self) -> relax.Var:
        return self.vars[-1]

    def key(self, source) -> tuple:
        """What siblings share: the input's source (`_source`), the weight's shape and dtype, the sums' dtype, the
        cast's, and whether a bias is added."""
        cast = str(self.cast.ty.dtype) if self.cast is not None else None
        return (source, tuple(self.weight.value.shape), str(self.weight.value.dtype), str(self.matmul.ty.dtype), cast,
                self.bias is not None)


def merge_sibling_matmuls(mod: tvm.IRModule, pays: MergeRule | None, merged: list | None = None,
                          sizes: list[dict[str, int]] | None = None) -> tvm.IRModule:
    """Each group of two or more `matmul(x, W_i)` (same x, 2-D constant W_i [K, N] of one shape and dtype, each W_i
    read there only), every one followed alike by nothing, a cast, and/or an `add` of a 1-D constant bias [N] read
    there only, becomes `split(add(cast(matmul(x, [W_1 ... W_n])), [b_1 ... b_n]), n, axis=-1)` where `pays(M, N,
    K, n)` says so; None merges nothing. M: x's rows; where they are symbolic, at each of `sizes` (the symbolic
    dims' values the build is specialized for, its buckets: the group merges where it pays at every one; without
    sizes, never). `merged`, if given, gets one (M, N, K, n) per group (M the rows, or "lo..hi" over `sizes`)."""
    if pays is None:
        return mod
    found: list = [] if merged is None else merged
    return mutate_functions(mod, lambda copy: _Merger(copy, pays, found, sizes or []))


def _const_uses(fn: relax.Function) -> dict:
    uses: dict = {}

    def visit(expr):
        if isinstance(expr, GenericConst):
            uses[expr] = uses.get(expr, 0) + 1

    relax.analysis.post_order_visit(fn.body, visit)
    return uses


def _rows(x: relax.Var, sizes: list[dict[str, int]]) -> list[int] | None:
    """x's rows (every dim but the last): [M] where static, else M at each of `sizes` (its symbolic dims bound by
    name); None where a dim stays symbolic (no sizes, or one that does not name it)."""
    dims = getattr(getattr(x.ty, "shape", None), "values", None)
    if dims is None:
        return None
    rows = dims[:-1]
    if all(isinstance(d, tvm.tirx.IntImm) for d in rows):
        return [int(np.prod([int(d) for d in rows]))]
    symbols = {v.name: v for d in rows for v in tvm.tirx.analysis.undefined_vars(d)}
    found = []
    for size in sizes:
        analyzer = Analyzer()
        for name in symbols.keys() & size.keys():
            analyzer.bind(symbols[name], tvm.tirx.IntImm(str(symbols[name].ty.dtype), size[name]))
        bound = [analyzer.simplify(d) for d in rows]
        if any(not isinstance(d, tvm.tirx.IntImm) for d in bound):
            return None
        found.append(int(np.prod([int(d) for d in bound])))
    return found or None


def _chains(fn: relax.Function) -> dict:
    """`_Chain.key` -> the chains of two or more siblings that share it, in binding order."""
    bindings = [b for blk in fn.body.blocks for b in blk.bindings]
    value = {b.var: b.value for b in bindings}
    users: dict = {}
    for b in bindings:
        for v in relax.analysis.free_vars(b.value):
            users.setdefault(v, []).append(b.var)
    outputs = set(relax.analysis.free_vars(fn.body.body))
    const_uses = _const_uses(fn)

    def only_user(var):
        u = users.get(var, [])
        return u[0] if len(u) == 1 and var not in outputs else None

    groups: dict = {}
    for b in bindings:
        call = b.value
        if not (isinstance(call, relax.Call) and call.op.same_as(MATMUL) and isinstance(call.args[0], relax.Var)
                and isinstance(call.args[1], GenericConst) and len(call.args[1].value.shape) == 2
                and const_uses.get(call.args[1]) == 1 and b.var not in outputs):
            continue
        chain = _Chain(b.var, call.args[0], call.args[1], vars=[b.var])
        nxt = only_user(b.var)
        if nxt is not None and isinstance(value[nxt], relax.Call) and value[nxt].op.same_as(ASTYPE):
            chain.cast = nxt
            chain.vars.append(nxt)
            nxt = only_user(nxt)
        if nxt is not None and isinstance(value[nxt], relax.Call) and value[nxt].op.same_as(ADD):
            other = [a for a in value[nxt].args if not a.same_as(chain.out)]
            width = call.args[1].value.shape[1]
            if (len(other) == 1 and isinstance(other[0], GenericConst) and tuple(other[0].value.shape) == (width,)
                    and const_uses.get(other[0]) == 1):
                chain.bias, chain.add = other[0], nxt
                chain.vars.append(nxt)
        if all(isinstance(v, relax.DataflowVar) for v in chain.vars):  # the parts are bound inside the block
            groups.setdefault(chain.key(_source(call.args[0], value)), []).append(chain)
    return {k: g for k, g in groups.items() if len(g) >= 2}


def _source(x: relax.Var, value: dict):
    """What x is, for grouping: (y, shape) where x = reshape(y, shape) (the importer flattens each 3-D matmul's input
    on its own: three reshapes of one tensor), else x itself."""
    bound, dims = value.get(x), getattr(getattr(x.ty, "shape", None), "values", None)
    if isinstance(bound, relax.Call) and bound.op.same_as(RESHAPE) and isinstance(bound.args[0], relax.Var) \
            and dims is not None:
        return bound.args[0], tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in dims)
    return x


@relax.expr_functor.mutator
class _Merger(relax.PyExprMutator):
    def __init__(self, mod, pays: MergeRule, merged: list, sizes: list[dict[str, int]]):
        super().__init__(mod)
        self.pays, self.merged, self.sizes = pays, merged, sizes
        self.first: dict = {}  # the first sibling's matmul var -> its group
        self.skip: set = set()  # every sibling's chain bindings

    def visit_function_(self, fn):  # pylint: disable=arguments-renamed
        for group in _chains(fn).values():
            ms, (k, n) = _rows(group[0].x, self.sizes), group[0].weight.value.shape
            if ms is None or not all(self.pays(m, int(n), int(k), len(group)) for m in ms):
                continue
            self.first[group[0].matmul] = group
            self.skip.update(v for c in group for v in c.vars)
            rows = ms[0] if len(set(ms)) == 1 else f"{min(ms)}..{max(ms)}"
            self.merged.append((rows, int(n), int(k), len(group)))
        return super().visit_function_(fn)

    def visit_var_binding_(self, binding):  # pylint: disable=arguments-renamed
        if binding.var in self.first:
            self._emit_group(binding, self.first[binding.var])
        elif binding.var not in self.skip:
            super().visit_var_binding_(binding)

    def _emit_group(self, binding, group: list) -> None:
        """At the first sibling: the merged matmul (its cast and bias as the siblings had them), the split, and each
        sibling's last variable bound to its part under its own name."""
        head, emit = group[0], self.builder_.emit
        x = self.visit_expr(head.x)  # the first sibling's input (the others' may be reshapes of the same tensor)
        weight = relax.const(np.concatenate([c.weight.value.numpy() for c in group], axis=1))
        y = emit(relax.op.matmul(x, weight, out_dtype=str(head.matmul.ty.dtype)), f"{head.matmul.name}_siblings")
        if head.cast is not None:
            y = emit(relax.op.astype(y, str(head.cast.ty.dtype)), f"{head.cast.name}_siblings")
        if head.bias is not None:
            bias = relax.const(np.concatenate([c.bias.value.numpy() for c in group]))
            y = emit(relax.op.add(y, bias), f"{head.add.name}_siblings")
        parts = emit(relax.op.split(y, len(group), axis=-1), f"{head.out.name}_parts")
        for i, chain in enumerate(group):
            self.set_var_remap(chain.out, emit(relax.TupleGetItem(parts, i), chain.out.name))
