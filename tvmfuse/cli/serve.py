"""`python -m tvmfuse serve` and `queue`: start a tracker with RPC servers, show what a tracker holds."""

from __future__ import annotations

import argparse
import sys
import time

from tvmfuse.errors import TvmfuseError
from tvmfuse.tune.remote import Cluster, parse_address, tracker_summary


def serve_main(argv: list[str]) -> int:
    """`python -m tvmfuse serve`: a tracker and N servers under one key, until Ctrl-C."""
    p = argparse.ArgumentParser(prog="python -m tvmfuse serve")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9190, help="tracker port (default 9190)")
    p.add_argument("--key", required=True, help="device key the servers register under, e.g. h200")
    p.add_argument("--servers", type=int, default=1, help="RPC servers to start (default 1)")
    p.add_argument("--gpus", action="store_true", help="pin server i to GPU i (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--fork", action="store_true",
                   help="fork a session instead of spawning one (faster; CPU only: CUDA cannot start in a fork)")
    args = p.parse_args(argv)
    try:
        cluster = Cluster(args.host, args.port, args.key).start(args.servers, gpus=args.gpus, fork=args.fork)
    except TvmfuseError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    print(f"tracker {cluster.address}, {args.servers} server(s) under key {args.key!r}; "
          f"tune with --rpc {cluster.address} --rpc-key {args.key}; Ctrl-C stops them", flush=True)
    try:
        while all(s.poll() is None for s in cluster.servers):
            time.sleep(1)
        print("error: an RPC server exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


def queue_main(argv: list[str]) -> int:
    """`python -m tvmfuse queue HOST:PORT`: servers registered per key, free and pending."""
    p = argparse.ArgumentParser(prog="python -m tvmfuse queue")
    p.add_argument("address", help="the tracker, HOST:PORT")
    args = p.parse_args(argv)
    try:
        summary = tracker_summary(*parse_address(args.address))
    except TvmfuseError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    queue = summary.get("queue_info", {})
    print(f"tracker {args.address}: {len(summary.get('server_info', []))} server(s)")
    print(f"{'key':20s} {'free':>5s} {'pending':>8s}")
    for key in sorted(queue):
        print(f"{key:20s} {queue[key].get('free', 0):5d} {queue[key].get('pending', 0):8d}")
    return 0
