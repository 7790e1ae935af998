"""`schedules/`: a small library of the best tuning record per kernel, target and TVM version (see its README)."""

from __future__ import annotations

import base64
import json
import os
import tempfile
import time
import zlib

import tvm
import tvm_ffi

from .database import TuningDatabase
from .record_keys import mean_secs, target_key

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "schedules")
INDEX, FORMAT = "index.json", "tvmfuse-schedules/1"


def pack_workload(workload_json: list) -> dict:
    """MetaSchedule's `[hash, base64 graph]` -> `{"hash", "zlib"}` (the graph is ~15x smaller deflated)."""
    raw = base64.b64decode(workload_json[1])
    return {"hash": str(workload_json[0]), "zlib": base64.b64encode(zlib.compress(raw, 9)).decode()}


def unpack_workload(packed: dict) -> list:
    return [packed["hash"], base64.b64encode(zlib.decompress(base64.b64decode(packed["zlib"]))).decode()]


def load_file(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError("no 'records' list")
    return data


def target_files(lib: str) -> list[str]:
    return sorted(os.path.join(lib, n) for n in os.listdir(lib) if n.endswith(".json") and n != INDEX) \
        if os.path.isdir(lib) else []


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
    from .targets import target_name  # pylint: disable=import-outside-toplevel

    path = os.path.join(lib, f"{target_name(db.target)}.json")
    today = today or time.strftime("%Y-%m-%d", time.gmtime())
    data = load_file(path) if os.path.exists(path) else {"target": db.key, "tvm": db.tvm_version, "date": today,
                                                         "records": []}
    counts = {"added": 0, "improved": 0, "kept": 0}
    for wl, workload, record in db.best():
        us = round(mean_secs(record) * 1e6, 3)
        same = [r for r in data["records"] if str(r.get("workload_hash")) == wl
                and r.get("tvm", data.get("tvm")) == db.tvm_version and _key_or_none(r) in (None, db.key)]
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


def _key_or_none(rec: dict) -> str | None:
    return target_key(rec["target_json"]) if rec.get("target_json") else None


def lookup(lib: str, target: tvm.target.Target) -> tuple[list[dict], dict[str, int]]:
    """The library's records for this target and TVM version, and how many others it skipped."""
    from .targets import target_name  # pylint: disable=import-outside-toplevel

    key, found = target_key(target), []
    skipped = {"other target": 0, "other TVM version": 0, "unreadable": 0}
    for path in target_files(lib):
        try:
            data = load_file(path)
        except (OSError, ValueError):
            skipped["unreadable"] += 1
            continue
        for rec in data["records"]:
            try:
                # full form: the record's own target JSON; simple form: the file's name (kind and arch)
                mine = _key_or_none(rec) == key if rec.get("target_json") else \
                    os.path.basename(path)[:-5] == target_name(target)
            except Exception:  # pylint: disable=broad-except  (a target this TVM cannot parse)
                mine = False
            if not mine:
                skipped["other target"] += 1
            elif rec.get("tvm", data.get("tvm")) != tvm.__version__:
                skipped["other TVM version"] += 1
            else:
                found.append(rec)
    return found, skipped


def as_record(rec: dict, mod: tvm.IRModule, target: tvm.target.Target):
    """A library record as a MetaSchedule TuningRecord of the task module `mod`."""
    from tvm.s_tir import meta_schedule as ms  # pylint: disable=import-outside-toplevel

    workload = ms.database.Workload(mod)
    args = rec.get("args_info") or [a.as_json() for a in ms.arg_info.ArgInfo.from_prim_func(mod["main"])]
    secs = rec.get("run_secs") or [rec["latency_us"] * 1e-6]
    insts, decisions = rec["trace"]
    trace = [insts, [[int(i), d] for i, d in decisions]]  # indices may have become strings in hand-kept files
    return ms.database.TuningRecord.from_json([trace, secs, json.loads(target_key(target)), args], workload)


def seed(db: TuningDatabase, lib: str, target: tvm.target.Target, mod: tvm.IRModule | None = None):
    """Warm start: the library's matching records go into `db` in memory (never counted as trials spent).

    A record is matched to a kernel by workload hash: to `mod`'s kernels, or to its own stored workload.
    """
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod  # pylint: disable=import-outside-toplevel

    found, skipped = lookup(lib, target)
    kernels = {}
    for func in (mod.functions.values() if mod is not None else []):
        if isinstance(func, tvm.tirx.PrimFunc):
            task = _normalize_mod(func)
            kernels[str(tvm_ffi.structural_hash(task))] = task
    added = 0
    for rec in found:
        try:
            wl = str(rec["workload_hash"])
            task = kernels.get(wl)
            if task is None and rec.get("workload_graph"):
                task = ms_workload(rec).mod
            if task is None:
                continue  # a kernel this model does not have
            added += db.add_record(as_record(rec, task, target))
        except Exception:  # pylint: disable=broad-except  (a damaged record is skipped, never fatal)
            skipped["unreadable"] += 1
    return added, skipped


def ms_workload(rec: dict):
    from tvm.s_tir import meta_schedule as ms  # pylint: disable=import-outside-toplevel

    return ms.database.Workload.from_json(unpack_workload(rec["workload_graph"]))


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


def open_database(work_dir: str, target: tvm.target.Target, lib: str | None, say=print,
                  mod: tvm.IRModule | None = None) -> TuningDatabase:
    """The job's tuning database (stored records for this target and TVM version) plus the library's seeds."""
    db = TuningDatabase(work_dir, target)
    if db.loaded or db.skipped:
        say(f"records in {work_dir}: {db.summary()}")
    if lib:
        n, skipped = seed(db, lib, target, mod)
        if n or any(skipped.values()):
            say(f"schedules library {lib}: {n} records for this target and TVM version"
                + "".join(f", {k} skipped: {v}" for k, v in skipped.items() if v))
    return db
