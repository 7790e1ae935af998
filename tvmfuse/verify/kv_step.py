"""Verification of a decoder step with a KV cache: consistent sizes (the mask covers past + seq), and the
in-place step checked against onnxruntime's ONNX-semantics step (logits, and the cache against `present`)."""

from __future__ import annotations

import numpy as np
import onnx
import tvm
from tvm import relax

from tvmfuse.verify.inputs import random_inputs
from tvmfuse.verify.outputs import Verification, cast_array, compare, onnxruntime_outputs, to_numpy

PAST, SEQ = 3, 2  # the checked step: 3 positions cached, 2 new ones (the other symbolic dims: verification_dims)


def step_dims(inputs, past_inputs: list[str], base: dict[str, int]) -> dict[str, int]:
    """`base` with the past length PAST, and every symbolic dim only a mask (or position) input has set to
    past + seq: the exported step's total length, which onnxruntime checks against past + seq."""
    by_name = {t.name: t for t in inputs}
    past_dim = by_name[past_inputs[0]].shape[2]
    dims = dict(base)
    if isinstance(past_dim, str):
        dims[past_dim] = PAST
    ids = next((t for t in inputs if len(t.shape) == 2 and t.name not in past_inputs and "mask" not in t.name), None)
    if ids is not None and isinstance(ids.shape[1], str):
        dims[ids.shape[1]] = SEQ
    seq = ids.shape[1] if ids is not None and isinstance(ids.shape[1], int) else SEQ  # a symbolic one was set to SEQ
    for t in inputs:
        if "mask" in t.name and isinstance(t.shape[-1], str) and t.shape[-1] not in (ids.shape if ids else ()):
            dims[t.shape[-1]] = dims.get(past_dim, PAST) + seq
    return dims


def cache_arrays(layout: dict, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Each cache [capacity, batch, kv heads, head dim] holding its past input ([batch, kv heads, past, head
    dim]) in its first positions, zeros after."""
    out = []
    for site in layout["caches"]:
        past = feeds[site["past"]]
        cache = np.zeros((layout["capacity"], past.shape[0], site["kv_heads"], site["head_dim"]), np.float32)
        cache[:past.shape[2]] = past.transpose(2, 0, 1, 3)
        out.append(cast_array(cache, layout["dtype"]))
    return out


def compare_kv_step(vm: relax.VirtualMachine, device, model: onnx.ModelProto | str, inputs, output_names: list[str],
                    layout: dict, dims: dict[str, int], compute_dtype: str | None,
                    tolerance: tuple[float, float] | None = None, weights=()) -> tuple[Verification, list]:
    """Run onnxruntime's step (past inputs -> present outputs) and the in-place step (caches holding the same
    past) on the same seeded inputs; compare the outputs, and each cache's first past + seq positions with its
    `present`. Returns the comparison and the in-place step's arguments (for timing)."""
    feeds = random_inputs(inputs, seed=0, dims=step_dims(inputs, [s["past"] for s in layout["caches"]], dims))
    want = dict(zip(output_names, onnxruntime_outputs(model, feeds)))
    pasts = {s["past"] for s in layout["caches"]}
    past_len = feeds[layout["caches"][0]["past"]].shape[2]
    caches = [tvm.runtime.tensor(c, device) for c in cache_arrays(layout, feeds)]
    args = ([tvm.runtime.tensor(a, device) for n, a in feeds.items() if n not in pasts]
            + [tvm.runtime.ShapeTuple([past_len])] + caches + list(weights))
    got = to_numpy(vm["main"](*args))
    presents = [s["present"] for s in layout["caches"]]
    total = past_len + next(iter(feeds.values())).shape[1]
    got += [c.numpy()[:total].transpose(1, 2, 0, 3).astype(np.float32) for c, p in zip(caches, presents) if p]
    wanted = [want[n] for n in output_names if n not in presents] + [want[p] for p in presents if p]
    return compare(got, wanted, compute_dtype=compute_dtype, user_tolerance=tolerance), args
