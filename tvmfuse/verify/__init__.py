"""Verify stage: the build against onnxruntime on the same seeded inputs (per-dtype tolerances), its latency, and
each hand-written kernel variant against the generic kernel it replaces, each replayed tuned schedule against the
kernel's default schedule."""

from tvmfuse.verify.inputs import random_inputs
from tvmfuse.verify.kernels import VariantCheck
from tvmfuse.verify.kv_step import compare_kv_step, step_dims
from tvmfuse.verify.measure import compare_at_dims, latency_us
from tvmfuse.verify.outputs import TOLERANCES, Verification, compare, onnxruntime_outputs, run_vm
from tvmfuse.verify.schedules import schedule_check

__all__ = ["TOLERANCES", "VariantCheck", "Verification", "compare", "compare_at_dims", "latency_us",
           "onnxruntime_outputs", "random_inputs", "run_vm", "schedule_check"]
