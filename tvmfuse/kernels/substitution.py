"""Template substitution: find the fused kernels a hand-written template takes (`template_sites`) and put the
template in their place (`substitute`)."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, tirx

from tvmfuse.kernels.attention.common import Template, normalize
from tvmfuse.isolation import TEMPLATE, reason, record
from tvmfuse.kernels.table import TABLE
from tvmfuse.prepare.opmath import exact_scalar
from tvmfuse.records.knobs import best_knobs, failed_knobs, target_kind

def templates(pattern_name: str) -> list[Template]:
    """The templates of a pattern, in the table's order."""
    entry = TABLE.get(pattern_name)
    return list(entry.templates) if entry else []


def lookup(pattern_name: str, shapes: dict) -> Template | None:
    """The first template of the pattern whose check accepts these shapes, else None."""
    return next((t for t in templates(pattern_name) if t.check(shapes) is None), None)


def template_sites(mod: tvm.IRModule, patterns: dict[str, str], info: dict[str, dict] | None = None,
                   target: "str | tvm.target.Target" = "cuda", log: list | None = None) -> list[tuple]:
    """(global var, kernel name, template, shapes, argument order) for each PrimFunc named in `patterns`
    ({primfunc: pattern}) whose argument roles, shapes and softmax scale are understood and that a registered
    template accepts. `info` ({primfunc: candidate info}) may give `scale`, `causal`; `log` collects
    (primfunc, outcome) pairs, also for the kernels no template takes. `target`: its kind's name, or the Target
    (a CUDA target's arch then reaches the templates' checks as shapes["arch"])."""
    log = log if log is not None else []
    calls, sites = call_sites(mod), []
    for gv, fn in mod.functions.items():
        name = gv.name_hint
        if not isinstance(fn, tirx.PrimFunc) or name not in patterns or patterns[name] not in TABLE:
            continue  # only kernels of patterns that have templates are considered (and logged)
        pattern = patterns[name]
        try:
            roles = TABLE[pattern].analysis(fn)
        except Exception as err:  # noqa: BLE001 - anything unexpected means: keep the generic kernel
            roles = None
            log.append((name, f"generic: roles not found ({type(err).__name__}: {err})"))
            continue
        if roles is None:
            log.append((name, "generic: argument roles not recognised"))
            continue
        call = calls.get(name)
        if call is None:
            log.append((name, "generic: no call site in main"))
            continue
        shapes = {**roles["shapes"], **{k: v for k, v in (info or {}).get(name, {}).items() if k in ("causal", "scale")}}
        # any positive scale: 1/sqrt(head_dim) from the graph, or 1 where the model scaled Q before its head split
        # (OPT's projection), each template scales the fp32 scores by it
        scale = shapes.get("scale") or _scale(roles, call, mod)
        if scale is None or not (math.isfinite(scale) and scale > 0):
            log.append((name, f"generic: softmax scale {scale} is not a positive constant"))
            continue
        guard = _where_guard(roles["order"], call)
        if guard is not None:  # the template gives 0 for a row with no finite logit: so must the graph's guard
            log.append((name, f"generic: {guard}"))
            continue
        shapes["scale"] = scale
        if roles.get("softcap") is not None:
            cap = _scalar_arg(call, roles["softcap"], mod)
            if cap is None or not (math.isfinite(cap) and cap > 0):
                log.append((name, f"generic: soft cap {cap} is not a positive constant"))
                continue
            shapes["softcap"] = cap
        if shapes.get("mask") == "additive" and _all_zero(call, roles["order"].index("mask")):
            shapes["mask"] = "none"  # exporters write a constant zero mask where none was given: adding it is a no-op
        if shapes.get("mask") == "additive" and _causal_constant(call, roles["order"].index("mask"), shapes):
            shapes.update(mask="none", causal=True)  # a static decoder's folded mask: the templates skip its tiles
        shapes["target"] = target_kind(target)
        if _arch(target):
            shapes["arch"] = _arch(target)
        tmpl = lookup(pattern, shapes)
        if tmpl is None:
            reasons = "; ".join(f"{t.name}: {t.check(shapes)}" for t in templates(pattern))
            log.append((name, f"generic: no template accepts ({reasons})"))
            continue
        sites.append((gv, name, tmpl, shapes, [roles["order"].index(r) for r in _signature(normalize(shapes)) if r != "out"]))
    return sites


def substitute(mod: tvm.IRModule, patterns: dict[str, str], info: dict[str, dict] | None = None,
               knobs: dict[str, dict] | None = None, target: "str | tvm.target.Target" = "cuda",
               log: list | None = None,
               database=None) -> tvm.IRModule:
    """Replace each kernel a template takes (`template_sites`) by the template; everything else is left
    untouched. Knobs: `knobs` ({primfunc: knobs}) if given, else the best measured in `database`
    (`records.knobs.best_knobs`: records of the tuning database or the schedules library), else the defaults when none
    was measured; when every measured knob set failed (wrong output, build or run error) the generic kernel stays."""
    log = log if log is not None else []
    rewrite = {}
    for gv, name, tmpl, shapes, perm in template_sites(mod, patterns, info, target, log):
        chosen, why = (knobs or {}).get(name), ""
        if chosen is None and database is not None:
            chosen, us = best_knobs(database, tmpl, shapes, target)
            failed = failed_knobs(database, tmpl, shapes, target) if chosen is None else 0
            if failed:
                log.append((name, f"generic: every measured knob set failed ({failed})"))
                continue
            why = f", measured knobs {chosen} ({us:.1f} us)" if chosen is not None else ", default knobs (none measured)"
        try:
            rewrite[gv] = (name, tmpl(shapes, chosen, target_kind(target)).with_attr("global_symbol", name), perm)
        except Exception as err:  # noqa: BLE001  (a template that fails on a kernel: the generic kernel stays)
            record(name, TEMPLATE, f"{tmpl.name}: {reason(err)}")
            log.append((name, f"generic: template {tmpl.name} failed ({reason(err)})"))
            continue
        log.append((name, f"template {tmpl.name}{why}"))
    if not rewrite:
        return mod
    out = tvm.IRModule({gv: fn for gv, fn in mod.functions.items() if gv not in rewrite}, attrs=mod.attrs,
                       global_infos=mod.global_infos)
    return _CallRewriter(out, rewrite).run()


def call_sites(mod: tvm.IRModule) -> dict:
    """{kernel name: its call_tir in `main`}."""
    calls = {}

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get("relax.call_tir")):
            calls[expr.args[0].name_hint] = expr
    relax.analysis.post_order_visit(mod["main"], visit)
    return calls


def constant_value(arg):
    """The numpy value of a constant call argument, else None."""
    value = getattr(arg, "value", None)
    return value.numpy() if value is not None and hasattr(value, "numpy") else None


def _arch(target) -> str:
    """A CUDA target's arch (sm_90a, ...), or '' (a target given by its kind's name alone)."""
    return str(target.attrs.get("arch", "")) if isinstance(target, tvm.target.Target) and target.kind.name == "cuda" \
        else ""


#: a mask value at or below this takes a key out of the softmax: exp(-1e4 + any score) is 0 in fp32
MASKED_OUT = -1.0e4


def _causal_constant(call, index: int, shapes: dict) -> bool:
    """Whether the call's argument `index` is a constant [1, 1, S, S] mask that is causal: 0 on and below the
    diagonal, masked out (MASKED_OUT or below, -inf included) above it. Static exports of decoders fold the causal
    mask their graph builds into such a constant; no row of it is fully masked, so causal attention without it
    computes what the graph does."""
    value = constant_value(list(call.args[1].fields)[index])
    if value is None or value.ndim != 4 or value.shape[:2] != (1, 1) or value.shape[2] != value.shape[3]:
        return False
    if shapes.get("seq_q") != shapes.get("seq_k") or str(value.shape[2]) != str(shapes.get("seq_q")):
        return False
    grid = value[0, 0].astype("float32")
    above = np.triu(np.ones(grid.shape, dtype=bool), 1)
    return bool((grid[~above] == 0).all() and (grid[above] <= MASKED_OUT).all())


def _all_zero(call, index: int) -> bool:
    """Whether the call's argument `index` is a constant tensor of zeros."""
    value = constant_value(list(call.args[1].fields)[index])
    return value is not None and not value.any()


def _scale(roles: dict, call, mod: tvm.IRModule) -> float | None:
    """The softmax scale: the product of the scalar constants the call passes, each raised to the number of
    times the kernel multiplies it in (Q and K may each get one, or share one), divided by those it divides by.
    The template scales fp32 scores: a constant the precision stage rounded counts with the model's fp32 value
    (fp16's sqrt(1/sqrt(128)) = 0.29736 for 0.29730 moved every score by 4e-4 of itself)."""
    scale = 1.0
    for i, role in enumerate(roles["order"]):
        if role == "scale":
            value = _scalar_arg(call, i, mod)
            if value is None:
                return None
            muls, divs = roles["uses"].get(i, (1, 0))
            scale *= value ** (muls - divs)
    return scale


def _scalar_arg(call, index: int, mod: tvm.IRModule) -> float | None:
    """The model's fp32 value of the scalar constant the call passes as argument `index`, else None."""
    value = constant_value(list(call.args[1].fields)[index])
    if value is None or value.size != 1:
        return None
    return exact_scalar(mod, float(value.reshape(())))


def _where_guard(order: list, call) -> str | None:
    """None when the isnan -> where guard's value (rank 0 or 1) is the constant 0, else why not."""
    for role, arg in zip(order, list(call.args[1].fields)):
        if role == "const":
            value = constant_value(arg)
            if value is None or value.size != 1:
                return "where-guard value is not a scalar constant"
            if float(value.reshape(())) != 0.0:
                return f"where-guard value {float(value.reshape(()))} is not 0 (the template gives 0 for fully masked rows)"
    return None


@relax.expr_functor.mutator
class _CallRewriter(relax.PyExprMutator):
    """Point the rewritten kernels' call_tir at the template's argument order (scalars dropped)."""

    def __init__(self, mod: tvm.IRModule, rewrite: dict):
        super().__init__(mod)
        self.mod_ = mod
        self.perm = {gv: (self.builder_.add_func(new, name), new, perm) for gv, (name, new, perm) in rewrite.items()}

    def run(self) -> tvm.IRModule:
        main = self.mod_.get_global_var("main")
        self.builder_.update_func(main, self.visit_expr(self.mod_[main]))
        return self.builder_.get()

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if call.op.same_as(tvm.ir.Op.get("relax.call_tir")) and call.args[0] in self.perm:
            new_gv, _, perm = self.perm[call.args[0]]
            args = list(call.args[1].fields)
            return relax.call_tir(new_gv, relax.Tuple([args[i] for i in perm]), call.ty_args[0])
        return call


def _signature(s: dict) -> list[str]:
    return ["q", "k", "v"] + (["mask"] if s["mask"] == "additive" else []) + ["out"]
