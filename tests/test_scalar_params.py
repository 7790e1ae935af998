"""Scalar constants of a pattern group inline in its kernel (fuse/scalar_params.py): literals with the model's fp32
values instead of 0-d buffers, and kept as parameters wherever LegalizeOps could not write them as literals."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import test_patterns
from tvmfuse.build.compile import build
from tvmfuse.decide.decision import decide
from tvmfuse.frontend.importer import import_model
from tvmfuse.fuse.fusion import lower
from tvmfuse.fuse.scalar_params import inline_scalar_params
from tvmfuse.prepare import prepare_module
from tvmfuse.targets import device_for, resolve_target
from tvmfuse.verify import random_inputs
from tvmfuse.verify.outputs import onnxruntime_outputs, run_vm

#: the fp32 values of the exported GELUs' constants (sqrt 2; sqrt(2/pi) and 0.044715), as TVMScript prints them
EXACT = {"gelu": ["1.4142135381698608"], "gelu_tanh": ["0.79788458347320557", "0.044714998453855515"]}


def exported_gelu(act: str, m: int = 16, k: int = 32, n: int = 64):
    """x [m, k] @ W [k, n] + b, then GELU as opset-17 exporters write it (Div/Erf/Add/Mul; Pow/Tanh): no Gelu op to
    fold into."""
    model = test_patterns.matmul_bias(act, m=m, k=k, n=n)
    model.opset_import[0].version = 17
    return model


def _fused(model, dtype: str, target: str = "llvm"):
    bound = prepare_module(import_model(model, {}), dtype)
    return lower(bound, plan=decide(bound, resolve_target(target)))


def _gemm_kernel(fused) -> tvm.tirx.PrimFunc:
    (func,) = [f for gv, f in fused.mod.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint]
    return func


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_exported_gelu_constants_are_literals_with_the_models_values(act, dtype):
    """The GEMM's epilogue reads W, x and b and nothing else; its constants are the fp32 values the model holds,
    not their fp16/bf16 roundings (the epilogue computes in fp32)."""
    fused = _fused(exported_gelu(act), dtype)
    func = _gemm_kernel(fused)
    assert "erf" in func.script() or "tanh" in func.script()
    assert len(func.params) == 4  # W, x, b, the output: no 0-d buffer
    assert "T.Buffer(()" not in func.script()
    for value in EXACT[act]:
        assert value in func.script(), value


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_exported_gelu_with_inline_constants_matches_onnxruntime(act):
    """fp16 build on llvm against onnxruntime in fp32, fp16's tolerance, every element."""
    model = exported_gelu(act)
    imported = import_model(model, {})
    ex, _ = build(_fused(model, "fp16").mod, resolve_target("llvm"))
    feeds = random_inputs(imported.inputs, dims={})
    dev = device_for(resolve_target("llvm"))
    (got,) = run_vm(relax.VirtualMachine(ex, dev), dev, list(feeds.values()))
    (want,) = onnxruntime_outputs(model, feeds)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=1e-2)


NAMES = ("tvmfuse.test",)


def _composite_module(body, values: list[float], name: str = "tvmfuse.test") -> tvm.IRModule:
    """main calls one composite function f(x, c) = body(x, c) once per value, each with a 0-d constant c."""
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    c = relax.Var("c", relax.TensorType((), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("f", [x, c], attrs={"Composite": name, "Primitive": True}, private=True):
        with bb.dataflow():
            out = bb.emit_output(body(x, c))
        bb.emit_func_output(out)
    f = bb.get().get_global_var("f")
    arg = relax.Var("arg", x.ty)
    with bb.function("main", [arg]):
        with bb.dataflow():
            y = arg
            for v in values:
                y = bb.emit(relax.Call(f, [y, relax.const(v, "float32")]))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _params_of_f(mod) -> int:
    return len(next(fn for gv, fn in mod.functions.items() if gv.name_hint == "f").params)


def _main_args(mod) -> list[int]:
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(len(e.args)) if isinstance(e, relax.Call)
                                    and isinstance(e.op, relax.GlobalVar) else None)
    return calls


def test_a_scalar_every_call_shares_leaves_the_signature():
    mod = inline_scalar_params(_composite_module(relax.op.multiply, [0.5, 0.5]), NAMES)
    assert _params_of_f(mod) == 1 and _main_args(mod) == [1, 1]
    relax.analysis.well_formed(mod)  # raises if not


@pytest.mark.parametrize("body, values", [
    (relax.op.multiply, [0.5, 0.25]),  # two calls, two values: one function cannot hold both
    (relax.op.power, [0.5]),  # a non-integer exponent: LegalizeOps would hand FuseTIR a tensor constant
    (lambda x, c: relax.op.where(relax.op.less(x, c), x, c), [0.0]),  # `where` takes no literal either
])
def test_scalars_legalization_cannot_write_as_literals_stay_parameters(body, values):
    mod = inline_scalar_params(_composite_module(body, values), NAMES)
    assert _params_of_f(mod) == 2 and _main_args(mod) == [2] * len(values)


def test_groups_not_named_keep_their_scalars():
    """Attention's template reads its scale as an argument (by role): only the named groups are inlined."""
    mod = inline_scalar_params(_composite_module(relax.op.multiply, [0.5], name="tvmfuse.attention"), NAMES)
    assert _params_of_f(mod) == 2


def test_integer_exponent_is_inlined():
    mod = inline_scalar_params(_composite_module(relax.op.power, [3.0]), NAMES)
    assert _params_of_f(mod) == 1
