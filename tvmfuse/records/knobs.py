"""Template knob records: which knob sets of a hand-written kernel the database measured, and the best still valid
(`tmpl`: a template, anything with `key(shapes, target)` and `knob_space(shapes)`).
Their workloads carry the `tvmfuse.template` and `tvmfuse.knobs` attributes (tvmfuse.tune.templates writes them)."""

from __future__ import annotations

import json

import tvm

from tvmfuse.records.keys import knob_key, mean_secs


def target_kind(target) -> str:
    """'llvm' (the templates' CPU variants) or 'cuda'."""
    kind = target.kind.name if isinstance(target, tvm.target.Target) else str(target)
    return "llvm" if kind == "llvm" else "cuda"


def measured(database, tmpl, shapes: dict, target) -> dict[str, float]:
    """{knob key: best mean seconds (inf: failed)} over the records of this template and shapes in `database`
    (stored, or seeded from the schedules library): the workloads carry `tvmfuse.template` and `tvmfuse.knobs`."""
    key, out = tmpl.key(shapes, target_kind(target)), {}
    for record in database.get_all_tuning_records():
        attrs = next(iter(record.workload.mod.functions.values())).attrs
        if attrs is None or str(attrs.get("tvmfuse.template", "")) != key or "tvmfuse.knobs" not in attrs:
            continue
        knobs = str(attrs["tvmfuse.knobs"])
        out[knobs] = min(out.get(knobs, float("inf")), mean_secs(record))
    return out


def best_knobs(database, tmpl, shapes: dict, target) -> tuple[dict | None, float | None]:
    """The fastest measured knob set still valid for these shapes, and its latency in µs; (None, None) if none."""
    timed = [(secs, k) for k, secs in _measured_valid(database, tmpl, shapes, target).items() if secs < float("inf")]
    if not timed:
        return None, None
    secs, knobs = min(timed)
    return json.loads(knobs), secs * 1e6


def failed_knobs(database, tmpl, shapes: dict, target) -> int:
    """How many measured knob sets still valid for these shapes failed (wrong output, build or run error)."""
    return sum(secs == float("inf") for secs in _measured_valid(database, tmpl, shapes, target).values())


def _measured_valid(database, tmpl, shapes: dict, target) -> dict[str, float]:
    valid = {knob_key(k) for k in tmpl.knob_space(shapes)}
    return {k: secs for k, secs in measured(database, tmpl, shapes, target).items() if k in valid}
