"""Trials per minute when measuring through 1 and 2 RPC servers (loopback on llvm, or one server per GPU on cuda), as JSON."""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import tvm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tvmfuse.fuse.fusion import lower  # noqa: E402
from tvmfuse.prepare import bind_params  # noqa: E402
from tvmfuse.frontend.default_model import make_tiny_block  # noqa: E402
from tvmfuse.frontend.importer import import_model  # noqa: E402
from tvmfuse.prepare.precision import to_compute_dtype  # noqa: E402
from tvmfuse.tune.remote import Cluster, _free_port  # noqa: E402
from tvmfuse.spaces import space_for  # noqa: E402
from tvmfuse.targets import resolve_target  # noqa: E402
from tvmfuse.tune.search import tune  # noqa: E402


def workload(name: str, dtype: str):
    """The fused module to tune: the embedded tiny block, or LayerNorm+GELU rows x hidden ('ln_gelu:8192x4096')."""
    if name == "tiny-block":
        imp = import_model(make_tiny_block())
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from onnx_models import layer_norm_gelu  # pylint: disable=import-outside-toplevel

        rows, hidden = (int(v) for v in name.split(":", 1)[1].split("x"))
        imp = import_model(layer_norm_gelu(rows=rows, hidden=hidden))
    bound = to_compute_dtype(bind_params(imp.mod, imp.params), dtype)
    return lower(bound).mod


def measure(servers: int, trials: int, target, mod, gpus: bool, logs: str | None = None) -> dict:
    with Cluster("127.0.0.1", _free_port("127.0.0.1"), "bench") as cluster, tempfile.TemporaryDirectory() as tmp:
        wd = os.path.join(logs, f"servers{servers}") if logs else tmp
        cluster.start(servers, gpus=gpus, fork="cuda" not in str(target.kind.name))
        start = time.time()
        progress = tune(mod, target, wd, trials, rpc=(cluster.address, cluster.key), batch=8 * servers,
                        space_for=space_for)
        secs = time.time() - start
    done = sum(p.trials for p in progress.values())
    failed = sum(p.failed for p in progress.values())
    best = {p.name: p.best_us for p in progress.values()}
    return {"servers": servers, "trials": done, "failed": failed, "seconds": round(secs, 1),
            "trials_per_minute": round(done / secs * 60, 1), "best_us": best}


def _gpus() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=16, help="trials per kernel")
    p.add_argument("--target", default="llvm")
    p.add_argument("--model", default="tiny-block", help="tiny-block or ln_gelu:ROWSxHIDDEN")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--servers", default="1,2", help="server counts to compare")
    p.add_argument("--gpus", action="store_true", help="pin server i to GPU i")
    p.add_argument("--out", default="bench/results/rpc_loopback.json")
    p.add_argument("--logs", help="keep MetaSchedule's logs here (default: a temporary folder)")
    args = p.parse_args()
    target = resolve_target(args.target)
    mod = workload(args.model, args.dtype)
    runs = []
    for n in (int(s) for s in args.servers.split(",")):
        runs.append(measure(n, args.trials, target, mod, args.gpus, args.logs))
        print(json.dumps(runs[-1]), flush=True)
    result = {"command": "python " + " ".join(sys.argv), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "gpus": _gpus(), "target": args.target, "model": args.model, "dtype": args.dtype,
              "kernels": sorted(gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)), "runs": runs,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
