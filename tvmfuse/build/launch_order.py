"""Order each dataflow block so that the launches a CUDA graph cannot capture stand together, between fewer graphs."""

from __future__ import annotations

import tvm
from tvm import relax

#: ops that launch a kernel (the rest are builtins the VM runs on the host)
LAUNCHES = ("relax.call_tir", "relax.call_tir_inplace", "relax.call_dps_packed")


def _symbolic(ty) -> bool:
    return ty is not None and bool(relax.analysis.tir_vars_in_type(ty))


def check_uncapturable(binding, inputs: set) -> bool:
    """Whether TVM's RewriteCUDAGraph leaves `binding` outside its graphs: it reads one of the function's inputs (a
    parameter before `num_input`: not a weight) or has a size or value only known when it runs (a symbolic dim)."""
    if _symbolic(binding.var.ty) or relax.analysis.free_symbolic_vars(binding.value):
        return True
    return any(v in inputs or _symbolic(v.ty) for v in relax.analysis.free_vars(binding.value))


def _op_name(binding) -> str:
    """The name of the op a binding calls ("" for anything else: a tuple, a var, a call of a function)."""
    value = binding.value
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""


def order_block(bindings: list, inputs: set) -> list:
    """`bindings` (one dataflow block, in a valid order) reordered: the uncapturable ones that read nothing the
    block computes first (in their order; not an in-place write, which would then run before a read of what it
    overwrites), each other uncapturable one (and each host builtin only they read) right before the first binding
    that uses it, the rest as they were. Every binding still follows what it reads."""
    order = list(bindings)
    defined = {b.var for b in order}
    casts = [b for b in order if isinstance(b, relax.MatchCast)]  # they stay: they may define symbolic dims
    sizes = {v for b in casts for v in relax.analysis.definable_tir_vars_in_type(b.ty)}
    moving = {b.var for b in order if b not in casts and check_uncapturable(b, inputs)}
    users: dict = {}
    for b in order:
        for v in relax.analysis.free_vars(b.value):
            users.setdefault(v, []).append(b.var)
    for b in order:  # host builtins (R.null_value() for a view's dtype) read by moving bindings alone move with them
        readers = users.get(b.var)
        if _op_name(b) not in LAUNCHES and b.var not in moving and readers and all(u in moving for u in readers):
            moving.add(b.var)

    def reads_nothing_computed(b) -> bool:  # nor a size a cast of the block defines
        sized = set(relax.analysis.free_symbolic_vars(b.value)) | set(relax.analysis.tir_vars_in_type(b.var.ty))
        return not set(relax.analysis.free_vars(b.value)) & defined and not sized & sizes

    early = [b for b in order if b.var in moving and _op_name(b) != "relax.call_tir_inplace"
             and reads_nothing_computed(b)]
    order = early + [b for b in order if b not in early]
    for b in reversed([b for b in order if b.var in moving and b not in early]):
        rest = [x for x in order if x is not b]
        at = next((i for i, x in enumerate(rest) if x.var in users.get(b.var, ())), None)
        if at is not None:  # (a binding that only the block's output reads stays where it is)
            order = rest[:at] + [b] + rest[at:]
    return order


@tvm.transform.module_pass(opt_level=0, name="OrderLaunches")
def order_launches(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Each Relax function's dataflow blocks ordered by `order_block`. In a decoder step with the in-place cache
    the cache writes, their views and the attention at the symbolic cache length run outside the CUDA graphs:
    exported in the graph's order, a layer's writes stood between its projections and split the layer into three
    graphs; together before the attention they leave one graph per layer."""
    out = mod
    for gv, func in mod.functions.items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        count = func.attrs.get("num_input") if func.attrs else None
        inputs = set(func.params[:int(count)] if count is not None else func.params)
        blocks = [relax.DataflowBlock(order_block(list(block.bindings), inputs))
                  if isinstance(block, relax.DataflowBlock) else block for block in func.body.blocks]
        body = relax.SeqExpr(blocks, func.body.body)
        out[gv] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
    return out
