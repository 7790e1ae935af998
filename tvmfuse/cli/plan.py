"""`python -m tvmfuse plan MODEL.onnx`: the fusion report, every candidate with its prediction and decision."""

from __future__ import annotations

import argparse
import json
import sys

from tvmfuse.errors import TvmfuseError
from tvmfuse.jobs import parse_shape


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tvmfuse plan", description="Show the fusion decisions for a model.")
    p.add_argument("model", metavar="MODEL.onnx")
    p.add_argument("--target", default="llvm", help="llvm or cuda (the cost model's device follows it)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--threshold-us", type=float, default=0.0, help="keep a fusion only if it saves more (us)")
    p.add_argument("--device", choices=["h100", "h200", "cpu"], help="device description for the cost model")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=N",
                   help="value assumed for a symbolic dim in the cost model (default batch=1, others 128)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS", help="fix input dims, as tune.py")
    p.add_argument("--dtype", default="fp32", help="compute dtype, as tune.py (fp16 and bf16 fuse around their casts)")
    args = p.parse_args(argv)
    from tvmfuse.decide import Settings, format_text  # pylint: disable=import-outside-toplevel  (TVM: after --help)
    from tvmfuse.pipeline import plan_model  # pylint: disable=import-outside-toplevel

    try:
        dims = {"batch": 1, **{k: int(v) for k, v in (d.split("=", 1) for d in args.dim)}}
        settings = Settings(threshold_us=args.threshold_us, device=args.device, dims=dims)
        report = plan_model(args.model, args.target, settings, dict(parse_shape(s) for s in args.shape), args.dtype)
    except TvmfuseError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_text(report), end="" if not args.json else "\n")
    return 0

