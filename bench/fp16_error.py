"""CPU emulation of tvmfuse's fp16 precision policy on the bench's Llama layer (bench/hf_models.py, prefill): where
the fp16 build's error against the fp32 reference comes from. Each rounding point (a tensor stored in fp16) can be
switched on alone or with the others; the layer is written out from the HF modules' fp32 weights (matches HF to
~1e-5 with no rounding). A helper's study, 2026-12-01 (docs/benchmarks.md, eighth session).

    python bench/fp16_error.py [--seq 512] [--seeds 0,1]     # ~1 min per configuration on 2 cores
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
    def __init__(self, model):
        self.m = model
        mm = model.model; L = mm.layers[0]; a = L.self_attn; p = L.mlp
        g = lambda lin: lin.weight.detach().clone()
        self.W32 = dict(emb=mm.embed_tokens.weight.detach().clone(), q=g(a.q_proj), k=g(a.k_proj), v=g(a.v_proj),
                        o=g(a.o_proj), gate=g(p.gate_proj), up=g(p.up_proj), down=g(p.down_proj), head=g(model.lm_head))
        self.W16 = {k: v.half().float() for k, v in self.W32.items()}
        self.nw = [L.input_layernorm.weight, L.post_attention_layernorm.weight, mm.norm.weight]
        self.eps = model.config.rms_norm_eps
        self.rot = mm.rotary_emb
        self.nh = model.config.num_attention_heads; self.hd = model.config.head_dim

    def norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def forward(self, ids, on=(), keep=None, tap=None):
        """The layer's logits with the rounding points `on`; `tap(name, tensor)` sees each point's value as stored."""
        on = set(on)

        def r(n, x):
            x = x.half().float() if n in on else x
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
        ro = (lambda x: x.half().float()) if "rope_ops" in on else (lambda x: x)
        def rope(t):
            t2 = torch.cat((-t[..., hd // 2:], t[..., :hd // 2]), -1)
            return ro(ro(t * cos) + ro(t2 * sin))
        q = r("rope_out", rope(q)); k = r("rope_out", rope(k))
        if "scale_fused" in on:   # fp16 q,k rope'd + scaled in fp32 in one kernel, one fp16 rounding
            s = math.sqrt(1 / math.sqrt(hd))
            if "rope_out" in on: raise ValueError
            q = (q * s).half().float(); k = (k * s).half().float()
            sc = q @ k.transpose(-1, -2)
        elif "qk_scale" in on:
            s = float(torch.tensor(math.sqrt(1 / math.sqrt(hd))).half())
            q = (q * s).half().float(); k = (k * s).half().float()
            sc = q @ k.transpose(-1, -2)
        elif "scale_const16" in on:  # the GPU template: fp32 scores scaled by the fp16 constant's square
            s = float(torch.tensor(math.sqrt(1 / math.sqrt(hd))).half())
            sc = (q @ k.transpose(-1, -2)) * (s * s)
        else:
            sc = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        sc = r("scores", sc)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        sc = sc.masked_fill(~mask, float("-inf"))
        P = r("probs", torch.softmax(sc, -1))
        at = r("attn", P @ v).transpose(0, 1).reshape(T, nh * hd)
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

def stats(out, ref):
    """Max abs error, violations of |err| <= 1e-2 + 1e-2 |ref| (tvmfuse's fp16 tolerance), worst err / allowance."""
    e = (out - ref).abs()
    allowance = 1e-2 + 1e-2 * ref.abs()
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--seeds", default="0")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    model = H.build("llama", False)
    emu, wrapped = Emu(model), H.wrap(model, "prefill_512")
    for seed in (int(s) for s in args.seeds.split(",")):
        feeds = H.inputs("llama", model, dict(batch=1, seq=args.seq, kv_len=0), seed=seed)
        ids = torch.from_numpy(feeds["input_ids"])
        ref = wrapped(ids)
        for name, on in CONFIGS.items():
            s = stats(emu.forward(ids, on), ref)
            print(f"seq={args.seq} seed={seed} {name:26s} max={s['max']:.5f} rms={s['rms']:.5f} "
                  f"violations={s['viol']:3d} worst/allowance={s['ratio']:.3f}", flush=True)


if __name__ == "__main__":
    main()
