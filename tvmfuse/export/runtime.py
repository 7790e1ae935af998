"""Load an exported model: check the manifest's sha256s, load the library (and its weights), run it in a Relax VM."""

from __future__ import annotations

import json
import os

import numpy as np
import tvm
from tvm import relax

from tvmfuse.errors import TvmfuseError
from tvmfuse.export.digest import sha256_of
from tvmfuse.export.generate import Generation, KVCache, generate
from tvmfuse.export.library import FORMAT, LIBRARY, MANIFEST
from tvmfuse.export.weights import load_weights
from tvmfuse.quiet import quiet_native_logs
from tvmfuse.targets import device_for
from tvmfuse.verify.outputs import to_numpy


class LoadedModel:
    """A callable over an exported module: `model(x, ...)` or `model(x=...)` -> list of numpy arrays (a KV cache
    step's `past_len` may be an int, its caches `KVCache.tensors`, written in place)."""

    def __init__(self, path: str, device=None):
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        self.folder = folder
        manifest_path = os.path.join(folder, MANIFEST)
        if not os.path.exists(manifest_path):
            raise TvmfuseError(f"{folder}: no {MANIFEST}; not a tvmfuse export")
        with open(manifest_path, encoding="utf-8") as f:
            self.manifest = json.load(f)
        lib = os.path.join(folder, self.manifest.get("library", LIBRARY))
        if not os.path.exists(lib):
            raise TvmfuseError(f"{lib}: missing")
        if sha256_of(lib) != self.manifest.get("sha256"):
            raise TvmfuseError(f"{lib}: sha256 does not match {MANIFEST}; the library was changed or damaged")
        if device is None:
            device = device_for(self.manifest["target"]["kind"])
        elif isinstance(device, str):
            device = tvm.device(device, 0)
        self.device = device
        if self.manifest.get("format", 1) > FORMAT:
            raise TvmfuseError(f"{manifest_path}: export format {self.manifest['format']} is newer than this "
                               f"tvmfuse reads ({FORMAT}); update tvmfuse")
        stored = self.manifest.get("weights") or {"storage": "embedded"}
        self.weights = load_weights(folder, stored, device) if stored["storage"] != "embedded" else []
        with quiet_native_logs():  # TVM logs a warning line per constant as it loads the executable
            self.vm = relax.VirtualMachine(tvm.runtime.load_module(lib), device)
        self.input_names = [t["name"] for t in self.manifest["inputs"]]
        self._shape_inputs = {t["name"] for t in self.manifest["inputs"] if t["dtype"] == "shape"}  # past_len

    def __call__(self, *args, **kwargs) -> list[np.ndarray]:
        if kwargs:
            missing = [n for n in self.input_names if n not in kwargs]
            if missing or args:
                raise TypeError(f"pass all inputs by name ({', '.join(self.input_names)}) or all by position")
            args = tuple(kwargs[n] for n in self.input_names)
        if len(args) != len(self.input_names):
            raise TypeError(f"expected {len(self.input_names)} inputs ({', '.join(self.input_names)}), got {len(args)}")
        tensors = [tvm.runtime.ShapeTuple([int(a)] if np.ndim(a) == 0 else [int(x) for x in a])
                   if name in self._shape_inputs and not isinstance(a, tvm.runtime.ShapeTuple)
                   else a if isinstance(a, (tvm.runtime.Tensor, tvm.runtime.ShapeTuple))
                   else tvm.runtime.tensor(np.asarray(a), self.device) for name, a in zip(self.input_names, args)]
        out = self.vm["main"](*tensors, *self.weights)
        return to_numpy(out)

    def kv_cache(self, batch: int) -> KVCache:
        """A new in-place KV cache for `batch` rows on this model's device (the export's capacity and dtype)."""
        if self.manifest.get("kv_cache", {}).get("mode") != "inplace":
            raise TvmfuseError(f"{self.folder}: no in-place KV cache (built without one, or with --kv-cache onnx)")
        return KVCache(self.manifest["kv_cache"], batch, self.device)

    def generate(self, ids, new_tokens: int, on_token=None, cache: KVCache | None = None,
                 prefill_to: int | None = None, sync_every: int = 16) -> Generation:
        """Greedy decoding: prefill `ids` [batch, prompt], then `new_tokens` tokens per row (export.generate)."""
        return generate(self, ids, new_tokens, on_token, cache, prefill_to, sync_every)


def load(path: str, device=None) -> LoadedModel:
    """Load `<out>/<model>-<target>/` (or its model.so) after checking the manifest's sha256."""
    return LoadedModel(path, device)
