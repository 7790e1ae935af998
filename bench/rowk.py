"""GPU benchmark of the TIRx row kernel (tvmfuse/kernels/row_kernel.py): LayerNorm+GELU and RMSNorm+residual at
8192 x 4096 fp16 (the fused PrimFuncs of bench/cases.py, as bench/run.py builds them), every knob set checked
against torch in fp32 and timed (time_evaluator, median of 5 x 100 runs) beside TVM's default (dlight) schedule of
the same PrimFunc, torch eager and torch.compile; ptxas' registers per thread for each knob set.

    python3 bench/rowk.py --out results.json [--cases ln_gelu rms_res] [--knobs 2x4 4x2 ...] [--dry]

Knobs: `warps_per_row x rows_per_cta`. --dry builds the kernels only (no GPU, no torch) and writes their register
counts (where nvcc is on PATH).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.smallm import copy_bandwidth, log, torch_time, write_json

KNOBS = ("1x8", "2x4", "2x2", "2x1", "4x2", "4x1", "4x4")
CASES = ("ln_gelu", "rms_res")


def ptxas_usage(src: str) -> dict:
    """{"regs", "spill_bytes"} of the CUDA source's kernel from `nvcc --resource-usage` (sm_90a), {} without nvcc."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cu")
        with open(path, "w") as f:
            f.write(src)
        try:
            out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-o", os.path.join(tmp, "k.cubin"),
                                  "--resource-usage", path], capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return {}
    text = out.stdout + out.stderr
    regs = re.findall(r"Used (\d+) registers", text)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return {"regs": int(regs[0]), "spill_bytes": sum(spills)} if regs else {"ptxas": text.strip()[-300:]}


def build_case(case: str, knobs: list[str]):
    """(fused PrimFunc, info, [(knobs, runtime module | None, row)]) for one case at 8192 x 4096."""
    import tvm

    from bench import cases
    from tvmfuse.kernels.hopper.row_analysis import analyze_rows
    from tvmfuse.kernels.hopper.row_kernel import RowKnobs, default_knobs, row_kernel
    build, shape, _, _ = cases.CASES[case]
    _, pf = cases.fused_primfunc(*build(*shape))
    info, why = analyze_rows(pf)
    if info is None:
        raise SystemExit(f"{case}: the row kernel refuses it: {why}")
    default = default_knobs(info)
    out = []
    for spec in knobs:
        kn = RowKnobs(*(int(v) for v in spec.split("x")))
        row = {"knobs": spec, "default": kn == default}
        try:
            t = time.time()
            lib = tvm.compile(tvm.IRModule({"main": row_kernel(info, kn, "main")}),
                              target=tvm.target.Target("nvidia/nvidia-h100"), tir_pipeline="tirx").mod
            row["build_s"] = round(time.time() - t, 1)
            row.update(ptxas_usage(lib.imports[0].inspect_source("cuda")))
        except Exception as err:  # noqa: BLE001  (record the build error, keep sweeping)
            lib, row["error"] = None, str(err).strip().splitlines()[-1][:300]
        log(case, row)
        out.append((kn, lib, row))
    return pf, info, out


def torch_case(case: str, d: int):
    """(numpy inputs in the PrimFunc's parameter order, the same as torch tensors, fp32 reference outputs, the fp16
    torch function)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from bench import cases
    arrays = cases.inputs(case, np.random.default_rng(0))
    xs = [torch.from_numpy(np.array(a, copy=True)).cuda() for a in arrays]
    with torch.no_grad():
        if case == "ln_gelu":
            x, g, b = (t.float() for t in xs)
            ref = [F.gelu(F.layer_norm(x, (d,), g, b, 1e-5))]
        else:  # h = x + r is an fp16 output the norm reads back
            x, r, eps, w = xs
            h = (x + r).float()
            ref = [h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps.float()) * w.float(), h]
    return arrays, xs, ref, cases.torch_fn(case)


def time_kernel(lib, row, ins, ref, ideal_us, nbytes, dev):
    """Run `lib` on fresh outputs, record its largest error against `ref` and its time (median of 5 x 100 runs)."""
    import numpy as np
    import torch
    import tvm

    try:
        outs = [tvm.runtime.tensor(np.zeros(r.shape, "float16"), dev) for r in ref]  # fresh: nothing stale
        lib["main"](*ins, *outs)
        row["max_abs_err"] = max(float((torch.from_dlpack(o).float() - r).abs().max()) for o, r in zip(outs, ref))
        row["us"] = float(np.median(lib.time_evaluator("main", dev, number=100, repeat=5)(*ins, *outs).results) * 1e6)
        row["TBps"] = round(nbytes / row["us"] / 1e6, 2)
        row["pct_ideal"] = round(100 * ideal_us / row["us"], 1)
    except Exception as err:  # noqa: BLE001  (a kernel that fails to launch)
        row["error"] = str(err).strip().splitlines()[-1][:300]


def run_case(case, built, res, dev, target):
    """Time one case's row kernels, TVM's default schedule of its fused PrimFunc, torch eager and torch.compile."""
    import torch
    import tvm

    from bench import cases
    from tvmfuse.spaces import default_schedule
    pf, kernels = built
    c = res["cases"][case]
    c["ideal_us"] = c["bytes"] / (res["copy_bw_TBps"] * 1e6)
    arrays, xs, ref, tfn = torch_case(case, cases.D)
    ins = [tvm.runtime.tensor(a, dev) for a in arrays]
    for _, lib, row in kernels:
        if lib is not None:
            time_kernel(lib, row, ins, ref, c["ideal_us"], c["bytes"], dev)
            log(case, row)
    c["dlight"] = {}
    try:
        lib = tvm.compile(default_schedule(tvm.IRModule({"main": pf}), target), target=target).mod
        time_kernel(lib, c["dlight"], ins, ref, c["ideal_us"], c["bytes"], dev)
    except Exception as err:  # noqa: BLE001
        c["dlight"]["error"] = str(err).strip().splitlines()[-1][:300]
    with torch.no_grad():
        c["torch_max_abs_err"] = max(float((o.float() - r).abs().max()) for o, r in zip(tfn(*xs), ref))
        c["torch_eager_us"] = torch_time(lambda: tfn(*xs))
        try:
            comp = torch.compile(tfn)
            comp(*xs)
            c["torch_compile_us"] = torch_time(lambda: comp(*xs))
        except Exception as err:  # noqa: BLE001
            c["torch_compile_error"] = str(err).strip().splitlines()[-1][:300]
    ok = [r for r in c["knobs"] if "us" in r and r["max_abs_err"] < 5e-2]
    c["best"] = min(ok, key=lambda r: r["us"]) if ok else None
    log(case, {k: v for k, v in c.items() if k != "knobs"})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    p.add_argument("--knobs", nargs="*", default=list(KNOBS), help="warps_per_row x rows_per_cta")
    p.add_argument("--dry", action="store_true", help="build only (no GPU)")
    opts = p.parse_args()
    from bench import cases
    res = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "shape": [cases.N, cases.D], "cases": {}}
    built = {}
    for case in opts.cases:
        pf, info, kernels = build_case(case, opts.knobs)
        built[case] = (pf, kernels)
        res["cases"][case] = {"bytes": cases.CASES[case][2], "inputs": [b.name for b in info["inputs"]],
                              "outputs": [b.name for b in info["outputs"]], "knobs": [r for _, _, r in kernels]}
    if opts.dry:
        write_json(opts.out, res, finished=True)
        log("dry run: built", {c: sum(lib is not None for _, lib, _ in k) for c, (_, k) in built.items()})
        return
    import torch
    import tvm

    dev, target = tvm.cuda(0), tvm.target.Target("nvidia/nvidia-h100")
    res.update(gpu=torch.cuda.get_device_name(), copy_bw_TBps=copy_bandwidth() / 1e12)
    for case in opts.cases:
        run_case(case, built[case], res, dev, target)
        write_json(opts.out, res)
    write_json(opts.out, res, finished=True)


if __name__ == "__main__":
    main()
