"""GPU benchmark of the TIRx GEMM kernels: each tile of the Hopper GEMM (tvmfuse/kernels/wgmma_gemm.py) at the Llama
prefill projections and the issue-5 GEMM, or of the small-M kernel (tvmfuse/kernels/mma_smallm.py, `--kernel smallm`)
at decode shapes; checked against torch (cuBLAS) and timed beside it.

    python3 bench/wgmma.py --out results.json [--kernel smallm] [--cases NAME ...] [--tiles 128x4 256x3 ...]

Tiles: `bn x stages` (wgmma), `n8 x warps x vec x unroll` (smallm). Weights of 32 MiB or less stay in the H200's
L2 between timed runs (time_evaluator), so those cases time L2-resident weights, torch's too.
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
SMALL_TILES = ("4x8x1x4", "2x8x1x4", "1x8x1x4", "4x4x1x4", "8x8x1x2", "4x8x2x2", "2x8x2x2", "2x4x2x2", "2x16x1x2",
               "4x8x1x2")  # n8 x warps x vec x unroll
SMALL_CASES = [  # name, M, K, N, bias + GELU: the issue-5 GEMV, Llama and GPT-2 decode projections, other M
    ("m16_k4096_n11008_bias_gelu", 16, 4096, 11008, True),
    ("m16_k4096_n4096", 16, 4096, 4096, False),
    ("m16_k11008_n4096", 16, 11008, 4096, False),
    ("m16_k4096_n22016", 16, 4096, 22016, False),
    ("m16_k768_n3072_bias_gelu", 16, 768, 3072, True),
    ("m16_k3072_n768", 16, 3072, 768, False),
    ("m1_k4096_n11008_bias_gelu", 1, 4096, 11008, True),
    ("m1_k4096_n4096", 1, 4096, 4096, False),
    ("m4_k4096_n11008_bias_gelu", 4, 4096, 11008, True),
    ("m64_k4096_n11008_bias_gelu", 64, 4096, 11008, True),
]


def _tile(kernel, spec):
    from tvmfuse.kernels.mma_smallm import SmallMTile
    from tvmfuse.kernels.wgmma_gemm import WgmmaTile
    vals = [int(v) for v in spec.split("x")]
    return SmallMTile(*vals) if kernel == "smallm" else WgmmaTile(bn=vals[0], stages=vals[1])


def _build(kernel, job):
    """Compile one (case, tile); returns (runtime module, error)."""
    m, k, n, gelu, spec, _ = job
    import tvm

    from tvmfuse.kernels.mma_smallm import check_smallm_shape, make_smallm_gemm
    from tvmfuse.kernels.wgmma_gemm import (
        check_wgmma_shape,
        hopper_target,
        make_wgmma_gemm,
    )
    check, make = (check_smallm_shape, make_smallm_gemm) if kernel == "smallm" else (check_wgmma_shape, make_wgmma_gemm)
    tile = _tile(kernel, spec)
    why = check(m, n, k, tile)
    if why:
        return None, why
    try:
        func = make(m, n, k, tile, "bias_gelu" if gelu else "none")
        return tvm.compile(tvm.IRModule({"main": func}), target=hopper_target(), tir_pipeline="tirx").mod, None
    except Exception as err:  # noqa: BLE001  (record the build error, keep sweeping)
        return None, str(err).strip().splitlines()[-1][:300]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="*", help="case names (default: all)")
    p.add_argument("--kernel", choices=("wgmma", "smallm"), default="wgmma")
    p.add_argument("--tiles", nargs="*", help=f"tiles (default: {TILES} / {SMALL_TILES})")
    opts = p.parse_args()
    tiles = opts.tiles or list(SMALL_TILES if opts.kernel == "smallm" else TILES)
    import numpy as np
    import torch
    import torch.nn.functional as F
    import tvm

    cases = [c for c in (SMALL_CASES if opts.kernel == "smallm" else CASES) if not opts.cases or c[0] in opts.cases]
    jobs = [(m, k, n, gelu, spec, None) for name, m, k, n, gelu in cases for spec in tiles]
    t = time.time()
    built = [_build(opts.kernel, job) for job in jobs]  # in this process: a forked build pool broke CUDA init (run 1)
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
                    row["TBps"] = round((n * k + m * k + m * n) * 2 / row["us"] / 1e6, 2)  # operands + output
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
