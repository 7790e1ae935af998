"""Keeping `schedules/`: add a database's best records, drop other versions and slower duplicates, reindex, verify."""

from __future__ import annotations

import json
import os
import tempfile
import time

import tvm

from tvmfuse.records.database import TuningDatabase
from tvmfuse.records.keys import mean_secs
from tvmfuse.records.library import DEFAULT_DIR, INDEX, as_record, load_file, ms_workload, pack_workload, record_target_key, target_files

FORMAT = "tvmfuse-schedules/1"


def _write_json(path: str, obj, indent=None) -> None:
    """Write next to `path`, then rename over it: a reader never sees half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=os.path.dirname(path) or ".")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, separators=None if indent else (",", ":"))
        f.write("\n")
    os.replace(tmp, path)


def reindex(lib: str) -> list[dict]:
    """Rewrite `index.json`: workload hash, target, TVM version, kernel, latency and date of every record."""
    entries = []
    for path in target_files(lib):
        try:
            data = load_file(path)
        except (OSError, ValueError):
            continue
        for rec in data["records"]:
            entries.append({"workload": str(rec.get("workload_hash")), "target": os.path.basename(path)[:-5],
                            "tvm": rec.get("tvm", data.get("tvm")), "kernel": rec.get("kernel", "?"),
                            "latency_us": rec.get("latency_us"), "date": rec.get("date", data.get("date")),
                            "file": os.path.basename(path)})
    entries.sort(key=lambda e: (e["target"], e["kernel"], e["workload"]))
    _write_json(os.path.join(lib, INDEX), {"format": FORMAT, "entries": entries}, indent=1)
    return entries


def load_index(lib: str) -> list[dict]:
    path = os.path.join(lib, INDEX)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return json.load(f)["entries"]


def add_from_database(db: TuningDatabase, lib: str = DEFAULT_DIR, today: str | None = None) -> dict[str, int]:
    """Put each workload's best valid record of `db` into `<lib>/<target>.json` unless a faster one is there."""
    from tvmfuse.targets import target_name  # pylint: disable=import-outside-toplevel

    path = os.path.join(lib, f"{target_name(db.target)}.json")
    today = today or time.strftime("%Y-%m-%d", time.gmtime())
    data = load_file(path) if os.path.exists(path) else {"target": db.key, "tvm": db.tvm_version, "date": today,
                                                         "records": []}
    counts = {"added": 0, "improved": 0, "kept": 0}
    for wl, workload, record in _fastest_knob_sets(db.best()):
        us = round(mean_secs(record) * 1e6, 3)
        same = [r for r in data["records"] if str(r.get("workload_hash")) == wl
                and r.get("tvm", data.get("tvm")) == db.tvm_version and record_target_key(r) in (None, db.key)]
        if same and min(r.get("latency_us", float("inf")) for r in same) <= us:
            counts["kept"] += 1
            continue
        trace, run_secs, _, args_info = record.as_json()
        data["records"] = [r for r in data["records"] if not any(r is o for o in same)] + [{
            "kernel": db.names.get(wl, "?"), "workload_hash": wl, "latency_us": us, "date": today,
            "tvm": db.tvm_version, "target_json": json.loads(db.key), "trace": trace, "run_secs": run_secs,
            "args_info": args_info, "workload_graph": pack_workload(workload.as_json())}]
        counts["improved" if same else "added"] += 1
    _write_json(path, data)
    reindex(lib)
    return counts


def _fastest_knob_sets(best: list[tuple]) -> list[tuple]:
    """`TuningDatabase.best()` with, of the records of one hand-written kernel (its variants' workloads share a
    `tvmfuse.template` key: an attention kernel's knob sets, a GEMM's Hopper tiles), the fastest alone: the one
    `records.knobs.best_knobs` would choose (18 tiles of one GEMM are 18 workloads)."""
    def template(workload) -> str | None:
        attrs = next(iter(workload.mod.functions.values())).attrs
        return str(attrs["tvmfuse.template"]) if attrs is not None and "tvmfuse.template" in attrs else None

    fastest: dict[str, float] = {}
    for _, workload, record in best:
        key = template(workload)
        if key is not None:
            fastest[key] = min(fastest.get(key, float("inf")), mean_secs(record))
    return [(wl, workload, record) for wl, workload, record in best
            if template(workload) is None or mean_secs(record) == fastest[template(workload)]]


def prune(lib: str = DEFAULT_DIR, keep_other_versions: bool = False) -> dict[str, int]:
    """Drop records of other TVM versions and all but the fastest record per workload, target and version."""
    counts = {"other TVM version": 0, "slower duplicate": 0}
    for path in target_files(lib):
        data = load_file(path)
        best = {}
        for rec in data["records"]:
            version = rec.get("tvm", data.get("tvm"))
            if version != tvm.__version__ and not keep_other_versions:
                counts["other TVM version"] += 1
                continue
            k = (str(rec.get("workload_hash")), json.dumps(rec.get("target_json"), sort_keys=True), version)
            if k in best:
                counts["slower duplicate"] += 1
                if rec.get("latency_us", float("inf")) >= best[k].get("latency_us", float("inf")):
                    continue
            best[k] = rec
        data["records"] = list(best.values())
        _write_json(path, data)
    reindex(lib)
    return counts


def verify(lib: str = DEFAULT_DIR) -> list[tuple[dict, str, str]]:
    """Replay each record on its stored workload and build it for its target: (record, ok|FAIL|skip, why)."""
    out = []
    for path in target_files(lib):
        data = load_file(path)
        for rec in data["records"]:
            version = rec.get("tvm", data.get("tvm"))
            if version != tvm.__version__:
                out.append((rec, "FAIL", f"tuned with TVM {version}, this is {tvm.__version__}: never applied"))
                continue
            if not rec.get("workload_graph") or not rec.get("target_json"):
                out.append((rec, "skip", "simple form (no stored workload or target): applied by hash only"))
                continue
            try:
                workload = ms_workload(rec)
                if str(workload.as_json()[0]) != str(rec["workload_hash"]):
                    raise ValueError("the stored workload's hash differs from workload_hash")
                target = tvm.target.Target(rec["target_json"])
                record = as_record(rec, workload.mod, target)
                with target:
                    tvm.tirx.build(record.as_measure_candidate().sch.mod, target=target)
                out.append((rec, "ok", "applies and builds"))
            except Exception as err:  # pylint: disable=broad-except  (any failure is this record's verdict)
                out.append((rec, "FAIL", f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:120]}"))
    return out
