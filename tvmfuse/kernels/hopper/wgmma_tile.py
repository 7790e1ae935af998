"""Configurations of the Hopper GEMM kernel (`wgmma_gemm.py`): tiles, the shapes each takes, the order CTAs walk tiles."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WgmmaTile:
    """One kernel configuration: a CTA of one loading warpgroup and bm / 64 computing warpgroups (each 64 rows; bm 64,
    128 or 192) makes bm x bn, K in 64s through a ring of `stages` shared-memory stages."""

    bn: int = 128
    stages: int = 4
    bm: int = 128
    #: two accumulator sets, even and odd k-tiles: one wgmma group stays in flight while the next is issued, and no
    #: group ever accumulates into registers another in-flight group writes (twice the registers: bn <= 128, or
    #: <= DUAL_MAX_BN_SETMAXNREG with `setmaxnreg`)
    dual: bool = False
    #: one accumulator set: leave each k-tile's wgmma group in flight while the next stage is waited for and issued
    #: (1; PTX orders wgmmas of one shape that accumulate into the same registers), or wait for it first (0). On the
    #: H200, over 16 tile and shape pairs, 1 took from 2.1% less to 13% more time (2048x11008 @ 4096: 286.5 vs
    #: 253.5 µs; bench/results/wgmma_run7.json). Two sets (`dual`) always keep one group in flight
    inflight: int = 0
    #: CTAs per cluster: 2 pairs CTAs of neighbouring row tiles and one column tile, each loading half the B (weight)
    #: tile and multicasting it to both (a quarter to a third fewer bytes from L2 a k-step); needs an even number of
    #: row tiles and an even `group_m`. On the H200 2 was slower than 1 in all 32 tile and shape pairs measured (by
    #: 0.7-27%, median 8.8%; bench/results/wgmma_run8.json); on an H100 the loads alone were slower with the cluster
    #: than without at 4 and at 6 stages (wgmma_run11.json, wgmma_run13_ablate.json): our multicast costs more than
    #: the L2 bytes it saves
    cluster: int = 1
    #: with `cluster` 2, which operand the pair shares: "b" (neighbouring row tiles of one column tile share the B
    #: tile, the weights) or "a" (neighbouring column tiles of one row tile share the A tile, as cuBLAS's 1x2
    #: clusters at 512x4096x4096: at 512 rows each A tile is read by every column tile, 32 CTAs, each B tile by 4).
    #: "a" needs an even number of column tiles. Right on an H100 (gpu_tests_run47.txt) but slower there at the three
    #: 512-row Llama shapes: 128x128 dual, 6 stages, `sr` 34.2 against 28.7 µs at 512x4096x4096, 82.3 against 68.1
    #: at K = 11008; its loads alone took longer than the whole kernel without a cluster (wgmma_run15_c2a.json)
    multicast: str = "b"
    #: encode the shared-memory descriptors once a k-tile and step their start address by 32 bytes a k16 step, as
    #: CUTLASS does (7 instructions between wgmmas in the SASS instead of 17); False: encode each wgmma's from its
    #: address. Right on the GPU (gpu_tests_run31_hopper.txt, an H100); on the 128x128 tile 0.4-4.1% faster at three
    #: Llama shapes (wgmma_run10.json, H100). Off by default (the rules' pick); --trials measures it on each GEMM's pick
    stepped_desc: bool = False
    #: one CTA per SM (at most), each walking output tiles bid, bid + grid, ...: the loader goes on into the next
    #: tile's k-tiles while the consumers run this one's epilogue, and no CTA is launched per tile.
    #: Right on the GPU (gpu_tests_run31_hopper.txt); on the 128x128 tile from 0.2% slower to 1.9% faster
    #: (wgmma_run10.json). Off by default; --trials measures it on each GEMM's pick
    persistent: bool = False
    #: the loading warpgroup gives registers to the computing ones (`setmaxnreg`, 40 and 232 a thread) where
    #: ptxas otherwise holds every thread to 65536 / 384 = 170.
    #: Right on the GPU (gpu_tests_run31_hopper.txt); with stepped descriptors 0.1-2.4% faster than them alone
    #: (wgmma_run10.json). Off by default; --trials measures it on each GEMM's pick
    setmaxnreg: bool = False
    #: the full and empty barriers waited for by a spinning try-wait without a suspend-time hint (no NANOSLEEP between
    #: tries, `wgmma_gemm.SPIN_WAIT_SRC`); False: TVM's mbarrier_wait. On an H100 from 2.6% faster to 2.5% slower over
    #: 6 tile and shape pairs (wgmma_run14.json): off
    spin_wait: bool = False
    #: each consumer warpgroup releases a stage with one arrival (in each CTA of a cluster) after its four warps meet
    #: at a named barrier, as CUTLASS's sm90 pipeline releases one a warpgroup; False: every warp arrives (4 times
    #: the arrivals; with clusters, half of them remote). Right in fp16 and bf16 (gpu_tests_run48.txt); on the H200
    #: 27.77 -> 27.51 µs at 512x4096x4096 without a cluster, 28.85 -> 28.83 with one (wgmma_run16_release.json):
    #: within noise, off
    wg_release: bool = False
    #: CTAs walk groups of `group_m` row tiles, rows fastest, so the CTAs in flight share B (weight) tiles in L2;
    #: 1: columns fastest, each wave of row tiles streams all of B again. On the H200 16 made the 17 GPT-2 / Llama
    #: prefill projections 10% faster in all than 1 (4: 8%), the wide ones most: 2048x50257x768 410 -> 334 µs,
    #: 512x11008x4096 86 -> 77 (bench/results/wgmma_run6.json)
    group_m: int = 16
    #: the loader issues the B (weight) loads of the first `stages` k-tiles before it waits for the kernel before it
    #: (programmatic dependent launch), so the weights stream in while that kernel ends, then the A loads after the
    #: wait. Only where B is a weight no kernel writes (`select.weight_params`; chosen with
    #: `kernels.dependent_launch.early_weights()`); nothing changes without the dependent launch
    early_weights: bool = False
    #: B k-tiles prefetched into L2 (`cp.async.bulk.prefetch.tensor`) this many k-tiles ahead of the ring's loads, so
    #: that a weight streamed from HBM arrives in L2 before its TMA load asks for it; 0: none
    l2_ahead: int = 0

    @property
    def bk(self) -> int:
        return 64

    @property
    def consumers(self) -> int:
        return self.bm // 64

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * self.bk * 2


#: the widest tile with two accumulator sets where the computing threads rise to 232 registers (`setmaxnreg`):
#: 2 x 96 fp32 accumulators; ptxas 13 (sm_90a) compiles 128x144 ... 128x192 dual tiles without spills or serialized
#: wgmmas, 128x208 spills 2080 bytes and serializes them (C7512); without setmaxnreg (168 registers) 128 is the widest
DUAL_MAX_BN_SETMAXNREG = 192


def check_wgmma_shape(m: int, n: int, k: int, tile: WgmmaTile) -> str | None:
    """Why this kernel cannot compute an m x n x k GEMM with `tile`, or None when it can. Sizes need not be
    multiples of the tile: TMA fills rows and columns past the end with zeros and the stores are guarded."""
    if m < tile.bm:
        return f"M={m} is below one {tile.bm}-row tile (small M: the GEMV schedules)"
    if k % 8:
        return f"K={k} is not a multiple of 8 (TMA needs 16-byte row strides)"
    if tile.bm not in (64, 128, 192) or tile.bn % 8 or not 64 <= tile.bn <= 256 or tile.stages < 2:
        return f"unsupported tile {tile}"
    if tile.inflight not in (0, 1) or (tile.dual and tile.inflight):
        return f"unsupported tile {tile}: inflight 0 or 1, and 0 with two accumulator sets (they keep one in flight)"
    if tile.cluster not in (1, 2) or tile.multicast not in ("a", "b") or (
            tile.cluster == 2 and tile.multicast == "b" and tile.group_m % 2):
        return f"unsupported tile {tile}: clusters of 1 or 2 CTAs sharing A or B (B: an even group_m)"
    if tile.persistent and tile.wg_release:
        return f"tile {tile}: persistent CTAs release their last stage a warp at a time (no wg_release)"
    if tile.persistent and (tile.cluster != 1 or n % 2):
        return (f"tile {tile}: persistent CTAs take no clusters, nor an odd N (its epilogue stages rows in the ring "
                "the loader refills)")
    if tile.cluster == 2 and tile.multicast == "b" and -(-m // tile.bm) % 2:
        return f"M={m} makes an odd number of {tile.bm}-row tiles (clusters of 2 pair them)"
    if tile.cluster == 2 and tile.multicast == "a" and -(-n // tile.bn) % 2:
        return f"N={n} makes an odd number of {tile.bn}-column tiles (clusters of 2 sharing A pair them)"
    if tile.setmaxnreg and tile.bm < 128:  # ptxas: "'setmaxnreg' ignored; unable to determine register count"
        return f"tile {tile}: setmaxnreg needs two computing warpgroups (with one, ptxas ignores it: C7508)"
    if tile.dual and tile.bn > (DUAL_MAX_BN_SETMAXNREG if tile.setmaxnreg else 128):
        return f"tile {tile}: two accumulator sets of m64n{tile.bn} do not fit the registers"
    if tile.bm == 192 and (tile.dual or tile.bn > 192):  # 512 threads: 128 registers each, 152 with setmaxnreg
        return f"tile {tile}: three computing warpgroups hold one accumulator set of at most m64n192"
    if (tile.early_weights or tile.l2_ahead) and (tile.persistent or tile.cluster != 1):
        return f"tile {tile}: early weights and L2 prefetch take neither persistent CTAs nor clusters"
    if tile.l2_ahead < 0:
        return f"tile {tile}: l2_ahead is a count of k-tiles (0: none)"
    if tile.smem_bytes > 200 * 1024:
        return f"tile {tile} needs {tile.smem_bytes} bytes of shared memory"
    return None


def tile_of(bid, tiles_m: int, tiles_n: int, group: int, minimum=min):
    """(column tile, row tile) of CTA `bid`: groups of `group` row tiles, rows fastest within a group."""
    rows = group if tiles_m % group == 0 else minimum(tiles_m - bid // (group * tiles_n) * group, group)
    return bid % (group * tiles_n) // rows, bid // (group * tiles_n) * group + bid % (group * tiles_n) % rows


def pair_tile_of(bid, tiles_m: int, tiles_n: int, group: int, minimum=min):
    """(column tile, row tile) of CTA `bid` in clusters of two sharing the A tile: pair bid // 2 walks tiles of one
    row and two columns as `tile_of` walks single tiles, and its CTAs take the two columns (tiles_n even)."""
    col, row = tile_of(bid // 2, tiles_m, tiles_n // 2, group, minimum)
    return col * 2 + bid % 2, row
