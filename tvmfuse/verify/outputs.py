"""Verify stage: run the built module and onnxruntime on the same random inputs and compare."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import tvm
from tvm import relax

from tvmfuse.frontend import onnx_io
from tvmfuse.frontend.onnx_io import cast_array

#: (atol, rtol) per output dtype: an element passes when |tvm - ort| <= atol + rtol * |ort|. fp16 and bf16 follow
#: one rule, ten times the dtype's epsilon (2^-10, 2^-7), rounded: 1e-2 and 8e-2 (bf16's error is 8x fp16's on the
#: same kernels, bench/fp16_error.py --dtype bf16; its old 5e-2 was only 5x fp16's; docs/precision.md)
TOLERANCES = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (8e-2, 8e-2), "float64": (1e-7, 1e-7)}


@dataclass
class Verification:
    """The largest errors over all outputs and whether every element is within tolerance."""

    max_abs_err: float
    max_rel_err: float
    ok: bool
    tolerance: dict
    violations: int = 0  # elements outside tolerance
    rms_err: float = 0.0  # over every element of every output (inf where one is non-finite)

    def as_dict(self) -> dict:
        return {"status": "passed" if self.ok else "FAILED", "max_abs_err": self.max_abs_err,
                "max_rel_err": self.max_rel_err, "tolerance": self.tolerance, "reference": "onnxruntime"}

    def tolerance_text(self) -> str:
        """'atol=0.01 rtol=0.01 for float16 outputs' (each distinct tolerance applied; '(user-set)' when it was)."""
        groups: dict[str, list[str]] = {}
        for dtype, t in self.tolerance.items():
            user = " (user-set)" if t.get("set_by") == "user" else ""
            groups.setdefault(f"atol={t['atol']:g} rtol={t['rtol']:g}{user}", []).append(dtype)
        return "; ".join(f"{k} for {', '.join(v)} outputs" for k, v in groups.items()) or "none"


def module_inputs(arrays, io_dtype: str | None = None) -> list[np.ndarray]:
    """The inputs as the module takes them: float32 arrays in its interface dtype `io_dtype` (None: float32)."""
    if io_dtype in (None, "float32"):
        return list(arrays)
    return [cast_array(a, io_dtype) if a.dtype == np.float32 else a for a in arrays]


def run_vm(vm: relax.VirtualMachine, device, arrays: list[np.ndarray], io_dtype: str | None = None,
           weights=()) -> list[np.ndarray]:
    """Run `main`; float32 `arrays` are cast to the module's interface dtype `io_dtype` first; `weights`: main's
    weight parameters (weights outside the library), passed after the inputs."""
    return to_numpy(vm["main"](*[tvm.runtime.tensor(a, device) for a in module_inputs(arrays, io_dtype)], *weights))


def onnxruntime_outputs(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime's outputs on `feeds`; `model` a path: the session opens the file (external data from the model's
    folder, never one serialized proto), without pre-packed weight copies; else the proto, serialized."""
    session = onnx_io.ort_session(model, low_memory=isinstance(model, str))
    return onnx_io.ort_run(session, onnx_feeds([i.name for i in session.get_inputs()], feeds))


def onnx_feeds(names: list[str], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`feeds` keyed by the ONNX input `names`: TVM's importer renames inputs (`past_key_values.0.key` becomes
    `past_key_values_0_key`), and the module's inputs carry those names."""
    if set(feeds) <= set(names):
        return feeds
    renamed = {n.replace(".", "_"): n for n in names}
    renamed.update({f"input_{k}": n for k, n in list(renamed.items()) if not k[:1].isalpha() and k[:1] != "_"})
    return {renamed.get(k, k): v for k, v in feeds.items()}


def tolerance(output_dtype: str, compute_dtype: str | None = None) -> tuple[float, float]:
    """(atol, rtol) for an output: by its dtype, loosened to the compute dtype's for a mixed-precision build
    (fp32 outputs of a module computing in fp16 get fp16's 1e-2, bf16's 8e-2)."""
    atol, rtol = TOLERANCES.get(output_dtype, (0.0, 0.0))
    if compute_dtype and output_dtype in TOLERANCES and compute_dtype in TOLERANCES:
        c_atol, c_rtol = TOLERANCES[compute_dtype]
        atol, rtol = max(atol, c_atol), max(rtol, c_rtol)
    return atol, rtol


def is_float(dtype) -> bool:
    return str(dtype) in TOLERANCES or np.issubdtype(dtype, np.floating)


def compare(got: list[np.ndarray], want: list[np.ndarray], compute_dtype: str | None = None,
            user_tolerance: tuple[float, float] | None = None) -> Verification:
    """The errors of `got` against onnxruntime's `want`; `user_tolerance` (atol, rtol), when given, replaces the
    dtype defaults for every float output (integer outputs stay exact), and the reported tolerance says so."""
    if len(got) != len(want):
        raise ValueError(f"the module returned {len(got)} outputs, onnxruntime {len(want)}")
    max_abs = max_rel = squares = 0.0
    violations = count = 0
    tol = {}
    for g, w in zip(got, want):
        if g.shape != w.shape:
            raise ValueError(f"output shape {g.shape} differs from onnxruntime's {w.shape}")
        if user_tolerance is not None and is_float(w.dtype):
            atol, rtol = (float(v) for v in user_tolerance)
            tol[str(w.dtype)] = {"atol": atol, "rtol": rtol, "set_by": "user"}
        else:
            atol, rtol = tolerance(str(w.dtype), compute_dtype)
            tol[str(w.dtype)] = {"atol": atol, "rtol": rtol}
        g64, w64 = g.astype(np.float64), w.astype(np.float64)  # g may be fp16/bf16 (an fp16 interface)
        same = (g64 == w64) | (np.isnan(g64) & np.isnan(w64))  # NaN where onnxruntime has NaN, or the same inf, agrees
        with np.errstate(invalid="ignore"):  # inf - inf where both agree: replaced by 0 below
            err = np.where(same, 0.0, np.abs(g64 - w64))
        err = np.where(np.isnan(err), np.inf, err)
        if err.size:
            max_abs = max(max_abs, float(err.max()))
            max_rel = max(max_rel, float((err / np.maximum(np.abs(np.nan_to_num(w64)), 1e-12)).max()))
            violations += int(np.sum(err > atol + rtol * np.abs(np.nan_to_num(w64))))
            squares, count = squares + float(np.sum(err ** 2)), count + err.size
    return Verification(max_abs, max_rel, violations == 0, tol, violations, (squares / count) ** 0.5 if count else 0.0)


def to_numpy(value) -> list[np.ndarray]:
    if hasattr(value, "numpy"):
        return [value.numpy()]
    return [a for v in value for a in to_numpy(v)]
