"""The export manifest: what one job built (model, target, interface, precision, kernels, checks) as JSON data."""

from __future__ import annotations

import json
import os

import tvm

from tvmfuse.build.compile import TUNED
from tvmfuse.build.dependent_launch import applies_to as launched_dependent
from tvmfuse.prepare.precision import precision_info
from tvmfuse.targets import target_json
from tvmfuse.version import __version__


def make_manifest(job, target: tvm.target.Target, source: str, imported, bound: tvm.IRModule, fused,
                  kernels: list[str], kinds: dict[str, str], records: dict, verification: dict,
                  latency_us: dict, work_dir: str, bucketed=None) -> dict:
    """`manifest.json` of one job: `bound` is the module precision conversion produced, `fused` the fused one
    (`kernels` its kernels, or all functions' with buckets); `records`: kernel -> (trials, best us)."""
    manifest = {
        "tvmfuse_version": __version__, "tvm_version": tvm.__version__,
        "model": {"name": job.name, "source": os.path.abspath(job.path) if job.path else source},
        "target": json.loads(target_json(target)),
        "inputs": [_io_tensor(t.as_dict(), job.io_dtype, job.dtype) for t in imported.inputs],
        "outputs": [_io_tensor(t.as_dict(), job.io_dtype, job.dtype) for t in imported.outputs],
        "precision": precision_info(bound, job.dtype, job.io_dtype),
        "cuda_graph": bool(job.cuda_graph and target.kind.name == "cuda"),
        "dependent_launch": launched_dependent(target),
        "kernels": [{"name": k, "pattern": fused.pattern_of(k), "schedule": kinds.get(k, "default"),
                     "trials": records.get(k, (0, None))[0], "best_us": records.get(k, (0, None))[1],
                     **({"kernel": fused.kernel_choices[k]} if k in fused.kernel_choices else {})}
                    for k in kernels],
        "rejected_matches": [{"pattern": p, "at": at, "reason": why} for p, at, why in fused.rejections],
        "verification": verification,
        "latency_us": latency_us,
        "tuning_log": os.path.abspath(work_dir),
    }
    if bucketed:
        manifest["buckets"] = bucketed.manifest({k for k, kind in kinds.items() if kind == TUNED})
    return manifest


def _io_tensor(tensor: dict, io_dtype: str | None, compute_dtype: str = "float32") -> dict:
    """An input/output as the exported module takes it: a float32 one (or, built with --dtype bf16, a bfloat16 one
    of a model stored in bf16, which prepare.precision gives the float32 interface too) has the io dtype
    (--io-dtype), float32 by default."""
    if tensor["dtype"] == "float32" or (tensor["dtype"] == "bfloat16" and compute_dtype == "bfloat16"):
        return {**tensor, "dtype": io_dtype if io_dtype not in (None, "float32") else "float32"}
    return tensor
