"""A mutator that replaces the global vars and vars a mapping names, for the fuse stage's rewrites."""

from __future__ import annotations

from tvm import relax


@relax.expr_functor.mutator
class Substitute(relax.PyExprMutator):
    """Replaces the global vars and vars that `mapping` names (a kernel by its twin, a shape param by its value, a
    scalar param by its constant)."""

    def __init__(self, mapping):
        super().__init__()
        self.mapping = mapping

    def visit_global_var_(self, gv):  # pylint: disable=arguments-renamed
        return self.mapping.get(gv, gv)

    def visit_var_(self, var):  # pylint: disable=arguments-renamed
        return self.mapping.get(var, var)
