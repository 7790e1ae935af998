"""`scripts/tune.py` (`python -m tvmfuse tune`): parse arguments, run each job through the pipeline, print a summary."""

from __future__ import annotations

import argparse
import sys

from tvmfuse.quiet import quiet_native_logs
from tvmfuse.errors import TvmfuseError
from tvmfuse.jobs import WEIGHT_PLACEMENTS, Job, job_from_path, load_jobs, parse_buckets, parse_shape, parse_tolerance
from tvmfuse.prepare.dtypes import check_io_dtype, parse_dtype

USAGE_EXAMPLES = """examples:
  python scripts/tune.py --target llvm                       # the embedded default job
  python scripts/tune.py --target cuda model.onnx --shape input_ids=1,128 --trials 64
  python scripts/tune.py --target cuda --jobs jobs.toml --out exports
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tune.py", epilog=USAGE_EXAMPLES, formatter_class=argparse.RawTextHelpFormatter,
                                description="Import ONNX models, fuse, tune, verify against onnxruntime and "
                                            "export one TVM library per model.")
    p.add_argument("models", nargs="*", metavar="MODEL.onnx", help="ONNX files (none: the embedded default job)")
    p.add_argument("--target", required=True,
                   help="llvm, cuda (the nvidia/nvidia-h100 tag, sm_90a), a tag, or a target JSON dict")
    p.add_argument("--jobs", metavar="JOBS.toml", help="a TOML jobs file: [[model]] path, name, shapes, trials")
    p.add_argument("--trials", type=int, metavar="N",
                   help="MetaSchedule trials per kernel (default: 16 on llvm, 64 on cuda; 0: no tuning)")
    p.add_argument("--dtype", default="fp32", metavar="{fp32,fp16,bf16}",
                   help="compute dtype: fp16/bf16 convert the fp32 model to mixed precision (fp32 accumulation, "
                        "fp32 inputs and outputs); a jobs file's dtype overrides it (default: fp32)")
    p.add_argument("--io-dtype", default="fp32", metavar="{fp32,fp16,bf16}",
                   help="dtype of the module's float inputs and outputs: fp32, or the --dtype itself (no cast "
                        "kernels around the model); a jobs file's io_dtype overrides it (default: fp32)")
    p.add_argument("--tolerance", metavar="ATOL,RTOL",
                   help="verification tolerance for every float output: an element passes when |tvm - onnxruntime| "
                        "<= ATOL + RTOL * |onnxruntime|; a jobs file's tolerance overrides it (default: by dtype, "
                        "fp32 1e-4,1e-4, fp16 1e-2,1e-2, bf16 8e-2,8e-2)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="cuda: capture each static run of kernel launches as a CUDA graph (TVM's RewriteCUDAGraph); "
                        "cuts launch overhead at decode sizes; symbolic-shape regions stay launches")
    p.add_argument("--weights", choices=WEIGHT_PLACEMENTS, default="auto", metavar="{auto,external,library}",
                   help="where the export keeps the weights: auto (default) puts them in weights/ beside model.so for "
                        "models stored as ONNX external data or of 1 GiB or more and in model.so otherwise; external "
                        "always beside it, library always in it (under 2 GiB); a jobs file's weights wins")
    p.add_argument("--no-dependent-launch", dest="dependent_launch", action="store_false",
                   help="cuda, sm_90 and newer: launch each kernel only once the one before has finished (default: "
                        "programmatic dependent launch, each kernel launched and set up while the one before ends)")
    p.add_argument("--batch", type=int, metavar="N",
                   help="candidates built and measured per tuning round (default: 16 on llvm, 64 on cuda)")
    p.add_argument("--kv-cache", choices=("inplace", "onnx"),
                   help="a decoder step with past K/V inputs: 'inplace' (default where found) preallocates the "
                        "caches and writes each step's K/V into them in place; 'onnx' keeps the exported "
                        "past -> present interface (every step copies the cache)")
    p.add_argument("--max-seq", type=int, metavar="N",
                   help="capacity of the in-place KV cache in positions (default: the largest bucket of the past or "
                        "total length dim, else 256)")
    p.add_argument("--out", default="out", metavar="DIR", help="where exports go (default: out)")
    p.add_argument("--logs", default="tuning_logs", metavar="DIR", help="tuning databases (default: tuning_logs)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS",
                   help="fix an input's dims (x=1,128,768) or a symbolic dim (seq=128); repeatable")
    p.add_argument("--buckets", action="append", default=[], metavar="DIM=V1,V2,...",
                   help="keep DIM symbolic, and also build a tuned static copy for each value (seq=1,128,512); "
                        "other sizes run the default-schedule path; repeatable (the cross product)")
    p.add_argument("--schedules", metavar="DIR",
                   help="library of best schedules used as a warm start (default: the repo's schedules/; 'none': off)")
    p.add_argument("--rpc", metavar="HOST:PORT", help="measure on RPC servers of this tracker (builds stay local)")
    p.add_argument("--rpc-key", metavar="KEY", help="the device key the servers registered under (with --rpc)")
    p.add_argument("--verbose", action="store_true", help="also show TVM's own C++ log lines (hidden by default)")
    return p


def collect_jobs(args: argparse.Namespace) -> list[Job]:
    if args.trials is not None and args.trials < 0:
        raise TvmfuseError("--trials must be >= 0")
    shapes = dict(parse_shape(s) for s in args.shape)
    dtype = parse_dtype(args.dtype)
    io_dtype = check_io_dtype(args.io_dtype, dtype)
    tolerance = parse_tolerance(args.tolerance) if args.tolerance is not None else None
    jobs = [job_from_path(m, shapes, args.trials, dtype) for m in args.models]
    for job in jobs:
        job.io_dtype, job.tolerance, job.weights = io_dtype, tolerance, args.weights
    if args.jobs:
        jobs += load_jobs(args.jobs, args.trials, dtype, io_dtype, tolerance, args.weights)
    if not jobs:
        jobs = [Job(name="tiny-block", path=None, shapes=shapes, trials=args.trials, dtype=dtype, io_dtype=io_dtype,
                    tolerance=tolerance, weights=args.weights)]
    buckets = parse_buckets(args.buckets)
    for job in jobs:  # a jobs file's own buckets win
        job.buckets = job.buckets or dict(buckets)
    if args.max_seq is not None and args.max_seq <= 0:
        raise TvmfuseError("--max-seq must be a positive number of positions")
    for job in jobs:
        job.cuda_graph = args.cuda_graph
        job.dependent_launch = args.dependent_launch
        job.kv_cache, job.max_seq = args.kv_cache or job.kv_cache, args.max_seq or job.max_seq
    if args.batch is not None:
        if args.batch < 1:
            raise TvmfuseError("--batch must be >= 1")
        for job in jobs:
            job.batch = args.batch
    names = [j.name for j in jobs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TvmfuseError(f"two jobs would export to the same name: {', '.join(dupes)} (name them in a jobs file)")
    return jobs


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from tvmfuse.pipeline import run_job  # pylint: disable=import-outside-toplevel  (TVM import is slow)
    from tvmfuse.records import SCHEDULES_DIR  # pylint: disable=import-outside-toplevel
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    try:
        target = resolve_target(args.target)
        jobs = collect_jobs(args)
        rpc = _rpc(args)
    except TvmfuseError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    results = []
    library = {"none": None, None: SCHEDULES_DIR}.get(args.schedules, args.schedules)
    with quiet_native_logs(not args.verbose):
        for job in jobs:
            try:
                result = run_job(job, target, args.out, args.logs, say=lambda s: print(s, flush=True), rpc=rpc,
                                 schedules=library)
            except KeyboardInterrupt as err:  # tuning already wrote every measured record; exports are atomic
                print(f"\n{err or 'interrupted'}", file=sys.stderr, flush=True)
                return 130
            if not result.ok:
                print(f"error: {result.error}", file=sys.stderr, flush=True)
            results.append(result)
    print_summary(results)
    failed = [r for r in results if not r.ok]
    return max((r.details.get("exit_code", 1) for r in failed), default=0)


def _rpc(args: argparse.Namespace) -> tuple[str, str] | None:
    from tvmfuse.tune.remote import parse_address  # pylint: disable=import-outside-toplevel

    if args.rpc is None:
        if args.rpc_key:
            raise TvmfuseError("--rpc-key needs --rpc HOST:PORT")
        return None
    parse_address(args.rpc)
    if not args.rpc_key:
        raise TvmfuseError("--rpc needs --rpc-key KEY (the key the servers registered under)")
    return args.rpc, args.rpc_key


def print_summary(results) -> None:
    from tvmfuse.export.weights import describe as describe_weights  # pylint: disable=import-outside-toplevel

    rows = [("model", "kernels", "fused", "tuned", "before us", "after us", "verify", "output")]
    for r in results:
        if r.ok:
            rows.append((r.name, str(r.kernels), str(r.fused), str(r.tuned), _us(r.latency_before_us),
                         _us(r.latency_after_us), r.verification, r.output or "-"))
        else:
            rows.append((r.name, "-", "-", "-", "-", "-", "FAILED", r.error or ""))
    widths = [max(len(row[i]) for row in rows[:]) if i < 7 else 0 for i in range(8)]
    print()
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for r in results:  # the fusion report's totals (full report: fusion_report.txt beside each export)
        f = r.details.get("fusion") if r.ok else None
        if f:
            print(f"fusion {r.name}: kept {f['kept']} of {f['candidates']} candidates "
                  f"({', '.join(k.split('.')[-1] + f' x{v}' for k, v in sorted(f['kept_by_pattern'].items()))}); "
                  f"{f['launches_after']} launches; predicted {f['predicted_saved_us']:.1f} us saved")
    for r in results:  # wall time and peak RSS (the process's, up to this job's export), where the weights are
        b = r.details.get("build") if r.ok else None
        if b:
            print(f"build {r.name}: {b['wall_s']:.1f} s wall, peak RSS {b['peak_rss_bytes'] / 2**20:.0f} MiB; "
                  f"weights {b['weights_bytes'] / 2**20:.1f} MiB, {describe_weights(r.details.get('weights'))}")
    ok = sum(r.ok for r in results)
    print(f"\n{ok} of {len(results)} jobs succeeded")


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"
