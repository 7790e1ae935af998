"""`python -m tvmfuse plan MODEL.onnx`: the fusion report — every candidate, its prediction and decision."""

from __future__ import annotations

import argparse
import json
import sys

from .decide import Plan, Settings

REPORT_JSON, REPORT_TEXT = "fusion_report.json", "fusion_report.txt"


def fusion_report(plan: Plan, fused, stock, measured_us: dict[str, float] | None = None) -> dict:
    """The report as plain data. `fused`/`stock`: `fuse.Fused` with and without the table;
    `measured_us`: kernel -> measured latency (after tuning), shown next to the prediction."""
    from .fuse import launches  # pylint: disable=import-outside-toplevel

    kernel_of = fused.candidate_kernels
    rows = []
    for c in plan.candidates:
        tag = f"{c.match.pattern}@{c.match.root}"
        row = {"pattern": c.match.pattern, "root": c.match.root, "ops": c.ops(), "decision": c.decision,
               "reason": c.reason or "predicted benefit beats the threshold; no overlap lost",
               "info": c.match.info, "kernel": kernel_of.get(tag)}
        if c.unfused is not None:
            row.update({
                "bytes_unfused": c.unfused.bytes, "bytes_fused": c.fused.bytes,
                "bytes_saved": c.unfused.bytes - c.fused.bytes, "launches_saved": c.unfused.launches - 1,
                "flops": c.fused.flops, "intensity_fused": round(c.fused.intensity, 3),
                "predicted_unfused_us": round(c.unfused_us, 3), "predicted_fused_us": round(c.fused_us, 3),
                "predicted_saved_us": round(c.benefit_us, 3), "smem_bytes": c.smem, "regs_per_thread": c.regs})
        if measured_us and row["kernel"] in measured_us:
            row["measured_fused_us"] = measured_us[row["kernel"]]
        rows.append(row)
    kept = plan.kept()
    before, after = launches(stock.mod), launches(fused.mod)
    by_pattern: dict[str, int] = {}
    for c in kept:
        by_pattern[c.match.pattern] = by_pattern.get(c.match.pattern, 0) + 1
    return {
        "device": plan.device.name, "threshold_us": plan.settings.threshold_us, "assumed_dims": plan.assumed_dims,
        "candidates": rows,
        "kernels_before": {"launches": before, "distinct": len(stock.kernels()), "names": stock.kernels()},
        "kernels_after": {"launches": after, "distinct": len(fused.kernels()), "names": fused.kernels()},
        "totals": {"candidates": len(rows), "kept": len(kept), "kept_by_pattern": by_pattern,
                   "launches_before": before, "launches_after": after, "launches_saved": before - after,
                   "predicted_saved_us": round(sum(c.benefit_us for c in kept), 3),
                   "bytes_saved": sum(c.unfused.bytes - c.fused.bytes for c in kept)},
    }


def format_text(report: dict) -> str:
    t = report["totals"]
    lines = [f"fusion report — cost model: {report['device']}; threshold {report['threshold_us']} us; "
             f"symbolic dims assumed {report['assumed_dims'] or 'none'}",
             f"{'decision':8}  {'pattern':30} {'root':7} {'ops':>3} {'bytes saved':>12} {'launch':>6} "
             f"{'pred us':>9} {'meas us':>8}  reason"]
    for r in report["candidates"]:
        meas = f"{r['measured_fused_us']:.1f}" if "measured_fused_us" in r else "-"
        lines.append(f"{r['decision']:8}  {r['pattern']:30} {r['root']:7} {len(r['ops']):>3} "
                     f"{r.get('bytes_saved', 0):>12} {r.get('launches_saved', 0):>6} "
                     f"{r.get('predicted_saved_us', 0):>9.3f} {meas:>8}  {r['reason']}")
    lines.append(f"kept {t['kept']} of {t['candidates']} candidates: " +
                 ", ".join(f"{k} x{v}" for k, v in sorted(t["kept_by_pattern"].items())))
    lines.append(f"kernel launches per run: stock TVM fusion {t['launches_before']} -> tvmfuse {t['launches_after']} "
                 f"({t['launches_saved']} fewer; distinct PrimFuncs {report['kernels_before']['distinct']} -> "
                 f"{report['kernels_after']['distinct']}); predicted time saved {t['predicted_saved_us']:.3f} us, "
                 f"{t['bytes_saved']} bytes of global-memory traffic saved")
    lines.append("why: each kept group runs as ONE kernel, so its intermediates never go through global memory "
                 "and its ops share one launch; stock FuseOps stops at reductions, matmuls and reshapes.")
    return "\n".join(lines) + "\n"


def report_files(report: dict) -> dict[str, str]:
    """What `export(..., extra_files=...)` writes beside the library."""
    return {REPORT_JSON: json.dumps(report, indent=2) + "\n", REPORT_TEXT: format_text(report)}


def plan_model(path: str, target_name: str, settings: Settings, shapes: dict | None = None) -> dict:
    from .decide import decide  # pylint: disable=import-outside-toplevel
    from .fuse import lower  # pylint: disable=import-outside-toplevel
    from .importer import import_model, load_onnx  # pylint: disable=import-outside-toplevel
    from .pipeline import prepare_module  # pylint: disable=import-outside-toplevel
    from .targets import resolve_target  # pylint: disable=import-outside-toplevel

    target = resolve_target(target_name)
    imported = import_model(load_onnx(path), shapes, path)
    bound = prepare_module(imported)  # as a job sees it (fp32: plan has no --dtype)
    plan = decide(bound, target, settings)
    return fusion_report(plan, lower(bound, plan=plan), lower(bound, patterns=[]))


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
    args = p.parse_args(argv)
    from .errors import TvmfuseError  # pylint: disable=import-outside-toplevel
    from .jobs import parse_shape  # pylint: disable=import-outside-toplevel

    try:
        dims = {"batch": 1, **{k: int(v) for k, v in (d.split("=", 1) for d in args.dim)}}
        settings = Settings(threshold_us=args.threshold_us, device=args.device, dims=dims)
        report = plan_model(args.model, args.target, settings, dict(parse_shape(s) for s in args.shape))
    except TvmfuseError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_text(report), end="" if not args.json else "\n")
    return 0
