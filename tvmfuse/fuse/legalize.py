"""Legalization overrides for LegalizeOps: integer powers become products (TVM's CUDA `pow` is NaN for negative bases), last-axis concatenations pick their part per 16-byte vector, splits feeding fused groups one kernel."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, te, tirx, topi

from tvmfuse.fuse.legalize_scan import LEGALIZE as SCAN_LEGALIZE  # cumsum / cumprod at symbolic shapes

#: largest integer exponent written as a product
MAX_PRODUCT_EXPONENT = 4


def integer_exponent(expr) -> int | None:
    value = getattr(expr, "value", None)  # a constant (tvm.ir.GenericConst in TVM 0.27)
    if value is None or not hasattr(value, "numpy") or value.numpy().size != 1:
        return None
    y = float(value.numpy().reshape(()))
    return int(y) if y.is_integer() and 1 <= y <= MAX_PRODUCT_EXPONENT else None


def legalize_power(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """`power(x, n)` for a constant integer n in 1..4 as x*x*...; anything else as TVM's own `topi.power`.

    CUDA builds use --use_fast_math, where powf(x, 3) is exp2(3*log2(x)): NaN for every x < 0 (GPT-2's tanh-GELU
    cube and RMSNorm's square gave NaN/inf on the H200; llvm's exact pow hid it). A product is exact and cheaper."""
    n = integer_exponent(call.args[1])
    if n is None:  # e.g. the exponent is a parameter of a fused composite function (its value unknown here)
        return bb.call_te(_signed_power, call.args[0], call.args[1])

    def product(x: te.Tensor) -> te.Tensor:
        def body(*idx):
            value = x(*idx)
            for _ in range(n - 1):
                value = value * x(*idx)
            return value
        return te.compute(x.shape, body, name="T_power")

    return bb.call_te(product, call.args[0])


def _signed_power(x: te.Tensor, y: te.Tensor) -> te.Tensor:
    """pow(|x|, y), negated where x < 0 and y is an odd integer: what pow gives for integer y, without handing a
    negative base to fast-math powf (exp2(y*log2 x) = NaN). A non-integer y of a negative x (NaN in pow) is not
    meaningful either way. Exponents that broadcast other than as a scalar keep TVM's pow."""
    if len(y.shape) and [int(d) for d in y.shape] != [int(d) for d in x.shape]:
        return topi.power(x, y)

    def body(*idx):
        y_val = (y(*idx) if len(y.shape) else y()).astype("float32")
        value = te.power(te.abs(x(*idx)), y_val.astype(x.dtype))
        odd = y_val - te.floor(y_val * 0.5) * 2.0 == 1.0
        return te.if_then_else(te.all(x(*idx) < te.const(0, x.dtype), odd), -value, value)

    return te.compute(x.shape, body, name="T_power")


VECTOR_BYTES = 16  # the injective CUDA schedule's vector (tvmfuse.spaces.elementwise)


def legalize_concat(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """A concatenation on the last axis whose parts have static widths, each a multiple of g = 16 bytes of the dtype
    (8 fp16/bf16 lanes), picks its part by `j < end` (part by part from the first); anything else as TVM's.

    TVM's (topi.concatenate) picks by `start <= j`. For Llama's rotary embedding, concat(-x[..., 64:], x[..., :64]),
    the vectorized CUDA schedule has j = (bx*2048 + tx*8 + lane) % 128, and TVM's simplifier (StmtSimplify, just
    before VectorizeLoop) makes `64 <= j` into `64 <= tx % 16 * 8 + lane`: it depends on the lane, so VectorizeLoop
    ran the 8 lanes as a loop of 2-byte accesses (9-10 µs instead of ~2.5 on the H200). It makes `j < 64` into
    `tx % 16 < 8`, one choice per vector: 16-byte loads and stores. (A `j // g < end // g` condition is already
    `j < end` in the PrimFunc TE makes.) Any end a multiple of the vector width gives the same; others could not
    be decided per vector anyway, and keep TVM's form."""
    widths = _last_axis_widths(call)
    bits = tvm.runtime.DataType(call.ty.dtype).bits if widths else 0
    lanes = VECTOR_BYTES * 8 // bits if bits and (VECTOR_BYTES * 8) % bits == 0 else 0
    if not lanes or not any(widths) or any(w % lanes for w in widths):
        return tvm.ir.Op.get("relax.concat").get_attr("FLegalize")(bb, call)
    fields = [f for f, w in zip(_concat_fields(bb, call), widths) if w]  # zero-width parts are never picked
    return bb.call_te(lambda *parts: _concat_last_axis(parts, [w for w in widths if w]), *fields,
                      primfunc_name_hint="concatenate")


def _last_axis_widths(call: relax.Call) -> list[int] | None:
    """Each part's static extent on the concatenation axis, or None unless that axis is the last one."""
    ndim, axis = call.ty.ndim, call.attrs.axis
    if axis is None or ndim <= 0 or int(axis) % ndim != ndim - 1:
        return None
    shapes = [getattr(f, "shape", None) for f in call.args[0].ty.fields]
    if not shapes or not all(isinstance(s, relax.ShapeExpr) and isinstance(s.values[-1], tirx.IntImm)
                             for s in shapes):
        return None
    return [int(s.values[-1]) for s in shapes]


def _concat_fields(bb: relax.BlockBuilder, call: relax.Call) -> list[relax.Expr]:
    """The tensors concatenated (as TVM's legalization finds them): the bound tuple's fields, else its items."""
    t = call.args[0]
    while isinstance(t, relax.Var) and isinstance(bb.lookup_binding(t), (relax.Tuple, relax.Var)):
        t = bb.lookup_binding(t)
    if isinstance(t, relax.Tuple):
        return list(t.fields)
    return [bb.emit(relax.TupleGetItem(t, i)) for i in range(len(call.args[0].ty.fields))]


def _concat_last_axis(parts, widths: list[int]) -> te.Tensor:
    """concat(parts, axis=-1) as `j < end_0 ? part_0 : j < end_1 ? part_1 : ... : part_last`."""
    ends = [sum(widths[:k + 1]) for k in range(len(widths))]

    def body(*idx):
        *outer, j = idx
        value = parts[-1](*outer, j - ends[-2] if len(parts) > 1 else j)
        for k in range(len(parts) - 2, -1, -1):
            value = te.if_then_else(j < ends[k], parts[k](*outer, j - ends[k - 1] if k else j), value)
        return value

    return te.compute(list(parts[0].shape[:-1]) + [ends[-1]], body, name="T_concat")


LEGALIZE = {"relax.power": legalize_power, "relax.concat": legalize_concat, **SCAN_LEGALIZE}


#: a PrimFunc attribute, [parts, axis]: the one-kernel split of its input into `parts` equal parts on `axis` (the
#: kernels stage lets attention read those parts where they lie, `kernels/split_reads.py`)
SPLIT_ATTR = "tvmfuse.split"
#: TVM's OpPatternKind kOpaque, for a one-kernel split of a reshape: FuseOps fuses no producer into it, so the reshape
#: (GPT-2's [B*S, W] -> [B, S, W]) stays a view and the split's input is the tensor the attention can read in place;
#: kInjective for any other: a producer that is a kernel of its own otherwise (GPT-NeoX's head permute) is fused in
OPAQUE, INJECTIVE = 8, 2


def one_kernel_splits(mod: tvm.IRModule) -> tvm.IRModule:
    """Equal-part splits (static on the split axis) with a part read by a fused group (a composite function:
    FuseOpsByPattern has run), directly or through reshapes, legalize as one block writing all parts: one kernel
    instead of one per part (GPT-2's QKV split, 3 launches per layer). FuseOps cannot fuse such a split into its
    consumers (the group is opaque to it), so every part is written to memory either way; a split whose parts only
    elementwise ops read keeps TVM's, which FuseOps fuses into their kernel."""
    fused = {gv for gv, fn in mod.functions.items() if isinstance(fn, relax.Function) and fn.attrs
             and "Composite" in fn.attrs}
    out = mod
    for gv, fn in mod.functions.items():
        if isinstance(fn, relax.Function) and gv not in fused:
            splits = _splits_feeding_groups(fn, fused)
            if splits:
                rewriter = _OneKernelSplits(out, splits)
                new = rewriter.visit_expr(fn)
                out = rewriter.builder_.get()
                out[gv] = new
    return out


def _splits_feeding_groups(fn: relax.Function, fused: set) -> list:
    """The split calls in `fn` with equal parts, a part of which a call of a `fused` function reads (through
    reshapes)."""
    bindings = [b for blk in fn.body.blocks for b in blk.bindings]
    users: dict = {}
    for b in bindings:
        for v in relax.analysis.free_vars(b.value):
            users.setdefault(v, []).append(b)
    reshape, split = tvm.ir.Op.get("relax.reshape"), tvm.ir.Op.get("relax.split")

    def feeds_group(var) -> bool:  # through reshapes (views, no kernel): the head split before attention
        return any(isinstance(u.value, relax.Call) and (isinstance(u.value.op, relax.GlobalVar) and u.value.op in fused
                                                        or u.value.op.same_as(reshape) and feeds_group(u.var))
                   for u in users.get(var, []))

    return [b.value for b in bindings if isinstance(b.value, relax.Call) and b.value.op.same_as(split)
            and _equal_parts(b.value) is not None
            and any(isinstance(u.value, relax.TupleGetItem) and feeds_group(u.var) for u in users.get(b.var, []))]


def _equal_parts(call: relax.Call) -> list | None:
    """The common shape of the split's parts (static on the split axis, any dims elsewhere), or None unless there
    are several, all of one shape."""
    shapes = [getattr(f.shape, "values", None) for f in call.ty.fields]
    axis = int(call.attrs.axis) % call.ty.fields[0].ndim if shapes[0] is not None else 0
    if len(shapes) < 2 or any(s is None or not tvm_ffi.structural_equal(s, shapes[0]) for s in shapes) \
            or not isinstance(shapes[0][axis], tirx.IntImm):
        return None
    return list(shapes[0])


def _split_one_block(x: te.Tensor, parts: int, axis: int, width: int) -> list[te.Tensor]:
    """split(x, parts, axis) as one compute writing every part: element i of part k is x[i + k * width on axis]."""
    def body(*idx):
        return tuple(x(*idx[:axis], idx[axis] + k * width, *idx[axis + 1:]) for k in range(parts))

    return te.compute(list(x.shape[:axis]) + [width] + list(x.shape[axis + 1:]), body, name="T_split")


@relax.expr_functor.mutator
class _OneKernelSplits(relax.PyExprMutator):
    def __init__(self, mod, splits: list):
        super().__init__(mod)
        self.splits = splits

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        if not any(call.same_as(s) for s in self.splits):
            return super().visit_call_(call)
        x, parts = self.visit_expr(call.args[0]), len(call.ty.fields)
        axis = int(call.attrs.axis) % x.ty.ndim
        width = int(_equal_parts(call)[axis])
        source = self.builder_.lookup_binding(x) if isinstance(x, relax.Var) else None
        of_reshape = isinstance(source, relax.Call) and source.op.same_as(tvm.ir.Op.get("relax.reshape"))
        return self.builder_.call_te(_split_one_block, x, parts, axis, width, primfunc_name_hint="split",
                                     primfunc_attrs={SPLIT_ATTR: [parts, axis],
                                                     "op_pattern": OPAQUE if of_reshape else INJECTIVE})
