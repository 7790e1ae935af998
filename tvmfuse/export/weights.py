"""Weights outside the library: the fused module reads its large weights as parameters of `main`, and the export
stores them in TVM's tensor cache (`weights/params_shard_*.bin` + `weights/tensor-cache.json`, the format
mlc-llm's runtime reads; see docs/weights.md).

The build binds every weight as a constant so that precision conversion, the [N, K] layout and constant folding
see them (tvmfuse.pipeline.prepare_module, tvmfuse.fuse.lower); `unbind_weights` then turns every large constant
`main` passes to its kernels back into a trailing parameter. The stored values are therefore the transformed ones
(fp16, [N, K], folded) that the kernels read; scalars and small constants stay in the library.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import sys

import numpy as np
import tvm
from tvm import relax

from tvmfuse.errors import TvmfuseError
from tvmfuse.export.digest import sha256_of

FOLDER = "weights"  # inside the export folder
CACHE_JSON = "tensor-cache.json"
PREFIX = "param"  # cache names param_0, param_1, ...: vm.builtin.param_array_from_cache("param", -1) reads them
STORAGE = "tvm-tensor-cache"
#: constants of main at least this large become parameters (smaller ones: scalars, shapes, tiny tables stay bound)
MIN_BYTES = 1024
#: weights of at least this many bytes go outside the library even when the ONNX file holds them inline
AUTO_BYTES = 1 << 30
#: constants in `.rodata` from this size on fail to link (TVM issue #10882): `--weights library` refuses them
LIBRARY_MAX_BYTES = 2 << 30


def nbytes(tensor) -> int:
    return int(np.prod(tensor.shape, dtype=np.int64)) * tvm.runtime.DataType(str(tensor.dtype)).bits // 8


def outside(has_external_data: bool, weight_bytes: int, placement: str = "auto") -> bool:
    """Whether a model's weights are stored outside the library. `placement` (a job's `--weights`): "auto" puts
    external-data ONNX files and models of at least AUTO_BYTES of weights outside (others embed them in model.so),
    "external" every model's, "library" none; weights of LIBRARY_MAX_BYTES or more do not fit in a library (a
    TvmfuseError before anything is built)."""
    if placement == "library" and weight_bytes >= LIBRARY_MAX_BYTES:
        raise TvmfuseError(f"--weights library: the model's weights are {weight_bytes / 2**20:,.1f} MiB, and a "
                           f"library's constants must stay under {LIBRARY_MAX_BYTES / 2**20:,.0f} MiB (they do not "
                           "link above it, TVM issue #10882); use --weights auto or external")
    if placement in ("external", "library"):
        return placement == "external"
    return has_external_data or weight_bytes >= AUTO_BYTES


@relax.expr_functor.mutator
class _Unbind(relax.PyExprMutator):
    """Each constant whose tensor has a parameter in `params` (by `_key`: the large ones) becomes it."""

    def __init__(self, params: dict):
        super().__init__()
        self.params = params

    def visit_generic_const_(self, op):  # pylint: disable=arguments-renamed
        return self.params.get(_key(op.value), op) if isinstance(op.value, tvm.runtime.Tensor) else op


def _param_for(mutator, op):
    """The parameter replacing constant `op` (one per constant), or `op` itself when it is small."""
    value = op.value
    if not isinstance(value, tvm.runtime.Tensor) or nbytes(value) < mutator.min_bytes:
        return op
    if op not in mutator.vars:
        mutator.vars[op] = relax.Var(f"weight{len(mutator.vars)}", _tensor_type(value))
    return mutator.vars[op]


PERMUTE = tvm.ir.Op.get("relax.permute_dims")


@relax.expr_functor.mutator
class _StandIns(relax.PyExprMutator):
    """Large constants, and permutes of them (what FoldConstant would fold into a second copy), become params."""

    def __init__(self, min_bytes: int):
        super().__init__()
        self.min_bytes = min_bytes
        self.vars: dict = {}

    def visit_generic_const_(self, op):  # pylint: disable=arguments-renamed
        return _param_for(self, op)

    def visit_call_(self, call):  # pylint: disable=arguments-renamed
        arg = call.args[0] if call.args else None
        if call.op.same_as(PERMUTE) and isinstance(arg, tvm.ir.GenericConst) and nbytes(arg.value) >= self.min_bytes:
            if call not in self.vars:
                self.vars[call] = relax.Var(f"weight{len(self.vars)}", call.ty)
            return self.vars[call]
        return super().visit_call_(call)


def without_weights(mod: tvm.IRModule, min_bytes: int = MIN_BYTES) -> tvm.IRModule:
    """`mod` for counting kernels only (the fusion report's stock-TVM lowering of a big model): every large
    constant of main, and every permute of one, a parameter instead, so lowering it folds no weight into a second
    copy; its kernels and launches are those of the module with the folded constants."""
    main = mod["main"]
    stand_ins = _StandIns(min_bytes)
    body = stand_ins.visit_expr(main.body)
    out = mod.clone()
    out["main"] = relax.Function(list(main.params) + list(stand_ins.vars.values()), body, main.ret_ty, main.is_pure,
                                 main.attrs, main.span)
    return out


def unbind_weights(mod: tvm.IRModule, min_bytes: int = MIN_BYTES) -> tuple[tvm.IRModule, list[tvm.runtime.Tensor]]:
    """`mod` with every constant of at least `min_bytes` in `main` and its bucket copies (`main_*` functions with
    inputs) a trailing parameter of each of them (all take the same weights, in order of first use; a tensor used
    twice is one parameter), and the values those parameters take (the constants' own tensors: no copy).
    num_input stays: the weights follow the inputs."""
    names = ["main"] + sorted(gv.name_hint for gv, f in mod.functions.items()
                              if isinstance(f, relax.Function) and gv.name_hint.startswith("main_")
                              and f.attrs is not None and "num_input" in f.attrs)
    order: dict = {}  # the tensor's _key -> the tensor (in order of first use)

    def collect(expr):
        value = getattr(expr, "value", None) if isinstance(expr, tvm.ir.GenericConst) else None
        if isinstance(value, tvm.runtime.Tensor) and nbytes(value) >= min_bytes:
            order.setdefault(_key(value), value)

    for name in names:
        relax.analysis.post_order_visit(mod[name], collect)
    if not order:
        return mod, []
    # fresh GlobalVars for the functions whose signature grows (a GlobalVar keeps the type it was added with)
    bb = relax.BlockBuilder(tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv.name_hint not in names},
                                         attrs=mod.attrs, global_infos=mod.global_infos))
    for name in names:
        fn = mod[name]
        params = [relax.Var(f"weight{i}", _tensor_type(t)) for i, t in enumerate(order.values())]
        body = _Unbind(dict(zip(order, params))).visit_expr(fn.body)
        bb.add_func(relax.Function(list(fn.params) + params, body, fn.ret_ty, fn.is_pure, fn.attrs, fn.span), name)
    return bb.get(), list(order.values())


def _tensor_type(value: tvm.runtime.Tensor) -> relax.TensorType:
    return relax.TensorType(list(value.shape), str(value.dtype))


def _key(value: tvm.runtime.Tensor) -> tuple:
    return value.data_ptr(), tuple(value.shape), str(value.dtype)


def write_weights(export_folder: str, tensors: list) -> dict:
    """Store `tensors` (main's weight parameters, in order) as a raw tensor cache under `export_folder`/weights;
    returns the manifest's "weights" entry (every file's sha256)."""
    from tvm.contrib import tvmjs  # pylint: disable=import-outside-toplevel

    folder = os.path.join(export_folder, FOLDER)
    names = [f"{PREFIX}_{i}" for i in range(len(tensors))]
    # raw: the default encoding, "f32-to-bf16", silently stores float32 weights as bfloat16
    with contextlib.redirect_stdout(io.StringIO()):  # it prints progress lines
        tvmjs.dump_tensor_cache(((n, t) for n, t in zip(names, tensors)), folder, encode_format="raw",
                                show_progress=False)
    files = sorted(os.listdir(folder))
    return {"storage": STORAGE, "folder": FOLDER, "cache": CACHE_JSON, "encoding": "raw", "params": names,
            "count": len(tensors), "nbytes": sum(nbytes(t) for t in tensors),
            "files": {f: sha256_of(os.path.join(folder, f)) for f in files}}


def check_weights(export_folder: str, entry: dict) -> str:
    """The weights folder of an export after checking every file against the manifest's sha256."""
    folder = os.path.join(export_folder, entry.get("folder", FOLDER))
    for name, digest in entry["files"].items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise TvmfuseError(f"{path}: missing (a weight file of this export)")
        if sha256_of(path) != digest:
            raise TvmfuseError(f"{path}: sha256 does not match manifest.json; the weights were changed or damaged")
    return folder


def load_weights(export_folder: str, entry: dict, device) -> list:
    """The export's weights on `device`, in main's parameter order, through the TVM runtime's tensor cache
    (`vm.builtin.tensor_cache.load`, what a C++ or plain-TVM loader calls too); files checked first."""
    folder = check_weights(export_folder, entry)
    load = tvm.get_global_func("vm.builtin.tensor_cache.load")
    by_name = tvm.get_global_func("vm.builtin.param_array_from_cache_by_name")
    clear = tvm.get_global_func("vm.builtin.tensor_cache.clear")
    try:
        load(folder, device.dlpack_device_type(), device.index)
        return list(by_name(list(entry["params"])))
    finally:
        clear()  # the cache is process-wide; the tensors live on in the returned list


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def build_stats(started: float, weight_bytes: int) -> dict:
    """The manifest's "build" entry: wall time since `started`, this process's peak RSS, the weights' bytes."""
    import time  # pylint: disable=import-outside-toplevel

    return {"wall_s": round(time.time() - started, 2), "peak_rss_bytes": peak_rss_bytes(),
            "weights_bytes": int(weight_bytes)}


def available_memory() -> int | None:
    """Bytes of memory available to start new work (MemAvailable), None where unknown."""
    forced = os.environ.get("TVMFUSE_AVAILABLE_MEMORY")  # for tests and for a cgroup limit /proc does not show
    if forced:
        return int(forced)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reference_memory(weight_bytes: int) -> int:
    """What onnxruntime's fp32 reference needs beside the build: its own copy of the weights (fp32, as in the
    ONNX file) plus a margin for activations and the runtime."""
    return int(weight_bytes * 1.1) + (256 << 20)


def describe(entry: dict | None) -> str:
    if not entry or entry.get("storage") != STORAGE:
        return "embedded in the library"
    return f"{entry['count']} tensors, {entry['nbytes'] / 2**20:.1f} MiB in {entry['folder']}/ ({STORAGE})"


