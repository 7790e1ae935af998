"""Attention kernels read Q, K and V where they lie in the tensor a one-kernel split cuts them from (GPT-2's fused
QKV projection, BERT's merged sibling projections), so the split is not launched."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, tirx

from tvmfuse.fuse.legalize import SPLIT_ATTR
from tvmfuse.fuse.views import is_view
from tvmfuse.kernels.attention.common import Template
from tvmfuse.kernels.table import TABLE

CALL_TIR, RESHAPE = tvm.ir.Op.get("relax.call_tir"), tvm.ir.Op.get("relax.reshape")
#: environment switch: 0 keeps every split (bench/models.py --before split_reads measures the pair)
SWITCH = "TVMFUSE_SPLIT_READS"


@dataclass
class _Site:
    """A call of an attention template's kernel `kernel` whose Q, K and V are parts of the split of `source`."""

    kernel: relax.GlobalVar
    template: Template
    shapes: dict  # the kernel's template shapes with `packed`
    knobs: dict
    source: relax.Expr  # the split's input, [batch, seq, width]
    rest: list  # the call's other arguments (the mask)

    @functools.cached_property
    def variant(self) -> str:
        """The packed kernel this call needs: the sites of one variant share one PrimFunc."""
        return json.dumps([self.template.name, self.shapes, self.knobs], sort_keys=True, default=str)


def read_split_parts(mod: tvm.IRModule, target: "str | tvm.target.Target" = "cuda",
                     log: list | None = None) -> tvm.IRModule:
    """Each call of an attention template whose Q, K and V are three parts of one split (each through a head
    reshape, read by that call alone) becomes a call of the template's packed variant on the split's input; the
    split and the reshapes, then unused, go. The kernel keeps its name where every call of it is packed alike, else
    the packed variant is `<kernel>_packed`. `target`: the templates' target (a CUDA target's arch reaches their
    checks). `log` gets one (kernel, outcome) per packed variant or refusal. SWITCH=0: the module as it is."""
    log = log if log is not None else []
    if os.environ.get(SWITCH, "1").strip() == "0":
        return mod
    arch = str(target.attrs.get("arch", "")) if isinstance(target, tvm.target.Target) else ""
    funcs = [fn for fn in mod.functions.values() if isinstance(fn, relax.Function)]
    bindings = [b for fn in funcs for blk in fn.body.blocks for b in blk.bindings]
    values = {var: value for fn in funcs for var, value in relax.analysis.get_var2val(fn).items()}
    uses = _use_counts(funcs)
    sites = {b.var: site for b in bindings if (site := _packed_site(mod, b.value, values, uses)) is not None}
    if not sites:
        return mod
    built: dict = {}  # variant -> its PrimFunc, or None where the template refused it
    for site in sites.values():
        if site.variant in built:
            continue
        try:
            built[site.variant] = site.template(dict(site.shapes, arch=arch) if arch else site.shapes, site.knobs,
                                                site.shapes["target"])
        except Exception as err:  # noqa: BLE001 - the template reads the parts apart: such calls stay as they are
            built[site.variant] = None
            log.append((site.kernel.name_hint, f"Q, K and V stay split ({type(err).__name__}: {err})"))
    sites = {v: s for v, s in sites.items() if built[s.variant] is not None}
    if not sites:
        return mod
    calls: dict = {}
    for b in bindings:
        if isinstance(b.value, relax.Call) and b.value.op.same_as(CALL_TIR):
            calls.setdefault(b.value.args[0], []).append(b.var)
    whole = {s.kernel for s in sites.values()  # every call of the kernel packed alike: the kernel keeps its name
             if all(v in sites and sites[v].variant == s.variant for v in calls[s.kernel])}
    builder = relax.BlockBuilder(tvm.IRModule({gv: fn for gv, fn in mod.functions.items() if gv not in whole},
                                              attrs=mod.attrs, global_infos=mod.global_infos))
    variants: dict = {}  # variant -> GlobalVar of its PrimFunc
    for site in sites.values():
        if site.variant in variants:
            continue
        name = site.kernel.name_hint if site.kernel in whole else f"{site.kernel.name_hint}_packed"
        variants[site.variant] = builder.add_func(built[site.variant].with_attr("global_symbol", name), name)
        log.append((name, f"Q, K and V read in place from the split's input (rows of {site.shapes['packed'][0]}, "
                          f"at {', '.join(map(str, site.shapes['packed'][1:]))}): no split launched"))
    out = _Repack(builder.get(), sites, variants).run()
    return relax.transform.DeadCodeElimination(
        [gv.name_hint for gv, fn in out.functions.items() if isinstance(fn, relax.Function)])(out)


def _use_counts(funcs: list) -> dict:
    counts: dict = {}
    for fn in funcs:
        for blk in fn.body.blocks:
            for b in blk.bindings:
                for v in relax.analysis.free_vars(b.value):
                    counts[v] = counts.get(v, 0) + 1
        for v in relax.analysis.free_vars(fn.body.body):
            counts[v] = counts.get(v, 0) + 1
    return counts


def _attrs(mod: tvm.IRModule, gv) -> dict:
    fn = mod[gv]
    return fn.attrs if isinstance(fn, tirx.PrimFunc) and fn.attrs else {}


def _part(view, values: dict, uses: dict, mod: tvm.IRModule) -> tuple | None:
    """(the split call's var, part index, parts, the split's input) for a [B, S, H, D] head reshape (a view) of a
    part of a one-kernel split of [B, S, W] on its last axis, the reshape and the part each read once; else None."""
    value = values.get(view)
    if not isinstance(value, relax.Call) or uses.get(view) != 1:
        return None
    if value.op.same_as(RESHAPE):
        part = value.args[0]
    elif value.op.same_as(CALL_TIR) and is_view(mod[value.args[0]]) and len(value.args[1].fields) == 1:
        part = value.args[1].fields[0]
    else:
        return None
    got = values.get(part)
    if not isinstance(got, relax.TupleGetItem) or uses.get(part) != 1:
        return None
    split = values.get(got.tuple_value)
    if not (isinstance(split, relax.Call) and split.op.same_as(CALL_TIR)) \
            or SPLIT_ATTR not in _attrs(mod, split.args[0]):
        return None
    parts, axis = (int(x) for x in _attrs(mod, split.args[0])[SPLIT_ATTR])
    source = split.args[1].fields[0]
    src_dims, view_dims = list(part.ty.shape.values), list(view.ty.shape.values)
    if len(src_dims) != 3 or axis != 2 or len(view_dims) != 4 \
            or not all(tvm_ffi.structural_equal(a, b) for a, b in zip(src_dims[:2], view_dims[:2])):
        return None
    return got.tuple_value, int(got.index), parts, source


def _packed_site(mod: tvm.IRModule, call, values: dict, uses: dict) -> _Site | None:
    """The site where the call is an attention template's whose Q, K and V are three parts of one split, else
    None."""
    if not (isinstance(call, relax.Call) and call.op.same_as(CALL_TIR)):
        return None
    attrs = _attrs(mod, call.args[0])
    if "tvmfuse.template" not in attrs or "tvmfuse.knobs" not in attrs:
        return None
    key = json.loads(str(attrs["tvmfuse.template"]))
    tmpl = next((t for entry in TABLE.values() for t in entry.templates if t.name == key["template"]), None)
    args = list(call.args[1].fields)
    parts = [_part(a, values, uses, mod) for a in args[:3]]
    if tmpl is None or any(p is None for p in parts) or any(not p[0].same_as(parts[0][0]) for p in parts) \
            or len({p[1] for p in parts}) != 3:
        return None
    source, count = parts[0][3], parts[0][2]
    width = source.ty.shape.values[-1]
    if not isinstance(width, tirx.IntImm) or int(width) % count:
        return None
    offsets = [p[1] * (int(width) // count) for p in parts]
    shapes = dict(key["shapes"], target=key["target"], packed=[int(width), *offsets])
    return _Site(call.args[0], tmpl, shapes, json.loads(str(attrs["tvmfuse.knobs"])), source, args[3:])


@relax.expr_functor.mutator
class _Repack(relax.PyExprMutator):
    """Point each packed site's call at its variant, on the split's input."""

    def __init__(self, mod: tvm.IRModule, sites: dict, variants: dict):
        super().__init__(mod)
        self.mod_, self.sites, self.variants = mod, sites, variants

    def run(self) -> tvm.IRModule:
        for gv, fn in self.mod_.functions.items():
            if isinstance(fn, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(fn))
        return self.builder_.get()

    def visit_var_binding_(self, binding):  # pylint: disable=arguments-renamed
        site = self.sites.get(binding.var)
        if site is None:
            return super().visit_var_binding_(binding)
        args = relax.Tuple([self.visit_expr(site.source), *map(self.visit_expr, site.rest)])
        call = relax.call_tir(self.variants[site.variant], args, binding.value.ty_args[0])
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(call)))
