"""What an Nsight Compute report of `bench/ncu_kernels.py` says, per launch: time, clock, the throughputs, the
tensor-pipe and warp-stall metrics, and the SASS instructions where the sampled warps stalled most (with why), read
through Nsight Compute's own Python module (`extras/python/ncu_report`).

    python3 bench/ncu_summary.py REPORT.ncu-rep LABELS.json --out summary.json [--top 30]
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import re
import sys

#: scalar metrics kept (by name) for every launch; the rest of the report stays in the .ncu-rep
KEEP = re.compile(r"^(gpu__time_duration\.sum|sm__cycles_elapsed\.avg\.per_second|launch__grid_size|launch__block_size|"
                  r"launch__registers_per_thread|launch__shared_mem_per_block_dynamic|launch__cluster_dim_x|"
                  r"sm__throughput\.avg\.pct_of_peak_sustained_elapsed|"
                  r"gpu__compute_memory_throughput\.avg\.pct_of_peak_sustained_elapsed|"
                  r"lts__throughput\.avg\.pct_of_peak_sustained_elapsed|"
                  r"dram__throughput\.avg\.pct_of_peak_sustained_elapsed|"
                  r"dram__bytes_read\.sum|dram__bytes_write\.sum|lts__t_sector_hit_rate\.pct|"
                  r"sm__inst_executed_pipe_tensor_op_gmma\.avg\.pct_of_peak_sustained_active|"
                  r"TPC\.TriageCompute\.sm__pipe_tensor_cycles_active_realtime\.avg\.pct_of_peak_sustained_elapsed|"
                  r"smsp__issue_active\.avg\.pct_of_peak_sustained_active|smsp__inst_executed\.sum|"
                  r"l1tex__data_bank_conflicts_pipe_lsu_mem_shared\.sum)$")


def ncu_report_module():
    for path in sorted(glob.glob("/opt/nvidia/nsight-compute/*/extras/python"), reverse=True):
        sys.path.insert(0, path)
        try:
            import ncu_report
            return ncu_report
        except ImportError:
            sys.path.pop(0)
    raise SystemExit("error: Nsight Compute's Python module (ncu_report) was not found under /opt/nvidia")


def metric_value(metric):
    for get in ("value", "as_double", "as_uint64", "as_string"):
        try:
            return getattr(metric, get)()
        except Exception:  # noqa: BLE001  (the type decides which accessor answers)
            continue
    return None


def stalls_by_pc(action, top: int) -> list[dict]:
    """The `top` instructions by sampled warps, each with its SASS and its largest stall reasons."""
    def sass(pc):  # ncu_report 2025: sass_by_pc(address) -> the instruction's text
        try:
            return action.sass_by_pc(pc)
        except Exception:  # noqa: BLE001  (no SASS in the report)
            return ""
    per_pc: dict[int, dict] = {}
    for name in action.metric_names():
        if not name.startswith("smsp__pcsamp_warps_issue_stalled_") and name != "smsp__pcsamp_sample_count":
            continue
        metric = action.metric_by_name(name)
        if metric.num_instances() == 0 or not metric.has_correlation_ids():
            continue
        pcs = metric.correlation_ids()
        for i in range(metric.num_instances()):
            value = metric.as_double(i)
            if value:
                reason = name.removeprefix("smsp__pcsamp_warps_issue_stalled_")
                per_pc.setdefault(pcs.as_uint64(i), {})[reason] = value
    rows = []
    for pc, reasons in per_pc.items():
        total = reasons.pop("smsp__pcsamp_sample_count", None) or sum(v for r, v in reasons.items()
                                                                        if not r.endswith("_not_issued"))
        big = sorted(((r, v) for r, v in reasons.items() if not r.endswith("_not_issued")), key=lambda rv: -rv[1])
        rows.append({"pc": pc, "sass": sass(pc), "samples": total, "stalls": dict(big[:4])})
    rows.sort(key=lambda r: -r["samples"])
    return rows[:top]


def stalls_from_source_page(path: str, top: int) -> dict[str, dict]:
    """Per kernel name, from `ncu -i REPORT --page source --csv --print-source sass`: the sampled warps' stall reasons
    (share of all samples) and the `top` instructions by samples, each with its largest reasons."""
    blocks: dict[str, list[str]] = {}
    name = None
    for line in open(path, encoding="utf-8", errors="replace"):
        if line.startswith('"Kernel Name"'):
            name = next(csv.reader([line]))[1]
            blocks.setdefault(name, [])
        elif name is not None and line.strip():
            blocks[name].append(line)
    out = {}
    for name, lines in blocks.items():
        rows = list(csv.reader(lines))
        if not rows or "Source" not in rows[0]:
            continue
        head, data = rows[0], rows[1:]
        src, samples = head.index("Source"), head.index("Warp Stall Sampling (All Samples)")
        reasons = [(j, h.removeprefix("stall_")) for j, h in enumerate(head)
                   if h.startswith("stall_") and "Not Issued" not in h]
        value = lambda row, j: float(row[j] or 0)  # noqa: E731
        total = sum(value(r, samples) for r in data) or 1.0
        by_reason = {h: round(sum(value(r, j) for r in data) / total * 100, 1) for j, h in reasons}
        rows_top = sorted(data, key=lambda r: -value(r, samples))[:top]
        out[name] = {"samples": total, "stall_pct": dict(sorted(by_reason.items(), key=lambda kv: -kv[1])[:10]),
                     "top": [{"sass": " ".join(r[src].split()), "pct": round(value(r, samples) / total * 100, 1),
                              "stalls_pct": {h: round(value(r, j) / total * 100, 1) for j, h in
                                             sorted(reasons, key=lambda jh: -value(r, jh[0]))[:3] if value(r, j)}}
                             for r in rows_top]}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report")
    p.add_argument("labels")
    p.add_argument("--out", required=True)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--source", help="the report's source page as CSV (ncu -i REPORT --page source --csv "
                   "--print-source sass): the stall table from it, per kernel")
    opts = p.parse_args()
    labels = json.load(open(opts.labels))
    ncu_report = ncu_report_module()
    ctx = ncu_report.load_report(opts.report)
    actions = [r.action_by_idx(i) for r in (ctx.range_by_idx(j) for j in range(ctx.num_ranges()))
               for i in range(r.num_actions())]
    source = stalls_from_source_page(opts.source, opts.top) if opts.source else {}
    kernels = []
    for idx, action in enumerate(actions):
        names = action.metric_names()
        metrics = {n: metric_value(action.metric_by_name(n)) for n in names if KEEP.search(n)}
        row = {"launch": idx, "kernel": action.name(), "metrics": metrics}
        if source and action.name() in source:
            row["stalls"] = source[action.name()]
        else:
            try:
                row["stalls_by_pc"] = stalls_by_pc(action, opts.top)
            except Exception as err:  # noqa: BLE001  (an older ncu_report: the metrics alone)
                row["stalls_by_pc_error"] = f"{type(err).__name__}: {err}"
        kernels.append(row)
        dur = metrics.get("gpu__time_duration.sum")
        clock = metrics.get("sm__cycles_elapsed.avg.per_second")
        print(f"{idx:3d} {action.name()[:60]:60s} {dur and dur / 1e3:9.2f} us  clock {clock and clock / 1e9:.2f} GHz")
    # the launches of one label are those until the next label's first kernel: one label per pair member, in order;
    # a peer that launches several kernels (cuDNN) leaves the mapping to the kernel names
    json.dump({"labels": labels, "kernels": kernels}, open(opts.out, "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
