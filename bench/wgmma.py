"""GPU benchmark of the Hopper GEMM kernel (tvmfuse/kernels/wgmma_gemm.py): each tile at the Llama prefill projections
and the issue-5 GEMM, checked against torch (cuBLAS) and timed beside it.

    python3 bench/wgmma.py --out results.json [--cases NAME ...] [--tiles 128x4 256x3 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.smallm import copy_bandwidth, inputs, log, torch_time, write_json
from bench.tcgemm import CASES

TILES = ("128x4", "128x5", "256x3", "256x4")  # bn x stages


def _tile(spec):
    from tvmfuse.kernels.wgmma_gemm import WgmmaTile
    bn, stages = (int(v) for v in spec.split("x"))
    return WgmmaTile(bn=bn, stages=stages)


def _build(job):
    """Compile one (case, tile); returns (runtime module, error)."""
    m, k, n, gelu, spec, _ = job
    from tvmfuse.kernels.wgmma_gemm import build_wgmma_gemm, check_wgmma_shape
    why = check_wgmma_shape(m, n, k, _tile(spec))
    if why:
        return None, why
    try:
        return build_wgmma_gemm(m, n, k, _tile(spec), "bias_gelu" if gelu else "none").mod, None
    except Exception as err:  # noqa: BLE001  (record the build error, keep sweeping)
        return None, str(err).strip().splitlines()[-1][:300]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="*", help="case names (default: all)")
    p.add_argument("--tiles", nargs="*", default=list(TILES), help="bn x stages (default: %(default)s)")
    opts = p.parse_args()
    import numpy as np
    import torch
    import torch.nn.functional as F
    import tvm

    cases = [c for c in CASES if not opts.cases or c[0] in opts.cases]
    jobs = [(m, k, n, gelu, spec, None) for name, m, k, n, gelu in cases for spec in opts.tiles]
    t = time.time()
    built = [_build(job) for job in jobs]  # in this process: a forked build pool broke CUDA init (run 1)
    log(f"{len(jobs)} kernels built in {time.time() - t:.0f} s")
    res = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(),
           "copy_bw_TBps": copy_bandwidth() / 1e12, "cases": {}}
    dev = tvm.cuda(0)
    for name, m, k, n, gelu in cases:
        x, w, b = inputs(m, k, n)
        x2 = x.reshape(m, k)
        ref_fn = (lambda x2=x2, w=w, b=b: F.gelu(F.linear(x2, w, b))) if gelu else (lambda x2=x2, w=w: F.linear(x2, w))
        ref = ref_fn().float()
        case = res["cases"][name] = {"m": m, "k": k, "n": n, "epilogue": "bias+gelu" if gelu else "none",
                                     "gflop": 2 * m * n * k / 1e9, "torch_us": torch_time(ref_fn), "tiles": []}
        for (jm, jk, jn, _, spec, _), (lib, err) in zip(jobs, built):
            if (jm, jk, jn) != (m, k, n):
                continue
            row = {"tile": spec}
            if err:
                row["error"] = err
            else:
                try:
                    args = [tvm.runtime.from_dlpack(v.contiguous()) for v in (x2, w, b)]
                    out = tvm.runtime.tensor(np.zeros((m, n), "float16"), dev)
                    lib["main"](*args, out)
                    row["max_abs_err"] = float((torch.from_dlpack(out).float() - ref).abs().max())
                    ev = lib.time_evaluator("main", dev, number=100, repeat=5)
                    row["us"] = float(np.median(ev(*args, out).results) * 1e6)
                    row["tflops"] = round(case["gflop"] / row["us"] * 1e3, 1)
                except Exception as e:  # noqa: BLE001  (a kernel that fails to launch)
                    row["error"] = str(e).strip().splitlines()[-1][:300]
            case["tiles"].append(row)
            log(name, row)
        ok = [r for r in case["tiles"] if "us" in r and r["max_abs_err"] < 5e-2]
        case["best"] = min(ok, key=lambda r: r["us"]) if ok else None
        log(name, f"torch {case['torch_us']:.1f} us, best {case['best']}")
        write_json(opts.out, res)
    write_json(opts.out, res, finished=True)


if __name__ == "__main__":
    main()
