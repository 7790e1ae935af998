"""A decoder step's causal + padding mask, which exports build from `attention_mask` with a dozen small ops every step
(aranges, a gather_nd over the mask, comparisons, a where), becomes one kernel, once evaluation on probes up to the
in-place cache's capacity shows it equals that mask."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import tirx as T

NAME = "decoder_mask"


@dataclass
class MaskSite:
    """The binding of an additive mask [batch, 1, seq, past + seq] and what computes it."""

    var: relax.Var
    bindings: list  # the bindings it is computed by, in order (the where's own last)
    masked: float  # the value a hidden key gets (the where's large negative constant)
    dtype: str


def _where_consts(value) -> tuple[float, float] | None:
    """(shown, hidden) when `value` is where(cond, 0, c) with c a large negative scalar constant, else None."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.where"):
        return None
    consts = value.args[1:]
    if not all(isinstance(c, tvm.ir.GenericConst) and c.value.numpy().size == 1 for c in consts):
        return None
    shown, hidden = (float(c.value.numpy().reshape(-1)[0]) for c in consts)
    return (shown, hidden) if shown == 0.0 and hidden <= -1e30 else None


def find_mask_sites(fn: relax.Function, mask: relax.Var) -> list[MaskSite]:
    """The additive masks [B, 1, S, L] that `fn` computes from `mask` (its attention_mask parameter) and shapes
    alone: no other parameter, weight or kernel call reaches them."""
    bound, order = {}, {}
    for blk in fn.body.blocks:
        for b in blk.bindings:
            if isinstance(b, relax.VarBinding):
                bound[b.var] = b
                order[b.var] = len(order)
    params = set(fn.params)
    sites = []
    for var, binding in bound.items():
        consts = _where_consts(binding.value)
        ty = var.ty
        if consts is None or not isinstance(ty, relax.TensorType) or ty.ndim != 4 or ty.shape is None:
            continue
        if not (isinstance(ty.shape.values[1], tirx.IntImm) and int(ty.shape.values[1]) == 1):
            continue
        closure, todo, ok = {}, [var], True
        while todo and ok:
            v = todo.pop()
            if v in closure:
                continue
            b = bound[v]
            value = b.value
            if isinstance(value, relax.Call) and (not isinstance(value.op, tvm.ir.Op) or value.op.name in (
                    "relax.call_tir", "relax.call_tir_inplace")):
                ok = False  # a kernel or another function: not the exported ops alone
                break
            closure[v] = b
            for u in relax.analysis.free_vars(value):
                if u in bound:
                    todo.append(u)
                elif u in params and not u.same_as(mask):
                    ok = False  # another input (the ids, a cache, a weight) reaches the mask
                    break
        if ok and any(u.same_as(mask) for b in closure.values() for u in relax.analysis.free_vars(b.value)):
            sites.append(MaskSite(var, sorted(closure.values(), key=lambda b: order[b.var]), consts[1], str(ty.dtype)))
    return sites


def _probe_function(site: MaskSite, params: list) -> relax.Function:
    """The mask's bindings as a function of `params` (the step's inputs that define its sizes)."""
    out = relax.Var("mask", site.var.ty)
    body = relax.SeqExpr([relax.DataflowBlock([*site.bindings, relax.VarBinding(out, site.var)])], out)
    return relax.Function(params, body, site.var.ty)


def expected_mask(mask: np.ndarray, past: int, seq: int, masked: float, dtype: str) -> np.ndarray:
    """The causal + padding mask: key j is shown to query i (at position past + i) when j <= past + i and
    mask[b, j] != 0."""
    total = mask.shape[1]
    causal = np.arange(total)[None, :] <= past + np.arange(seq)[:, None]
    shown = causal[None, None] & (mask != 0)[:, None, None, :]
    return np.where(shown, 0, masked).astype(dtype)


def _probe_params(fn: relax.Function, mask: relax.Var, position: relax.Var) -> list:
    """The step's inputs that define a mask's sizes: the ids [batch, seq] (seq), the mask (batch, total), past_len."""
    size_params = [p for p in fn.params if p.same_as(mask) or p.same_as(position)]
    ids = [p for p in fn.params[:int(fn.attrs["num_input"])] if p not in size_params
           and isinstance(p.ty, relax.TensorType) and p.ty.ndim == 2]
    return ids[:1] + size_params


def check_mask_site(probe: relax.Function, site: MaskSite, mask: relax.Var, position: relax.Var, capacity: int,
                    seqs: list[int]) -> str | None:
    """None when `probe` (`_probe_function` of the site) equals `expected_mask` on every probe input (batch 2,
    random masks with zeros, query lengths `seqs` and 1-3, pasts from 0 to the capacity's last; a batch or query
    length the step fixes (`--shape`) at its own size), else why not."""
    params = list(probe.params)
    ids = [p for p in params if not p.same_as(mask) and not p.same_as(position)]
    dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in (ids[0].ty.shape.values if ids else [])]
    batch, fixed_seq = (dims + [None, None])[:2]
    try:
        ex = tvm.compile(tvm.IRModule({"main": probe}), target="llvm")
        vm = relax.VirtualMachine(ex, tvm.cpu())
    except Exception as err:  # pylint: disable=broad-except  (an op the probe cannot build: leave the mask alone)
        return f"its ops do not build on their own ({type(err).__name__})"
    rng = np.random.default_rng(0)
    lengths = [fixed_seq] if fixed_seq else sorted({1, 2, 3, *seqs})
    probes = [(s, p) for s in lengths for p in (0, 1, capacity - s) if 0 <= p <= capacity - s]
    for seq, past in probes:
        am = (rng.random((batch or 2, past + seq)) < 0.7).astype(str(mask.ty.dtype))
        am[0] = 1
        feed = [tvm.runtime.ShapeTuple([past]) if p.same_as(position) else tvm.runtime.tensor(am) if p.same_as(mask)
                else tvm.runtime.tensor(np.zeros((batch or 2, seq), str(p.ty.dtype))) for p in params]
        got = vm["main"](*feed).numpy()
        want = expected_mask(am, past, seq, site.masked, site.dtype)
        if got.shape != want.shape or not np.array_equal(got, want):
            return f"it differs from causal + padding at seq {seq}, past {past}"
    return None


def _mask_kernel(mask_dtype: str, dtype: str, masked: float) -> tirx.PrimFunc:
    """out[b, 0, i, j] = 0 where j <= past + i and mask[b, j] != 0, else `masked`."""

    @T.prim_func(private=True, s_tir=True)
    def decoder_mask(mask_h: T.handle, past: T.int64, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        batch, total, seq, length = T.int64(), T.int64(), T.int64(), T.int64()
        am = T.match_buffer(mask_h, (batch, total), mask_dtype)
        out = T.match_buffer(out_h, (batch, T.int64(1), seq, length), dtype)
        assert length == total, "attention_mask must hold past_len + seq positions"
        for b, i, j in T.grid(batch, seq, length):
            with T.sblock("decoder_mask"):
                vb, vi, vj = T.axis.remap("SSS", [b, i, j])
                out[vb, T.int64(0), vi, vj] = T.Select(
                    vj <= past + vi and am[vb, vj] != T.Cast(mask_dtype, 0), T.Cast(dtype, 0), T.Cast(dtype, masked))

    return decoder_mask


def one_kernel_decoder_mask(mod: tvm.IRModule, mask_name: str, position_name: str, capacity: int,
                            seqs: list[int]) -> tuple[tvm.IRModule, list[str]]:
    """`mod` with each causal + padding mask that `main` builds from its `mask_name` input computed by one kernel,
    and a line per mask found saying what became of it."""
    fn = mod["main"]
    by_name = {p.name: p for p in fn.params}
    mask, position = by_name.get(mask_name), by_name.get(position_name)
    if mask is None or position is None or not isinstance(position.ty, relax.ShapeType):
        return mod, []
    params = _probe_params(fn, mask, position)
    notes, replace, checked = [], {}, []  # checked: (probe, reason) of each distinct computation (one per layer)
    for site in find_mask_sites(fn, mask):
        probe = _probe_function(site, params)
        reason = next((r for p, r in checked if tvm_ffi.structural_equal(p, probe)), False)
        if reason is False:
            reason = check_mask_site(probe, site, mask, position, capacity, seqs)
            checked.append((probe, reason))
        if reason:
            notes.append(f"the mask {site.var.name} stays as exported: {reason}")
            continue
        replace[site.var] = site
    if not replace:
        return mod, notes
    bb = relax.BlockBuilder(mod.clone())
    key_of = {var: (str(mask.ty.dtype), site.dtype, site.masked) for var, site in replace.items()}
    kernels = {key: bb.add_func(_mask_kernel(*key), NAME) for key in dict.fromkeys(key_of.values())}
    new_fn = _Replace(bb.get(), {var: kernels[key] for var, key in key_of.items()}, mask,
                      position.ty.values[0]).visit_expr(fn)
    result = bb.get()
    result["main"] = relax.analysis.remove_all_unused(new_fn)
    notes.extend(f"the mask {v.name}: one kernel ({len(s.bindings)} ops before; causal + padding from {mask_name} "
                 f"on every probe up to {capacity} positions)" for v, s in replace.items())
    if len(replace) > 1:
        notes.append(f"the {len(replace)} masks are one launch (the same values)")
    return result, notes


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    def __init__(self, mod, kernel_of: dict, mask: relax.Var, past):
        super().__init__(mod)
        self.kernel_of, self.mask, self.past = kernel_of, mask, past
        self.computed: dict = {}  # one launch for the masks each layer of some exports builds anew

    def visit_var_binding_(self, binding):  # pylint: disable=arguments-renamed
        kernel = self.kernel_of.get(binding.var)
        if kernel is None:
            return super().visit_var_binding_(binding)
        key = (kernel.name_hint, str(binding.var.ty))
        if key in self.computed:
            self.set_var_remap(binding.var, self.computed[key])
            return
        call = self.builder_.normalize(relax.call_tir(kernel, relax.Tuple([self.mask, relax.prim_value(self.past)]),
                                                      binding.var.ty))
        self.builder_.emit_normalized(relax.VarBinding(binding.var, call))
        self.computed[key] = binding.var
