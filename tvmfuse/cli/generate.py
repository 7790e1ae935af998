"""`python -m tvmfuse generate EXPORT`: prefill a prompt, then greedy decoding on an exported decoder step, timed."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from tvmfuse.quiet import quiet_native_logs
from tvmfuse.errors import TvmfuseError


def read_ids(path: str) -> np.ndarray:
    """Prompt token ids from a .npy file ([batch, prompt] integers) or a text file (one row of ids a line)."""
    try:
        if path.endswith(".npy"):
            ids = np.load(path)
        else:
            with open(path, encoding="utf-8") as f:
                rows = [[int(t) for t in line.replace(",", " ").split()] for line in f if line.strip()]
            if len({len(r) for r in rows}) > 1:
                raise TvmfuseError(f"{path}: rows of different lengths ({sorted({len(r) for r in rows})})")
            ids = np.array(rows, dtype=np.int64)
    except (OSError, ValueError) as err:
        raise TvmfuseError(f"{path}: cannot read token ids: {err}") from None
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise TvmfuseError(f"{path}: expected integer token ids [batch, prompt], got {ids.dtype} {list(ids.shape)}")
    return ids.astype(np.int64)


def decode_graphs_text(manifest: dict, decode: dict) -> str:
    """Where the decode steps ran and what of them replayed CUDA graphs (`Generation.decode`)."""
    if not manifest.get("cuda_graph"):
        return f"{decode['function']}, no CUDA graphs (built without --cuda-graph)"
    if not decode.get("graphs"):
        buckets = {f["function"] for f in (manifest.get("buckets") or {}).get("functions", [])}
        why = ("" if decode["function"] in buckets
               else " (symbolic shapes: build with --buckets seq=1 --buckets batch=N)")
        return f"{decode['function']}, no CUDA graphs{why}"
    return (f"{decode['function']} through {decode['graphs']} CUDA graphs ({decode['kernels_in_graphs']} kernels in "
            f"them, {decode['kernels_outside']} launched one by one)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tvmfuse generate",
                                description="Greedy generation on an export of a decoder step with a KV cache.")
    p.add_argument("export", metavar="EXPORT", help="an export folder (<out>/<model>-<target>)")
    p.add_argument("--batch", type=int, default=1, help="rows of random prompt ids (without --ids; default 1)")
    p.add_argument("--prompt-len", type=int, default=8, help="random prompt length (without --ids; default 8)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens to generate per row (default 32)")
    p.add_argument("--ids", metavar="FILE", help="prompt ids: .npy [batch, prompt], or text, one row a line")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.add_argument("--verbose", action="store_true", help="also show TVM's own C++ log lines")
    args = p.parse_args(argv)
    with quiet_native_logs(not args.verbose):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from tvmfuse.export.runtime import load  # pylint: disable=import-outside-toplevel  (TVM: after --help)

    try:
        for name in ("batch", "prompt_len", "new_tokens"):
            if getattr(args, name) < 1:
                raise TvmfuseError(f"--{name.replace('_', '-')} must be >= 1")
        model = load(args.export)
        if args.ids:
            ids = read_ids(args.ids)
        else:
            vocab = next((t["shape"][-1] for t in model.manifest["outputs"] if isinstance(t["shape"][-1], int)), 2)
            ids = np.random.default_rng(args.seed).integers(0, vocab, (args.batch, args.prompt_len), dtype=np.int64)
        every = max(1, args.new_tokens // 8)

        def progress(i: int, ms: float) -> None:
            if (i + 1) % every == 0 or i + 1 == args.new_tokens:
                print(f"  {i + 1}/{args.new_tokens} tokens, {ms:.2f} ms/token", flush=True)  # its window's mean

        out = model.generate(ids, args.new_tokens, on_token=progress)
    except TvmfuseError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    mode = model.manifest["kv_cache"]["mode"]
    padded = f", padded to {out.prefill['length']}" if out.prefill["length"] != ids.shape[1] else ""
    print(f"prefill {out.prefill_ms:.2f} ms ({ids.shape[0]} x {ids.shape[1]} tokens in {out.prefill['function']}"
          f"{padded}); decode "
          f"{out.ms_per_token:.2f} ms/token, {out.tokens_per_s:.1f} tokens/s (batch {ids.shape[0]}, KV cache {mode})")
    if model.manifest["target"]["kind"] == "cuda":
        print(f"decode steps: {decode_graphs_text(model.manifest, out.decode)}")
    for row, tokens in enumerate(out.tokens[:4]):
        print(f"tokens[{row}]: {' '.join(map(str, tokens))}")
    return 0
