"""Tuning database: an append-only, locked, fsynced JSON-lines store keyed by target and TVM version."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from typing import Callable, Iterable

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from tvmfuse.records.files import append_lines, read_lines
from tvmfuse.records.keys import mean_secs, target_key

FILE = "tvmfuse_records.jsonl"  # one JSON object per line: {"workload": ...}, {"record": ...} or {"rejected": ...}
MS_WORKLOADS, MS_RECORDS = "database_workload.json", "database_tuning_record.json"  # MetaSchedule's own


def trace_key(record) -> str:
    """What tells a record's schedule apart from others of its workload: a digest of its trace."""
    return hashlib.sha256(json.dumps(record.as_json()[0], sort_keys=True).encode()).hexdigest()[:16]


def _stderr(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


@derived_object
class TuningDatabase(ms.database.PyDatabase):
    """MetaSchedule database over `<work_dir>/tvmfuse_records.jsonl`, holding only records whose target
    and TVM version match; others stay on disk untouched and are counted in `skipped`.

    Records live in a MemoryDatabase (TVM does the workload matching and top-k); every commit is also
    appended to the file at once, so a killed run loses nothing it measured; a record can also live
    in memory only (`add_record`: a warm start from the schedules library), not counted as spent.
    """

    def __init__(self, work_dir: str | None, target: tvm.target.Target,
                 warn: Callable[[str], None] = _stderr, ms_tvm_version: str | None = None):
        self.work_dir, self.target, self.warn = work_dir, target, warn
        self.path = os.path.join(work_dir, FILE) if work_dir else None
        self.key, self.tvm_version = target_key(target), tvm.__version__
        self.mem = ms.database.MemoryDatabase()
        self.spent = Counter()  # workload hash -> trials recorded on disk (this target + version)
        self.skipped = Counter()  # why lines were not used: corrupt, other target, other TVM version, ...
        self.loaded = 0
        self.names: dict[str, str] = {}  # workload hash -> kernel name, when known
        self._written: set[str] = set()  # workload hashes already on disk
        self.rejected: set[tuple[str, str]] = set()  # (workload hash, trace_key) of records found wrong (`reject`)
        if self.path:
            self._load_lines(self.path)
            self._load_ms_json(work_dir, ms_tvm_version)

    # -- loading ------------------------------------------------------------------------------
    def _warn(self, why: str, msg: str) -> None:
        self.skipped[why] += 1
        self.warn(msg)

    def _load_lines(self, path: str) -> None:
        workloads, records = {}, []
        for number, obj in read_lines(path, lambda m: self._warn("corrupt", m)):
            if isinstance(obj, dict) and isinstance(obj.get("workload"), list) and "hash" in obj:
                workloads.setdefault(str(obj["hash"]), (number, obj["workload"]))
                if obj.get("name"):
                    self.names.setdefault(str(obj["hash"]), str(obj["name"]))
            elif isinstance(obj, dict) and isinstance(obj.get("record"), list) and "hash" in obj:
                records.append((number, obj))
            elif isinstance(obj, dict) and isinstance(obj.get("rejected"), str) and "hash" in obj:
                self.rejected.add((str(obj["hash"]), obj["rejected"]))
            else:
                self._warn("corrupt", f"{path}:{number}: skipped a line that is not a tvmfuse record")
        self._written.update(workloads)
        self._commit_all(path, workloads, records)

    def _load_ms_json(self, work_dir: str, tvm_version: str | None) -> None:
        """MetaSchedule's JSONDatabase files, if any: they carry no TVM version, so `tvm_version` says it."""
        wl_path, rec_path = os.path.join(work_dir, MS_WORKLOADS), os.path.join(work_dir, MS_RECORDS)
        if not os.path.exists(rec_path):
            return
        warn = lambda m: self._warn("corrupt", m)  # noqa: E731
        table = [(n, obj) for n, obj in read_lines(wl_path, warn)]
        workloads = {str(obj[0]): (n, obj) for n, obj in table if isinstance(obj, list) and len(obj) == 2}
        index = [str(obj[0]) if isinstance(obj, list) and obj else None for _, obj in table]
        records = []
        for number, obj in read_lines(rec_path, warn):
            ok = isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], int) and 0 <= obj[0] < len(index)
            if not ok or not isinstance(obj[1], list) or len(obj[1]) < 3:
                self._warn("corrupt", f"{rec_path}:{number}: skipped a line that is not a MetaSchedule record")
                continue
            records.append((number, {"hash": index[obj[0]], "record": obj[1], "tvm": tvm_version,
                                     "target": obj[1][2]}))
        self._commit_all(rec_path, workloads, records)

    def _commit_all(self, path: str, workloads: dict, records: list) -> None:
        decoded = {}
        for number, obj in records:
            version, wl = obj.get("tvm"), str(obj["hash"])
            if version != self.tvm_version:
                self.skipped["other TVM version" if version else "no TVM version"] += 1
                continue
            try:
                same_target = target_key(obj.get("target")) == self.key
            except Exception:  # pylint: disable=broad-except  (an unknown target kind or attribute)
                same_target = False
            if not same_target:
                self.skipped["other target"] += 1
                continue
            if wl not in workloads:
                self._warn("no workload", f"{path}:{number}: skipped a record whose workload is missing")
                continue
            try:
                if wl not in decoded:
                    decoded[wl] = self.mem.commit_workload(ms.database.Workload.from_json(workloads[wl][1]).mod)
                record = ms.database.TuningRecord.from_json(obj["record"], decoded[wl])
            except Exception as err:  # pylint: disable=broad-except  (TVM raises several kinds)
                self._warn("corrupt", f"{path}:{number}: skipped an undecodable record "
                                      f"({type(err).__name__}: {str(err).strip().splitlines()[-1][:80]})")
                continue
            self.spent[wl] += 1  # a trial spent, whatever came of it
            if (wl, trace_key(record)) in self.rejected:
                self.skipped["rejected (wrong output)"] += 1
                continue
            self.mem.commit_tuning_record(record)
            self.loaded += 1

    def summary(self) -> str:
        """`40 records for this target and TVM version; skipped 1 corrupt, 3 other target`."""
        text = f"{self.loaded} stored records for this target and TVM version"
        if self.skipped:
            text += "; skipped " + ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items()))
        return text

    # -- the MetaSchedule database interface ---------------------------------------------------
    def has_workload(self, mod: tvm.IRModule) -> bool:
        return self.mem.has_workload(mod)

    def commit_workload(self, mod: tvm.IRModule):
        return self.mem.commit_workload(mod)  # written to disk with its first record, never alone

    def commit_tuning_record(self, record) -> None:
        workload = self.mem.commit_workload(record.workload.mod)
        wl = str(workload.as_json()[0])
        if not record.workload.same_as(workload):  # MemoryDatabase matches workloads by identity
            record = ms.database.TuningRecord(record.trace, workload, record.run_secs, record.target,
                                              record.args_info)
        self.mem.commit_tuning_record(record)
        self.spent[wl] += 1
        if not self.path:
            return
        lines = [{"hash": wl, "tvm": self.tvm_version, "target": json.loads(self.key), "time": round(time.time(), 3),
                  "pid": os.getpid(), "record": record.as_json()}]
        if wl not in self._written:  # the workload goes in the same locked write as its first record
            lines.insert(0, {"hash": wl, "workload": workload.as_json(), "tvm": self.tvm_version,
                             **({"name": self.names[wl]} if wl in self.names else {})})
        os.makedirs(self.work_dir, exist_ok=True)
        append_lines(self.path, lines)
        self._written.add(wl)

    def get_top_k(self, workload, top_k: int):
        return self.mem.get_top_k(workload, top_k)

    def get_all_tuning_records(self):
        return self.mem.get_all_tuning_records()

    def query_tuning_record(self, mod, target, workload_name=None):
        return self.mem.query_tuning_record(mod, target, workload_name or "main")

    def query_schedule(self, mod, target, workload_name=None):
        return self.mem.query_schedule(mod, target, workload_name or "main")

    def query_ir_module(self, mod, target, workload_name=None):
        return self.mem.query_ir_module(mod, target, workload_name or "main")

    def __len__(self) -> int:
        return len(self.mem)

    # -- tvmfuse extras ------------------------------------------------------------------------
    def add_record(self, record) -> bool:
        """Add a record in memory only (a warm-start seed): not written, not counted as a trial spent."""
        workload = self.mem.commit_workload(record.workload.mod)
        self.mem.commit_tuning_record(ms.database.TuningRecord(record.trace, workload, record.run_secs,
                                                               record.target, record.args_info))
        return True

    def reject(self, record, reason: str) -> None:
        """Mark `record` wrong (its schedule's output check failed): the line goes to the file at once, and from the
        next load on the record is left out (counted in `skipped`), so no build checks it again and `schedules add`
        never keeps it."""
        wl, key = str(record.workload.as_json()[0]), trace_key(record)
        if (wl, key) in self.rejected:
            return
        self.rejected.add((wl, key))
        if self.path:
            os.makedirs(self.work_dir, exist_ok=True)
            append_lines(self.path, [{"hash": wl, "rejected": key, "reason": reason, "tvm": self.tvm_version,
                                      "time": round(time.time(), 3)}])

    def _wrong(self, record) -> bool:
        return bool(self.rejected) and (str(record.workload.as_json()[0]), trace_key(record)) in self.rejected

    def records_of(self, mod: tvm.IRModule) -> list:
        """All records (stored and seeded) of one workload, best first."""
        if not self.mem.has_workload(mod):
            return []
        workload = self.mem.commit_workload(mod)
        mine = [r for r in self.mem.get_all_tuning_records() if r.workload.same_as(workload) and not self._wrong(r)]
        return sorted(mine, key=mean_secs)

    def best(self) -> Iterable[tuple[str, object, object]]:
        """(hash, workload, best valid record) per workload in memory."""
        by_wl = {}
        for record in self.mem.get_all_tuning_records():
            if mean_secs(record) == float("inf") or self._wrong(record):
                continue
            wl = str(record.workload.as_json()[0])
            if wl not in by_wl or mean_secs(record) < mean_secs(by_wl[wl]):
                by_wl[wl] = record
        return [(wl, r.workload, r) for wl, r in by_wl.items()]

    def export_ms_json(self, dest_dir: str) -> int:
        """Write the matching records as a MetaSchedule JSONDatabase in `dest_dir`; returns how many."""
        os.makedirs(dest_dir, exist_ok=True)
        out = ms.database.JSONDatabase(work_dir=dest_dir)
        for record in self.mem.get_all_tuning_records():
            out.commit_tuning_record(ms.database.TuningRecord(
                record.trace, out.commit_workload(record.workload.mod), record.run_secs, record.target,
                record.args_info))
        return len(out)
