"""Fit `TILE_COSTS` (tvmfuse/kernels/hopper/select.py) to `bench/wgmma.py --prefill` results: for each tile, the µs
one CTA spends per 64-deep k-step, with the fixed cost a tile `TILE_FIXED_US`, by least squares over the shapes it
was measured at; then how the fitted estimate's pick and the product's (`choose_tile`) at each shape compare with the
measured best there.

    python3 bench/fit_tile_costs.py bench/results/wgmma_run13_llama.json bench/results/wgmma_run13_gpt2.json \
        [--tiles 128x128x6dsr 128x256x4sr ...]   # the tiles to fit (default: every tile measured at every shape)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.wgmma import TOLERANCE, _tile  # noqa: E402


def measured(paths: list[str]) -> dict[str, dict[str, float]]:
    """{case: {tile spec (its CTA-order suffix dropped): µs}} of the correct, timed rows of wgmma.py's results."""
    out: dict[str, dict[str, float]] = {}
    for path in paths:
        with open(path) as f:
            for name, case in json.load(f)["cases"].items():
                rows = out.setdefault(name, {"_shape": (case["m"], case["n"], case["k"])})
                for r in case["tiles"]:
                    if "us" in r and r["max_abs_err"] < TOLERANCE[case["dtype"]] and "-" not in r["tile"]:
                        rows[r["tile"].split("g")[0]] = r["us"]
    return out


def fit(times: dict[str, dict], tiles: list[str], fixed_us: float) -> dict[str, float]:
    """Per tile: c minimising sum (waves * (k_steps * c + fixed_us) - us)^2 over the shapes it was measured at."""
    from tvmfuse.kernels.hopper.select import output_tiles
    from tvmfuse.targets import SMS
    costs = {}
    for spec in tiles:
        tile, _ = _tile("wgmma", spec)
        num = den = 0.0
        for rows in times.values():
            if spec not in rows:
                continue
            m, n, k = rows["_shape"]
            waves = -(-output_tiles(m, n, tile) // SMS)
            steps = -(-k // tile.bk)
            num += waves * steps * (rows[spec] - waves * fixed_us)
            den += (waves * steps) ** 2
        if den:
            costs[spec] = num / den
    return costs


def rules_pick(m: int, n: int, k: int) -> str | None:
    """The product's tile at an m x n x k GEMM (`select.choose_tile`) as a spec without its CTA order."""
    from bench.wgmma import tile_spec
    from tvmfuse.kernels.hopper.select import choose_tile
    tile = choose_tile(m, n, k)
    return tile and tile_spec(tile).split("g")[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+")
    p.add_argument("--tiles", nargs="*", help="tile specs to fit (default: those measured at every shape)")
    opts = p.parse_args()
    from tvmfuse.kernels.hopper.select import TILE_FIXED_US, estimate_us
    times = measured(opts.results)
    everywhere = set.intersection(*(set(r) - {"_shape"} for r in times.values()))
    costs = fit(times, opts.tiles or sorted(everywhere), TILE_FIXED_US)
    for spec, c in sorted(costs.items(), key=lambda kv: kv[1]):
        print(f"{spec:>16}  {c:.3f} µs a k-step")
    total_best = total_pick = 0.0
    for name, rows in times.items():
        m, n, k = rows["_shape"]
        tiles = {spec: _tile("wgmma", spec)[0] for spec in costs if spec in rows}
        est = {spec: estimate_us(m, n, k, tile, {tile: costs[spec]}) for spec, tile in tiles.items()}
        if not est:
            continue
        pick = min(est, key=est.get)
        best = min((s for s in rows if s != "_shape"), key=lambda s: rows[s])
        total_best, total_pick = total_best + rows[best], total_pick + rows[pick]
        rule = rules_pick(m, n, k)
        print(f"{name:>28}: pick {pick} {rows[pick]:.1f} µs, best {best} {rows[best]:.1f} "
              f"({rows[best] / rows[pick]:.2f}x); the rules' {rule} {rows.get(rule, float('nan')):.1f}")
    print(f"all shapes: picks {total_pick:.1f} µs, best {total_best:.1f}")


if __name__ == "__main__":
    main()
