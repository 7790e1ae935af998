"""CPU emulation of tvmfuse's fp16 precision policy on the bench's Llama layer (bench/hf_models.py, prefill): where
the fp16 build's error against the fp32 reference comes from. Each rounding point (a tensor stored in fp16) can be
switched on alone or with the others; the layer is written out from the HF modules' fp32 weights (matches HF to
~1e-5 with no rounding). A helper's study, 2026-12-01 (docs/benchmarks.md, eighth session).

    python bench/fp16_error.py [--seq 512] [--seeds 0,1]     # ~1 min per configuration on 2 cores
    python bench/fp16_error.py --dtype bf16 [--ablate]       # the bf16 build's rounding points (BF16_CONFIGS)
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import hf_models as H

#: rounding points: W weights, emb lookup, n1/n2/n3 norm outputs, q/k/v projections, rope tables and ops, the q/k
#: scale in fp16, scores (QK^T stored fp16), probs, attn output, o projection, res1/res2 residual sums, silu(gate),
#: mlp (up x silu), down, logits
ALL = ["W", "emb", "n1", "q", "k", "v", "rope_tab", "rope_ops", "qk_scale", "scores", "probs", "attn",
       "o", "res1", "n2", "silu", "mlp", "down", "res2", "n3", "logits"]


class Emu:
    def __init__(self, model, low=torch.float16):
        self.m = model
        self.low = low
        mm = model.model; L = mm.layers[0]; a = L.self_attn; p = L.mlp
        g = lambda lin: lin.weight.detach().clone()
        self.W32 = dict(emb=mm.embed_tokens.weight.detach().clone(), q=g(a.q_proj), k=g(a.k_proj), v=g(a.v_proj),
                        o=g(a.o_proj), gate=g(p.gate_proj), up=g(p.up_proj), down=g(p.down_proj), head=g(model.lm_head))
        self.W16 = {k: v.to(low).float() for k, v in self.W32.items()}  # the weights in `low` (fp16 or bf16)
        self.nw = [L.input_layernorm.weight, L.post_attention_layernorm.weight, mm.norm.weight]
        self.eps = model.config.rms_norm_eps
        self.rot = mm.rotary_emb
        self.nh = model.config.num_attention_heads; self.hd = model.config.head_dim

    def norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def forward(self, ids, on=(), keep=None, tap=None):
        """The layer's logits with the rounding points `on`; `tap(name, tensor)` sees each point's value as stored."""
        on = set(on)

        lo = self.low

        def r(n, x):
            x = x.to(lo).float() if n in on else x
            if tap is not None:
                tap(n, x)
            return x
        W = {n: (self.W16[n] if ("W" in on or "W:" + n in on) else self.W32[n]) for n in self.W32}
        T = ids.shape[1]; nh, hd = self.nh, self.hd
        h = r("emb", W["emb"][ids[0]])                     # [T, D]
        x = r("n1", self.norm(h, self.nw[0]))
        q = r("q", x @ W["q"].T); k = r("k", x @ W["k"].T); v = r("v", x @ W["v"].T)
        q = q.view(T, nh, hd).transpose(0, 1); k = k.view(T, nh, hd).transpose(0, 1); v = v.view(T, nh, hd).transpose(0, 1)
        pos = torch.arange(T)[None]
        cos, sin = self.rot(h[None], pos); cos = r("rope_tab", cos[0]); sin = r("rope_tab", sin[0])
        ro = (lambda x: x.to(lo).float()) if "rope_ops" in on else (lambda x: x)
        def rope(t):
            t2 = torch.cat((-t[..., hd // 2:], t[..., :hd // 2]), -1)
            return ro(ro(t * cos) + ro(t2 * sin))
        q = r("rope_out", rope(q)); k = r("rope_out", rope(k))
        if "scale_fused" in on:   # fp16 q,k rope'd + scaled in fp32 in one kernel, one fp16 rounding
            s = math.sqrt(1 / math.sqrt(hd))
            if "rope_out" in on: raise ValueError
            q = (q * s).to(lo).float(); k = (k * s).to(lo).float()
            sc = q @ k.transpose(-1, -2)
        elif "qk_scale" in on:
            s = float(torch.tensor(math.sqrt(1 / math.sqrt(hd))).to(lo))
            q = (q * s).to(lo).float(); k = (k * s).to(lo).float()
            sc = q @ k.transpose(-1, -2)
        elif "scale_const16" in on:  # the GPU template: fp32 scores scaled by the fp16 constant's square
            s = float(torch.tensor(math.sqrt(1 / math.sqrt(hd))).to(lo))
            sc = (q @ k.transpose(-1, -2)) * (s * s)
        else:
            sc = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        sc = r("scores", sc)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        sc = sc.masked_fill(~mask, float("-inf"))
        if "probs_flash" in on:  # the prefill template: exp(s - max) rounded for the PV product, the sum in fp32
            e = torch.exp(sc - sc.amax(-1, keepdim=True))
            at = r("attn", (e.to(lo).float() @ v) / e.sum(-1, keepdim=True))
        else:
            P = r("probs", torch.softmax(sc, -1))
            at = r("attn", P @ v)
        at = at.transpose(0, 1).reshape(T, nh * hd)
        o = r("o", at @ W["o"].T)
        h = r("res1", h + o)
        x = r("n2", self.norm(h, self.nw[1]))
        sg = r("silu", torch.nn.functional.silu(x @ W["gate"].T))
        mu = r("mlp", (x @ W["up"].T) * sg)
        d = r("down", mu @ W["down"].T)
        h = r("res2", h + d)
        if keep is not None: keep.update(h=h, d=d, o=o, h0=W["emb"][ids[0]])
        x = r("n3", self.norm(h, self.nw[2]))
        return r("logits", x @ W["head"].T)[None]

def stats(out, ref, tol=1e-2):
    """Max abs error, violations of |err| <= tol + tol |ref| (tvmfuse's fp16 tolerance 1e-2, bf16 8e-2; 5e-2 was bf16's before), worst
    err / allowance."""
    e = (out - ref).abs()
    allowance = tol + tol * ref.abs()
    return dict(max=float(e.max()), rms=float((out - ref).pow(2).mean().sqrt()), viol=int((e > allowance).sum()),
                ratio=float((e / allowance).max()))


#: the GPU build (scores fp32 in the attention template, scaled there by the fp16 constant's square), the
#: candidate fix: rotary embedding and the exact scale in fp32, q and k rounded to fp16 once, and that fix as built
CONFIGS = {
    "fp16 policy, scores fp16": set(ALL),
    "GPU build": (set(ALL) - {"qk_scale", "scores"}) | {"scale_const16"},
    "fix: rope + scale fp32": (set(ALL) - {"rope_ops", "qk_scale", "scores"}) | {"scale_fused"},
    # what the build does since: the rotary kernel computes in fp32 and stores q/k once, the attention template
    # scales the fp32 scores by the model's exact scale
    "fix as built": (set(ALL) - {"rope_ops", "qk_scale", "scores"}) | {"rope_out"},
}


#: the bf16 build (prepare/precision.py's bf16 path, as on the H200): every weight bf16, the embedding lookup bf16
#: (its table a bf16 constant: precision._lookups_in_compute_dtype), so the residual stream and its sums are bf16,
#: the norm outputs feeding the matmuls bf16, q/k/v bf16, the rotary tables bf16 constants, the rotary kernel in
#: fp32 storing q/k once, fp32 scores with the exact scale, P = exp(s - max) rounded to bf16 for the PV product
#: (its sum fp32), the attention output, o, SwiGLU (one kernel: silu(g) * u in fp32, stored once) and down bf16,
#: the final norm's output bf16 before the LM head, the logits fp32 (the head's fp32 accumulator is the output)
WEIGHTS = ["W:" + n for n in ("q", "k", "v", "o", "gate", "up", "down", "head")]
LOW_STREAM = {"W:emb", "emb", "res1", "res2"}  # the lookup's table and result, the two residual sums
BF16_BUILD = set(WEIGHTS) | LOW_STREAM | {"n1", "q", "k", "v", "rope_tab", "rope_out", "probs_flash", "attn", "o",
                                          "n2", "mlp", "down", "n3"}
#: rounding points taken out of the bf16 build one at a time (a name: that point; "W": every weight)
BF16_POINTS = {"W": set(WEIGHTS), "n1": {"n1"}, "qkv": {"q", "k", "v"}, "rope_tab": {"rope_tab"},
               "rope_out": {"rope_out"}, "probs": {"probs_flash"}, "attn": {"attn"}, "o": {"o"}, "n2": {"n2"},
               "mlp": {"mlp"}, "down": {"down"}, "n3": {"n3"}}
BF16_CONFIGS = {
    "bf16 build": BF16_BUILD,
    "bf16 build + silu(g) stored": BF16_BUILD | {"silu"},
    # what torch-style bf16 inference rounds besides: the embedding table, both residual sums, the logits,
    # the rotary products op by op
    "torch-style bf16": BF16_BUILD | {"logits", "rope_ops", "silu"} - {"rope_out"},
    # the build until models_run24: the lookup's fp32 table kept the residual stream and its sums fp32
    "bf16 build, fp32 residual stream": BF16_BUILD - LOW_STREAM,
    "fp16 build, same points": BF16_BUILD,  # run in fp16 (the lower rows' yardstick)
    # what could be fp32 for (almost) nothing: the rotary tables (constants, 2 x [T, 128]), then also the o and
    # down projections' outputs, which only the fp32 residual sums read (4 bytes instead of 2 written and read)
    "bf16 build, rope tables fp32": BF16_BUILD - {"rope_tab"},
    "bf16 build, rope tables, o, down fp32": BF16_BUILD - {"rope_tab", "o", "down"},
    # and the rotary embedding in the QKV GEMM's epilogue (q, k rounded once, after the rotation, not twice):
    # every rounding point of this layer that is not a bf16 tensor-core operand or a bf16 weight
    "bf16 build, all but operands fp32": BF16_BUILD - {"rope_tab", "o", "down", "q", "k"},
}


def bf16_table(emu16, emu, ids, ref, seed, seq, ablate, only=None):
    rows = []
    for name, on in BF16_CONFIGS.items():
        if only and name not in only:
            continue
        e = emu16 if name.startswith("fp16") else emu
        rows.append((name, on, e))
    if ablate:
        for point, names in BF16_POINTS.items():
            rows.append((f"bf16 build without {point}", BF16_BUILD - names, emu))
        for point, names in BF16_POINTS.items():
            rows.append((f"only {point}", set(names), emu))
    for name, on, e in rows:
        out = e.forward(ids, on)
        s, wide = stats(out, ref, 5e-2), stats(out, ref, 8e-2)
        print(f"seq={seq} seed={seed} {name:38s} max={s['max']:.5f} rms={s['rms']:.5f} "
              f"outside(5e-2)={s['viol']:3d} worst/allowance={s['ratio']:.3f} "
              f"outside(8e-2)={wide['viol']:3d} worst/allowance(8e-2)={wide['ratio']:.3f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--seeds", default="0")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    p.add_argument("--ablate", action="store_true", help="bf16: each rounding point alone and taken out")
    p.add_argument("--configs", default="", help="bf16: only these BF16_CONFIGS rows (names separated by ';')")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    model = H.build("llama", False)
    emu, wrapped = Emu(model), H.wrap(model, "prefill_512")
    bf16_emu = Emu(model, torch.bfloat16) if args.dtype == "bf16" else None
    for seed in (int(s) for s in args.seeds.split(",")):
        feeds = H.inputs("llama", model, dict(batch=1, seq=args.seq, kv_len=0), seed=seed)
        ids = torch.from_numpy(feeds["input_ids"])
        ref = wrapped(ids)
        if args.dtype == "bf16":
            bf16_table(emu, bf16_emu, ids, ref, seed, args.seq, args.ablate,
                       [c for c in args.configs.split(";") if c])
            continue
        for name, on in CONFIGS.items():
            s = stats(emu.forward(ids, on), ref)
            print(f"seq={args.seq} seed={seed} {name:26s} max={s['max']:.5f} rms={s['rms']:.5f} "
                  f"violations={s['viol']:3d} worst/allowance={s['ratio']:.3f}", flush=True)


if __name__ == "__main__":
    main()
