"""The KV cache updated in place: a decoder step that concatenates each past K/V input with the step's K/V on the
sequence axis (and returns the result as `present`) becomes a step over preallocated caches, written in place at
the past length and read by the attention where they lie (docs/kv_cache.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import tirx as T

from tvmfuse.errors import TvmfuseError

POSITION = "past_len"  # the step's Shape argument: how many positions the caches hold before this step
LAYOUT = ["capacity", "batch", "kv_heads", "head_dim"]  # each cache tensor; a prefix of the first axis is contiguous
LOW_DTYPES = ("float16", "bfloat16")  # compute dtypes the cache is stored in (half the bytes read per step)


@dataclass
class CacheSite:
    """One past K/V input of the exported step, the `present` output it makes and the cache that replaces both."""

    past: str  # the ONNX input it replaces
    present: str | None  # the ONNX output it replaces (None when the concatenation is not returned)
    cache: str  # the cache parameter of the in-place step
    kv_heads: int
    head_dim: int


@dataclass
class CacheLayout:
    """What the in-place step takes besides the model's own inputs: the past length and one cache per site."""

    capacity: int
    dtype: str
    sites: list[CacheSite] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"mode": "inplace", "capacity": self.capacity, "dtype": self.dtype, "layout": LAYOUT,
                "position": POSITION, "caches": [vars(s) for s in self.sites]}


def _bindings(fn: relax.Function) -> dict:
    return {b.var: b.value for blk in fn.body.blocks for b in blk.bindings}


def _past_param(expr, bound: dict, params: set):
    """The main parameter `expr` is (through one-element concats and casts), else None."""
    while True:
        if expr in params:
            return expr
        value = bound.get(expr)
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return None
        if value.op.name == "relax.concat" and isinstance(value.args[0], relax.Tuple) and len(value.args[0]) == 1:
            expr = value.args[0][0]
        elif value.op.name == "relax.astype":
            expr = value.args[0]
        else:
            return None


def _returned_site(expr, bound: dict, sites) -> bool:
    """Whether a returned field is a cache concatenation (or a cast of one: the interface's output dtype)."""
    while not (isinstance(expr, relax.Var) and expr in sites):
        value = bound.get(expr) if isinstance(expr, relax.Var) else expr
        if not (isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.astype"):
            return False
        expr = value.args[0]
    return True


def find_cache_sites(mod: tvm.IRModule) -> list[tuple[relax.Var, relax.Var, relax.Expr]]:
    """(past param, concat var, step's K/V) for each `concat((past, new), axis=seq)` in `main` where past is a
    4-D [batch, kv heads, past, head dim] parameter of main: the exported KV cache idiom."""
    fn = mod["main"]
    bound, params = _bindings(fn), set(fn.params)
    sites = []
    for var, value in bound.items():
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.concat"
                and isinstance(value.args[0], relax.Tuple) and len(value.args[0]) == 2):
            continue
        shape = value.ty.shape.values if isinstance(value.ty, relax.TensorType) and value.ty.shape is not None else None
        if shape is None or len(shape) != 4 or int(value.attrs.axis) not in (2, -2):
            continue
        past = _past_param(value.args[0][0], bound, params)
        if past is not None and isinstance(past.ty.shape.values[2], tirx.Var):
            sites.append((past, var, value.args[0][1]))
    order = {p: i for i, p in enumerate(fn.params)}
    return sorted(sites, key=lambda site: order[site[0]])  # as the past inputs are ordered


def _write_kernel(capacity: int, kv_heads: int, head_dim: int, dtype: str, seq_major: bool,
                  rows: tuple[int, int] | None = None) -> tirx.PrimFunc:
    """cache[pos + s, b, h, d] = new[b, h, s, d] (`seq_major`: new[b, s, h, d], the step's K/V before the export's
    transpose to heads-major; `rows` = (width, offset): new[b, s, offset + h * head_dim + d], the K/V a slice of
    rows of `width`, as Phi-3's V of its one QKV projection): the step's K or V written into the cache in place."""
    heads, dim = T.int64(kv_heads), T.int64(head_dim)

    def new_index(b, s, h, d) -> tuple:  # where position s of head h is in `new`
        if rows is not None:
            return (b, s, T.int64(rows[1]) + h * dim + d)
        return (b, s, h, d) if seq_major else (b, h, s, d)

    def new_shape(batch, seq) -> tuple:
        return (batch, seq, T.int64(rows[0])) if rows is not None else new_index(batch, seq, heads, dim)

    @T.prim_func(s_tir=True)
    def kv_cache_write(cache_h: T.handle, new_h: T.handle, pos: T.int64):
        T.func_attr({"op_pattern": 8, "tirx.noalias": True})
        batch, seq = T.int64(), T.int64()
        cache = T.match_buffer(cache_h, (T.int64(capacity), batch, heads, dim), dtype)
        new = T.match_buffer(new_h, new_shape(batch, seq), dtype)
        assert pos + seq <= T.int64(capacity), "KV cache overflow: past_len + seq exceeds the cache's capacity"
        for b, s, h, d in T.grid(batch, seq, heads, dim):  # cache rows in order
            with T.sblock("kv_cache_write"):
                vb, vs, vh, vd = T.axis.remap("SSSS", [b, s, h, d])
                cache[pos + vs, vb, vh, vd] = new[new_index(vb, vs, vh, vd)]

    return kv_cache_write


def _write_source(expr, bound: dict, dtype: str) -> tuple:
    """(what the cache write reads, whether it is seq-major, its rows) for the step's K/V `expr`: past its casts to
    fp32 from the cache's `dtype` (the exported concatenation with an fp32 past; the cast back is exact), a
    transpose of [batch, seq, heads, dim] to heads-major, which the write does itself, and a head split of a slice
    of the last axis of [batch, seq, width] in `dtype` (rows: (width, the slice's offset); else None), which it
    reads where it lies. Each is a launch less a step."""
    seq_major = False
    while isinstance(expr, relax.Var):
        value = bound.get(expr)
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            break
        source = value.args[0]
        if value.op.name == "relax.astype" and str(value.ty.dtype) == "float32" and str(source.ty.dtype) == dtype:
            expr = source
        elif (value.op.name == "relax.permute_dims" and not seq_major and value.attrs.axes is not None
              and [int(a) for a in value.attrs.axes] == [0, 2, 1, 3]):
            expr, seq_major = source, True
        else:
            break
    rows = _sliced_rows(expr, bound, dtype) if seq_major else None
    return (rows[0], True, rows[1]) if rows is not None else (expr, seq_major, None)


def _sliced_rows(expr, bound: dict, dtype: str) -> tuple | None:
    """(x, (width, offset)) where `expr` [B, S, H, D] is reshape(x[:, :, offset:offset + H*D]) of an x [B, S, width]
    in `dtype` with static width and offset (Phi-3's V), else None."""
    heads, dims = bound.get(expr), list(getattr(getattr(expr.ty, "shape", None), "values", None) or [])
    part = heads.args[0] if isinstance(heads, relax.Call) and getattr(heads.op, "name", "") == "relax.reshape" else None
    cut = bound.get(part) if isinstance(part, relax.Var) else None
    if len(dims) != 4 or not isinstance(cut, relax.Call) or getattr(cut.op, "name", "") != "relax.strided_slice":
        return None
    x = cut.args[0]
    shape = list(getattr(getattr(x.ty, "shape", None), "values", None) or [])
    axes, begin = [int(a.value) for a in cut.args[1].fields], cut.args[2].fields[0].value
    strides = [getattr(a, "value", None) for a in cut.args[4].fields] if len(cut.args) > 4 else [1]
    if len(shape) != 3 or str(x.ty.dtype) != dtype or axes not in ([2], [-1]) or strides not in ([1],) \
            or not isinstance(shape[2], tirx.IntImm) or not isinstance(begin, (int, tirx.IntImm)) \
            or not all(isinstance(d, tirx.IntImm) for d in dims[2:]) \
            or not all(tvm_ffi.structural_equal(a, b) for a, b in zip(shape[:2], dims[:2])):
        return None
    width, offset, used, extent = int(shape[2]), int(begin), int(dims[2]) * int(dims[3]), cut.ty.shape.values[2]
    if offset < 0 or offset + used > width or not isinstance(extent, tirx.IntImm) or int(extent) != used:
        return None
    return x, (width, offset)


@relax.expr_functor.mutator
class _InPlace(relax.PyExprMutator):
    """Each cache concatenation becomes: write the step's K/V into the cache in place, view the first
    past + seq positions (no copy), permute that view to [batch, kv heads, positions, head dim]. The returned
    tuple loses the concatenations (the `present` outputs)."""

    def __init__(self, mod, sites: dict, caches: dict, past_len, capacity: int, ret_var, bound: dict):
        super().__init__(mod)
        self.sites, self.caches, self.past_len, self.capacity, self.ret_var = sites, caches, past_len, capacity, ret_var
        self.bound = bound
        self.writers: dict = {}

    def _writer(self, cache: relax.Var, seq_major: bool, rows: tuple | None) -> relax.GlobalVar:
        _, _, heads, dim = cache.ty.shape.values
        key = (str(cache.ty.dtype), int(heads), int(dim), seq_major, rows)
        if key not in self.writers:
            name = f"kv_cache_write_{key[0]}" + ("_seq_major" if seq_major else "") + (
                f"_of_rows_{rows[0]}_at_{rows[1]}" if rows else "")
            self.writers[key] = self.builder_.add_func(
                _write_kernel(self.capacity, key[1], key[2], key[0], seq_major, rows), name)
        return self.writers[key]

    def visit_var_binding_(self, binding):
        if binding.var.same_as(self.ret_var) and isinstance(binding.value, relax.Tuple):
            return self._returned(binding)
        if binding.var not in self.sites:
            return super().visit_var_binding_(binding)
        past, new = self.sites[binding.var]
        cache = self.caches[past]
        source, seq_major, rows = _write_source(new, self.bound, str(cache.ty.dtype))
        new = self.visit_expr(source)
        if new.ty.dtype != cache.ty.dtype:
            new = self.builder_.emit(relax.op.astype(new, cache.ty.dtype))
        written = self.builder_.emit(relax.op.call_tir_inplace(
            self._writer(cache, seq_major, rows), relax.Tuple([cache, new, relax.prim_value(self.past_len)]), [0],
            cache.ty))
        _, batch, heads, dim = cache.ty.shape.values
        length = self.past_len + new.ty.shape.values[1 if seq_major else 2]
        view = self.builder_.emit(relax.op.memory.view(written, relax.ShapeExpr([length, batch, heads, dim])))
        out = relax.op.permute_dims(view, [1, 2, 0, 3])
        if binding.var.ty.dtype != cache.ty.dtype:
            out = relax.op.astype(self.builder_.emit(out), binding.var.ty.dtype)
        self.set_var_remap(binding.var, self.builder_.emit(out, binding.var.name))

    def _returned(self, binding):
        """The returned tuple without the cache concatenations (one output left: that output alone)."""
        fields = [self.visit_expr(f) for f in binding.value.fields if not _returned_site(f, self.bound, self.sites)]
        value = fields[0] if len(fields) == 1 else relax.Tuple(fields)
        leaves_block = self.builder_.current_block_is_dataflow() and not isinstance(binding.var, relax.DataflowVar)
        emit = self.builder_.emit_output if leaves_block else self.builder_.emit
        self.set_var_remap(binding.var, emit(value, binding.var.name))


def in_place_kv_cache(mod: tvm.IRModule, capacity: int, output_names: list[str],
                      compute_dtype: str = "float32") -> tuple[tvm.IRModule, CacheLayout]:
    """`main(inputs..., past_k0, past_v0, ...) -> (outputs..., present_k0, ...)` becomes
    `main(inputs..., past_len: Shape([past]), cache_k0, cache_v0, ...) -> outputs...`, each cache
    [capacity, batch, kv heads, head dim], written in place at past_len, in `compute_dtype` when that is fp16 or
    bf16 (the exported past K/V inputs have symbolic shapes, so the precision pass leaves their concatenation in
    fp32: the step's K/V are rounded to the compute dtype as they are written, and the attention reads the
    cache's view through a cast), else in the dtype the concatenation computes in.
    `output_names`: main's ONNX output names, in order. Raises TvmfuseError when `main` has no cache idiom."""
    sites = find_cache_sites(mod)
    if not sites:
        raise TvmfuseError("--kv-cache inplace: the model has no KV cache to update in place (no past K/V input "
                           "concatenated with the step's K/V on the sequence axis); pass --kv-cache onnx")
    fn = mod["main"]
    lengths = {str(p.ty.shape.values[2]) for p, _, _ in sites}
    if len(lengths) != 1:
        raise TvmfuseError(f"--kv-cache inplace: the past K/V inputs have different lengths ({', '.join(lengths)})")
    if len({p for p, _, _ in sites}) != len(sites):
        raise TvmfuseError("--kv-cache inplace: one past K/V input is concatenated more than once")
    past_len = sites[0][0].ty.shape.values[2]
    caches, by_var = {}, {}
    for past, var, new in sites:
        batch, heads, _, dim = past.ty.shape.values
        name = past.name[len("past_"):] if past.name.startswith("past_") else past.name
        dtype = compute_dtype if compute_dtype in LOW_DTYPES else str(var.ty.dtype)
        caches[past] = relax.Var(f"cache_{name}", relax.TensorType([capacity, batch, heads, dim], dtype))
        by_var[var] = (past, new)
    ret = fn.body.body
    bound = _bindings(fn)
    mutator = _InPlace(mod, by_var, caches, past_len, capacity, ret, bound)
    body = mutator.visit_expr(fn.body)
    if isinstance(ret, relax.Tuple):  # returned as a literal tuple: drop the concatenations' fields there
        kept = [new for old, new in zip(ret.fields, body.body.fields) if not _returned_site(old, bound, by_var)]
        body = mutator.builder_.normalize(relax.SeqExpr(body.blocks, kept[0] if len(kept) == 1 else relax.Tuple(kept)))
    pasts = {p for p, _, _ in sites}
    num_input = int(fn.attrs["num_input"]) if fn.attrs and "num_input" in fn.attrs else len(fn.params)
    inputs = [p for p in fn.params[:num_input] if p not in pasts]
    position = relax.Var(POSITION, relax.ShapeType([past_len]))
    cache_params = [caches[p] for p, _, _ in sites]
    params = inputs + [position] + cache_params + list(fn.params[num_input:])
    out = mutator.builder_.get()
    out["main"] = relax.Function(params, body, None, fn.is_pure, fn.attrs).with_attr(
        "num_input", len(inputs) + 1 + len(cache_params))
    out = relax.transform.DeadCodeElimination(["main"])(out)
    left = sorted({v.name for v in relax.analysis.free_vars(out["main"])} & {p.name for p in pasts})
    if left:
        raise TvmfuseError(f"--kv-cache inplace: {', '.join(left)} are read other than through the cache "
                           "concatenation; pass --kv-cache onnx")
    present = {}
    for i, (p, var, _) in enumerate(sites):
        idx = next((j for j, f in enumerate(ret_fields(fn)) if _returned_site(f, bound, {var})), None)
        present[i] = output_names[idx] if idx is not None and idx < len(output_names) else None
    layout = CacheLayout(capacity, str(caches[sites[0][0]].ty.dtype), [
        CacheSite(p.name, present[i], caches[p].name, int(p.ty.shape.values[1]), int(p.ty.shape.values[3]))
        for i, (p, _, _) in enumerate(sites)])
    return out, layout


def ret_fields(fn: relax.Function) -> list:
    """The fields of the tuple main returns (bound to its return var), or [the returned expr]."""
    ret = fn.body.body
    value = _bindings(fn).get(ret, ret) if isinstance(ret, relax.Var) else ret
    return list(value.fields) if isinstance(value, relax.Tuple) else [ret]
