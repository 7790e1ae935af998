"""Integer powers legalize to products: exact for negative bases, where CUDA's fast-math powf is NaN."""

import numpy as np
import pytest
import tvm
from tvm import relax

from tvmfuse.fuse import lower
from tvmfuse.targets import resolve_target


def _power_module(exponent: float, dtype: str = "float32"):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 32), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.power(x, relax.const(exponent, dtype)))
        bb.emit_func_output(out)
    return lower(bb.get(), patterns=[]).mod


def _kernel_source(mod) -> str:
    return "\n".join(str(f) for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))


@pytest.mark.parametrize("exponent", [2.0, 3.0])
def test_integer_power_is_a_product(exponent):
    mod = _power_module(exponent)
    assert "pow(" not in _kernel_source(mod)
    x = np.linspace(-3, 3, 128, dtype="float32").reshape(4, 32)
    got = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, x ** exponent, rtol=1e-6)


def test_other_powers_keep_tvm_pow():
    assert "pow(" in _kernel_source(_power_module(0.5))


def test_cuda_source_has_no_powf_for_the_gelu_cube():
    """The CUDA kernel multiplies (CUDA builds use --use_fast_math: powf(x<0, 3) would be NaN)."""
    from tvmfuse.build import apply_default_schedules, compile_module

    target = resolve_target("cuda")
    mod = apply_default_schedules(_power_module(3.0, "float16"), target)
    src = compile_module(mod, target).jit().imports[0].inspect_source()
    assert "hpow" not in src.split("main_kernel", 1)[-1] and "powf" not in src.split("main_kernel", 1)[-1]


def test_power_with_a_parameter_exponent_is_right_for_negative_bases():
    """Inside a fused composite the exponent is a parameter, not a constant: pow(|x|, y) with the sign restored
    for odd integer y (CUDA's fast-math powf of a negative base is NaN)."""
    bb = relax.BlockBuilder()
    x, y = relax.Var("x", relax.TensorType((4, 32), "float32")), relax.Var("y", relax.TensorType((), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.power(x, y))
        bb.emit_func_output(out)
    mod = lower(bb.get(), patterns=[]).mod
    assert "fabs" in _kernel_source(mod) or "abs(" in _kernel_source(mod)
    xs = np.linspace(-3, 3, 128, dtype="float32").reshape(4, 32)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    for exponent in (2.0, 3.0, 0.5):
        got = vm["main"](tvm.runtime.tensor(xs), tvm.runtime.tensor(np.array(exponent, "float32"))).numpy()
        want = xs ** exponent if exponent != 0.5 else np.abs(xs) ** 0.5
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
