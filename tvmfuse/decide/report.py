"""The fusion report: every candidate, its prediction and decision, and the kernel launches before and after."""

from __future__ import annotations

import json

from tvmfuse.decide.decision import Plan

REPORT_JSON, REPORT_TEXT = "fusion_report.json", "fusion_report.txt"


def fusion_report(plan: Plan, fused, measured_us: dict[str, float] | None = None, stock=None) -> dict:
    """The report as plain data. `fused`: the fuse stage's result (`kernels()`, `launches()`, `candidate_kernels`);
    `measured_us`: kernel -> measured latency (after tuning), shown next to the prediction; `stock`: the same
    module lowered without the table, for the launches stock TVM fusion makes (`plan` lowers it; a job does not)."""
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
    after = fused.launches()
    by_pattern: dict[str, int] = {}
    for c in kept:
        by_pattern[c.match.pattern] = by_pattern.get(c.match.pattern, 0) + 1
    report = {
        "device": plan.device.name, "threshold_us": plan.settings.threshold_us, "assumed_dims": plan.assumed_dims,
        "candidates": rows,
        "kernels_after": {"launches": after, "distinct": len(fused.kernels()), "names": fused.kernels()},
        "totals": {"candidates": len(rows), "kept": len(kept), "kept_by_pattern": by_pattern, "launches_after": after,
                   "predicted_saved_us": round(sum(c.benefit_us for c in kept), 3),
                   "bytes_saved": sum(c.unfused.bytes - c.fused.bytes for c in kept)},
    }
    if stock is not None:
        before = stock.launches()
        report["kernels_before"] = {"launches": before, "distinct": len(stock.kernels()), "names": stock.kernels()}
        report["totals"].update(launches_before=before, launches_saved=before - after)
    return report


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
    after = report["kernels_after"]
    if "launches_before" in t:
        launches = (f"kernel launches per run: stock TVM fusion {t['launches_before']} -> tvmfuse {t['launches_after']} "
                    f"({t['launches_saved']} fewer; distinct PrimFuncs {report['kernels_before']['distinct']} -> "
                    f"{after['distinct']})")
    else:
        launches = (f"kernel launches per run: {t['launches_after']} ({after['distinct']} distinct PrimFuncs; "
                    "`python -m tvmfuse plan` compares with stock TVM fusion)")
    lines.append(f"{launches}; predicted time saved {t['predicted_saved_us']:.3f} us, "
                 f"{t['bytes_saved']} bytes of global-memory traffic saved")
    lines.append("why: each kept group runs as ONE kernel, so its intermediates never go through global memory "
                 "and its ops share one launch; stock FuseOps stops at reductions, matmuls and reshapes.")
    return "\n".join(lines) + "\n"


def report_files(report: dict) -> dict[str, str]:
    """What `export(..., extra_files=...)` writes beside the library."""
    return {REPORT_JSON: json.dumps(report, indent=2) + "\n", REPORT_TEXT: format_text(report)}


