"""Resolve the user's `--target` into a TVM target and a short name for folders."""

from __future__ import annotations

import json
import os

import tvm

from tvmfuse.errors import TvmfuseError

#: What `--target cuda` means when the user gives no JSON: the H100 tag (sm_90a), which the H200 shares.
DEFAULT_CUDA_TAG = "nvidia/nvidia-h100"
#: The streaming multiprocessors the CUDA kernels' default tiles and splits are sized for (the H200's 132).
SMS = 132


def resolve_target(spec: str) -> tvm.target.Target:
    """`llvm`, `cuda`, a tag, or a target JSON dict -> Target (CUDA targets get an llvm host)."""
    spec = spec.strip()
    try:
        if spec.startswith("{"):
            target = tvm.target.Target(json.loads(spec))
        elif spec == "llvm":
            target = tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1})
        elif spec == "cuda":
            target = tvm.target.Target(DEFAULT_CUDA_TAG)
        else:
            target = tvm.target.Target(spec)
    except Exception as err:  # TVM raises several error types for a bad target
        raise TvmfuseError(f"invalid --target {spec!r}: {str(err).splitlines()[-1]}") from None
    if target.kind.name == "llvm" and "num-cores" not in target.attrs:
        # MetaSchedule needs to know how many cores it may use on CPU targets.
        target = tvm.target.Target({**_as_dict(target), "num-cores": os.cpu_count() or 1})
    if target.kind.name == "cuda" and target.host is None:
        target = tvm.target.Target(target, host=tvm.target.Target({"kind": "llvm"}))
    return target


def _as_dict(target: tvm.target.Target) -> dict:
    return {k: v for k, v in json.loads(target_json(target)).items() if k != "host"}


def target_json(target: tvm.target.Target) -> str:
    """The target as canonical JSON (what the manifest and the tuning records store)."""
    return json.dumps(_to_py(target.export()), sort_keys=True)


def _to_py(value):
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): _to_py(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (hasattr(value, "__len__") and not isinstance(value, str)):
        return [_to_py(v) for v in value]
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    return str(value)


def target_name(target: tvm.target.Target) -> str:
    """A short folder-safe name: `llvm`, `cuda-sm_90a`."""
    name = target.kind.name
    arch = target.attrs.get("arch")
    return f"{name}-{arch}" if arch else name


def device_for(target) -> tvm.runtime.Device:
    """Device 0 of a Target, or of a target kind name such as "llvm" or "cuda"."""
    kind = target if isinstance(target, str) else target.kind.name
    return tvm.cpu(0) if kind in ("llvm", "c") else tvm.device(kind, 0)


def has_device(target: tvm.target.Target) -> bool:
    """True when this machine can run code built for `target`."""
    return target.kind.name == "llvm" or bool(device_for(target).exist)


#: the oldest CUDA arch with native bf16 arithmetic and bf16 tensor cores (wmma/mma.sync ...bf16)
BF16_MIN_ARCH = 80


def cuda_arch_number(target: tvm.target.Target) -> int | None:
    """A CUDA target's arch as a number ("sm_90a" -> 90), None for other targets or an arch that is not sm_NN[a-z]."""
    arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else ""
    digits = arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz") if arch.startswith("sm_") else ""
    return int(digits) if digits.isdigit() else None


def check_compute_dtype(target: tvm.target.Target, dtype: str) -> None:
    """Refuse a bf16 build for a CUDA arch older than sm_80 (or none): TVM's BF16ComputeLegalize would quietly
    compute every bf16 op in fp32 (it asks the arch through tvm.support.nvcc.supports_bf16) and no bf16 tensor-core
    instruction exists there. The arch is kept as given (the nvidia/nvidia-h100 tag: sm_90a)."""
    if dtype != "bfloat16" or target.kind.name != "cuda":
        return
    number = cuda_arch_number(target)
    if number is None or number < BF16_MIN_ARCH:
        raise TvmfuseError(f"--dtype bf16 needs a CUDA arch of sm_{BF16_MIN_ARCH} or newer, the target's is "
                           f"{target.attrs.get('arch', 'not set')!s}: give --target cuda (sm_90a) or a target JSON "
                           'with "arch", e.g. {"kind": "cuda", "arch": "sm_90a"}')
