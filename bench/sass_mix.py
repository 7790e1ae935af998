"""Static SASS instruction mix of the bench cases' kernels (no GPU needed): TVM CUDA source -> nvcc -cubin -> cuobjdump.

    python3 bench/sass_mix.py --out bench/results/sass_mix.json [--cases ln_gelu,gemv_m16,gemm_m4096]

For each kernel it counts SASS instructions by class: global loads/stores by width (LDG.E.128 = 16 bytes per
thread), shared-memory traffic (LDS/STS/LDSM = ldmatrix, LDGSTS = cp.async), FP32 FMA/ADD/MUL, HFMA2,
HMMA (tensor core), MUFU (erf/tanh/exp/rsqrt: the SFU) and conversions (F2F). These are STATIC counts (the
instructions in the binary), not executed counts: a loop body counts once. `per_output` divides them by the
outputs each thread writes in the unrolled code only where that is exact (see `note`). nvcc/cuobjdump: the
CUDA toolkit's; cuobjdump from the `nvidia-cuda-cuobjdump` wheel works (set CUOBJDUMP or put it on PATH).
"""

from __future__ import annotations

import argparse, collections, glob, json, os, re, shutil, subprocess, sys, sysconfig, tempfile  # noqa: E401

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLASSES = [  # (class, regex on the opcode with modifiers)
    ("LDG.128", r"^LDG\.E\.(?:\S+\.)?128"), ("LDG.64", r"^LDG\.E\.(?:\S+\.)?64"),
    ("LDG.32", r"^LDG\.E(?:\.(?:CONSTANT|EF|EL|LU|NA|STRONG\.\w+|SYS|GPU))*$"),
    ("LDG.16", r"^LDG\.E\.(?:\S+\.)?U?16"), ("LDG.8", r"^LDG\.E\.(?:\S+\.)?U?8"),
    ("STG.128", r"^STG\.E\.(?:\S+\.)?128"), ("STG.64", r"^STG\.E\.(?:\S+\.)?64"),
    ("STG.32", r"^STG\.E(?:\.(?:EF|EL|NA|STRONG\.\w+|SYS|GPU))*$"), ("STG.16", r"^STG\.E\.(?:\S+\.)?U?16"),
    ("LDGSTS", r"^LDGSTS"), ("LDSM", r"^LDSM"), ("LDS", r"^LDS(?!M)"), ("STS", r"^STS"),
    ("HMMA", r"^HMMA"), ("HFMA2", r"^HFMA2"), ("HADD2/HMUL2", r"^H(?:ADD2|MUL2)"),
    ("FFMA", r"^FFMA"), ("FADD", r"^FADD"), ("FMUL", r"^FMUL"), ("MUFU", r"^MUFU"), ("F2F", r"^F2F"),
    ("SHFL", r"^SHFL"), ("BAR", r"^BAR"), ("DEPBAR", r"^DEPBAR"), ("BRA", r"^BRA"),
]


def tool(name: str) -> str:
    """Path of a CUDA tool: $NAME, PATH, or the nvidia-cuda-<name> wheel's bin folder."""
    path = os.environ.get(name.upper()) or shutil.which(name)
    if not path:
        roots = {sysconfig.get_paths()["purelib"], os.path.dirname(os.path.dirname(os.__file__))}  # venv or base
        hits = [h for root in sorted(roots) for h in glob.glob(os.path.join(root, "**", "nvidia", "*", "bin", name),
                                                                recursive=True)] + \
            glob.glob(f"/tmp/*/nvtools/nvidia/*/bin/{name}")
        path = hits[0] if hits else None
    if not path:
        raise SystemExit(f"{name} not found: pip install nvidia-cuda-{name} (or set {name.upper()})")
    return path


def sass_of(cuda_src: str, arch: str = "sm_90a") -> str:
    """cuobjdump -sass of the source compiled by nvcc for `arch`."""
    with tempfile.TemporaryDirectory() as d:
        cu, cubin = os.path.join(d, "k.cu"), os.path.join(d, "k.cubin")
        open(cu, "w").write(cuda_src)
        subprocess.run([tool("nvcc"), "-cubin", f"-arch={arch}", "-O3", "-o", cubin, cu], check=True,
                       capture_output=True)
        env = dict(os.environ)  # cuobjdump -sass runs nvdisasm: from PATH, or beside it from its wheel
        env["PATH"] = os.pathsep.join([os.path.dirname(tool("nvdisasm")), env.get("PATH", "")])
        return subprocess.run([tool("cuobjdump"), "-sass", cubin], check=True, capture_output=True, text=True,
                              env=env).stdout


def mix(sass: str) -> dict[str, dict]:
    """Per kernel: total instructions, counts per class, MUFU sub-ops."""
    kernels, cur = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = kernels.setdefault(m.group(1), {"total": 0, "classes": collections.Counter(), "mufu": collections.Counter()})
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if cur is None or not m:
            continue
        op = m.group(1)
        if op == "NOP":
            continue
        cur["total"] += 1
        for cls, rx in CLASSES:
            if re.match(rx, op):
                cur["classes"][cls] += 1
                if cls == "MUFU":
                    cur["mufu"][op.split(".", 1)[1] if "." in op else "?"] += 1
                break
    return {k: {"total": v["total"], "classes": dict(v["classes"]), "mufu": dict(v["mufu"])} for k, v in kernels.items()}


def schedules(case: str, pf, target):
    """(label, scheduled IRModule, build config) for the schedules we measure for this case."""
    import tvm
    from tvmfuse.spaces import default_schedule, gemm, gemv
    out = [("dlight_default", default_schedule(tvm.IRModule({"main": pf}), target), {})]
    if case.startswith("gemv"):
        for tx, ky, vec in ((32, 8, 8), (64, 4, 4), (16, 16, 8)):
            sch = tvm.s_tir.Schedule(pf)
            if gemv.schedule_gemv(sch, tx=tx, ky=ky, vec=vec, unroll=16):
                out.append((f"gemv_space tx={tx} ky={ky} vec={vec}", sch.mod, {}))
    if case == "gemm_m4096":  # 64x64 block tile, 4 warps of 32x32, K step 32 (units: 16 rows, 8 columns, 8 of K)
        got = gemm.sample_schedule(pf, target, tiles=[[8, 8, 2, 2, 1], [43, 4, 2, 2, 2], [128, 1, 4]])
        if got is not None:
            out.append(("mma_space 64x64x32", got, dict(gemm.BUILD_CONFIG)))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/sass_mix.json")
    p.add_argument("--cases", default="ln_gelu,gemv_m16,gemm_m4096")
    args = p.parse_args()
    import tvm
    from bench import cases
    target = tvm.target.Target("nvidia/nvidia-h100")
    res = {"what": "static SASS instruction counts per kernel (instructions in the cubin, not executed counts)",
           "arch": "sm_90a", "tvm": tvm.__version__, "cases": {}}
    for case in args.cases.split(","):
        build, shape, _, _ = cases.CASES[case]
        _, pf = cases.fused_primfunc(*build(*shape))
        for label, mod, cfg in schedules(case, pf, target):
            try:
                with tvm.transform.PassContext(config=cfg):
                    src = tvm.compile(mod, target=target).jit().imports[0].inspect_source("cuda")
                kern = mix(sass_of(src))
                launch = re.findall(r"__launch_bounds__\((\d+)\)", src)
                res["cases"].setdefault(case, {})[label] = {"threads_per_block": [int(x) for x in launch], "kernels": kern}
                print(case, label, json.dumps({k: v["classes"] for k, v in kern.items()}), flush=True)
            except Exception as err:  # pylint: disable=broad-except
                res["cases"].setdefault(case, {})[label] = {"error": str(err).splitlines()[-1][:300]}
                print(case, label, "FAILED", str(err).splitlines()[-1][:300], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
