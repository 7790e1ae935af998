"""GPU benchmark of the tensor-core GEMM schedule (tvmfuse/spaces/tcgemm.py): every knob set at the Llama prefill
projections and the issue-5 GEMM, checked against torch (cuBLAS) and timed beside it and dlight's default.

    python3 bench/tcgemm.py --out results.json [--cases NAME ...] [--build-only]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.smallm import copy_bandwidth, inputs, kernel, log, time_variants, torch_time, write_json  # noqa: E402

CASES = [  # name, M, K, N, bias + GELU epilogue
    ("m512_k4096_n4096", 512, 4096, 4096, False),
    ("m512_k4096_n11008", 512, 4096, 11008, False),
    ("m512_k11008_n4096", 512, 11008, 4096, False),
    ("m4096_k4096_n11008_bias_gelu", 4096, 4096, 11008, True),
    ("m2048_k4096_n4096", 2048, 4096, 4096, False),
]
DLIGHT = "dlight"  # the knobs column of dlight's own schedule (tvmfuse.baseline.TensorCoreMatmul)


def knob_sets():
    """Warp grids x warp tiles x K chunks x pipelines, within 64K registers per block at ~8 per accumulator."""
    out = []
    for (wm, wn), (fm, fn), kc, stages in itertools.product(
            ((2, 2), (2, 4), (4, 2), (4, 4)), ((2, 2), (2, 4), (4, 2), (4, 4)), (2, 4), (0, 3, 4)):
        if wm * wn * 32 * (8 * fm * fn + 64) <= 65536:
            out.append(dict(wm=wm, wn=wn, fm=fm, fn=fn, kc=kc, vec=8, stages=stages))
    return out


def variants_for(fn, m, k, n):
    from tvm import s_tir

    from tvmfuse.spaces.defaults import default_rule
    from tvmfuse.spaces import tcgemm
    from tvmfuse.targets import resolve_target

    out = []
    rule, sch = default_rule(fn, resolve_target("cuda"), stock=False)
    if rule is not None:
        out.append(({"knobs": DLIGHT, "rule": type(rule).__name__}, sch.mod))
    for knobs in knob_sets():
        if not tcgemm.fits(m, n, k, **knobs):
            continue
        sch = s_tir.Schedule(fn)
        try:
            if tcgemm.schedule_tc_gemm(sch, **knobs):
                out.append((knobs, sch.mod))
        except Exception as err:  # noqa: BLE001  (record the schedule error, keep sweeping)
            log("schedule error", knobs, str(err).strip().splitlines()[-1][:160])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="*", help="case names (default: all)")
    p.add_argument("--build-only", action="store_true", help="build every variant, report build errors (no GPU)")
    opts = p.parse_args()
    from tvm.s_tir import meta_schedule as ms

    from tvmfuse.spaces import tcgemm
    from tvmfuse.targets import resolve_target
    from tvmfuse.tune.search import make_builder as _builder

    target = resolve_target("cuda")
    res = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": {}}
    if not opts.build_only:
        import torch
        import torch.nn.functional as F
        res["gpu"], res["copy_bw_TBps"] = torch.cuda.get_device_name(), copy_bandwidth() / 1e12
    for name, m, k, n, gelu in CASES:
        if opts.cases and name not in opts.cases:
            continue
        fn = kernel(m, k, n, gelu)
        variants = variants_for(fn, m, k, n)
        t = time.time()
        built = _builder(os.cpu_count() or 1).build([ms.builder.BuilderInput(mod, target) for _, mod in variants])
        log(name, f"{len(variants)} variants built in {time.time() - t:.0f} s,",
            sum(bool(b.error_msg) for b in built), "build errors")
        case = res["cases"][name] = {"m": m, "k": k, "n": n, "epilogue": "bias+gelu" if gelu else "none",
                                     "default_knobs": tcgemm.default_knobs(), "gflop": 2 * m * n * k / 1e9}
        if opts.build_only:
            case["build_errors"] = [[kn, b.error_msg.strip().splitlines()[-1][:200]]
                                    for (kn, _), b in zip(variants, built) if b.error_msg]
            continue
        x, w, b = inputs(m, k, n)
        ref_fn = (lambda: F.gelu(F.linear(x, w, b))) if gelu else (lambda: F.linear(x, w))
        ref, case["torch_us"] = ref_fn().float(), torch_time(ref_fn)
        rows = time_variants(fn, variants, built, {"x": x, "w": w, "b": b}, ref, (1, m, n),
                             case["default_knobs"], name)
        for row in rows:
            if "us" in row:
                row["tflops"] = round(case["gflop"] / row["us"] * 1e3, 1)  # GFLOP per µs = PFLOP/s
        ok = [r for r in rows if "us" in r and r["max_abs_err"] < 5e-2]
        case["best"] = min(ok, key=lambda r: r["us"]) if ok else None
        case["dlight_us"] = next((r.get("us") for r in rows if r["knobs"].get("knobs") == DLIGHT), None)
        case["default_us"] = next((r.get("us") for r in rows if r["default"]), None)
        case["variants"] = rows
        log(name, f"torch {case['torch_us']:.1f} us, dlight {case['dlight_us']}, default {case['default_us']}, "
            f"best {case['best'] and case['best']['us']:.1f} {case['best'] and case['best']['knobs']}")
        write_json(opts.out, res)
    write_json(opts.out, res, finished=True)


if __name__ == "__main__":
    main()
