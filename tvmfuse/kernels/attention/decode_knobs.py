"""Decode template's shape check, knob space and default knobs, and the keys per split (chunk) each knob set gives."""

from __future__ import annotations

from tvmfuse.kernels.attention.common import ceil_div
from tvmfuse.targets import SMS

VEC = 8  # 16-byte loads of fp16/bf16
#: 256: Gemma's (a warp a key); 80 and 96: Phi-2's and Phi-3's (16 lanes a key, the last 6 or 4 idle)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
PAST = -3.0e38  # the score of a key at or past L: below NEG, so it never raises a running max and weighs exp2(.) = 0
_SMEM = 48 * 1024  # static shared memory for the in-block combine


def check(s: dict) -> str | None:
    if isinstance(s["seq_q"], str):
        return "decode template needs a static query length (the step template takes a symbolic one)"
    if s["seq_q"] != 1 and (s["causal"] or group(s) > 8):
        return "decode template needs one query token (or, not causal, up to 8 rows of a query head group)"
    if s["v_heads"] != s["kv_heads"]:
        return "decode template needs K and V with the same head count"
    if s["head_dim"] not in HEAD_DIMS or s["heads"] % s["kv_heads"]:
        return f"head_dim must be one of {'/'.join(map(str, HEAD_DIMS))} and kv heads must divide query heads"
    if s["dtype"] not in ("float16", "bfloat16", "float32"):
        return f"decode template is fp16/bf16/fp32 only (got {s['dtype']})"
    if not knob_space(s):
        return "no knob set fits in shared memory"
    return None


def group(s: dict) -> int:
    """Query rows per KV head. Without mask or causality each of seq_q > 1 rows is one more query head:
    transformers' GQA decode folds the group into the rows (Q [B, kv_heads, G, D])."""
    return s["heads"] * s["seq_q"] // s["kv_heads"]


def lanes(head_dim: int) -> int:
    """Lanes of a warp that hold one key: head_dim / VEC (a 16-byte vector each), rounded up to a power of two for
    the warp sums' shuffles; at head dims 80 and 96 the last of 16 lanes load nothing."""
    return 1 << (ceil_div(head_dim, VEC) - 1).bit_length()


def keys_per_warp(head_dim: int) -> int:
    return 32 // lanes(head_dim)


def chunk_of(s: dict, knobs: dict, length=None):
    """Keys per split: ceil(L / split) rounded up to whole steps of warps x keys a warp x unroll keys;
    `length`: L as the kernel has it (a TIR size when the KV length is symbolic), else the shapes' seq_k."""
    rows = knobs.get("warps", 4) * keys_per_warp(s["head_dim"]) * knobs.get("unroll", 1)
    return ceil_div(ceil_div(s["seq_k"] if length is None else length, knobs["split"]), rows) * rows


def knob_space(s: dict) -> list[dict]:
    """split (blocks per KV head), warps, unroll (steps of keys in flight per thread), for any L; those whose
    in-block combine (per key slot: the G heads' D partial outputs, max and sum) fits in static shared memory."""
    slots = {w: w * keys_per_warp(s["head_dim"]) for w in (2, 4, 8)}  # keys in flight per step, per unroll
    return [{"split": split, "warps": w, "unroll": u} for split in (1, 4, 8, 16, 32, 64) for w in (2, 4, 8)
            for u in (1, 2, 4) if 4 * slots[w] * group(s) * (s["head_dim"] + 2) <= _SMEM]


SYMBOLIC_LENGTH = 2048  # the KV length a symbolic one counts as when its splits are chosen


def default_knobs(s: dict) -> dict:
    """A static KV length: about 2 blocks with keys per SM (528), 4 warps; then the fewest empty splits and padded
    keys. A symbolic one (a decoder's in-place cache: one kernel for every step; it counts as SYMBOLIC_LENGTH keys):
    the most blocks up to 16 query heads' worth per SM (at least 2 blocks) with at least 128 keys per split, and with
    an additive mask 8 warps of 2 steps. attention_run4 (H200, 32 KV heads, L 2048, SBHD cache, fp32 mask
    [B, 1, 1, L]): batch 16 ran 260 us at split 1 (512 blocks, the static rule's pick) and 135 us at split 4,
    8 warps, unroll 2 (cuDNN 130); batch 1 12.6 us at 4 warps and 10.1 at 8. With 8 KV heads of 4 query heads
    (attention_run2, static L 4096) batch 16 was fastest at split 4 (512 blocks), not 8: the cap counts query
    heads. A symbolic batch counts as 1."""
    batch = s["batch"] if isinstance(s["batch"], int) else 1
    space = knob_space(s)
    if not space:
        return {"split": 1, "warps": 4, "unroll": 1}
    if isinstance(s["seq_k"], str):
        masked = s["mask"] == "additive"
        warps, unroll = (8, 2) if masked else (4, 4)

        def by_blocks(k):
            blocks = batch * s["kv_heads"] * k["split"]
            short = ceil_div(SYMBOLIC_LENGTH, k["split"]) < 128
            rows = blocks * group(s)  # a block computes its KV head's whole query group
            return (blocks < 2 * SMS, rows > 16 * SMS, short, -blocks, k["warps"] != warps, k["unroll"] != unroll)
        return min(space, key=by_blocks)

    def key(k):
        chunk = chunk_of(s, k)
        live, padded = ceil_div(s["seq_k"], chunk), chunk * k["split"]  # splits with keys
        blocks = batch * s["kv_heads"] * live
        return (blocks < 2 * SMS or k["warps"] != 4, abs(blocks - 4 * SMS), k["split"] - live, padded, -k["unroll"])
    return min(space, key=key)
