"""Hopper prefill attention template (sm_90a): TMA loads, wgmma GEMMs, the online softmax in registers
(`prefill_wgmma_kernel.py`); its shape check, knob space and default knobs. The table tries it before the mma.sync
prefill template, which keeps every shape this one refuses."""

from __future__ import annotations

from tvmfuse.kernels.attention.common import Template, q_dtype, symbolic
from tvmfuse.kernels.attention.prefill_wgmma_kernel import (MAX_SMEM, PANEL, pairs_query_tiles, smem_bytes,
                                                            wgmma_attention)


def check(s: dict) -> str | None:
    if s.get("arch") != "sm_90a":
        return "needs sm_90a (TMA and wgmma)"
    if s["dtype"] not in ("float16", "bfloat16") or q_dtype(s) != s["dtype"]:
        return f"fp16/bf16 Q, K and V of one dtype only (TMA copies them as stored; got {q_dtype(s)} x {s['dtype']})"
    if s["head_dim"] not in (PANEL, 2 * PANEL):
        return f"head_dim {s['head_dim']} is not 64 or 128"
    if s["mask"] == "additive":
        return "an additive mask (the mma.sync template votes on its tiles)"
    if s.get("softcap"):
        return "soft-capped scores (the mma.sync template caps them)"
    if symbolic(s):
        return "symbolic sizes (static shapes only)"
    if s["heads"] % s["kv_heads"] or s["heads"] % s["v_heads"]:
        return "K and V heads must divide query heads"
    if s["causal"] and s["seq_q"] != s["seq_k"]:
        return "causal needs seq_q == seq_k"
    if s["seq_q"] < 64:
        return f"seq_q={s['seq_q']} is below one 64-row tile"
    if not knob_space(s):
        return f"no knob set fits head_dim {s['head_dim']} in {MAX_SMEM} bytes of shared memory"
    return None


def knob_space(s: dict) -> list[dict]:
    """consumers (computing warpgroups, 64 query rows each: 1 or 2), block_n (keys a tile: 64, 128, 176; wgmma's N
    and the S accumulators a thread holds, block_n / 2), stages (K/V tiles in flight: 2 or 3), setmaxnreg (with two
    consumers: the loading warpgroup gives its registers to them, 40 and 232 a thread), overlap (1: tile j's S = Q K^T
    is issued with tile j - 1's P V, and j's softmax runs while P V does, FlashAttention-3's intra-warpgroup
    pipelining; 0: each tile's GEMMs and softmax in turn), batched (not overlapped: tile j - 1's P V and tile j's S
    issued together and waited for together, one wait a tile instead of two), pingpong (two overlapped or batched
    consumers take turns issuing their GEMMs by named barriers, so one's softmax runs beside the other's GEMMs,
    FlashAttention-3's inter-warpgroup schedule; batched + pingpong is its schedule without intra-warpgroup
    overlap), cluster (2: the CTAs of two neighbouring query tiles of a head share every K and V tile, each loading
    one 64-wide panel by TMA multicast, as FlashAttention-3 does without causality at head dim 128: half the bytes
    from L2; tried with two consumers and setmaxnreg, where the query tiles pair up), order (without causality, 1:
    consecutive CTAs take consecutive query tiles of one head, so the CTAs in flight share the K and V of few heads in
    L2, as FlashAttention-3's scheduler orders them; 0: the heads of one query tile first, the longest causal rows
    first; with causality 0 alone until 1, each head's longest rows first, is measured)."""
    space = [{"consumers": c, "block_n": n, "stages": st, "setmaxnreg": r, "overlap": ov, "batched": bt,
              "pingpong": pp}
             for ov in (1, 0) for bt in ((1, 0) if not ov else (0,)) for c in (2, 1) for n in (128, 64, 176)
             for st in (2, 3) for r in ((1, 0) if c == 2 else (0,))
             for pp in ((0, 1) if c == 2 and (ov or bt) else (0,))]
    pairs = pairs_query_tiles(s, 2)
    space = [dict(k, cluster=cl) for k in space
             for cl in ((1, 2) if pairs and k["consumers"] == 2 and k["setmaxnreg"] else (1,))]
    space = [dict(k, order=o) for k in space for o in ((0,) if s["causal"] else (1, 0))]
    return [k for k in space if smem_bytes(s, k) <= MAX_SMEM
            and k["block_n"] // 2 + s["head_dim"] // 2 <= 192]  # S and O accumulators: registers a thread


#: the measured picks at head dim 128 (`attention_run11.json` and `attention_run10.json`, the latter in the results'
#: archive-attention-runs-4-12.tar.xz; H100), tried in this order
PICKS = [
    # without causality: 176 keys a tile, overlapped, ping-pong, query tiles first; 0.2% behind the best at 2048
    # (133.7 µs against 133.5), 0.9% at 8192 (1837.7 against 1820.5 with clusters, which lose 7% at 2048); with the
    # tail tile the best of its space at 2048 and 8192 in fp16 and bf16 (attention_run13.json)
    dict(block_n=176, overlap=1, batched=0, pingpong=1, cluster=1, order=1),
    # with causality 128 keys, overlapped: 0.5% behind the best at causal 2048 and 8192 (85.6 and 1086.0 µs against
    # 85.2 and 1080.4 with ping-pong, which is behind elsewhere: 1057.7 against 1043.5 in bf16 at 8192, 989.7
    # against 982.3 with GQA)
    dict(block_n=128, overlap=1, batched=0, pingpong=0, cluster=1, order=0),
]


def default_knobs(s: dict) -> dict:
    """Two consumers (128 query rows a CTA), two stages, the loader's registers given to them; at head dim 128 the
    first of PICKS the shape takes; at head dim 64 (not measured) 128 keys, each tile's GEMMs and softmax in turn
    (the best at head dim 128 before K and V were released apart); the first valid knob set where none of these
    fits. (The space lists the overlapped sets first, then the batched, then in turn: `--trials N` measures the
    default and then the space in order.)"""
    space = knob_space(s)
    base = {"consumers": 2, "stages": 2, "setmaxnreg": 1}
    in_turn = dict(block_n=128, overlap=0, batched=0, pingpong=0, cluster=1, order=0 if s["causal"] else 1)
    for pick in PICKS + [in_turn] if s["head_dim"] == 2 * PANEL else [in_turn]:
        if dict(base, **pick) in space:
            return dict(base, **pick)
    return (space or [{"consumers": 1, "block_n": 64, "stages": 2, "setmaxnreg": 0, "overlap": 0, "batched": 0,
                       "pingpong": 0, "cluster": 1, "order": 0}])[0]


def build(s: dict, knobs: dict, target: str = "cuda"):
    """The CUDA kernel (the template has no CPU variant: check refuses every target but sm_90a)."""
    if target == "llvm":
        raise ValueError("attention_prefill_wgmma has no CPU variant")
    return wgmma_attention(s, knobs)


TEMPLATE = Template("attention_prefill_wgmma", build, check, knob_space, default_knobs)
