"""Scalar constants a pattern group received as parameters are put back inline, so its kernel sees literals."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvmfuse.fuse.legalize import integer_exponent
from tvmfuse.fuse.substitute import Substitute

Const = tvm.ir.GenericConst  # relax.Constant in TVM 0.27


def inline_scalar_params(mod: tvm.IRModule, names: tuple[str, ...]) -> tvm.IRModule:
    """Each parameter of a composite function (FuseOpsByPattern's, `bind_constants=False`) named in `names` that
    every call passes the same 0-d constant becomes that constant, and leaves the signature and the calls.

    Without this, an exported GELU's `x / sqrt 2`, `+ 1` and `* 0.5` are 0-d buffers the fused kernel loads, and
    an fp32 epilogue reads their fp16/bf16 roundings (sqrt 2 as 1.4140625). Inline, LegalizeOps writes them as
    literals (TVM's binary legalization takes 0-d constants as scalars), and `opmath_groups` gives the fp32 ones
    the model's values. Shapes lifted the same way are `fusion.inline_shape_params`'s. Groups that a kernel
    template takes (attention) read their scalars as arguments, by role: they are not named."""
    calls = {gv: sites for gv, sites in _composite_calls(mod).items() if str(mod[gv].attrs["Composite"]) in names}
    renamed: dict = {}  # old GlobalVar: (a new one, typed with the new signature; the kept parameter indices)
    out = tvm.IRModule({}, attrs=mod.attrs, global_infos=mod.global_infos)
    for gv, fn in mod.functions.items():
        shared = [_shared_scalar(calls[gv], i) for i in range(len(fn.params))] if gv in calls else []
        consts = {p: c for p, c in zip(fn.params, shared) if c is not None and check_literal_uses(fn, p, c)}
        if not consts:
            out[gv] = fn
            continue
        keep = [i for i, p in enumerate(fn.params) if p not in consts]
        new = relax.Function([fn.params[i] for i in keep], Substitute(consts).visit_expr(fn.body), fn.ret_ty,
                             fn.is_pure, fn.attrs, fn.span)
        new_gv = relax.GlobalVar(gv.name_hint)
        relax.expr._update_type(new_gv, new.ty)  # pylint: disable=protected-access
        renamed[gv] = (new_gv, keep)
        out[new_gv] = new
    if not renamed:
        return mod
    for gv, fn in list(out.functions.items()):
        if isinstance(fn, relax.Function) and not _is_composite(fn):
            out[gv] = _DropArgs(renamed).visit_expr(fn)
    return out


def _is_composite(fn) -> bool:
    return isinstance(fn, relax.Function) and fn.attrs is not None and "Composite" in fn.attrs


def _composite_calls(mod: tvm.IRModule) -> dict:
    """{composite function's GlobalVar: [each call of it]} over the module's other Relax functions."""
    composites = {gv for gv, fn in mod.functions.items() if _is_composite(fn)}
    calls: dict = {gv: [] for gv in composites}

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, relax.GlobalVar) and expr.op in composites:
            calls[expr.op].append(expr)

    for fn in mod.functions.values():
        if isinstance(fn, relax.Function) and not _is_composite(fn):
            relax.analysis.post_order_visit(fn, visit)
    return {gv: sites for gv, sites in calls.items() if sites}


#: ops whose 0-d constant operands TVM's binary legalization writes as literals
BINARY_OPS = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum")


def check_literal_uses(fn: relax.Function, param: relax.Var, const) -> bool:
    """Whether LegalizeOps writes every use of `param` in `fn` as the literal `const`: an operand of an elementwise
    binary op, or power's exponent where it becomes a product. (A tensor constant left for FuseTIR fails it.)"""
    uses: list = []

    def visit(expr):
        if isinstance(expr, relax.Call):
            uses.extend((expr, i) for i, arg in enumerate(expr.args) if arg.same_as(param))
        elif isinstance(expr, relax.Tuple):
            uses.extend((expr, -1) for f in expr.fields if f.same_as(param))

    relax.analysis.post_order_visit(fn.body, visit)
    return all(isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op)
               and (e.op.name in BINARY_OPS or e.op.name == "relax.power" and i == 1 and integer_exponent(const))
               for e, i in uses) and not fn.body.body.same_as(param)


def _shared_scalar(sites: list, index: int):
    """The 0-d floating constant every call passes at `index` (one value, one dtype), else None."""
    args = [site.args[index] for site in sites]
    first = args[0]
    if not (isinstance(first, Const) and isinstance(first.value, tvm.runtime.Tensor)
            and first.ty.ndim == 0 and str(first.ty.dtype).startswith(("float", "bfloat"))):
        return None
    value = first.value.numpy()
    same = all(isinstance(a, Const) and isinstance(a.value, tvm.runtime.Tensor) and a.ty.ndim == 0
               and str(a.ty.dtype) == str(first.ty.dtype) and np.array_equal(a.value.numpy(), value, equal_nan=True)
               for a in args[1:])
    return first if same else None


@relax.expr_functor.mutator
class _DropArgs(relax.PyExprMutator):
    """Calls of the functions in `renamed` go to the new GlobalVar with only the arguments at the kept indices."""

    def __init__(self, renamed: dict):
        super().__init__()
        self.renamed = renamed

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        if isinstance(call.op, relax.GlobalVar) and call.op in self.renamed:
            new_gv, keep = self.renamed[call.op]
            args = [self.visit_expr(call.args[i]) for i in keep]
            return relax.Call(new_gv, args, call.attrs, call.ty_args, call.span)
        return super().visit_call_(call)
