"""Where a tvmfuse fp16 build of the bench's Llama layer departs from the fp32 reference, kernel by kernel: every
kernel's output in one run of the built module (the Relax VM's instrument hook) against the layer's fp32
intermediates (bench/fp16_error.py's Emu, no rounding), beside what the CPU emulation of the precision policy
gives for the same tensor. A tensor whose error is well above its emulation's is where the build does something
the emulation does not model.

    python bench/fp16_trace.py --target cuda [--seq 512] [--out trace.json]    # on the GPU machine
    python bench/fp16_trace.py --target llvm --smoke --seq 8                   # CPU check, tiny config
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import fp16_error as E
from bench import hf_models as H


def taps(emu, ids, on) -> dict[str, torch.Tensor]:
    """Every rounding point's stored value by name (q/k rope outputs as rope_q/rope_k), fp64 on the CPU."""
    got: dict[str, torch.Tensor] = {}

    def tap(name, x):
        if name == "rope_out":
            name = "rope_q" if "rope_q" not in got else "rope_k"
        if name not in got:
            got[name] = x.detach().double().cpu()
    emu.forward(ids, on, tap=tap)
    return got


def views(t: torch.Tensor) -> list[torch.Tensor]:
    """The layouts a kernel may store a reference tensor in: as is, and heads/sequence swapped ([H,T,D] <-> [T,H,D])."""
    out = [t.reshape(-1)]
    if t.dim() == 3:
        out += [t.transpose(0, 1).reshape(-1), t.transpose(1, 2).reshape(-1), t.permute(1, 2, 0).reshape(-1)]
    return out


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def match(out: np.ndarray, ref: dict, emu: dict) -> dict | None:
    """The reference tensor (and layout) closest to a kernel output, its relative rms error, the emulation's."""
    x = torch.from_numpy(out.astype(np.float64).reshape(-1))
    best = None
    for name, t in ref.items():
        if t.numel() != x.numel():
            continue
        for i, v in enumerate(views(t)):
            err = rel_rms(x, v)
            if best is None or err < best["rel_rms"]:
                best = {"ref": name, "layout": i, "rel_rms": err, "max_abs": float((x - v).abs().max()),
                        "emulated_rel_rms": rel_rms(views(emu[name])[i], v) if name in emu else None}
    return best if best is not None and best["rel_rms"] < 0.1 else None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="cuda")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--config", default="fix as built", choices=list(E.CONFIGS), help="emulation to compare with")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--smoke", action="store_true", help="the tiny Llama config (a CPU check of this script)")
    args = p.parse_args()
    import tvm  # pylint: disable=import-outside-toplevel

    from tvmfuse import pipeline  # pylint: disable=import-outside-toplevel
    from tvmfuse.jobs import Job  # pylint: disable=import-outside-toplevel
    from tvmfuse.export.runtime import load  # pylint: disable=import-outside-toplevel
    from tvmfuse.targets import resolve_target  # pylint: disable=import-outside-toplevel

    torch.set_grad_enabled(False)
    model = H.build("llama", args.smoke)
    feeds = H.inputs("llama", model, {"batch": 1, "seq": args.seq, "kv_len": 0})
    ids = torch.from_numpy(feeds["input_ids"])
    emu = E.Emu(model)
    ref, emulated = taps(emu, ids, ()), taps(emu, ids, E.CONFIGS[args.config])
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "llama.onnx")
        H.export(H.wrap(model, "prefill_512"), feeds, path)
        del model
        job = Job("llama", path, {}, 0, "fp16", tolerance=(1.0, 1.0))  # the trace checks the error itself
        result = pipeline.run_job(job, resolve_target(args.target), os.path.join(work, "out"),
                                  os.path.join(work, "logs"), say=print)
        if not result.ok:
            raise SystemExit(f"build failed: {result.error}")
        loaded = load(result.output)
        rows = []

        def instrument(func, symbol, before, ret, *call_args):
            if not before and not str(symbol).startswith("vm.") and call_args and isinstance(
                    call_args[-1], tvm.runtime.Tensor):
                out = call_args[-1].numpy()
                if out.dtype in (np.float16, np.float32):
                    rows.append({"kernel": str(symbol), "shape": list(out.shape), "dtype": str(out.dtype),
                                 **(match(out, ref, emulated) or {"ref": None})})
            return 0
        loaded.vm.set_instrument(instrument)
        logits = loaded(feeds["input_ids"])[0]
    stats = E.stats(torch.from_numpy(logits.astype(np.float32)), ref["logits"].float().reshape(logits.shape))
    emu_stats = E.stats(emulated["logits"].float(), ref["logits"].float())
    for r in rows:
        if r["ref"]:
            print(f"{r['kernel'][:48]:48s} {r['ref']:9s} rel_rms {r['rel_rms']:.2e}  emulated {r['emulated_rel_rms']:.2e}"
                  f"  max_abs {r['max_abs']:.4f}")
        else:
            print(f"{r['kernel'][:48]:48s} (no reference tensor) {r['shape']} {r['dtype']}")
    print("logits:", stats, "emulation:", emu_stats)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"seq": args.seq, "target": args.target, "config": args.config, "logits": stats,
                       "emulated_logits": emu_stats, "kernels": rows}, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
