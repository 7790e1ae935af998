"""Static SASS analysis of the attention templates' best measured variants (no GPU needed): instruction mix, main-loop paths, registers, shared memory, occupancy.

    python3 bench/attention_sass.py --out bench/results/attention_sass.json [--knobs bench/results/attention_run2.json]

Each case of bench/attention.py named in CASES is built with its best knobs from the GPU run's JSON for
{"kind": "cuda", "arch": "sm_90"} (the bench's target); TVM's CUDA source is compiled to a cubin by TVM's own
nvcc call (tvm.support.nvcc.compile_cuda: -O3 --use_fast_math, ptxas register-usage-level 10) and read with
cuobjdump -sass / -res-usage. Everything here is STATIC: instructions in the binary (a loop body counts once),
except `loop.paths`, which counts the instructions on each branch path through the main loop's body (what one
iteration issues per warp when it takes that path). Occupancy is the theoretical one for sm_90 (64K registers
in 4 sub-partitions, 256-register warp granule, 228 KB shared memory, 64 warps and 32 blocks per SM); on sm_90
cuobjdump's SHARED already holds the 1 KB the driver reserves per block (the decode kernel's 16640 bytes of
__shared__ arrays show as 17664), and the dynamic part is the PrimFunc's shared.dyn allocations.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.sass_mix import CLASSES, tool

CASES = ["prefill_b1_h32_s2048_d128_causal_fp16", "prefill_b1_h32kv8_s2048_d64_mask_fp16",
         "decode_b1_h32kv8_L4096_d128_fp16", "decode_b16_h32kv8_L4096_d128_fp16"]
EXTRA = [("HGMMA(wgmma)", r"^HGMMA"), ("UTMA(TMA)", r"^UTMA|^UBLKCP"), ("LDL(spill)", r"^LDL"), ("STL(spill)", r"^STL"),
         ("ISETP", r"^ISETP"), ("FSETP", r"^FSETP"), ("FSEL", r"^FSEL"), ("FMNMX", r"^FMNMX"), ("IMAD/IADD", r"^I(?:MAD|ADD3)"),
         ("MOV", r"^U?MOV"), ("LEA", r"^U?LEA"), ("LOP3", r"^U?LOP3"), ("F2FP(pack)", r"^F2FP")]
SM90 = {"regs": 65536, "subparts": 4, "reg_granule": 256, "smem": 228 * 1024, "smem_reserved": 1024, "warps": 64, "blocks": 32}


def parse_sass(sass: str) -> dict[str, list[tuple]]:
    """Per kernel: [(address, predicate, opcode with modifiers, operands)], NOPs dropped."""
    kernels, cur = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = kernels.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", line)
        if cur is not None and m and m.group(3) != "NOP":
            cur.append((int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3), m.group(4).strip()))
    return kernels


def classify(ops: list[str]) -> dict[str, int]:
    """Counts by class (bench.sass_mix.CLASSES, then EXTRA), plus every HMMA/HGMMA/MUFU opcode spelled out."""
    out = collections.Counter()
    for op in ops:
        cls = next((c for c, rx in CLASSES + EXTRA if re.match(rx, op)), None)
        out[cls or "other"] += 1
        if op.startswith(("HMMA", "HGMMA", "MUFU")):
            out[op] += 1
    return dict(sorted(out.items()))


def main_loop(ins: list[tuple]) -> dict | None:
    """The backward branch whose body holds the most HMMA (else the most instructions): its size, and per
    branch path from its head to the back edge (forward branches inside only) the instructions issued."""
    addr = [a for a, *_ in ins]
    loops = [(int(o, 16), a) for a, _, op, o in ins if op == "BRA" and re.fullmatch(r"0x[0-9a-f]+", o) and int(o, 16) < a]
    if not loops:
        return None
    body = lambda lp: [x for x in ins if lp[0] <= x[0] <= lp[1]]
    head, tail = max(loops, key=lambda lp: (sum(x[2].startswith("HMMA") for x in body(lp)), len(body(lp))))
    paths, stack = [], [(addr.index(head), [])]
    while stack and len(paths) < 64:  # walk the DAG of forward branches; a predicated BRA forks, a plain one jumps
        i, seen = stack.pop()
        while True:
            a, pred, op, opnd = ins[i]
            seen = seen + [ins[i][2]]
            if a == tail or op == "EXIT":
                paths.append(seen)
                break
            if op == "BRA" and re.fullmatch(r"0x[0-9a-f]+", opnd) and a < int(opnd, 16) <= tail:
                j = bisect.bisect_left(addr, int(opnd, 16))  # the target, or the first instruction after a NOP
                if pred:
                    stack.append((j, seen))
                else:
                    i = j
                    continue
            i += 1
    out = []
    for p in sorted(paths, key=len):
        c = classify(p)
        hmma = sum(v for k, v in c.items() if k.startswith("HMMA."))
        out.append({"instructions": len(p), "HMMA": hmma, "non_HMMA_per_HMMA": round((len(p) - hmma) / hmma, 2) if hmma else None,
                    "classes": c})
    loads = [i for i, x in enumerate(body((head, tail))) if x[2].startswith(("LDG", "LDGSTS"))]
    return {"head": hex(head), "back_edge": hex(tail), "static_body": len(body((head, tail))),
            "global_load_positions": loads, "paths": out}


def occupancy(regs: int, threads: int, smem_bytes: int) -> dict:
    """Theoretical blocks and warps per SM on sm_90 and what limits them."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // SM90["reg_granule"]) * SM90["reg_granule"]
    by_regs = SM90["subparts"] * (SM90["regs"] // SM90["subparts"] // per_warp) // warps
    by_smem = SM90["smem"] // max(smem_bytes, SM90["smem_reserved"])
    limits = {"registers": by_regs, "shared_memory": by_smem, "warps": SM90["warps"] // warps, "blocks": SM90["blocks"]}
    blocks = min(limits.values())
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps, "occupancy": round(blocks * warps / SM90["warps"], 3),
            "limited_by": sorted(k for k, v in limits.items() if v == blocks), "blocks_by": limits}


def dyn_smem(fn) -> int:
    """Bytes of the PrimFunc's shared.dyn allocations (TVM merges them into one dynamic buffer at launch)."""
    size = {"float16": 2, "bfloat16": 2, "float32": 4}
    total = 0
    for shape, dt in re.findall(r"sblock_alloc_buffer\(\(([\d, ]+)\),\s*\"(\w+)\",\s*scope=\"shared\.dyn\"", fn.script()):
        n = 1
        for d in shape.replace(" ", "").strip(",").split(","):
            n *= int(d)
        total += n * size[dt]
    return total


def grids(fn) -> list[int]:
    """Blocks per launch of each kernel, in order (gpu_kernel, gpu_kernel_1, ...): a blockIdx.x binding starts
    a kernel, blockIdx.y/z multiply into it."""
    out = []
    for extent, axis in re.findall(r"T\.thread_binding\((\d+), thread=\"blockIdx\.([xyz])\"\)", fn.script()):
        if axis == "x":
            out.append(int(extent))
        else:
            out[-1] *= int(extent)
    return out


def analyse(name: str, kind: str, shapes: dict, knobs: dict, arch: str = "sm_90", sms: int = 132) -> dict:
    import tvm
    from tvm.support import nvcc

    from tvmfuse.kernels.attention.decode import TEMPLATE as DECODE
    from tvmfuse.kernels.attention.prefill import TEMPLATE as PREFILL
    fn = (PREFILL if kind == "prefill" else DECODE)(shapes, knobs)
    target = tvm.target.Target({"kind": "cuda", "arch": arch}, host={"kind": "llvm"})
    src = tvm.compile(tvm.IRModule({"main": fn}), target=target).jit().imports[0].inspect_source("cuda")
    with tempfile.TemporaryDirectory() as d, target:
        cubin = os.path.join(d, "k.cubin")
        nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc", path_target=cubin)
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], check=True, capture_output=True, text=True).stdout
        res = subprocess.run([tool("cuobjdump"), "-res-usage", cubin], check=True, capture_output=True, text=True).stdout
    usage = {m.group(1): {k: int(v) for k, v in re.findall(r"(\w+(?:\[0\])?):(\d+)", m.group(2))}
             for m in re.finditer(r"Function (\S+):\s*\n\s*(REG:.*)", res)}
    bounds = {k: int(t) for t, k in re.findall(r"__launch_bounds__\((\d+)\)\s+(\w+)\(", src)}
    dyn = dyn_smem(fn)

    def uses_dyn(kern: str) -> bool:  # the kernel's definition declares the dynamic shared buffer
        return any(f" {kern}(" in c and "{" in c and "extern __shared__" in c for c in src.split("__global__"))
    out = {"knobs": knobs, "dynamic_smem_bytes": dyn, "cuda_source_has_wgmma": "wgmma" in src, "kernels": {}}
    blocks = dict(zip(["gpu_kernel"] + [f"gpu_kernel_{i}" for i in range(1, 8)], grids(fn)))
    for kern, ins in parse_sass(sass).items():
        u = usage.get(kern, {})
        occ = occupancy(u.get("REG", 0), bounds.get(kern, 128), smem := u.get("SHARED", 0) + (dyn if uses_dyn(kern) else 0))
        ops = [op for _, _, op, _ in ins]
        out["kernels"][kern] = {
            "threads_per_block": bounds.get(kern), "registers": u.get("REG"), "stack_bytes": u.get("STACK"),
            "local_bytes": u.get("LOCAL"), "static_smem_bytes": u.get("SHARED"), "smem_per_block_bytes": smem,
            "wgmma_HGMMA": sum(op.startswith("HGMMA") for op in ops), "tma_UTMA": sum(op.startswith("UTMA") for op in ops),
            "instructions": len(ins), "classes": classify(ops), "occupancy": occ, "grid_blocks": blocks.get(kern),
            f"waves_on_{sms}_sms": round(blocks[kern] / (occ["blocks_per_sm"] * sms), 2) if kern in blocks else None,
            "loop": main_loop(ins)}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/attention_sass.json")
    p.add_argument("--knobs", default="bench/results/attention_run2.json", help="the GPU run whose best_knobs to build (tar -xJf bench/results/archive-sessions-5-7.tar.xz first)")
    p.add_argument("--arch", default="sm_90", help="the bench's target arch (sm_90a gives the same SASS for these kernels)")
    args = p.parse_args()
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")  # as the bench built them (only the source is used here)
    import tvm

    from bench.attention import CASES as BENCH
    with open(args.knobs) as f:
        run = json.load(f)["cases"]

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT, check=False).stdout.strip()
    res = {"what": "STATIC analysis (cubin via TVM's nvcc call, cuobjdump); `measured` is copied from the GPU run",
           "arch": args.arch, "tvm": tvm.__version__, "knobs_from": args.knobs, "commit": git("rev-parse", "--short", "HEAD"),
           "templates_modified": bool(git("status", "--porcelain", "tvmfuse/kernels")), "cases": {}}
    for name, kind, shapes in BENCH:
        if name not in CASES:
            continue
        got = run[name]
        measured = {k: got[k] for k in ("tvmfuse_us", "tvmfuse_tflops", "tvmfuse_TBps", "torch_us", "torch_choice",
                                         "torch_tflops", "torch_TBps") if k in got}
        res["cases"][name] = {"measured": measured, **analyse(name, kind, shapes, got["best_knobs"], args.arch)}
        for kern, k in res["cases"][name]["kernels"].items():
            lp = k["loop"] or {"paths": []}
            print(name, kern, f"grid {k['grid_blocks']} regs {k['registers']} smem {k['smem_per_block_bytes']} occ {k['occupancy']['occupancy']}"
                  f" ({','.join(k['occupancy']['limited_by'])}) loop paths",
                  [(q["instructions"], q["HMMA"]) for q in lp["paths"]], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
