"""Run a built module: compare it with onnxruntime on the same random inputs at each shape checked, and time it."""

from __future__ import annotations

import numpy as np
import onnx
import tvm
from tvm import relax

from tvmfuse.verify.inputs import random_inputs
from tvmfuse.verify.outputs import Verification, compare, module_inputs, onnxruntime_outputs, run_vm


def compare_at_dims(vm: relax.VirtualMachine, device, model: onnx.ModelProto, inputs, dims_list: list[dict],
                    io_dtype: str | None, compute_dtype: str | None,
                    tolerance: tuple[float, float] | None = None) -> list[tuple[dict, Verification]]:
    """(dims, comparison with onnxruntime) for each of `dims_list` (symbolic dim -> size), seed-0 random inputs;
    `tolerance`: the user's (atol, rtol) for every float output (None: the dtype defaults, verify.TOLERANCES)."""
    checks = []
    for dims in dims_list:
        feeds = random_inputs(inputs, seed=0, dims=dims, io_dtype=io_dtype)
        checks.append((dims, compare(run_vm(vm, device, list(feeds.values()), io_dtype),
                                     onnxruntime_outputs(model, feeds), compute_dtype=compute_dtype,
                                     user_tolerance=tolerance)))
    return checks


def latency_us(vm: relax.VirtualMachine, device, feeds: dict[str, np.ndarray], io_dtype: str | None) -> float:
    """Median time of `main` on `feeds` (5 runs a repeat, 3 repeats of at least 50 ms), in microseconds."""
    args = [tvm.runtime.tensor(a, device) for a in module_inputs(feeds.values(), io_dtype)]
    timer = vm.time_evaluator("main", device, number=5, repeat=3, min_repeat_ms=50)
    return float(np.median(timer(*args).results) * 1e6)
