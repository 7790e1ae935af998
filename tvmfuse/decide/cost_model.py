"""Analytic cost model: bytes, FLOPs, launches, arithmetic intensity and a roofline latency per op/candidate."""

from __future__ import annotations

from dataclasses import dataclass, replace

import tvm
from tvm import relax, tirx

KIB = 1024


@dataclass(frozen=True)
class Device:
    """What the roofline and the resource budgets need to know about a device."""

    name: str
    bandwidth: float              # bytes/s from global memory (DRAM/HBM)
    peak_flops: dict[str, float]  # FLOP/s per dtype
    launch_us: float              # per kernel launch (VM call + launch)
    regs_per_thread: int          # register budget of one thread (GPU); CPUs: no limit modelled
    regs_per_sm: int
    smem_per_block: int           # bytes of shared memory one block may use (CPU: L2 per core)
    smem_per_sm: int


#: One small table. H100/H200: SXM data-sheet numbers (dense, no sparsity); fp32 is the non-tensor-core
#: rate. CPU: the 2-core dev host (AVX2, 2 FMA/cycle, ~2.5 GHz), one DDR channel's worth of bandwidth.
DEVICES: dict[str, Device] = {
    "h100": Device("NVIDIA H100 SXM (80 GB HBM3)", 3.35e12,
                   {"float32": 67e12, "float16": 989e12, "bfloat16": 989e12}, 4.0, 255, 65536, 227 * KIB, 228 * KIB),
    "h200": Device("NVIDIA H200 SXM (141 GB HBM3e)", 4.8e12,
                   {"float32": 67e12, "float16": 989e12, "bfloat16": 989e12}, 4.0, 255, 65536, 227 * KIB, 228 * KIB),
    "cpu": Device("host CPU (llvm, 2 cores AVX2)", 20e9,
                  {"float32": 160e9, "float16": 40e9, "bfloat16": 40e9}, 1.0, 1 << 30, 1 << 30, 512 * KIB, 512 * KIB),
}


def device_for_target(target: tvm.target.Target | None, name: str | None = None) -> Device:
    if name:
        return DEVICES[name]
    return DEVICES["h200" if target is not None and target.kind.name == "cuda" else "cpu"]


@dataclass
class Cost:
    bytes_read: int = 0
    bytes_written: int = 0
    flops: int = 0
    launches: int = 0

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.bytes_read + other.bytes_read, self.bytes_written + other.bytes_written,
                    self.flops + other.flops, self.launches + other.launches)

    def latency_us(self, device: Device, dtype: str = "float32") -> float:
        """Roofline: the slower of memory and compute, plus launch overhead."""
        peak = device.peak_flops.get(dtype, device.peak_flops["float32"])
        return max(self.bytes / device.bandwidth, self.flops / peak) * 1e6 + self.launches * device.launch_us


# ---- sizes ---------------------------------------------------------------------------------------

class Dims:
    """Evaluates symbolic shapes with assumed values for the symbolic dims (default `default`)."""

    def __init__(self, values: dict[str, int] | None = None, default: int = 128):
        self.values, self.default = dict(values or {}), default
        self.used: dict[str, int] = {}

    def value(self, expr) -> int:
        if isinstance(expr, int):
            return expr
        if isinstance(expr, tirx.IntImm):
            return int(expr)
        if isinstance(expr, str):  # a shape as a report string, e.g. "batch * seq"
            return int(eval(expr, {"__builtins__": {}}, _Names(self)))  # pylint: disable=eval-used
        analyzer = tvm.sym.Analyzer()
        for var in tirx.analysis.undefined_vars(expr):
            v = self.values.get(var.name, self.default)
            self.used[var.name] = v
            analyzer.bind(var, tirx.IntImm(str(var.ty), v))
        return int(analyzer.simplify(expr))

    def numel(self, ty) -> int:
        n = 1
        for d in ty.shape:
            n *= self.value(d)
        return n

    def nbytes(self, ty) -> int:
        if isinstance(ty, relax.TupleType):
            return sum(self.nbytes(f) for f in ty.fields)
        shape = getattr(ty, "shape", None)
        if shape is None or getattr(ty, "dtype", None) is None:
            return 0
        return self.numel(ty) * _itemsize(str(ty.dtype))


class _Names(dict):
    def __init__(self, dims: Dims):
        super().__init__()
        self.dims = dims

    def __missing__(self, name: str) -> int:
        value = self.dims.values.get(name, self.dims.default)
        self.dims.used[name] = value
        return value


def _itemsize(dtype: str) -> int:
    return 1 if dtype == "bool" else max(1, int("".join(c for c in dtype if c.isdigit()) or 32) // 8)


# ---- per op ----------------------------------------------------------------------------------------

VIEWS = {"reshape"}                       # free after RewriteDataflowReshape: no kernel, no traffic
MOVES = {"permute_dims", "expand_dims", "broadcast_to", "strided_slice", "concat", "split", "take",
         "squeeze", "astype", "where", "isnan", "negative"}
FLOPS_PER_ELEM = {"nn.gelu": 8, "nn.gelu_tanh": 10, "nn.silu": 4, "sigmoid": 4, "nn.softmax": 5,
                  "nn.layer_norm": 8, "nn.rms_norm": 5}
REDUCTIONS = {"mean", "sum", "max", "min", "variance"}


def op_name(call: relax.Call) -> str:
    return call.op.name[len("relax."):] if call.op.name.startswith("relax.") else call.op.name


def tensor_args(call: relax.Call) -> list:
    out = []
    for a in call.args:
        fields = a.fields if isinstance(a, relax.Tuple) else [a]
        out += [f for f in fields if isinstance(getattr(f, "ty", None), relax.TensorType)]
    return out


def op_cost(call: relax.Call, out_ty, dims: Dims) -> Cost:
    """One op as its own kernel: reads every input, writes its output once."""
    name = op_name(call)
    if name in VIEWS:
        return Cost()
    read = sum(dims.nbytes(a.ty) for a in tensor_args(call))
    written = dims.nbytes(out_ty)
    return Cost(read, written, op_flops(call, out_ty, dims), 1)


def op_flops(call: relax.Call, out_ty, dims: Dims) -> int:
    name = op_name(call)
    if name in VIEWS or name in MOVES or not isinstance(out_ty, relax.TensorType):
        return 0
    if name == "matmul":
        k = dims.value(call.args[0].ty.shape[-1])
        return 2 * dims.numel(out_ty) * k
    if name in REDUCTIONS:
        return dims.numel(call.args[0].ty)
    return dims.numel(out_ty) * FLOPS_PER_ELEM.get(name, 1)


def resources(ops: list[str], shapes: dict, dims: Dims, itemsize: int) -> tuple[int, int]:
    """(shared memory bytes per block, registers per thread) a one-kernel version would need.

    Matmul: 64x64 output tile per 128 threads, K step 32, A tile shared by all fused matmuls.
    Row reduction (norm, softmax): 4 rows of the reduced axis per block.
    Attention (non-flash, softmax needs whole score rows): 16 query rows x Sk scores + 64-key K/V tiles.
    """
    n_mm = ops.count("matmul")
    smem, regs = 0, 32
    if "attention" in shapes:
        a = shapes["attention"]
        sk, d = dims.value(a["seq_k"]), dims.value(a["head_dim"])
        smem = 16 * sk * itemsize + 2 * 64 * d * itemsize
        regs += 16 * d // 128 + 16
    elif n_mm:
        smem = (64 * 32 + n_mm * 32 * 64) * itemsize
        regs += n_mm * 64 * 64 // 128
    if "row" in shapes and "attention" not in shapes:
        smem += 4 * dims.value(shapes["row"]) * itemsize
    return smem, regs


def with_budget(device: Device, smem_per_block: int | None = None) -> Device:
    return device if smem_per_block is None else replace(device, smem_per_block=smem_per_block)
