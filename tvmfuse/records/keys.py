"""Which tuning records apply, and how good they are: the target key, the workload hash, a knob set's key, a
record's mean latency."""

from __future__ import annotations

import json

import tvm
import tvm_ffi

from tvmfuse.targets import target_json

FAILED = 1e9  # MetaSchedule stores 1e10 s for candidates that failed to build or run


def target_key(target) -> str:
    """Canonical JSON of a target without its host: two records apply to each other iff keys are equal."""
    if isinstance(target, (dict, str)):
        target = tvm.target.Target(json.loads(target) if isinstance(target, str) else target)
    return json.dumps({k: v for k, v in json.loads(target_json(target)).items() if k != "host"}, sort_keys=True)


def workload_hash(mod: tvm.IRModule) -> str:
    """The key MetaSchedule gives a workload (structural hash of its IRModule), as a string."""
    return str(tvm_ffi.structural_hash(mod))


def mean_secs(record) -> float:
    secs = [float(s) for s in (record.run_secs or [])]
    return sum(secs) / len(secs) if secs and min(secs) < FAILED else float("inf")


def knob_key(knobs: dict) -> str:
    """A template knob set as the records store it (canonical JSON)."""
    return json.dumps(knobs, sort_keys=True)
