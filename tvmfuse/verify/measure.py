"""Run a built module: compare it with onnxruntime on the same random inputs at each shape checked, and time it."""

from __future__ import annotations

import numpy as np
import onnx
import tvm
from tvm import relax

from tvmfuse.verify.inputs import random_inputs
from tvmfuse.verify.child_reference import reference_in_child
from tvmfuse.verify.outputs import Verification, compare, module_inputs, onnxruntime_outputs, run_vm


def compare_at_dims(vm: relax.VirtualMachine, device, model: onnx.ModelProto | str, inputs, dims_list: list[dict],
                    io_dtype: str | None, compute_dtype: str | None,
                    tolerance: tuple[float, float] | None = None, weights=(),
                    reference_rss: dict | None = None) -> list[tuple[dict, Verification]]:
    """(dims, comparison with onnxruntime) for each of `dims_list` (symbolic dim -> size), seed-0 random inputs;
    `tolerance`: the user's (atol, rtol) for every float output (None: the dtype defaults, verify.TOLERANCES);
    `model`: the ONNX proto or its path (big models: onnxruntime opens the file); `weights`: main's weight params.
    onnxruntime runs first and is dropped before the module runs, so the two never hold their buffers at once; with
    `weights` (a big model, `model` its path) it runs in a child process (`reference.reference_in_child`), whose
    peak RSS goes into `reference_rss["peak_rss_bytes"]`."""
    checks = []
    for dims in dims_list:
        feeds = random_inputs(inputs, seed=0, dims=dims, io_dtype=io_dtype)
        if weights and isinstance(model, str):
            want, peak = reference_in_child(model, feeds)
            if reference_rss is not None:
                reference_rss["peak_rss_bytes"] = peak
        else:
            want = onnxruntime_outputs(model, feeds)
        checks.append((dims, compare(run_vm(vm, device, list(feeds.values()), io_dtype, weights), want,
                                     compute_dtype=compute_dtype, user_tolerance=tolerance)))
    return checks


SLOW_RUN_S = 1.0


def latency_us(vm: relax.VirtualMachine, device, feeds: dict[str, np.ndarray], io_dtype: str | None,
               weights=()) -> float:
    """Median time of `main` on `feeds` (5 runs a repeat, 3 repeats of at least 50 ms), in microseconds; a model
    whose first run takes SLOW_RUN_S or more: that run's time."""
    args = [tvm.runtime.tensor(a, device) for a in module_inputs(feeds.values(), io_dtype)] + list(weights)
    once = float(vm.time_evaluator("main", device, number=1, repeat=1)(*args).results[0])
    if once >= SLOW_RUN_S:  # a big model on a slow schedule: one run is the measurement (15 would take minutes)
        return once * 1e6
    timer = vm.time_evaluator("main", device, number=5, repeat=3, min_repeat_ms=50)
    return float(np.median(timer(*args).results) * 1e6)
