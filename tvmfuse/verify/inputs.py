"""Verification inputs: seeded random values for a model's inputs, at the sizes a check names."""

from __future__ import annotations

import numpy as np

from tvmfuse.verify.outputs import cast_array


def random_inputs(inputs: list, seed: int = 0, dims: dict[str, int] | None = None,
                  io_dtype: str | None = None) -> dict[str, np.ndarray]:
    """Random inputs for verification; symbolic dims take `dims` or 4. Masks are ones; an input indexing a weight
    table (`index_bound`: token ids) takes indices over all its rows, other integers 0 and 1. With
    `io_dtype` (a module taking fp16/bf16), float32 values are ones that dtype holds exactly, so onnxruntime
    (fed float32) and the module (fed `verify.module_inputs`) see the same numbers."""
    rng = np.random.default_rng(seed)
    data = {}
    for t in inputs:
        shape = [d if isinstance(d, int) else (dims or {}).get(d, 4) for d in t.shape]
        if str(t.dtype) == "bfloat16":  # a model stored in bf16: its build takes float32 (values bf16 holds exactly,
            # as its fp32 reference copy does, verify.reference)
            data[t.name] = cast_array(cast_array(rng.standard_normal(shape).astype("float32"), "bfloat16"), "float32")
            continue
        if np.issubdtype(np.dtype(t.dtype), np.integer):
            high = t.index_bound or 2
            arr = np.ones(shape, t.dtype) if "mask" in t.name else rng.integers(0, high, shape).astype(t.dtype)
        elif t.dtype == "bool":
            arr = np.ones(shape, bool)
        else:
            arr = rng.standard_normal(shape).astype(t.dtype)
            if io_dtype not in (None, "float32") and t.dtype == "float32":
                arr = cast_array(cast_array(arr, io_dtype), "float32")
        data[t.name] = arr
    return data
