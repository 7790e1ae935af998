"""`python -m tvmfuse schedules {list,add,prune,verify}`: parse arguments, call the schedule library."""

from __future__ import annotations

import argparse
import os
import sys

from tvmfuse.records.database import TuningDatabase
from tvmfuse.errors import TvmfuseError
from tvmfuse.records.library import DEFAULT_DIR, target_files
from tvmfuse.records.upkeep import add_from_database, prune, reindex, verify


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tvmfuse schedules", description="The schedule library: the best tuning record per kernel, target and TVM version.")
    p.add_argument("--lib", default=DEFAULT_DIR, help="the library folder (default: the repo's schedules/)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="one line per record (and refresh index.json)")
    add = sub.add_parser("add", help="add the best records of a tuning database (tuning_logs/<model>-<target>)")
    add.add_argument("work_dir")
    add.add_argument("--target", required=True, help="the target the records were tuned for (as in tune.py)")
    pr = sub.add_parser("prune", help="drop records of other TVM versions and slower duplicates")
    pr.add_argument("--keep-other-versions", action="store_true")
    sub.add_parser("verify", help="check that each record still applies and builds")
    args = p.parse_args(argv)
    try:
        return _main(args)
    except TvmfuseError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


def _main(args: argparse.Namespace) -> int:
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    if args.cmd == "list":
        entries = reindex(args.lib) if target_files(args.lib) else []
        for e in entries:
            us = "-" if e["latency_us"] is None else f"{e['latency_us']:.1f}"
            print(f"{e['target']:<12} {e['tvm']:<13} {us:>9} us  {e['date']}  {e['workload']:<20}  {e['kernel']}")
        print(f"{len(entries)} records in {args.lib}")
        return 0
    if args.cmd == "add":
        if not os.path.isdir(args.work_dir):
            raise TvmfuseError(f"{args.work_dir}: no such tuning database folder")
        db = TuningDatabase(args.work_dir, resolve_target(args.target))
        counts = add_from_database(db, args.lib)
        print(f"{db.summary()}\n" + ", ".join(f"{n} {k}" for k, n in counts.items()))
        return 0
    if args.cmd == "prune":
        print(", ".join(f"{n} {k}" for k, n in prune(args.lib, args.keep_other_versions).items()) + " removed")
        return 0
    results = verify(args.lib)
    for rec, verdict, why in results:
        print(f"{verdict:<4} {rec.get('kernel', '?')}  {rec.get('workload_hash')}: {why}")
    fails = sum(v == "FAIL" for _, v, _ in results)
    print(f"{sum(v == 'ok' for _, v, _ in results)} ok, {fails} failed, "
          f"{sum(v == 'skip' for _, v, _ in results)} not checkable, of {len(results)} records")
    return 1 if fails else 0
