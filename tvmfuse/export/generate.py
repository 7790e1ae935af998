"""Greedy generation on an exported decoder step: prefill the prompt, then one token a step, through the in-place
KV cache (`KVCache`) or, for an export built with --kv-cache onnx, by feeding each step's present outputs back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tvm

from tvmfuse.errors import TvmfuseError
from tvmfuse.verify.outputs import cast_array


class KVCache:
    """The in-place step's caches on the device, one [capacity, batch, kv heads, head dim] tensor per past K/V
    input of the exported step, in the manifest's order; `length` positions are filled."""

    def __init__(self, layout: dict, batch: int, device):
        self.capacity, self.dtype, self.batch = int(layout["capacity"]), layout["dtype"], batch
        self.names = [s["cache"] for s in layout["caches"]]
        element = cast_array(np.zeros(0, np.float32), self.dtype).dtype  # numpy's (ml_dtypes' bfloat16)
        zeros: dict = {}  # one host array of zeros per shape, in the cache's dtype, copied to each cache: a 7B
        self.tensors = []  # model's 64 caches at batch 16 are 1 GB each (through fp32, each took seconds)
        for s in layout["caches"]:
            shape = (self.capacity, batch, int(s["kv_heads"]), int(s["head_dim"]))
            if shape not in zeros:
                zeros[shape] = np.zeros(shape, element)
            self.tensors.append(tvm.runtime.tensor(zeros[shape], device))
        self.length = 0

    def reset(self) -> None:
        """Start a new sequence: nothing past `length` is read, so the tensors are reused as they are."""
        self.length = 0


@dataclass
class Generation:
    """What `generate` returns: the new tokens [batch, new_tokens], the times, and where the decode steps ran."""

    tokens: np.ndarray
    prefill_ms: float
    step_ms: list[float] = field(default_factory=list)  # each decode step after the prefill (its window's mean)
    decode: dict = field(default_factory=dict)  # the function decode steps run in, and its CUDA graphs (decode_path)
    prefill: dict = field(default_factory=dict)  # the function the prefill ran in and the length it ran at

    @property
    def ms_per_token(self) -> float:
        return float(np.mean(self.step_ms)) if self.step_ms else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: new tokens (all rows of the batch) per second of decode steps."""
        total = sum(self.step_ms)
        return self.tokens.shape[0] * len(self.step_ms) / (total / 1e3) if total else 0.0


def last_position(logits: tvm.runtime.Tensor, position: int | None = None) -> np.ndarray:
    """The logits [batch, seq, vocab] of each row's last position (or of `position`) as numpy [batch, vocab], copied
    from the device alone (a prefill's whole logits can be gigabytes)."""
    batch, seq, vocab = (int(d) for d in logits.shape)
    at = seq - 1 if position is None else position
    if seq == 1:
        return logits.numpy()[:, 0]
    row = vocab * tvm.runtime.DataType(str(logits.dtype)).bits // 8
    return np.stack([logits._create_view((vocab,), str(logits.dtype), relative_byte_offset=(b * seq + at) * row)
                     .numpy() for b in range(batch)])  # pylint: disable=protected-access  (TVM's view, no copy)


def _step_inputs(manifest: dict) -> tuple[str, str | None]:
    """(ids input, mask input or None) of the exported step; any other model input is an error."""
    cache = manifest["kv_cache"]
    taken = {s.get(key) for s in cache["caches"] for key in ("past", "cache")} | {cache.get("position")}
    rest = [t for t in manifest["inputs"] if t["name"] not in taken]
    mask = next((t["name"] for t in rest if "mask" in t["name"]), None)
    ids = [t["name"] for t in rest if t["name"] != mask]
    if len(ids) != 1:
        raise TvmfuseError(f"generate drives input_ids, attention_mask and the KV cache; this step takes "
                           f"{', '.join(t['name'] for t in rest)}")
    return ids[0], mask


def _ids_dims(manifest: dict) -> list:
    """The ids input's [batch, seq] dims: a name where symbolic, else its size."""
    ids_name, _ = _step_inputs(manifest)
    return next(t["shape"] for t in manifest["inputs"] if t["name"] == ids_name)


def decode_function(manifest: dict, batch: int) -> str:
    """The function the exported `main` runs a decode step (seq 1, `batch` rows) in: the bucket of that shape
    (fuse.buckets dispatches on the dims' values), else the generic one (`main` itself without buckets)."""
    return _function_for(manifest, batch, 1)


def _function_for(manifest: dict, batch: int, seq: int) -> str:
    """The function the exported `main` runs ids [batch, seq] in (see decode_function)."""
    buckets = manifest.get("buckets")
    if not buckets:
        return "main"
    values = {d: v for d, v in zip(_ids_dims(manifest), (batch, seq)) if isinstance(d, str)}
    return next((f["function"] for f in buckets["functions"]
                 if all(values.get(d) == v for d, v in f["shape"].items())), buckets["generic"]["function"])


def prefill_length(manifest: dict, batch: int, prompt: int) -> int:
    """The length the prefill of a [batch, prompt] prompt runs at: the shortest seq bucket of this batch that holds
    the prompt and fits the in-place cache, else the prompt's own (the generic function). A decoder step is causal:
    the tokens padded after the prompt change none of its positions' outputs, and the cache entries they write
    are overwritten by the decode steps before any step reads them."""
    dims = _ids_dims(manifest)
    layout, buckets = manifest.get("kv_cache", {}), manifest.get("buckets")
    if layout.get("mode") != "inplace" or not buckets or not isinstance(dims[1], str):
        return prompt
    lengths = {f["shape"][dims[1]] for f in buckets["functions"] if dims[1] in f["shape"]}
    fits = [n for n in lengths if prompt <= n <= int(layout["capacity"])
            and _function_for(manifest, batch, n) != buckets["generic"]["function"]]  # as `main` dispatches
    return min(fits, default=prompt)


def decode_path(manifest: dict, batch: int) -> dict:
    """The decode steps' function and, in a --cuda-graph build, its CUDA graphs as the build counted them
    (build.cuda_graph_captures: graphs, kernels_in_graphs, kernels_outside, keyed)."""
    function = decode_function(manifest, batch)
    return {"function": function, **(manifest.get("cuda_graphs") or {}).get(function, {})}


def cuda_graph_summary(manifest: dict) -> str:
    """One line for the build log: each function's CUDA graphs and, for a decoder step, whether its decode steps
    run in a function of static shapes (only those are captured)."""
    launches = {fn: g["kernels_in_graphs"] + g["kernels_outside"] for fn, g in manifest["cuda_graphs"].items()}
    parts = [f"{fn} {g['graphs']} graphs ({g['kernels_in_graphs']} of {launches[fn]} launches)"
             for fn, g in manifest["cuda_graphs"].items() if launches[fn]]
    line = "CUDA graphs: " + ", ".join(parts)
    if "kv_cache" not in manifest:
        return line
    symbolic = [d for d in _ids_dims(manifest) if isinstance(d, str)]
    if not symbolic:
        return line + "; decode steps run in main (static shapes)"
    seq = _ids_dims(manifest)[1]
    static = [f for f in (manifest.get("buckets") or {}).get("functions", [])
              if set(symbolic) <= set(f["shape"]) and (not isinstance(seq, str) or f["shape"][seq] == 1)]
    if static:
        return line + "; decode steps run in " + ", ".join(f["function"] for f in static) + " (static shapes)"
    return (line + f"; decode steps run in {decode_function(manifest, 1)}, whose symbolic {', '.join(symbolic)} "
            "keep their launches out of the graphs: bucket them (e.g. --buckets seq=1 --buckets batch=1)")


def generate(model, ids: np.ndarray, new_tokens: int, on_token: Callable[[int, float], None] | None = None,
             cache: KVCache | None = None, prefill_to: int | None = None, sync_every: int = 16) -> Generation:
    """Greedy decoding on a loaded export (`tvmfuse.load`): `ids` [batch, prompt] int64; returns `new_tokens`
    tokens per row. `cache` (in place) is reused after a reset, else created. The prompt is padded to `prefill_to`
    tokens (default: `prefill_length`, the shortest seq bucket that holds it, whose kernels are the templates and
    tuned ones; in-place cache only). A prompt plus new tokens that do not fit the cache is a TvmfuseError.

    With the export's greedy sampler (the manifest's kv_cache.greedy) each step's tokens stay on the device as the
    next step's input, and the host runs ahead of the GPU as an inference engine does: it queues the steps in
    windows of `sync_every`, each step's tokens copied on the device into the window's buffer, and copies a window's
    tokens to the host in one copy once the window after it is queued (so the GPU waits for no copy but that one
    a window, and for none of the launches after it), gives each of them the window's mean time in `step_ms`
    (since the window before was read) and calls `on_token(i, ms)` for each. Without one (an older export) the
    host takes the argmax of each step's last logits, a wait per step."""
    manifest = model.manifest
    if "kv_cache" not in manifest:
        raise TvmfuseError(f"{model.folder}: not a decoder step with a KV cache (no past K/V inputs were found "
                           "when it was built)")
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[1] < 1 or new_tokens < 1 or sync_every < 1:
        raise TvmfuseError(f"generate needs ids [batch, prompt >= 1], new tokens >= 1 and sync_every >= 1 (got ids "
                           f"{list(ids.shape)}, {new_tokens} new tokens, sync_every {sync_every})")
    layout, (ids_name, mask_name) = manifest["kv_cache"], _step_inputs(manifest)
    batch, prompt = ids.shape
    inplace = layout["mode"] == "inplace"
    if inplace:
        need = prompt + new_tokens - 1  # the last token is not fed back
        if prompt > layout["capacity"] or need > layout["capacity"]:
            raise TvmfuseError(f"the prompt ({prompt} tokens) and {new_tokens} new tokens need {need} positions; "
                               f"this export's KV cache holds {layout['capacity']} (rebuild with a larger --max-seq)")
        if cache is None or cache.batch != batch:
            cache = KVCache(layout, batch, model.device)
        cache.reset()
    length = prefill_length(manifest, batch, prompt) if prefill_to is None else int(prefill_to)
    if length != prompt and (not inplace or not prompt <= length <= int(layout["capacity"])):
        raise TvmfuseError(f"cannot pad a {prompt}-token prompt to {length} tokens"
                           + ("" if inplace else " (only with the in-place KV cache)"))
    dev = model.device
    names = [t["name"] for t in manifest["inputs"]]
    dtype = {t["name"]: t["dtype"] for t in manifest["inputs"]}
    ids_dtype = dtype.get(ids_name, "int64")
    greedy = model.vm[layout["greedy"]] if layout.get("greedy") and ids_dtype == "int64" else None
    pasts = [tvm.runtime.tensor(cast_array(np.zeros((batch, s["kv_heads"], 0, s["head_dim"]), np.float32),
                                           dtype[s["past"]]), dev)
             for s in layout["caches"]] if not inplace else []

    # the decode steps' inputs live in buffers made once (or are the sampler's output): a step allocates no device
    # memory outside the VM's pool (a freed TVM tensor is a cudaFree, which waits for the GPU); the mask is all
    # ones, so any prefix of one buffer of ones is the mask
    mask_dtype = dtype.get(mask_name, "int64")
    ones = (tvm.runtime.tensor(np.ones(batch * max(length, prompt + new_tokens - 1), mask_dtype), dev)
            if mask_name else None)
    next_ids = tvm.runtime.empty((batch, 1), ids_dtype, dev) if greedy is None else None
    # with the sampler, each step's tokens are also copied on the device (no host wait) into a slot of one of two
    # window buffers [steps of a window, batch], and a window is read in one copy to the host: a copy to the host
    # waits for everything queued before it, so the GPU idles while the host makes it (~60 µs a copy from Python,
    # measured in generate_run9_h100.json's profile: one a step was 4% of the step)
    width = max(min(sync_every, new_tokens - 1), 1)  # the steps of a window (no more than there are)
    windows = tvm.runtime.empty((2, width, batch), "int64", dev) if greedy is not None else None
    row = batch * 8  # bytes of one step's tokens (int64)

    def slot(buffer: int, at: int):  # pylint: disable=protected-access  (TVM's view of a tensor, no copy)
        return windows._create_view((batch, 1), "int64", relative_byte_offset=(buffer * width + at) * row)

    def window_of(buffer: int, steps: int):  # pylint: disable=protected-access
        return windows._create_view((steps, batch), "int64", relative_byte_offset=buffer * width * row)

    slots = [[slot(b, j) for j in range(width)] for b in range(2)] if greedy is not None else None

    def step(tokens, seq: int, position: int, last: int):
        """Run the step on `tokens` ([batch, seq] on the device) at `position`; the argmax of position `last`'s
        logits: [batch, 1] on the device with the sampler, else [batch] on the host."""
        nonlocal pasts
        feed = {ids_name: tokens}
        if mask_name:
            feed[mask_name] = ones._create_view((batch, position + seq), mask_dtype)  # pylint: disable=protected-access
        if inplace:
            feed[layout["position"]] = tvm.runtime.ShapeTuple([position])
            feed.update(zip(cache.names, cache.tensors))
        else:
            feed.update(zip((s["past"] for s in layout["caches"]), pasts))
        out = model.vm["main"](*[feed[n] for n in names], *model.weights)
        outs = [out] if hasattr(out, "numpy") else list(out)
        if not inplace:
            presents = {t["name"]: o for t, o in zip(manifest["outputs"], outs)}
            pasts = [presents[s["present"]] for s in layout["caches"]]
        else:
            cache.length = position + last + 1
        if greedy is not None:
            return greedy(outs[0], last)
        return last_position(outs[0], last).argmax(-1).astype(np.int64)

    def fed(token):
        """The next step's ids: the sampler's output as it is, else the host's argmax copied in."""
        if greedy is not None:
            return token
        next_ids.copyfrom(token[:, None].astype(ids_dtype))
        return next_ids

    def read(token) -> np.ndarray:
        return token.numpy()[:, 0] if greedy is not None else token

    start = time.perf_counter()
    padded = np.concatenate([ids, np.repeat(ids[:, -1:], length - prompt, axis=1)], axis=1)
    token = step(tvm.runtime.tensor(padded.astype(ids_dtype), dev), length, 0, last=prompt - 1)
    result = Generation(np.zeros((batch, new_tokens), np.int64), 0.0, decode=decode_path(manifest, batch),
                        prefill={"function": _function_for(manifest, batch, length), "length": length})
    result.tokens[:, 0] = read(token)  # waits for the prefill
    result.prefill_ms = (time.perf_counter() - start) * 1e3
    window, pending, start, buffer = [], [], time.perf_counter(), 0

    def flush(done: list, filled: int) -> None:
        """The tokens of the window `done` (with the sampler: in window buffer `filled`): their copy waits for its
        last step (the GPU runs the window queued after it meanwhile); each step gets the window's mean time since
        the window before was read."""
        nonlocal start
        values = list(window_of(filled, len(done)).numpy()) if greedy is not None else [t for _, t in done]
        now = time.perf_counter()
        ms, start = (now - start) * 1e3 / len(done), now
        for (j, _), value in zip(done, values):
            result.tokens[:, j] = value
            result.step_ms.append(ms)
            if on_token is not None:
                on_token(j, ms)

    for i in range(1, new_tokens):
        token = step(fed(token), 1, prompt + i - 1, last=0)
        if greedy is not None:
            token.copyto(slots[buffer][len(window)])  # on the device, queued after the step
        window.append((i, token))
        if len(window) < sync_every and i < new_tokens - 1:
            continue
        if pending:  # the window before is read once this one is queued: the GPU does not wait for the host's
            flush(pending, 1 - buffer)  # copy, nor for the launches after it
        pending, window, buffer = window, [], 1 - buffer
    if pending:
        flush(pending, 1 - buffer)
    return result
