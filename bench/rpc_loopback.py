"""Trials per minute when measuring through 1 and 2 RPC servers on loopback (llvm), as JSON."""

import argparse
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tvmfuse.fuse import lower  # noqa: E402
from tvmfuse.default_model import make_tiny_block  # noqa: E402
from tvmfuse.importer import import_model  # noqa: E402
from tvmfuse.remote import Cluster, _free_port  # noqa: E402
from tvmfuse.targets import resolve_target  # noqa: E402
from tvmfuse.tune import tune  # noqa: E402


def measure(servers: int, trials: int, target) -> dict:
    imp = import_model(make_tiny_block())
    fused = lower(imp.mod, imp.params)
    with Cluster("127.0.0.1", _free_port("127.0.0.1"), "bench") as cluster, tempfile.TemporaryDirectory() as wd:
        cluster.start(servers)
        start = time.time()
        progress = tune(fused.mod, target, wd, trials, rpc=(cluster.address, cluster.key), batch=8)
        secs = time.time() - start
    done = sum(p.trials for p in progress.values())
    failed = sum(p.failed for p in progress.values())
    return {"servers": servers, "trials": done, "failed": failed, "seconds": round(secs, 1),
            "trials_per_minute": round(done / secs * 60, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=16, help="trials per kernel (4 kernels)")
    p.add_argument("--out", default="bench/results/rpc_loopback.json")
    args = p.parse_args()
    target = resolve_target("llvm")
    runs = [measure(n, args.trials, target) for n in (1, 2)]
    result = {"command": "python " + " ".join(sys.argv), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "target": "llvm", "model": "embedded tiny-block (4 kernels)", "runs": runs,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
