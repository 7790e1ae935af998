"""GPU benchmark of the small-M (decode batch) matmul schedule (tvmfuse/spaces/smallm.py): every knob set at the
issue-5 GEMV shape and the Llama decode-16 projections, checked against torch and timed beside torch (cuBLAS).

    python3 bench/smallm.py --out results.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [  # name, M, K, N, epilogue (bias + GELU, the issue-5 case; none: a Llama projection)
    ("m16_k4096_n11008_bias_gelu", 16, 4096, 11008, True),
    ("m16_k4096_n4096", 16, 4096, 4096, False),
    ("m16_k11008_n4096", 16, 11008, 4096, False),
]


def write_json(path, res, finished=False):
    """Write the results so far (compact JSON); `finished` stamps the end time first."""
    import json

    if finished:
        res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(path, "w") as f:
        json.dump(res, f, separators=(",", ":"))


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def kernel(m, k, n, gelu):
    """The fused PrimFunc tvmfuse builds for y = [gelu](x @ W^T [+ b]) in fp16, fp32 accumulation, W stored [N, K]."""
    from tvm import relax, tirx

    from tvmfuse.fuse.fusion import lower
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, m, k), "float16"))
    w = relax.Var("w", relax.TensorType((n, k), "float16"))
    params = [x, w] + ([relax.Var("b", relax.TensorType((n,), "float16"))] if gelu else [])
    with bb.function("main", params):
        with bb.dataflow():
            mm = bb.emit(relax.op.astype(bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w)),
                                                                   out_dtype="float32")), "float16"))
            y = relax.op.nn.gelu(bb.emit(relax.op.add(mm, params[2]))) if gelu else mm
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    low = lower(bb.get())
    (fn,) = [f for f in low.mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return fn.with_attr("global_symbol", "main")


def copy_bandwidth():
    """Device-to-device copy bandwidth in bytes/s (256 MiB, 20 copies)."""
    import torch

    x_ = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    y_ = torch.empty_like(x_)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record(); [y_.copy_(x_) for _ in range(20)]; t1.record(); torch.cuda.synchronize()
    return 2 * x_.numel() * 20 / (t0.elapsed_time(t1) / 1e3)


def inputs(m, k, n):
    """x [1, M, K], W [N, K] (scaled 0.02), bias [N] (0.1): fp16, seeded."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, m, k, device="cuda", dtype=torch.float16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=g) * 0.02
    return x, w, torch.randn(n, device="cuda", dtype=torch.float16, generator=g) * 0.1


_SPIN_CYCLES_PER_US: list[float] = []  # torch.cuda._sleep's cycles a µs on this GPU, once measured


def hold_the_gpu(us: float) -> None:
    """Queue a kernel that spins about `us` µs (torch.cuda._sleep) on the current stream, so that the launches the
    host queues behind it meanwhile run back to back: a kernel shorter than its host-side launch (a decode GEMV
    called from Python: ~15-25 µs a call) is then timed at the GPU's pace, not the host's."""
    import torch

    if not _SPIN_CYCLES_PER_US:
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0.record(); torch.cuda._sleep(1_000_000); t1.record(); torch.cuda.synchronize()
        _SPIN_CYCLES_PER_US.append(1_000_000 / (t0.elapsed_time(t1) * 1e3))
    torch.cuda._sleep(int(us * _SPIN_CYCLES_PER_US[0]))


def queued_time(call, runs: int, tries: int = 4) -> float:
    """Mean µs of `call(r)` for r in range(runs), the launches queued behind `hold_the_gpu` for twice the host's
    time to issue them (measured first), timed by CUDA events around them. Where the spinning kernel had ended
    before the host had queued them all (a host slowed meanwhile, e.g. by compiles in other threads: the launches
    ran at its pace), again with twice the spin, up to `tries` times; then it is an error."""
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for r in range(runs):
        call(r)
    spin_us = 2 * (time.perf_counter() - t) * 1e6 + 200
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(tries):
        torch.cuda.synchronize()
        hold_the_gpu(spin_us)
        t0.record()
        for r in range(runs):
            call(r)
        queued = not t0.query()  # the spin still ran once every launch was queued
        t1.record()
        torch.cuda.synchronize()
        if queued:
            return t0.elapsed_time(t1) * 1e3 / runs
        spin_us *= 2
    raise RuntimeError(f"the host took longer to queue {runs} calls than a {spin_us / 2:.0f} µs spin, {tries} times")


def torch_time(fn, runs=100):
    """Mean µs of `fn` over `runs` calls after 3 warm-up calls (CUDA events; the calls queued behind a spinning
    kernel, `queued_time`)."""
    for _ in range(3):
        fn()
    return queued_time(lambda _: fn(), runs)


def time_variants(fn, variants, built, by_name, ref, out_shape, default, name):
    """Run each built variant of `fn` on the named torch inputs (in the PrimFunc's parameter order), check it
    against `ref` and time it (median of 5 x 100 runs): one row per variant."""
    import numpy as np
    import torch
    import tvm

    dev = tvm.cuda(0)
    args = [tvm.runtime.tensor(by_name[str(prm.name)].cpu().numpy(), dev) for prm in fn.params[:-1]]
    rows = []
    for (knobs, _), b_res in zip(variants, built):
        row = {"knobs": knobs, "default": knobs == default}
        if b_res.error_msg:
            row["error"] = b_res.error_msg.strip().splitlines()[-1][:200]
            rows.append(row)
            continue
        try:
            lib = tvm.runtime.load_module(b_res.artifact_path)
            out = tvm.runtime.tensor(np.zeros(out_shape, "float16"), dev)
            lib["main"](*args, out)
            row["max_abs_err"] = float((torch.from_numpy(out.numpy()).cuda().float() - ref).abs().max())
            ev = lib.time_evaluator("main", dev, number=100, repeat=5)
            row["us"] = float(np.median(ev(*args, out).results) * 1e6)
        except Exception as err:  # noqa: BLE001  (a variant that fails to launch: too many registers, ...)
            row["error"] = str(err).strip().splitlines()[-1][:200]
            rows.append(row)
            continue
        rows.append(row)
        log(name, knobs, f"{row['us']:.1f} us err {row['max_abs_err']:.2e}")
    return rows


def knob_sets(m):
    return [dict(tn=tn, warps=w, vec=v) for tn, w, v in itertools.product((1, 2, 4, 8), (2, 4, 8), (4, 8))
            if (m * tn) % 32 == 0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    opts = p.parse_args()
    import torch
    import torch.nn.functional as F
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    from tvmfuse.spaces import smallm
    from tvmfuse.targets import resolve_target
    from tvmfuse.tune.search import make_builder as _builder

    target = resolve_target("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": {}}
    bw = copy_bandwidth()
    res["copy_bw_TBps"] = bw / 1e12
    for name, m, k, n, gelu in CASES:
        fn = kernel(m, k, n, gelu)
        default = smallm.default_knobs(m)
        variants = []
        for knobs in knob_sets(m):
            sch = s_tir.Schedule(fn)
            if smallm.schedule_small_m(sch, **knobs):
                variants.append((knobs, sch.mod))
        built = _builder(os.cpu_count() or 1).build([ms.builder.BuilderInput(mod, target) for _, mod in variants])
        x, w, b = inputs(m, k, n)
        ref_fn = (lambda: F.gelu(F.linear(x, w, b))) if gelu else (lambda: F.linear(x, w))
        ref, torch_us = ref_fn().float(), torch_time(ref_fn)
        ideal_us = 2 * (m * k + n * k + n + m * n) / bw * 1e6
        rows = time_variants(fn, variants, built, {"x": x, "w": w, "b": b}, ref, (1, m, n), default, name)
        ok = [r for r in rows if "us" in r and r["max_abs_err"] < 3e-2]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        dflt = next((r for r in rows if r["default"]), None)
        res["cases"][name] = {
            "m": m, "k": k, "n": n, "epilogue": "bias+gelu" if gelu else "none", "torch_us": torch_us,
            "ideal_us": ideal_us, "fma_bound_us_fp32_cuda_cores": m * k * n / (132 * 128 * 1.98e9) * 1e6,
            "default_knobs": default, "default_us": dflt.get("us") if dflt else None,
            "best": best, "variants": rows}
        log(name, f"torch {torch_us:.1f} us, ideal {ideal_us:.1f} us, default {res['cases'][name]['default_us']}, "
            f"best {best and best['us']:.1f} {best and best['knobs']}")
        with open(opts.out, "w") as f:
            json.dump(res, f, indent=1)
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(opts.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
