"""The kernels `bench/ncu.sh` profiles with Nsight Compute: wgmma GEMM tiles beside cuBLAS at the same shape, and the
wgmma attention at issue 25's shapes (its default knobs, or the ones given) beside cuDNN's SDPA. Each is built,
checked against its peer and warmed up first; then each is launched once between cudaProfilerStart and Stop, in the
order `--out` lists, so `ncu --profile-from-start off` sees those launches alone.

    python3 bench/ncu_kernels.py --out labels.json [--gemm 512x4096x4096:128x128x4d[:bf16][:gelu] ...]
                                 [--attention prefill_wgmma_b1_h32_s2048_d128_fp16[:block_n=128,...] ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gemm_pair(spec: str):
    """('M x K x N:tile[:bf16][:gelu]') -> [(label, launch)] for the tile and cuBLAS, after checking the tile."""
    import torch
    import torch.nn.functional as F
    import tvm

    from bench.smallm import inputs
    from bench.wgmma import _build
    shape, tile, *opts = spec.split(":")
    m, k, n = (int(v) for v in shape.split("x"))
    dt = "bfloat16" if "bf16" in opts else "float16"
    gelu = "gelu" in opts
    lib, err = _build("wgmma", (m, k, n, gelu, tile, dt))
    if err:
        raise SystemExit(f"error: {spec}: {err}")
    x, w, b = (t.to(getattr(torch, dt)) for t in inputs(m, k, n))
    x2 = x.reshape(m, k)
    ref_fn = (lambda: F.gelu(F.linear(x2, w, b))) if gelu else (lambda: F.linear(x2, w))
    args = [tvm.runtime.from_dlpack(v.contiguous()) for v in (x2, w, b)]
    out = tvm.runtime.empty((m, n), dt, tvm.cuda(0))
    lib["main"](*args, out)
    err = float((torch.from_dlpack(out).float() - ref_fn().float()).abs().max())
    print(f"{spec}: max |tile - cuBLAS| {err:.3g}", flush=True)
    return [(f"{spec} tvmfuse", lambda: lib["main"](*args, out)), (f"{spec} cublas", ref_fn)]


def attention_pair(spec: str):
    """('case[:knob=v,...]') -> [(label, launch)] for the wgmma template and cuDNN's SDPA, after checking it."""
    import torch
    import torch.nn.functional as F
    import tvm
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.attention import WGMMA_CASES
    from tvmfuse.kernels import ATTENTION_PREFILL_WGMMA as tmpl
    from tvmfuse.kernels.hopper.gemm_bench import hopper_target
    name, _, knobs = spec.partition(":")
    s = dict(next(c[2] for c in WGMMA_CASES if c[0] == name), arch="sm_90a")
    kn = dict(tmpl.default_knobs(s), **{a: int(v) for a, v in (p.split("=") for p in knobs.split(",") if p)})
    B, H, HKV, SQ, L, D = (s[x] for x in ("batch", "heads", "kv_heads", "seq_q", "seq_k", "head_dim"))
    tdt = getattr(torch, s["dtype"])
    q, k, v = (torch.randn(sh, device="cuda", dtype=tdt) for sh in ((B, H, SQ, D), (B, HKV, L, D), (B, HKV, L, D)))
    lib = tvm.compile(tvm.IRModule({"main": tmpl(s, kn)}), target=hopper_target(), tir_pipeline="tirx")
    out = torch.empty((B, H, SQ, D), device="cuda", dtype=tdt)
    args = [tvm.runtime.from_dlpack(t) for t in (q, k, v, out)]
    lib["main"](*args)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=s["causal"], enable_gqa=H != HKV)
    err = float((out.float() - cudnn().float()).abs().max())
    print(f"{spec} {kn}: max |template - cuDNN| {err:.3g}", flush=True)
    return [(f"{spec} tvmfuse", lambda: lib["main"](*args)), (f"{spec} cudnn", cudnn)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON: the labels of the profiled launches, in order")
    p.add_argument("--gemm", nargs="*", default=[])
    p.add_argument("--attention", nargs="*", default=[])
    opts = p.parse_args()
    import torch
    launches = [pair for spec in opts.gemm for pair in gemm_pair(spec)]
    launches += [pair for spec in opts.attention for pair in attention_pair(spec)]
    for _ in range(20):  # warm-up: module load, cuBLAS/cuDNN plans, clocks up
        for _, fn in launches:
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _, fn in launches:
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    with open(opts.out, "w") as f:
        json.dump([label for label, _ in launches], f, indent=1)


if __name__ == "__main__":
    main()
