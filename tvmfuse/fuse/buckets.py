"""Buckets stage: static copies of `main` for the bucket shapes the user names, and a `main` that dispatches."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Callable

import tvm
from tvm import relax, tirx

from tvmfuse.errors import JobError
from tvmfuse.fuse.fusion import Fused

GENERIC = "main_generic"  # the symbolic body (default schedules) that every other shape runs


@dataclass
class Bucketed:
    """The fused generic `main` plus one fused static function per bucket shape, in one module."""

    fused: Fused  # mod: `main` (generic) + main_<bucket> functions; kernel_patterns cover every kernel
    shapes: dict[str, dict[str, int]]  # bucket function -> {dim: value}
    kernels_of: dict[str, list[str]]  # function ("main" = the generic path) -> the kernels it calls, in order

    def kernels(self) -> list[str]:
        """Every kernel: the generic path's first, then each bucket's new ones."""
        return list(dict.fromkeys(k for names in self.kernels_of.values() for k in names))

    def tuning_views(self) -> list[tvm.IRModule]:
        """One module per function (the generic path, then each bucket) whose `main` is that function: tuning
        takes the kernels `main` calls with static shapes (tune.tunable_tasks), so each view gives that
        function's tunable kernels, and a bucket's kernels that kept an unbucketed symbolic dim are left out."""
        prims = {gv: f for gv, f in self.fused.mod.functions.items() if isinstance(f, tirx.PrimFunc)}
        views = [tvm.IRModule({**prims, self.fused.mod.get_global_var("main"): self.fused.mod["main"]})]
        for name in self.shapes:
            bb = relax.BlockBuilder(tvm.IRModule(prims))
            bb.add_func(self.fused.mod[name], "main")
            views.append(bb.get())
        return views

    def manifest(self, tuned: set[str]) -> dict:
        """The manifest's `buckets`: the generic function and each bucket's, with their kernels (`tuned`: the
        kernels that carry a tuned schedule)."""
        def entry(fn: str) -> dict:
            return {"kernels": self.kernels_of[fn], "tuned": sum(k in tuned for k in self.kernels_of[fn])}

        return {"dims": sorted({d for s in self.shapes.values() for d in s}),
                "generic": {"function": GENERIC, **entry("main")},
                "functions": [{"function": fn, "shape": shape, **entry(fn)} for fn, shape in self.shapes.items()]}


def check_buckets(buckets: dict[str, list[int]], imported, source: str) -> None:
    """Each bucketed dim must be one of the model's symbolic dims that --shape left symbolic."""
    named = {d.dim_param for i in imported.onnx_model.graph.input for d in i.type.tensor_type.shape.dim}
    for dim in buckets:
        if dim in imported.symbolic_dims:
            continue
        if dim in named:
            raise JobError(f"{source}: --buckets {dim}: {dim} is fixed by --shape; fix it or bucket it, not both")
        raise JobError(f"{source}: --buckets {dim}: the model has no symbolic dim of that name "
                       f"(its symbolic dims: {', '.join(imported.symbolic_dims) or 'none'})")


def bucket_shapes(buckets: dict[str, list[int]]) -> list[dict[str, int]]:
    """The cross product of the bucket values, one {dim: value} per static function."""
    dims = list(buckets)
    return [dict(zip(dims, values)) for values in itertools.product(*(buckets[d] for d in dims))]


def function_name(shape: dict[str, int]) -> str:
    """{seq: 128} -> main_seq128; {batch: 1, seq: 128} -> main_batch1_seq128."""
    return "main_" + "_".join(f"{re.sub(r'[^A-Za-z0-9_]', '_', d)}{v}" for d, v in shape.items())


def verification_dims(symbolic_dims: list[str], buckets: dict[str, list[int]]) -> list[dict[str, int]]:
    """Shapes to verify at: without buckets, every symbolic dim 4; with them, the first bucket shape and
    one shape no bucket covers (each bucketed dim the smallest value >= 2 not among its buckets)."""
    base = {d: 4 for d in symbolic_dims}
    if not buckets:
        return [base]
    other = {d: next(v for v in itertools.count(2) if v not in values) for d, values in buckets.items()}
    return [{**base, **bucket_shapes(buckets)[0]}, {**base, **other}]


def lower_buckets(mod: tvm.IRModule, generic: Fused, buckets: dict[str, list[int]],
                  fuse: Callable[[tvm.IRModule, str], Fused]) -> Bucketed:
    """For each bucket shape, bind the symbolic dims of `mod`'s `main` to its values, fuse that static copy
    with `fuse(mod, name)` (decide, fuse, templates: static kernels tuning can take) and add it to the generic
    module as `main_<dim><value>`. Structurally equal kernels across buckets are kept once."""
    merged, patterns, choices = generic.mod, dict(generic.kernel_patterns), dict(generic.kernel_choices)
    shapes: dict[str, dict[str, int]] = {}
    kernels_of = {"main": generic.kernels()}
    for shape in bucket_shapes(buckets):
        name = function_name(shape)
        static = mod.clone()
        static["main"] = mod["main"].bind_symbolic_vars(shape)
        fused = fuse(static, name)
        merged, renamed = _merge(merged, fused.mod, name)
        kernels_of[name] = [renamed[k] for k in fused.kernels()]
        patterns.update({renamed[k]: p for k, p in fused.kernel_patterns.items() if k in renamed})
        choices.update({renamed[k]: c for k, c in fused.kernel_choices.items() if k in renamed})
        shapes[name] = shape
    return Bucketed(Fused(merged, patterns, generic.rejections, generic.plan, generic.candidate_kernels, choices),
                    shapes, kernels_of)


def _merge(mod: tvm.IRModule, part: tvm.IRModule, name: str) -> tuple[tvm.IRModule, dict[str, str]]:
    """Add `part` (a fused module whose `main` becomes `name`) to `mod`; its kernels get the suffix of
    `name`, or the name of a structurally equal kernel already there (BlockBuilder.add_func dedups)."""
    suffix = name[len("main"):]
    bb = relax.BlockBuilder(mod.clone())
    renamed = {gv.name_hint: bb.add_func(fn, gv.name_hint + suffix)
               for gv, fn in part.functions.items() if isinstance(fn, tirx.PrimFunc)}
    for gv, fn in part.functions.items():
        if isinstance(fn, relax.Function):
            new = name if gv.name_hint == "main" else gv.name_hint + suffix
            fn = _Rename(renamed).visit_expr(fn)
            renamed[gv.name_hint] = bb.add_func(fn.with_attr("global_symbol", new) if new == name else fn, new)
    return bb.get(), {k: gv.name_hint for k, gv in renamed.items()}


@relax.expr_functor.mutator
class _Rename(relax.PyExprMutator):
    def __init__(self, names: dict[str, relax.GlobalVar]):
        super().__init__()
        self.names = names

    def visit_global_var_(self, gv):  # pylint: disable=arguments-renamed
        return self.names.get(gv.name_hint, gv)


def add_dispatch(mod: tvm.IRModule, shapes: dict[str, dict[str, int]]) -> tvm.IRModule:
    """`main` becomes `main_generic`; a new `main` with the same signature calls the bucket function whose
    shape equals the runtime dims (inputs match_cast to its static types), else `main_generic`."""
    generic = mod["main"]
    bb = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint != "main"},
                                         attrs=mod.attrs, global_infos=mod.global_infos))
    generic_gv = bb.add_func(generic.with_attr("global_symbol", GENERIC), GENERIC)
    params = [relax.Var(p.name, p.ty) for p in generic.params]
    dims = {v.name: v for v in relax.analysis.defined_symbolic_vars(generic)}

    def bound(bindings: list, expr: relax.Expr) -> relax.SeqExpr:  # the If's branches bind their result
        expr = bb.normalize(expr)
        out = relax.Var("out", expr.ty)
        return relax.SeqExpr([relax.BindingBlock([*bindings, relax.VarBinding(out, expr)])], out)

    body = bound([], relax.Call(generic_gv, params))
    for name, shape in reversed(list(shapes.items())):
        gv = bb.get().get_global_var(name)
        casts = [relax.MatchCast(relax.Var(p.name, q.ty), p, q.ty) for p, q in zip(params, bb.get()[gv].params)]
        same = tirx.all(*[dims[d] == v for d, v in shape.items()])
        body = bound([], relax.If(relax.prim_value(same), bound(casts, relax.Call(gv, [c.var for c in casts])),
                                  body))
    bb.add_func(relax.Function(params, body, generic.ret_ty, attrs=generic.attrs), "main")
    return bb.get()
