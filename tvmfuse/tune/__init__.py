"""Tune stage: MetaSchedule with the XGBoost cost model over every static-shape kernel (each kernel's default
measured first, so tuning never ends slower), the templates' knobs, local or RPC measurement, progress.

The names below load on first use (PEP 562): MetaSchedule's builder workers unpickle `tvmfuse.tune.builder.fast_build`
by reference, so every worker imports this package; importing the stage eagerly here pulled in tvmfuse.spaces and
with it every TVM tensor intrinsic (~10-15 s of CPU per worker, and LocalBuilder starts fresh workers for each round
of candidates), which fast_build exists to avoid.
"""

from __future__ import annotations

import importlib

#: exported name -> the submodule that defines it
_EXPORTS = {
    "kernels_keeping_default": "baseline", "measure_baselines": "baseline",
    "TaskProgress": "progress", "kernel_records": "progress",
    "TuningInterrupted": "search", "tunable_tasks": "search", "tune": "search",
    "tune_sites": "templates", "tune_templates": "templates",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:  # AttributeError lets `from tvmfuse.tune import search` import the submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
