"""No Relax operator reaches VM codegen unlowered: the importer notes which ONNX node emitted each call that
LegalizeOps might leave (no legalization registered, or an output shape it cannot know), and after lowering any
operator call still in the module becomes one TvmfuseError line naming the operator and that node."""

from __future__ import annotations

import tvm
from tvm import relax

from tvmfuse.errors import ModelError

SOURCES_ATTR = "tvmfuse.op_sources"  # module attr: {relax op name: "node 'NAME' (OpType)[, ...]"}

#: operators the VM backend lowers itself (after tvmfuse's lowering): calls, builtins, shape and memory ops
_VM_PREFIXES = ("relax.call_", "relax.builtin.", "relax.memory.", "relax.vm.", "relax.invoke_")
_VM_OPS = frozenset({"relax.shape_of", "relax.tensor_to_shape", "relax.shape_to_tensor", "relax.null_value",
                     "relax.print", "relax.assert_op", "relax.hint_on_device", "relax.to_vdevice",
                     "relax.make_closure", "relax.match_cast", "relax.size"})


def vm_lowers(op_name: str) -> bool:
    return op_name.startswith(_VM_PREFIXES) or op_name in _VM_OPS


def at_risk(call: relax.Call, custom: dict) -> bool:
    """Whether LegalizeOps may leave this call: a tensor operator with no legalization, or an unknown out shape."""
    if not isinstance(call.op, tvm.ir.Op) or vm_lowers(call.op.name):
        return False
    if call.op.name not in custom and call.op.get_attr("FLegalize") is None:
        return True
    ty = call.ty
    return isinstance(ty, relax.TensorType) and ty.shape is None


def note_sources(bb: relax.BlockBuilder, values, node, sources: dict, custom: dict, depth: int = 3) -> None:
    """Record `node` as the source of each at-risk call among the bindings behind `values` (its outputs)."""
    seen = set()

    def walk(expr, left):  # the converters' outputs are calls (normalized, not yet bound) or bound vars
        if left < 0 or not isinstance(expr, (relax.Var, relax.Call)) or expr in seen:
            return
        seen.add(expr)
        value = expr
        if isinstance(expr, relax.Var):
            try:
                value = bb.lookup_binding(expr)
            except Exception:  # noqa: BLE001 - a function parameter, or a var of an earlier block
                return
        if isinstance(value, relax.Call):
            if at_risk(value, custom):
                names = sources.setdefault(value.op.name, [])
                label = f"node {node.name!r} ({node.op_type})"
                if label not in names:
                    names.append(label)
            for arg in value.args:
                walk(arg, left - 1)

    for value in values:
        walk(value, depth)


def with_sources(mod: tvm.IRModule, sources: dict) -> tvm.IRModule:
    """`mod` with the noted sources as a module attribute (only when there are any)."""
    if not sources:
        return mod
    return mod.with_attr(SOURCES_ATTR, {op: ", ".join(names) for op, names in sources.items()})


def check_lowered(mod: tvm.IRModule) -> None:
    """Raise ModelError (one line) for the first operator call left in a Relax function of `mod`."""
    sources = dict(mod.attrs[SOURCES_ATTR]) if mod.attrs and SOURCES_ATTR in mod.attrs else {}
    left: list[relax.Call] = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and not vm_lowers(expr.op.name):
            left.append(expr)

    for _gv, fn in mod.functions.items():
        if isinstance(fn, relax.Function) and not left:
            relax.analysis.post_order_visit(fn, visit)
    if not left:
        return
    op = left[0].op.name
    shape = "" if not isinstance(left[0].ty, relax.TensorType) or left[0].ty.shape is not None \
        else " (its output shape could not be inferred)"
    origin = f", from ONNX {sources[op]}" if op in sources else ""
    raise ModelError(f"cannot lower operator {op}{shape}{origin}: no legalization applies at these shapes "
                     "(fix the dims with --shape NAME=VALUE, or report the model)")


def carry_sources(src: tvm.IRModule, dst: tvm.IRModule) -> tvm.IRModule:
    """`dst` with `src`'s noted sources (passes that rebuild the module, such as detach_params, drop them)."""
    if not src.attrs or SOURCES_ATTR not in src.attrs or (dst.attrs and SOURCES_ATTR in dst.attrs):
        return dst
    return dst.with_attr(SOURCES_ATTR, src.attrs[SOURCES_ATTR])
