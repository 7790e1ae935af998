"""Static SASS analysis of the tensor-core GEMM tile schedule (tvmfuse/spaces/tcgemm.py) at the shapes of bench/tcgemm.py (no GPU needed): main-loop instruction mix, registers, shared memory, occupancy, beside the times the GPU run measured.

    python3 bench/gemm_sass.py --out bench/results/gemm_sass.json [--measured bench/results/tcgemm_run1.json]

Each kernel is the one bench/tcgemm.py timed (x [1, M, K] @ W[N, K]^T, fp32 accumulation, cast or bias+GELU),
scheduled with the default knobs and with the fastest knobs of the GPU run, built for sm_90a with cp.async on
(as the product builds it) and compiled by TVM's own nvcc call; bench/attention_sass.py reads the cubin. Dynamic
shared memory is DERIVED from the tile (TVM merges the staging ring and the fp32 write-back tile, which are
live at different times, into one buffer: the larger of the two), not read from the binary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.attention_sass import classify, main_loop, occupancy, parse_sass  # noqa: E402
from bench.sass_mix import tool  # noqa: E402
from bench.smallm import kernel  # noqa: E402
from bench.tcgemm import CASES  # noqa: E402

FIELDS = ("wm", "wn", "fm", "fn", "kc", "vec", "stages")


def dyn_smem(wm, wn, fm, fn, kc, vec, stages) -> int:  # pylint: disable=unused-argument
    """Bytes: the larger of the staging ring (rows padded by 8 halves) and the fp32 write-back tile (padded by 4)."""
    bm, bn, bk = 16 * wm * fm, 16 * wn * fn, 16 * kc
    return max((bm + bn) * (bk + 8) * 2 * max(stages, 2), bm * (bn + 4) * 4)


def analyse(m: int, k: int, n: int, gelu: bool, knobs: dict) -> dict:
    import tvm
    from tvm import s_tir
    from tvm.support import nvcc

    from tvmfuse.spaces import tcgemm
    sch = s_tir.Schedule(kernel(m, k, n, gelu))
    assert tcgemm.schedule_tc_gemm(sch, **knobs), knobs
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host={"kind": "llvm"})
    with target, tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
        src = tvm.compile(sch.mod, target=target).jit().imports[0].inspect_source("cuda")
    with tempfile.TemporaryDirectory() as d, target:
        cubin = os.path.join(d, "k.cubin")
        nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc", path_target=cubin)
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], check=True, capture_output=True, text=True).stdout
        res = subprocess.run([tool("cuobjdump"), "-res-usage", cubin], check=True, capture_output=True, text=True).stdout
    (kern, ins), = parse_sass(sass).items()
    usage = {k_: int(v) for k_, v in re.findall(r"(\w+(?:\[0\])?):(\d+)", res.split("REG:", 1)[1].splitlines()[0])}
    usage["REG"] = int(re.search(r"REG:(\d+)", res).group(1))
    threads = knobs["wm"] * knobs["wn"] * 32
    smem = usage.get("SHARED", 0) + dyn_smem(**knobs)
    occ = occupancy(usage["REG"], threads, smem)
    grid = (m // (16 * knobs["wm"] * knobs["fm"])) * (n // (16 * knobs["wn"] * knobs["fn"]))
    return {"kernel": kern, "knobs": knobs, "threads_per_block": threads, "registers": usage["REG"],
            "stack_bytes": usage.get("STACK"), "smem_per_block_bytes": smem, "occupancy": occ, "grid_blocks": grid,
            "waves_on_132_sms": round(grid / (occ["blocks_per_sm"] * 132), 2), "instructions": len(ins),
            "classes": classify([op for _, _, op, _ in ins]), "loop": main_loop(ins)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/gemm_sass.json")
    p.add_argument("--measured", default="bench/results/tcgemm_run1.json",
                   help="a tcgemm run (this one: tar -xJf bench/results/archive-sessions-5-7.tar.xz first)")
    args = p.parse_args()
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    from tvmfuse.spaces import tcgemm
    with open(args.measured) as f:
        run = json.load(f)["cases"]
    res = {"what": "STATIC analysis (cubin via TVM's nvcc call, cuobjdump); `measured` is copied from the GPU run",
           "measured_from": args.measured, "cases": {}}
    for name, m, k, n, gelu in CASES:
        got = run.get(name, {})
        times = {tuple(v["knobs"]): v.get("us") for v in got.get("variants", []) if v["knobs"] != "dlight"}
        default = tcgemm.default_knobs()
        sets = {"default": default}
        if got.get("best") and got["best"]["knobs"] != [default[f] for f in FIELDS]:
            sets["fastest"] = dict(zip(FIELDS, got["best"]["knobs"]))
        case = res["cases"][name] = {"gflop": 2 * m * n * k / 1e9, "cublas_us": got.get("torch_cublas_us"),
                                     "dlight_us": got.get("dlight_us")}
        for label, knobs in sets.items():
            a = analyse(m, k, n, gelu, knobs)
            a["measured_us"] = times.get(tuple(knobs[f] for f in FIELDS))
            case[label] = a
            lp = a["loop"] or {"paths": [{}]}
            print(name, label, f"regs {a['registers']} smem {a['smem_per_block_bytes']} "
                  f"warps/SM {a['occupancy']['warps_per_sm']} ({','.join(a['occupancy']['limited_by'])}) "
                  f"waves {a['waves_on_132_sms']} loop {lp['paths'][0].get('instructions')} instr, "
                  f"{lp['paths'][0].get('HMMA')} HMMA, measured {a['measured_us']} us", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
