"""Template stage (CUDA): measure the templates' knobs into the tuning database, substitute the best, log each;
then, on sm_90a, the TIRx GEMM and row kernels where they fit (tvmfuse.hopper)."""

from __future__ import annotations

from typing import Callable

from .hopper import apply_hopper_kernels
from .kernels import substitute
from .kernels.tuning import tune_templates


def apply_templates(fused, target, database, trials: int, rpc, on_progress, log: Callable[[str], None]) -> None:
    """On CUDA, hand-written kernels (tvmfuse.kernels) where a template takes the shapes: their knobs measured into
    the same database first, the best measured applied; each kernel's outcome logged (`log`, one line each). Then
    the fused GEMMs and row reductions the TIRx kernels fit take them (sm_90a only; `hopper.apply_hopper_kernels`,
    its own log lines)."""
    if target.kind.name != "cuda":
        return
    templates: list = []
    tune_templates(fused.mod, fused.kernel_patterns, target, database, trials, rpc=rpc, on_progress=on_progress,
                   say=log)  # wrong knob sets, one line each
    fused.mod = substitute(fused.mod, fused.kernel_patterns, target="cuda", log=templates, database=database)
    for kernel, outcome in templates:
        log(f"{kernel}: {outcome}")
    fused.mod = apply_hopper_kernels(fused.mod, target, log)
