"""bench/wgmma.py's tile specs: each knob has its letter, and a tile's spec names it back."""

from __future__ import annotations

import pytest

from bench.wgmma import _tile, tile_spec
from tvmfuse.kernels.hopper.wgmma_tile import WgmmaTile


@pytest.mark.parametrize("tile", [
    WgmmaTile(128, 6, dual=True, cluster=2, multicast="a", stepped_desc=True, setmaxnreg=True),
    WgmmaTile(128, 6, dual=True, cluster=2, stepped_desc=True, setmaxnreg=True, wg_release=True),
    WgmmaTile(192, 4, 192, stepped_desc=True, setmaxnreg=True, spin_wait=True, group_m=4),
    WgmmaTile(256, 4, inflight=1, persistent=True),
    WgmmaTile(128, 6, dual=True, stepped_desc=True, setmaxnreg=True, early_weights=True, l2_ahead=8),
], ids=str)
def test_a_tiles_spec_names_it_back(tile):
    assert _tile("wgmma", tile_spec(tile)) == (tile, "")


def test_letters_and_ablations():
    assert _tile("wgmma", "128x128x6dc2sre-mma") == (
        WgmmaTile(128, 6, dual=True, cluster=2, stepped_desc=True, setmaxnreg=True, wg_release=True), "mma")
    assert _tile("wgmma", "128x128x6dsrbf12-loads") == (
        WgmmaTile(128, 6, dual=True, stepped_desc=True, setmaxnreg=True, early_weights=True, l2_ahead=12), "loads")
    with pytest.raises(ValueError, match="tile spec"):
        _tile("wgmma", "128x128x6q")
