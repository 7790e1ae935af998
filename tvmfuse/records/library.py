"""`schedules/`, the best record per kernel, target and TVM version (see its README): look up, seed a database."""

from __future__ import annotations

import base64
import json
import os
import zlib

import tvm
import tvm_ffi

from tvmfuse.records.database import TuningDatabase
from tvmfuse.records.keys import target_key

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "schedules")
INDEX = "index.json"


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


def record_target_key(rec: dict) -> str | None:
    """The target key of a record stored in full form (with its target JSON); None for the simple form."""
    return target_key(rec["target_json"]) if rec.get("target_json") else None


def lookup(lib: str, target: tvm.target.Target) -> tuple[list[dict], dict[str, int]]:
    """The library's records for this target and TVM version, and how many others it skipped."""
    from tvmfuse.targets import target_name  # pylint: disable=import-outside-toplevel

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
                mine = record_target_key(rec) == key if rec.get("target_json") else \
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
