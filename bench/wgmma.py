"""GPU benchmark of the TIRx GEMM kernels: each tile of the Hopper GEMM (tvmfuse/kernels/wgmma_gemm.py) at the Llama
prefill projections and the issue-5 GEMM, or of the small-M kernel (tvmfuse/kernels/mma_smallm.py, `--kernel smallm`)
at decode shapes; checked against torch (cuBLAS) and timed beside it.

    python3 bench/wgmma.py --out results.json [--kernel smallm] [--cases NAME ...] [--tiles 128x4 256x3 ...]
                           [--dtypes fp16,bf16]   # each case in each dtype (bf16 cases named NAME_bf16)

Tiles (wgmma): `bn x stages` or `bm x bn x stages`, then `d` for two accumulator sets, `i1` for one wgmma group in
flight over one set, `c2` for clusters of two CTAs sharing the B tile (`c2a`: the A tile), `s` for descriptors
encoded once a k-tile and stepped, `p` for persistent CTAs, `r` for setmaxnreg, `w` for barrier waits that spin (no
suspend-time hint), `e` for one stage release a warpgroup, `b` for the first B k-tiles loaded before the dependency
wait (no effect alone: nothing launches it dependent), `fF` for B prefetched into L2 F k-tiles ahead, `gG` for
groups of G row tiles; (smallm) `n8 x warps x vec x unroll [x stages]` (stages: the cp.async ring,
`SmallMTile.stages`), then `k` for that ring filled by bulk copies (`SmallMTile.bulk`), `fF` for the weight
rounds prefetched into L2 F rounds ahead (`SmallMTile.l2_ahead`);
diagnostics (wrong outputs): `-loads` loads only the first `stages` k-tiles, `-mma` issues no wgmma.
Each case also records the kernels torch ran (cuBLAS's name gives its tile, stages and cluster). Weights of 32 MiB
or less stay in the H200's L2 between timed runs (time_evaluator), so those cases time L2-resident weights, torch's
too; `--cold` times every kernel and torch over copies of the weight that together exceed L2 three times, each call
the next copy, so the weight streams from HBM on every call as in a model (A stays resident: in a model the kernel
before has just written it).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.model_timing import gpu_kernels
from bench.smallm import copy_bandwidth, inputs, log, queued_time, torch_time, write_json
from bench.tcgemm import CASES

TILES = ("128x4", "128x5", "256x3", "256x4")  # bn x stages
SMALL_TILES = ("4x8x1x4", "2x8x1x4", "1x8x1x4", "4x4x1x4", "8x8x1x2", "4x8x2x2", "2x8x2x2", "2x4x2x2", "2x16x1x2",
               "4x8x1x2")  # n8 x warps x vec x unroll
SMALL_CASES = [  # name, M, K, N, bias + GELU: the issue-5 GEMV, Llama and GPT-2 decode projections, other M
    ("m16_k4096_n11008_bias_gelu", 16, 4096, 11008, True),
    ("m16_k4096_n4096", 16, 4096, 4096, False),
    ("m16_k11008_n4096", 16, 11008, 4096, False),
    ("m16_k4096_n22016", 16, 4096, 22016, False),
    ("m16_k4096_n12288", 16, 4096, 12288, False),  # Llama-2-7B's Q, K and V as one GEMM
    ("m16_k768_n3072_bias_gelu", 16, 768, 3072, True),
    ("m16_k3072_n768", 16, 3072, 768, False),
    ("m1_k4096_n11008_bias_gelu", 1, 4096, 11008, True),
    ("m1_k4096_n4096", 1, 4096, 4096, False),
    ("m1_k4096_n12288", 1, 4096, 12288, False),
    ("m1_k11008_n4096", 1, 11008, 4096, False),
    ("m4_k4096_n11008_bias_gelu", 4, 4096, 11008, True),
    ("m64_k4096_n11008_bias_gelu", 64, 4096, 11008, True),
]


PREFILL_CASES = [  # the GPT-2, BERT, Llama-2-7B and Llama-3-8B prefill projections (M = 512, 2048), as run
    (f"m{m}_k{k}_n{n}" + ("_bias_gelu" if g else ""), m, k, n, g)
    for m in (512, 2048)
    for k, n, g in ((768, 2304, False), (768, 768, False), (768, 3072, True), (3072, 768, False), (768, 50257, False),
                    (4096, 4096, False), (4096, 11008, False), (11008, 4096, False), (4096, 256, False),
                    (4096, 1024, False), (4096, 2048, False), (4096, 14336, False), (14336, 4096, False))
    if not (m == 2048 and n == 256)]  # Llama-3-8B: K and V 1024 wide each (2048 merged), gate / up 14336
PREFILL_TILES = ("128x256x4", "128x192x4", "128x176x4", "128x168x5sr", "128x160x4", "128x144x4", "128x128x4",
                 "64x256x4", "64x192x4", "64x128x6", "64x64x8", "128x64x6", "192x192x4r")  # bm x bn x stages


def _tile(kernel, spec):
    """(the tile a spec names, its diagnostic ablation: "", "loads" or "mma")."""
    from tvmfuse.kernels.hopper.mma_smallm import SmallMTile
    from tvmfuse.kernels.hopper.wgmma_tile import WgmmaTile
    # "128x176x4g4": groups of 4 row tiles, rows fastest (g1: columns); "d": two accumulator sets; "i1": one wgmma
    # group left in flight over one set ("i0", the default: none); "c2": clusters of 2 CTAs multicasting the B tile
    # ("c2a": the A tile)
    pattern = (r"(\d+(?:x\d+)+)(d?)(?:i(\d))?(?:c(\d)(a?))?(s?)(p?)(r?)(w?)(e?)(b?)(k?)(?:f(\d+))?(?:g(\d+))?"
               r"(?:-(loads|mma))?")
    found = re.fullmatch(pattern, spec)
    if not found:
        raise ValueError(f"tile spec {spec!r}: NxN..[d][i0|i1][c1|c2[a]][s][p][r][w][e][b][k][fF][gG][-loads|-mma]")
    (dims, dual, inflight, cluster, share_a, stepped, persistent, regs, spin, wg, early, bulk, ahead, group,
     ablate) = found.groups()
    vals = [int(v) for v in dims.split("x")]
    if kernel == "smallm":  # `fF`: weight rounds prefetched into L2 F rounds ahead (no ring); `k`: the ring filled
        # by bulk copies; `b`: the weights' first rounds issued before the dependency wait
        return SmallMTile(*vals, l2_ahead=int(ahead or 0), bulk=bool(bulk), early_weights=bool(early)), ablate or ""
    return WgmmaTile(bn=vals[-2], stages=vals[-1], bm=vals[0] if len(vals) == 3 else 128, dual=bool(dual),
                     inflight=int(inflight or 0), cluster=int(cluster or 1), multicast="a" if share_a else "b",
                     stepped_desc=bool(stepped),
                     persistent=bool(persistent), setmaxnreg=bool(regs), spin_wait=bool(spin), wg_release=bool(wg),
                     early_weights=bool(early), l2_ahead=int(ahead or 0),
                     group_m=int(group) if group else WgmmaTile.group_m), ablate or ""


def tile_spec(t) -> str:
    """The spec of a WgmmaTile (the inverse of _tile)."""
    return (f"{t.bm}x{t.bn}x{t.stages}" + ("d" if t.dual else "") + ("" if t.inflight == 0 else f"i{t.inflight}")
            + ("" if t.cluster == 1 else f"c{t.cluster}" + ("a" if t.multicast == "a" else ""))
            + ("s" if t.stepped_desc else "")
            + ("p" if t.persistent else "") + ("r" if t.setmaxnreg else "") + ("w" if t.spin_wait else "")
            + ("e" if t.wg_release else "") + ("b" if t.early_weights else "")
            + (f"f{t.l2_ahead}" if t.l2_ahead else "") + f"g{t.group_m}")


def _chosen(m, k, n):
    """The product's tile at this shape (tvmfuse.hopper.choose_tile) as a tile spec, or None."""
    from tvmfuse.kernels.hopper.select import choose_tile
    t = choose_tile(m, n, k)
    return t and tile_spec(t)


def _case_tiles(kernel, tiles, m, k, n, groups=(1,)):
    """The tiles to measure at one shape: the given ones; with --tiles auto the product's choice too; with --tiles
    chosen the product's choice alone, in each CTA order of `groups` (the row-tile groups of WgmmaTile.group_m)."""
    if tiles == ["chosen"]:
        return [_chosen(m, k, n).split("g")[0] + f"g{g}" for g in groups]
    if tiles != ["auto"]:
        return tiles
    return list(dict.fromkeys(PREFILL_TILES + tuple(filter(None, [_chosen(m, k, n)]))))


def precompile(mods) -> float:
    """Compile every module's CUDA source with nvcc in parallel threads and answer TVM's load-time compile callback
    from that cache (one nvcc per kernel in turn took ~3 s each on the first launch)."""
    from concurrent.futures import ThreadPoolExecutor

    import tvm_ffi
    from tvm.support import nvcc

    from tvmfuse.kernels.hopper.gemm_bench import hopper_target

    def compile_one(code):
        with hopper_target():  # nvcc's arch comes from the current target (sm_90a: wgmma, TMA)
            return nvcc.compile_cuda(code, "fatbin", compiler="nvcc")
    t = time.time()
    srcs = list(dict.fromkeys(m.imports[0].inspect_source() for m in mods if m is not None and m.imports))
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        bins = dict(zip(srcs, pool.map(compile_one, srcs)))
    tvm_ffi.register_global_func("tvm_callback_cuda_compile",
                                 lambda code: bins.get(code) or compile_one(code),
                                 override=True)
    return time.time() - t


DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
TOLERANCE = {"float16": 5e-2, "bfloat16": 1e-1}  # max |kernel - torch| of a correct kernel (both round to dtype)


def cold_copies(w, l2_bytes: int = 50 << 20) -> int:
    """How many copies of weight `w` together exceed the L2 three times (at least 2)."""
    return max(2, -(-3 * l2_bytes // (w.numel() * w.element_size())))


def cold_time(call, copies: int, runs: int = 60, repeat: int = 5) -> float:
    """Median over `repeat` of the mean µs of `call(i)` over `runs` calls with i cycling through `copies` (CUDA
    events on the default stream, which TVM's launches share), after one call of each copy. The calls are queued
    behind a spinning kernel (`bench.smallm.queued_time`): M = 1 kernels of 10-30 µs are shorter than a call from
    Python, and timed one after the other as the host issues them they measured the host
    (wgmma_run19_smallm_hostbound.json: 23-28 µs for a 4096 x 4096 GEMV that takes 12.6 µs in the model)."""
    import statistics

    for i in range(copies):
        call(i)
    return statistics.median(queued_time(lambda r: call(r % copies), runs) for _ in range(repeat))


def _build(kernel, job):
    """Compile one (case, tile, dtype); returns (runtime module, error)."""
    m, k, n, gelu, spec, dtype = job
    import tvm

    from tvmfuse.kernels.hopper.gemm_bench import hopper_target, make_wgmma_gemm
    from tvmfuse.kernels.hopper.mma_smallm import check_smallm_shape, make_smallm_gemm
    from tvmfuse.kernels.hopper.wgmma_tile import check_wgmma_shape
    check, make = (check_smallm_shape, make_smallm_gemm) if kernel == "smallm" else (check_wgmma_shape, make_wgmma_gemm)
    tile, ablate = _tile(kernel, spec)
    why = check(m, n, k, tile)
    if why:
        return None, why
    try:
        extra = {"ablate": ablate} if ablate else {}  # diagnostics: -loads, -mma
        func = make(m, n, k, tile, "bias_gelu" if gelu else "none", dtype, **extra)
        return tvm.compile(tvm.IRModule({"main": func}), target=hopper_target(), tir_pipeline="tirx").mod, None
    except Exception as err:  # noqa: BLE001  (record the build error, keep sweeping)
        return None, str(err).strip().splitlines()[-1][:300]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="*", help="case names (default: all)")
    p.add_argument("--kernel", choices=("wgmma", "smallm"), default="wgmma")
    p.add_argument("--tiles", nargs="*", help=f"tiles (default: {TILES} / {SMALL_TILES}); auto: {PREFILL_TILES} "
                   "and the product's choice (tvmfuse.hopper.choose_tile) per shape; chosen: that choice alone (see --groups)")
    p.add_argument("--groups", nargs="*", type=int, default=[1], help="with --tiles chosen: row-tile groups to measure")
    p.add_argument("--prefill", action="store_true", help="the GPT-2 / Llama prefill projections (PREFILL_CASES)")
    p.add_argument("--dtypes", default="fp16", help="fp16, bf16 or fp16,bf16: each case in each (torch in the same)")
    p.add_argument("--cold", action="store_true",
                   help="weights from HBM on every call (copies cycled, 3x the L2), as in a model; torch's too")
    opts = p.parse_args()
    dtypes = [DTYPES[d] for d in opts.dtypes.split(",")]
    tiles = opts.tiles or list(SMALL_TILES if opts.kernel == "smallm" else TILES)
    import numpy as np
    import torch
    import torch.nn.functional as F
    import tvm

    table = SMALL_CASES if opts.kernel == "smallm" else PREFILL_CASES if opts.prefill else CASES
    cases = [c for c in table if not opts.cases or c[0] in opts.cases]
    jobs = [(m, k, n, gelu, spec, dt) for name, m, k, n, gelu in cases
            for spec in _case_tiles(opts.kernel, tiles, m, k, n, opts.groups) for dt in dtypes]
    t = time.time()
    built = [_build(opts.kernel, job) for job in jobs]  # in this process: a forked build pool broke CUDA init (run 1)
    log(f"{len(jobs)} kernels built in {time.time() - t:.0f} s; nvcc {precompile([b[0] for b in built]):.0f} s")
    res = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(),
           "copy_bw_TBps": copy_bandwidth() / 1e12, "cases": {}}
    dev = tvm.cuda(0)
    for (name, m, k, n, gelu), dt in ((c, dt) for c in cases for dt in dtypes):
        name = name + ("" if dt == "float16" else "_bf16")
        x, w, b = (t.to(getattr(torch, dt)) for t in inputs(m, k, n))
        x2 = x.reshape(m, k)
        ref_fn = (lambda x2=x2, w=w, b=b: F.gelu(F.linear(x2, w, b))) if gelu else (lambda x2=x2, w=w: F.linear(x2, w))
        ref = ref_fn().float()
        copies = [w] + [w.clone() for _ in range(cold_copies(w) - 1)] if opts.cold else [w]
        torch_us = cold_time(lambda i: (F.gelu(F.linear(x2, copies[i], b)) if gelu else F.linear(x2, copies[i])),
                             len(copies)) if opts.cold else torch_time(ref_fn)
        case = res["cases"][name] = {"m": m, "k": k, "n": n, "dtype": dt, "epilogue": "bias+gelu" if gelu else "none",
                                     "chosen": _chosen(m, k, n) if opts.kernel == "wgmma" else None,
                                     "weights": f"{len(copies)} copies cycled (from HBM)" if opts.cold else "one",
                                     "gflop": 2 * m * n * k / 1e9, "torch_us": torch_us, "tiles": [],
                                     # which cuBLAS kernel torch ran (its name gives the tile, cluster and schedule)
                                     "torch_kernels": gpu_kernels(ref_fn, top=3, name_chars=240)["top"]}
        for (jm, jk, jn, _, spec, jdt), (lib, err) in zip(jobs, built):
            if (jm, jk, jn, jdt) != (m, k, n, dt):
                continue
            row = {"tile": spec}
            if err:
                row["error"] = err
            else:
                try:
                    args = [tvm.runtime.from_dlpack(v.contiguous()) for v in (x2, w, b)]
                    out = tvm.runtime.empty((m, n), dt, dev)
                    lib["main"](*args, out)
                    row["max_abs_err"] = float((torch.from_dlpack(out).float() - ref).abs().max())
                    if opts.cold:
                        sets = [[args[0], tvm.runtime.from_dlpack(c), args[2]] for c in copies]
                        row["us"] = cold_time(lambda i, sets=sets, out=out: lib["main"](*sets[i], out), len(sets))
                    else:
                        ev = lib.time_evaluator("main", dev, number=100, repeat=5)
                        row["us"] = float(np.median(ev(*args, out).results) * 1e6)
                    row["tflops"] = round(case["gflop"] / row["us"] * 1e3, 1)
                    row["TBps"] = round((n * k + m * k + m * n) * 2 / row["us"] / 1e6, 2)  # operands + output
                except Exception as e:  # noqa: BLE001  (a kernel that fails to launch)
                    row["error"] = str(e).strip().splitlines()[-1][:300]
            case["tiles"].append(row)
            log(name, row)
        ok = [r for r in case["tiles"] if "us" in r and r["max_abs_err"] < TOLERANCE[dt]]
        case["best"] = min(ok, key=lambda r: r["us"]) if ok else None
        log(name, f"torch {case['torch_us']:.1f} us, best {case['best']}")
        write_json(opts.out, res)
    write_json(opts.out, res, finished=True)


if __name__ == "__main__":
    main()
