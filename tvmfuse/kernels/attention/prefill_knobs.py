"""Prefill template's shape check, knob space and default knobs, and the shared memory each knob set takes."""

from __future__ import annotations

from tvmfuse.kernels.attention.common import q_dtype


#: head dims the template takes: whole 16-wide mma k-steps; 80 Phi-2's, 96 Phi-3's, 256 Gemma's
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


def check(s: dict) -> str | None:
    if s["head_dim"] not in HEAD_DIMS or s["heads"] % s["kv_heads"] or s["heads"] % s["v_heads"]:
        return f"head_dim must be one of {'/'.join(map(str, HEAD_DIMS))} and K and V heads must divide query heads"
    if s["dtype"] not in ("float16", "bfloat16") and not (s["dtype"] == "float32" and s.get("target") == "llvm"):
        return f"prefill template is fp16/bf16 only, fp32 on llvm (got {s['dtype']})"
    if s["causal"] and s["seq_q"] != s["seq_k"]:
        return "causal needs seq_q == seq_k"
    if isinstance(s["seq_q"], int) and s["seq_q"] < 16 or not knob_space(s):
        return f"no tile divides seq_q={s['seq_q']}, seq_k={s['seq_k']}"
    return None


STATIC_SMEM, MAX_SMEM = 48 * 1024, 160 * 1024  # bytes: static shared memory limit; what a knob set may use


def smem_bytes(s: dict, knobs: dict) -> int:
    """Shared memory: stages x (K, V) x block_n rows of head_dim (+8 pad) 2-byte (fp16/bf16) elements, plus the Q tile
    (16 x warps x m_tiles rows) with q_smem."""
    rows = knobs.get("stages", 1) * 2 * knobs["block_n"]
    rows += 16 * knobs.get("warps", 4) * knobs.get("m_tiles", 1) if knobs.get("q_smem") else 0
    return rows * (s["head_dim"] + 8) * 2


def knob_space(s: dict) -> list[dict]:
    """warps (4/8, 16 query rows each per m-tile), block_n (keys per tile), m_tiles (16-row tiles per warp:
    2 reuses each K/V fragment twice), stages (1: synchronous K/V loads; 2: cp.async double buffering,
    tile j+1 loads while tile j computes), q_smem (with 2 m-tiles: Q fragments from shared memory by
    ldmatrix instead of registers, fewer registers)."""
    space = [{"warps": w, "block_n": n, "m_tiles": mt, "stages": st} | ({"q_smem": qs} if mt > 1 else {})
             for st in (1, 2) for mt in (1, 2) for qs in ((0, 1) if mt > 1 else (0,)) for w in (4, 8)
             for n in (32, 64, 128)]
    return [k for k in space if _tiles(s["seq_q"], 16 * k["warps"] * k["m_tiles"]) and _tiles(s["seq_k"], k["block_n"])
            and k["block_n"] * s["head_dim"] <= 8192
            and not (s["head_dim"] == 256 and k["m_tiles"] > 1)  # ptxas spills 1-3 KB a thread (255 registers)
            and not (k.get("q_smem") and q_dtype(s) != s["dtype"])  # Q staged in shared memory in the compute dtype
            and k["block_n"] * s["head_dim"] // 8 % (32 * k["warps"]) == 0  # every thread loads as many K/V vectors
            and smem_bytes(s, k) <= MAX_SMEM]


def _tiles(size, tile: int) -> bool:
    """Whether tiles of `tile` cover a size exactly; a symbolic size takes any tile (the kernel guards the ragged
    last one)."""
    return isinstance(size, str) or size % tile == 0


def default_knobs(s: dict) -> dict:
    space = knob_space(s)
    pref = [k for k in space if k == {"warps": 4, "block_n": 64, "m_tiles": 1, "stages": 1}]  # the first form
    return (pref or space or [{"warps": 4, "block_n": 64, "m_tiles": 1, "stages": 1}])[0]
