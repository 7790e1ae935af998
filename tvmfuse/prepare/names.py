"""Every variable a Relax function binds gets a name of its own: the match, decide and fuse stages know candidates
by their variables' names, and two bindings of one name made unrelated groups overlap (a dynamo-exported 8-layer
Llama: layer 0's `lv50 = multiply(q, scale)` and layer 4's `lv50 = permute_dims(v)` kept layer 0's attention out)."""

from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax


def duplicate_names(func: relax.Function) -> set[str]:
    """The names that more than one variable of `func` (parameters and bindings) carries."""
    counts = Counter(v.name for v in relax.analysis.all_vars(func))
    return {name for name, n in counts.items() if n > 1}


def unique_binding_names(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with each Relax function's repeated binding names made distinct (the first keeps its name, the later
    ones get `_u<k>`); the same module when no name repeats, and the same renaming every time."""
    out = None
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or not duplicate_names(func):
            continue
        out = out or mod.clone()
        taken = {v.name for v in relax.analysis.all_vars(func)}
        renamed = _Rename(out, taken, {p.name for p in func.params}).visit_expr(func)
        out.update_func(gv, renamed)
    return mod if out is None else out


@relax.expr_functor.mutator
class _Rename(relax.PyExprMutator):
    def __init__(self, mod, taken: set[str], seen: set[str]):
        super().__init__(mod)
        self.taken, self.seen = taken, set(seen)

    def _name(self, name: str) -> str:
        if name not in self.seen:
            self.seen.add(name)
            return name
        k = 1
        while f"{name}_u{k}" in self.taken:
            k += 1
        new = f"{name}_u{k}"
        self.taken.add(new)
        self.seen.add(new)
        return new

    def _rebind(self, var):
        name = self._name(var.name)
        if name == var.name:
            return var
        new = (relax.DataflowVar if isinstance(var, relax.DataflowVar) else relax.Var)(name, var.ty)
        self.set_var_remap(var, new)
        return new

    def visit_var_binding_(self, binding):  # pylint: disable=arguments-renamed
        value = self.visit_expr(binding.value)
        self.builder_.emit_normalized(relax.VarBinding(self._rebind(binding.var), value))

    def visit_match_cast_(self, binding):  # pylint: disable=arguments-renamed
        value = self.visit_expr(binding.value)
        self.builder_.emit_normalized(relax.MatchCast(self._rebind(binding.var), value, binding.ty))
