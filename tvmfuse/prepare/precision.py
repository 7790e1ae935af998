"""Precision stage: convert an fp32 Relax module so its kernels compute in fp16 or bf16 (mixed precision).

Runs after import and param binding, before decide/fuse. TVM's own pass does the conversion:
`relax.transform.ToMixedPrecision(out_dtype="float32", fp16_input_names=<the model's float inputs>)`.
What it does (observed on TVM 0.27, tests/test_dtype.py):

- without `fp16_input_names` the signature stays fp32 and only matmul/conv and what follows them compute in
  fp16: everything downstream of an fp32 input (LayerNorm, GELU, RMSNorm, the residual stream) stays fp32. So
  the inputs are named: those params become float16, and `interface.fp32_interface` gives `main` float32 params
  again, each cast to fp16 as the first binding. The outputs stay float32 (the pass casts them back itself).
  By default the exported module's interface is therefore float32 in and out, whatever the compute dtype.
  Inputs with symbolic dims are not named (the pass stops on them: "no block is being built"): they stay fp32,
  a matmul reading one casts it to fp16, and only ops applied to them directly compute in fp32;
- `relax.matmul` (policy "always") gets fp16 inputs and, with `out_dtype="float32"`, accumulates and returns
  fp32, followed by a cast to fp16;
- "follow" ops (elementwise, `layer_norm`, `gelu`, reshapes) compute in fp16 when all inputs are fp16 (TVM's
  fp16 `layer_norm` lowering accumulates its mean/variance in fp32);
- ops without a policy (`mean`, `sum`, `softmax`, ...) compute in fp32: their inputs are cast up first;
- except `take` in fp16 (and bf16): an embedding lookup from a constant table fp16 holds computes in fp16
  (`_lookups_in_compute_dtype`),
  so the hidden state after it, the residual stream with its adds and LayerNorms, is fp16 as in a torch fp16
  model, with no casts between the LayerNorms and the matmuls (without it the lookup's fp32 result kept the
  residual stream fp32: a cast to fp16 before each matmul and one back to fp32 after it);
- weights feeding fp16 ops become `astype(const, "float16")`; FoldConstant makes them fp16 constants, except
  0-d ones (scalar operands: attention scales, GELU constants), which it leaves as casts: `opmath.fold_scalar_casts`
  folds those, so the patterns see the same constants as in fp32, and records the fp32 value of each it rounded
  (`opmath.exact_scalar`): a kernel computing in fp32 with one (the attention template's scale) uses the model's value;

`io_dtype` (None or float32: as above; the compute dtype: the module takes and returns its float tensors in
the compute dtype): the fp32 interface is built as usual, then wrapped in casts to/from `io_dtype`
(`interface.low_interface`), and each
exact round trip (`astype(astype(x: fp16, fp32), fp16)`) cancels, so no interface cast kernel remains where
the first/last op already computes in the compute dtype.

The pass knows only float16. For bf16 the fp16 result is re-typed: casts to float16 become casts to bfloat16
and types are re-inferred; `layer_norm`/`group_norm`/`power` (TVM lowers them for fp32/fp16 only) compute in
fp32 between casts.

A model stored in bf16 (exported after `model.to(torch.bfloat16)`) already computes in bf16: ToMixedPrecision
would fail on it (it casts some operands to fp32, then a bf16 x fp32 multiply does not type-check) and there is
nothing to convert. `--dtype bf16` keeps its bf16 weights and ops as they are (`_stored_bf16`): matmuls get fp32
accumulation (`astype(matmul(a, b, out_dtype=float32), bfloat16)`, the form ToMixedPrecision leaves, which the
patterns and the bf16 tensor-core schedules take), `FP32_ONLY_IN_BF16` ops and the reductions of
`FP32_REDUCTIONS_IN_BF16` compute in fp32 between casts (torch's bf16 softmax and norms accumulate in fp32 too),
and the float interface becomes float32 as for a converted model. No weight passes through fp32. `--dtype fp16`
on such a model is refused (it would round bf16 weights to fp16).
"""

from __future__ import annotations

import contextlib

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvmfuse.errors import JobError
from tvmfuse.prepare.interface import cancel_constant_round_trips, fp32_interface, low_interface
from tvmfuse.prepare.dtypes import check_io_dtype, parse_dtype
from tvmfuse.prepare.opmath import fold_scalar_casts, mutate_functions, opmath_fp32

Const = tvm.ir.GenericConst
FLOAT32, FLOAT16, BFLOAT16 = "float32", "float16", "bfloat16"
#: what the module's inputs and outputs are by default whatever the compute dtype (ToMixedPrecision keeps the
#: signature); `io_dtype` may make them the compute dtype
INTERFACE_DTYPE = FLOAT32
PASS = "relax.transform.ToMixedPrecision(out_dtype='float32')"
#: what the manifest's `pass` says for a model stored in bf16, which no pass converts
STORED_PASS = "none: the model is stored in bfloat16 (tvmfuse.prepare.precision: fp32 accumulation, fp32 reductions)"
#: module attribute: the float dtype the model was stored in, where it was not float32
STORED_ATTR = "tvmfuse.stored_dtype"
#: ops whose TVM lowering takes float32/float16 only: in bf16 they compute in fp32 between casts (`power`:
#: tirx `pow` rejects bfloat16, "power only applies to float": GPT-2's tanh-GELU cube)
FP32_ONLY_IN_BF16 = ("relax.nn.layer_norm", "relax.nn.group_norm", "relax.power")
#: reductions a model stored in bf16 computes in fp32 between casts (what ToMixedPrecision does for ops it has no
#: policy for, and what torch's bf16 kernels do inside: fp32 accumulation, one rounding of the result)
FP32_REDUCTIONS_IN_BF16 = ("relax.nn.softmax", "relax.nn.log_softmax", "relax.mean", "relax.sum",
                           "relax.variance", "relax.nn.rms_norm")
#: float predicates TVM's TIR has no bf16 lowering for ("Data type bfloat16 not supported for isnan op"): a model
#: stored in bf16 asks them of the fp32 value (exact: every bf16 value is an fp32 value)
FP32_PREDICATES_IN_BF16 = ("relax.isnan", "relax.isinf", "relax.isfinite")


def to_compute_dtype(mod: tvm.IRModule, dtype: str, io_dtype: str | None = None,
                     low_lookups: bool = True) -> tvm.IRModule:
    """The module with its kernels computing in `dtype` (fp32 accumulation) and its float inputs and outputs in
    `io_dtype` (None: float32, or `dtype` itself); fp32: unchanged. `low_lookups`: see `_lookups_in_compute_dtype`."""
    dtype = parse_dtype(dtype, "dtype")
    io_dtype = interface_dtype(dtype, io_dtype)
    if dtype == FLOAT32:
        return mod
    stored = stored_float_dtypes(mod)
    if BFLOAT16 in stored:
        if dtype != BFLOAT16:
            raise JobError(f"the model stores bfloat16 weights; --dtype {dtype} would round them: build it with "
                           "--dtype bf16, or export it in fp32")
        return _finish(_stored_bf16(mod), io_dtype)
    main = mod["main"]
    n_in = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else len(main.params)
    # inputs with symbolic dims are not named: TVM 0.27's pass fails on them ("no block is being built", in
    # TypeMutator, when it re-types the parameter); they stay fp32 parameters, cast to fp16 where a matmul reads
    # them, so only ops applied to them directly still compute in fp32
    inputs = [p.name for p in main.params[:n_in] if str(getattr(p.ty, "dtype", "")) == FLOAT32
              and _static_shape(p)]
    with _lookups_in_compute_dtype(mod, dtype) if low_lookups else contextlib.nullcontext():
        mod = relax.transform.ToMixedPrecision(out_dtype=FLOAT32, fp16_input_names=inputs)(mod)
    mod = opmath_fp32(mod)
    mod = fp32_interface(mod, inputs)
    if dtype == BFLOAT16:
        mod = _fp16_to_bf16(mod)
    return _finish(mod, io_dtype)


def _finish(mod: tvm.IRModule, io_dtype: str) -> tvm.IRModule:
    """Constants folded into the compute dtype, exact scalars recorded, the interface in `io_dtype`."""
    mod = cancel_constant_round_trips(mod)  # weights read in the compute dtype (big models) stay as they are
    mod = relax.transform.FoldConstant()(mod)  # astype(weight) -> a constant in the compute dtype
    mod = fold_scalar_casts(mod)
    if io_dtype != FLOAT32:
        mod = low_interface(mod, io_dtype)
    mod = relax.transform.DeadCodeElimination(["main"])(relax.transform.CanonicalizeBindings()(mod))
    return unique_binding_names(mod)


def stored_float_dtypes(mod: tvm.IRModule) -> set[str]:
    """The dtypes of `main`'s float tensor constants (its weights once bound): {"bfloat16"} for a model exported
    in bf16, {"float32"} for an fp32 one. A constant cast straight to fp32 (a big fp32 model's weight the importer
    read in the compute dtype, `prepare.bind_params`) counts as fp32."""
    consts, upcast = [], set()

    def visit(expr):
        if isinstance(expr, Const):
            consts.append(expr)
        elif isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.astype" \
                and str(expr.attrs.dtype) == FLOAT32 and isinstance(expr.args[0], Const):
            upcast.add(expr.args[0])

    relax.analysis.post_order_visit(mod["main"], visit)
    found = set()
    for const in consts:
        value = getattr(const, "value", None)
        dtype = str(value.dtype) if value is not None and hasattr(value, "dtype") else ""
        if dtype in (FLOAT32, FLOAT16, BFLOAT16, "float64") and len(value.shape) > 0:
            found.add(FLOAT32 if any(const.same_as(c) for c in upcast) else dtype)
    return found


def _stored_bf16(mod: tvm.IRModule) -> tvm.IRModule:
    """A module whose weights are bf16 as it computes in bf16: fp32 accumulation for matmuls, fp32 between casts
    for FP32_ONLY_IN_BF16 ops and FP32_REDUCTIONS_IN_BF16, float32 inputs and outputs (see the module doc)."""
    mod = mutate_functions(mod, _Bf16Opmath)
    return _float32_interface(mod, BFLOAT16).with_attr(STORED_ATTR, BFLOAT16)


def _float32_interface(mod: tvm.IRModule, low: str) -> tvm.IRModule:
    """`main` taking float32 where it took `low` inputs (each cast to `low` first; symbolic shapes too: no
    ToMixedPrecision runs here) and returning float32 where it returned `low` (the interface a converted model
    has; `--io-dtype` makes it `low` again)."""
    main = mod["main"]
    n_in = int(main.attrs["num_input"]) if main.attrs and "num_input" in main.attrs else len(main.params)
    names = [p.name for p in main.params[:n_in] if str(getattr(p.ty, "dtype", "")) == low]
    if names:  # fp32_interface re-types fp16 params: re-type the bf16 ones the same way
        mod = fp32_interface(mod, names, low)
    return low_interface(mod, FLOAT32, from_dtype=low, inputs=False)


@contextlib.contextmanager
def _lookups_in_compute_dtype(mod: tvm.IRModule, dtype: str):
    """While ToMixedPrecision runs, `relax.take` has the policy "always" (its float table cast to fp16, an fp16
    result) where every float `take` in `main` reads a constant table fp16 holds (finite, |x| <= 65504): an
    embedding lookup. TVM registers no policy for take, which the pass reads as "never": the lookup returned
    fp32, and every "follow" op after it stayed fp32 with it (the whole residual stream: adds and LayerNorms in
    fp32, a cast to fp16 before each matmul, one to fp32 after it). ("follow" would not do: the int ids are not
    fp16-castable.) The hidden state is then fp16 from the lookup on, as in a torch fp16 model. In bf16 the same
    (the pass's fp16 is re-typed to bf16 after it): a bf16 residual stream as in a torch bf16 model, where an fp32
    one had cost GPT-2 and BERT a cast kernel per layer and fp32 LayerNorm reads (models_run24_bf16: 8-19% slower
    than fp16)."""
    op = tvm.ir.Op.get("relax.take")
    if dtype not in (FLOAT16, BFLOAT16) or op.get_attr("TMixedPrecisionPolicy") is not None \
            or not _fp16_tables(mod["main"]):
        yield
        return
    op.set_attr("TMixedPrecisionPolicy", 0)  # kAlways
    op.set_attr("FInferMixedPrecision", lambda call, out_dtype: call)  # nothing to adjust (no out_dtype)
    try:
        yield
    finally:
        op.reset_attr("TMixedPrecisionPolicy")
        op.reset_attr("FInferMixedPrecision")


def has_low_lookups(mod: tvm.IRModule) -> bool:
    """Whether `main` (after to_compute_dtype) looks up a float table in fp16 or bf16: the residual stream is."""
    return any(str(getattr(t.ty, "dtype", "")) in (FLOAT16, BFLOAT16) for t in _takes(mod["main"]))


def _fp16_tables(func: relax.Function) -> bool:
    """Whether `func` has float32 `take`s and each reads a constant table within fp16's range."""
    tables = [t.args[0] for t in _takes(func) if str(getattr(t.args[0].ty, "dtype", "")) == FLOAT32]
    for table in tables:
        data = table.value.numpy() if isinstance(table, Const) else None
        if data is None or not np.isfinite(data).all() or np.abs(data).max(initial=0.0) > 65504.0:
            return False
    return bool(tables)


def _takes(func: relax.Function) -> list[relax.Call]:
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.Call) and isinstance(
        e.op, tvm.ir.Op) and e.op.name == "relax.take" else None)
    return found


def _static_shape(param) -> bool:
    shape = getattr(param.ty, "shape", None)
    values = getattr(shape, "values", None)
    return values is not None and all(isinstance(v, tvm.tirx.IntImm) for v in values)


def interface_dtype(dtype: str, io_dtype: str | None) -> str:
    """The module's float input/output dtype: float32 (None) or the compute dtype; anything else is a JobError."""
    return FLOAT32 if io_dtype is None else check_io_dtype(io_dtype, parse_dtype(dtype, "dtype"), "io_dtype")


@mutator
class _UniqueNames(PyExprMutator):
    """Renames a binding whose name an earlier binding already has (`lv3` -> `lv3_1`)."""

    def __init__(self, mod=None):
        super().__init__(mod)
        self.seen: set[str] = set()

    def _fresh(self, var, cls):
        name, i = var.name, 1
        if name not in self.seen:
            self.seen.add(name)
            return var
        while f"{name}_{i}" in self.seen:
            i += 1
        self.seen.add(f"{name}_{i}")
        return cls(f"{name}_{i}", var.ty, var.span)

    def visit_var_def_(self, var):
        return self._fresh(var, relax.Var)

    def visit_dataflow_var_def_(self, var):
        return self._fresh(var, relax.DataflowVar)


def unique_binding_names(mod: tvm.IRModule) -> tvm.IRModule:
    """ToMixedPrecision reuses binding names; the fusion stages tell candidates apart by name."""
    out = mod.clone()
    out["main"] = _UniqueNames(mod).visit_expr(mod["main"])
    return out


def precision_info(mod: tvm.IRModule, dtype: str, io_dtype: str | None = None) -> dict:
    """What the manifest says about precision: compute dtype, interface dtype, and how many ops compute low."""
    dtype = parse_dtype(dtype, "dtype")
    info = {"compute_dtype": dtype, "interface_dtype": interface_dtype(dtype, io_dtype)}
    if dtype != FLOAT32:
        ops = _op_dtypes(mod)
        stored = str(mod.attrs[STORED_ATTR]) if mod.attrs and STORED_ATTR in mod.attrs else FLOAT32
        if stored != FLOAT32:
            residual = f"{stored} (as stored)"
        elif has_low_lookups(mod):
            residual = dtype
        else:
            residual = "as the ops above (lookups in fp32)"
        info.update({"stored_dtype": stored, "pass": STORED_PASS if stored != FLOAT32 else PASS,
                     "accumulation": FLOAT32, "weights_dtype": sorted(weight_dtypes(mod)),
                     "ops_in_compute_dtype": sum(1 for _, d in ops if d == dtype),
                     "ops_in_float32": sum(1 for _, d in ops if d == FLOAT32),
                     "residual_stream": residual})
    return info


def weight_dtypes(mod: tvm.IRModule) -> set[str]:
    """The dtypes of `main`'s float constants of two or more dimensions (matmul weights, embedding tables)."""
    found = set()

    def visit(expr):
        value = getattr(expr, "value", None) if isinstance(expr, Const) else None
        if value is not None and hasattr(value, "dtype") and len(value.shape) >= 2 \
                and str(value.dtype) in (FLOAT32, FLOAT16, BFLOAT16):
            found.add(str(value.dtype))

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


def _op_dtypes(mod: tvm.IRModule) -> list[tuple[str, str]]:
    """(op name, output dtype) of every operator call in `main` except casts."""
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name != "relax.astype":
            found.append((expr.op.name, str(getattr(expr.ty, "dtype", ""))))

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


def _fp16_to_bf16(mod: tvm.IRModule) -> tvm.IRModule:
    return mutate_functions(mod, _Retype)


def _fp32_between_casts(call: relax.Call, low: str) -> relax.Expr:
    """`call` on its `low` operands cast to fp32; its result cast back to `low` if it was `low` (not a bool)."""
    args = [relax.op.astype(a, FLOAT32) if str(getattr(a.ty, "dtype", "")) == low else a for a in call.args]
    wide = relax.Call(call.op, args, call.attrs)
    return relax.op.astype(wide, low) if str(getattr(call.ty, "dtype", "")) == low else wide


@relax.expr_functor.mutator
class _Bf16Opmath(relax.PyExprMutator):
    """In a module stored in bf16: bf16 matmuls accumulate in fp32 and round once; FP32_ONLY_IN_BF16 ops and
    FP32_REDUCTIONS_IN_BF16 compute in fp32 between casts."""

    def _rounded_from_fp32(self, expr):
        """y where `expr` is (bound to) astype(y: float32, bfloat16), else None."""
        value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
        if isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.astype") \
                and str(getattr(value.ty, "dtype", "")) == BFLOAT16 \
                and str(getattr(value.args[0].ty, "dtype", "")) == FLOAT32:
            return value.args[0]
        return None

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or not any(str(getattr(a.ty, "dtype", "")) == BFLOAT16
                                                         for a in call.args):
            return call
        if call.op.name in FP32_PREDICATES_IN_BF16 and self._rounded_from_fp32(call.args[0]) is not None:
            return relax.Call(call.op, [self._rounded_from_fp32(call.args[0])], call.attrs)  # isnan(round(y)) ==
            # isnan(y): the fp32 softmax itself, as ToMixedPrecision leaves sdpa's NaN guard
        if call.op.name == "relax.where" and isinstance(call.args[1], Const):
            wide = self._rounded_from_fp32(call.args[2])  # where(isnan(p), c, round(p)) -> round(where(isnan(p),
            cond = self.lookup_binding(call.args[0]) if isinstance(call.args[0], relax.Var) else call.args[0]
            if wide is not None and isinstance(cond, relax.Call) and cond.op == tvm.ir.Op.get("relax.isnan") \
                    and cond.args[0].same_as(wide):  # c, p)): exact, and the form the attention pattern takes
                picked = relax.op.where(call.args[0], relax.op.astype(call.args[1], FLOAT32), wide)
                return relax.op.astype(self.builder_.normalize(picked), BFLOAT16)
        if call.op.name == "relax.matmul" and str(getattr(call.ty, "dtype", "")) == BFLOAT16:
            acc = self.builder_.normalize(relax.op.matmul(call.args[0], call.args[1], out_dtype=FLOAT32))
            return relax.op.astype(acc, BFLOAT16)
        if call.op.name in FP32_ONLY_IN_BF16 + FP32_REDUCTIONS_IN_BF16 + FP32_PREDICATES_IN_BF16:
            return _fp32_between_casts(call, BFLOAT16)
        return call


@relax.expr_functor.mutator
class _Retype(relax.PyExprMutator):
    """float16 -> bfloat16 in casts, dtype attributes and constants; the mutator re-infers every type."""

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        call = super().visit_call_(call)
        attrs = call.attrs
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.astype" and str(attrs.dtype) == FLOAT16:
            return relax.op.astype(call.args[0], BFLOAT16)
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.matmul" and str(attrs.out_dtype) == FLOAT16:
            return relax.op.matmul(call.args[0], call.args[1], out_dtype=BFLOAT16)
        if isinstance(call.op, tvm.ir.Op) and call.op.name in FP32_ONLY_IN_BF16 \
                and any(str(getattr(a.ty, "dtype", "")) == BFLOAT16 for a in call.args):
            return _fp32_between_casts(call, BFLOAT16)
        if attrs is not None and FLOAT16 in str(attrs):
            raise NotImplementedError(f"bf16: cannot re-type {call.op} with a float16 attribute ({attrs})")
        return call

    def visit_constant_(self, const):  # pylint: disable=arguments-renamed
        value = getattr(const, "value", None)
        if value is not None and str(value.dtype) == FLOAT16:
            import ml_dtypes  # pylint: disable=import-outside-toplevel

            data = value.numpy().astype(np.float32).astype(ml_dtypes.bfloat16)
            return relax.const(tvm.runtime.tensor(data), BFLOAT16)
        return super().visit_constant_(const)
