"""Output check of tuned schedules: each kernel a record schedules, run against the same kernel under its default
schedule (computing in float32) on seeded random inputs, before the build keeps it."""

from __future__ import annotations

from typing import Callable

import numpy as np
import tvm
from tvm.s_tir.meta_schedule.arg_info import ArgInfo

from tvmfuse.build.compile import TIR_PIPELINE
from tvmfuse.isolation import reason
from tvmfuse.spaces.defaults import default_schedule
from tvmfuse.targets import device_for
from tvmfuse.verify.kernels import in_float32, random_array
from tvmfuse.verify.outputs import compare

SEED = 0
RUNS = 2  # the tuned kernel runs this often on the same inputs: a schedule with a race may be right once


def schedule_check(target: tvm.target.Target, say: Callable[[str], None]) -> Callable:
    """The build's check of a replayed record (`build.apply_database(check=...)`): `check(kernel, tuned, generic)`
    is None when `tuned` is right (or cannot be checked: `say` gets one line), else what is wrong. Each kernel's
    reference is built and run once, however many of its records are checked."""
    references: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}

    def check(kernel: str, tuned: tvm.tirx.PrimFunc, generic: tvm.tirx.PrimFunc) -> str | None:
        if kernel not in references:
            try:
                references[kernel] = reference_outputs(generic, target)
            except Exception as err:  # pylint: disable=broad-except  (no reference: the job's verification runs)
                say(f"{kernel}: tuned schedule not checked (no reference: {reason(err)})")
                return None
        want, arrays = references[kernel]
        return wrong_output(tuned, arrays, want, target)

    return check


def reference_outputs(generic: tvm.tirx.PrimFunc, target) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(every buffer after the generic kernel ran under its default schedule in float32, the seeded inputs it ran
    on in the kernel's own dtypes); outputs start as random data too, the same for both runs."""
    arrays = random_arguments(generic)
    reference = in_float32(generic)
    sch = default_schedule(reference, target)
    lib = build_kernel(sch.mod["main"] if sch is not None else reference, target)
    dtypes = [str(i.dtype) for i in ArgInfo.from_prim_func(reference)]
    return run_kernel(lib, target, [a.astype(d) if str(a.dtype) != d else a for a, d in zip(arrays, dtypes)]), arrays


def wrong_output(tuned: tvm.tirx.PrimFunc, arrays: list[np.ndarray], want: list[np.ndarray], target) -> str | None:
    """None when each of RUNS runs of `tuned` on `arrays` leaves every buffer within its dtype's tolerance of `want`
    (fp16/bf16 kernels: that dtype's); else what is wrong."""
    try:
        lib = build_kernel(tuned, target)
        runs = [run_kernel(lib, target, arrays) for _ in range(RUNS)]
    except Exception as err:  # pylint: disable=broad-except  (a tuned kernel that crashes is a wrong one)
        return f"tuned schedule failed its output check ({reason(err)})"
    for got in runs:
        checks = [compare([g], [w], compute_dtype=str(g.dtype)) for g, w in zip(got, want)]
        worst = max(checks, key=lambda v: (not v.ok, v.max_abs_err))
        if not worst.ok:
            atol, rtol = next(iter(worst.tolerance.values())).values()
            return (f"tuned schedule gave wrong output (max abs err {worst.max_abs_err:.3g} > tol {atol:g} + "
                    f"{rtol:g} * |ref| against the default schedule)")
    return None


def build_kernel(func: tvm.tirx.PrimFunc, target):
    """One kernel compiled alone, through the build's TIR pipeline."""
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    with target:
        return tvm.compile(mod, target=target, tir_pipeline=TIR_PIPELINE)


def run_kernel(lib, target, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Every buffer of the kernel after one run on copies of `arrays`, on the target's device in this process."""
    device = device_for(target)
    args = [tvm.runtime.tensor(a, device) for a in arrays]
    lib["main"](*args)
    device.sync()
    return [a.numpy() for a in args]


def random_arguments(func: tvm.tirx.PrimFunc) -> list[np.ndarray]:
    """N(0, 1) for every float buffer in its dtype, zeros for integer and bool ones (indices stay in range)."""
    rng = np.random.default_rng(SEED)
    return [random_array(rng, info, 1.0) for info in ArgInfo.from_prim_func(func)]
