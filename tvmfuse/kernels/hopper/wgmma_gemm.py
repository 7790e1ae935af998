"""Hopper GEMM kernel (TMA loads, mbarrier ring, wgmma) written in TIRx, for static K-innermost operands."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from tvmfuse.kernels.dependent_launch import dependent_launch, release_late, wgmma_waits
from tvmfuse.kernels.hopper.gemm_analysis import OPERAND_PTX
from tvmfuse.kernels.hopper.wgmma_tile import WgmmaTile, check_wgmma_shape, pair_tile_of, tile_of
from tvmfuse.targets import SMS

# keeps the compiler from moving accumulator registers across an in-flight wgmma (CUTLASS's warpgroup_fence_operand)
FENCE_SRC = '__device__ __forceinline__ void tvmfuse_fence_acc(float& r) { asm volatile("" : "+f"(r) :: "memory"); }'
#: arrive on the mbarrier at `bar`'s offset in cluster CTA `cta`'s shared memory, at the default .release.cta as
#: CUTLASS's ClusterBarrier::arrive does (with .release.cluster the clustered kernels ran 1.3-3.7x slower on the H200)
REMOTE_ARRIVE_SRC = ('__device__ __forceinline__ void tvmfuse_arrive_cluster(void* bar, int cta) { unsigned a = '
                     '(unsigned)__cvta_generic_to_shared(bar); asm volatile("{ .reg .b32 r; mapa.shared::cluster.u32 '
                     'r, %0, %1; mbarrier.arrive.shared::cluster.b64 _, [r]; }" :: "r"(a), "r"(cta) '
                     ': "memory"); }')
BAR_SRC = ('__device__ __forceinline__ void tvmfuse_bar_sync(int id, int n) '
           '{ asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory"); }')
#: (helper name, source) per 16-bit output dtype: two neighbouring outputs, rounded from fp32, in one 4-byte store
PAIR_STORES = {
    "float16": ("tvmfuse_store_half2", "__device__ __forceinline__ void tvmfuse_store_half2(half* p, float a, float b) "
                "{ *reinterpret_cast<half2*>(p) = __floats2half2_rn(a, b); }"),
    "bfloat16": ("tvmfuse_store_bf162", "__device__ __forceinline__ void tvmfuse_store_bf162(nv_bfloat16* p, float a, "
                 "float b) { *reinterpret_cast<nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b); }")}

#: wait for an mbarrier's phase by `mbarrier.try_wait` without a suspend-time hint (`WgmmaTile.spin_wait`): ptxas
#: then loops on the try-wait alone, where TVM's `mbarrier_wait` (CUTLASS's ticks, 0x989680) gets a
#: `NANOSLEEP.SYNCS` of up to 10 ms after each failed try (the thread sleeps until the barrier changes)
SPIN_WAIT_SRC = ('__device__ __forceinline__ void tvmfuse_mbar_spin(void* bar, int phase) { unsigned a = '
                 '(unsigned)__cvta_generic_to_shared(bar); asm volatile("{ .reg .pred p; LSPIN: '
                 'mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra LSPIN; }" :: "r"(a), "r"(phase) '
                 ': "memory"); }')

#: prefetch a box of a 2-D tensor map into L2 (`WgmmaTile.l2_ahead`): no shared memory, no barrier
PREFETCH_L2_SRC = ('__device__ __forceinline__ void tvmfuse_prefetch_l2(unsigned long long map, int c0, int c1) { '
                   'asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" :: "l"(map), '
                   '"r"(c0), "r"(c1) : "memory"); }')

#: registers per thread with `WgmmaTile.setmaxnreg`: the loading warpgroup drops to LOADER_REGS and the computing ones
#: rise to CONSUMER_REGS (CUTLASS's split: 128 x 40 + 256 x 232 of the SM's 65536)
LOADER_REGS, CONSUMER_REGS = 40, 232


def consumer_regs(consumers: int) -> int:
    """Registers a computing thread rises to with setmaxnreg beside the loader's LOADER_REGS: CONSUMER_REGS for two
    computing warpgroups, 152 for three (the SM's 65536 shared, in steps of 8)."""
    return min(CONSUMER_REGS, (65536 - 128 * LOADER_REGS) // (128 * consumers) // 8 * 8)

#: attribute marking a PrimFunc written in TIRx (compiled by TVM's tirx pipeline, never scheduled); its value names
#: the kernel ("wgmma", "mma_smallm") for the manifest
TIRX_ATTR = "tvmfuse.tirx"


def _tma_args(inner: int, outer: int, box_outer: int) -> list[int]:
    # cuTensorMapEncodeTiled: dims, byte stride of the outer dim, box, element strides,
    # interleave none, swizzle 128B (3), L2 promotion 256B (3), OOB fill none
    return [inner, outer, inner * 2, 64, box_outer, 1, 1, 0, 3, 3, 0]


def wgmma_kernel(m: int, n: int, k: int, tile: WgmmaTile, a, b, out, finish, place, params, name: str,
                 setup=lambda: None, ablate: str = ""):
    """The TIRx PrimFunc computing out = finish(a @ b^T): `a` holds [m, k] rows and `b` is [n, k] (both fp16 or
    both bf16, K innermost, contiguous); `finish(acc, row, col)` is the fp32 value of element (row, col) from its fp32
    accumulator, `place(row, col)` its indices in `out`; `params` (buffers) are the PrimFunc's signature: a, b,
    out and whatever else finish reads. `ablate` is for diagnostics only (wrong outputs; `bench/wgmma.py`): "loads"
    loads the first `stages` k-tiles alone and then completes each stage's barrier without data, so the loop runs at
    the rate of its issue and its wgmmas; "mma" issues no wgmma, so it runs at the rate the loads arrive."""
    why = check_wgmma_shape(m, n, k, tile)
    if why:
        raise ValueError(why)
    if ablate not in ("", "loads", "mma"):
        raise ValueError(f"ablate {ablate!r}: '', 'loads' or 'mma'")
    dt = str(a.dtype)
    if dt not in OPERAND_PTX or str(b.dtype) != dt:
        raise ValueError(f"operands {a.dtype} x {b.dtype} (both float16 or both bfloat16)")
    ab = OPERAND_PTX[dt]
    bm, bn, bk, stages, cons = tile.bm, tile.bn, tile.bk, tile.stages, tile.consumers
    inflight = 1 if tile.dual else tile.inflight  # wgmma groups left in flight after each k-tile's is issued
    cluster = tile.cluster
    releases = 1 if tile.wg_release else 4  # arrivals a stage gets from each consumer warpgroup of each CTA
    releaser = 128 // releases  # threads per arrival: the first of each warpgroup, or of each warp
    share_a = cluster == 2 and tile.multicast == "a"  # the pair shares A (one row tile, two column tiles), else B
    half = (bm if share_a else bn) // cluster  # rows of the shared tile each CTA of a cluster loads and multicasts
    cta_tile = pair_tile_of if share_a else tile_of  # (column tile, row tile) of a CTA
    persistent = tile.persistent
    k_tiles = -(-k // bk)
    tiles_n, tiles_m = -(-n // bn), -(-m // bm)
    group = min(tile.group_m, tiles_m)
    grid = min(tiles_n * tiles_m, SMS) if persistent else tiles_n * tiles_m  # CTAs: persistent ones, one per SM
    acc_n = bn // 2  # fp32 accumulators per thread for m64 x bn
    a_stage, b_stage = bm * bk, bn * bk  # elements per stage
    stage_bytes = (a_stage + b_stage) * 2
    mma = f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{ab}.{ab}"
    tma = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
    a_args = _tma_args(k, m, half if share_a else bm)
    b_args = _tma_args(k, n, bn if share_a else half)
    multicast = tma + ".multicast::cluster"
    A, B = a, b

    out_dtype = str(out.dtype)
    # two neighbouring 16-bit outputs (col even) in one 4-byte store; one by one where N is odd or the output fp32
    paired = n % 2 == 0 and out_dtype in PAIR_STORES
    # odd N (GPT-2's 50257-wide logits): rows staged in shared memory, then written by consecutive lanes (one
    # 2-byte store per lane from the registers touched 8 rows per warp store, 16 of each 256 bytes)
    staged = n % 2 == 1 and out_dtype in PAIR_STORES
    sets, ld = (2 if tile.dual else 1), bn + 8  # accumulator sets; staged row stride (8 more: no bank conflicts)

    def store(acc0, acc1, row, col):
        helper, src = PAIR_STORES[out_dtype]
        return T.cuda.func_call(helper, T.address_of(out[place(row, col)]),
                                finish(acc0, row, col), finish(acc1, row, col + 1), source_code=src)

    def total(acc, i):  # the sum of accumulator i over the sets
        return acc[i] + acc[acc_n + i] if sets == 2 else acc[i]

    pdl = dependent_launch()  # kernels.dependent_launch
    waits = wgmma_waits()  # (without the wait it is launched as usual, after the kernel before; it still releases)
    late = pdl and release_late()  # the successor released after the last load is issued, not after the wait
    early = waits and tile.early_weights  # the first k-tiles' B loads before the wait (B: a weight nobody writes)
    ahead = tile.l2_ahead
    # fmt: off
    @T.macro
    def wait(bar, phase):
        """Until mbarrier `bar` completes the phase of parity `phase`."""
        if tile.spin_wait:
            T.cuda.func_call("tvmfuse_mbar_spin", T.address_of(bar), phase, source_code=SPIN_WAIT_SRC)
        else:
            T.cuda.mbarrier_wait(T.address_of(bar), phase)

    @T.macro
    def k_step(acc, st, kt, g0, As, Bs, full, empty, desc_a, desc_b, cw, tx, rank):
        """k-tile kt into accumulator set st (g0 + kt: the CTA's k-step count, which picks the stage and its
        phase); releases the stage of the k-tile whose group is done."""
        wait(full[(g0 + kt) % stages], ((g0 + kt) // stages) % 2)
        for i in T.unroll(acc_n):
            T.cuda.func_call("tvmfuse_fence_acc", acc[st * acc_n + i], source_code=FENCE_SRC)
        T.ptx.wgmma.fence.sync.aligned()
        if ablate == "mma":  # diagnostics: the loop without its wgmmas
            T.evaluate(0)
        elif not tile.stepped_desc:
            for kk in T.unroll(bk // 16):
                T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a), T.address_of(As[(g0 + kt) % stages, cw * 64 * bk + kk * 16]), 1, 64, 3)
                T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b), T.address_of(Bs[(g0 + kt) % stages, kk * 16]), 1, 64, 3)
                T.ptx[mma](*[acc[st * acc_n + i] for i in range(acc_n)], desc_a, desc_b, T.bool(True), 1, 1, 0, 0)
        else:  # encoded once; k16 step kk starts 32 bytes further into each 128-byte swizzled row: start address + 2
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a), T.address_of(As[(g0 + kt) % stages, cw * 64 * bk]), 1, 64, 3)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b), T.address_of(Bs[(g0 + kt) % stages, 0]), 1, 64, 3)
            for kk in T.unroll(bk // 16):
                T.ptx[mma](*[acc[st * acc_n + i] for i in range(acc_n)], desc_a + T.uint64(2 * kk), desc_b + T.uint64(2 * kk), T.bool(True), 1, 1, 0, 0)
        T.ptx.wgmma.commit_group.sync.aligned()
        T.ptx.wgmma.wait_group.sync.aligned(inflight)
        if sets == 2:  # the other set's group is done: its registers are the compiler's again
            for i in T.unroll(acc_n):
                T.cuda.func_call("tvmfuse_fence_acc", acc[(1 - st) * acc_n + i], source_code=FENCE_SRC)
        # every consumer warp releases a stage once its own group that read it is done: warp 0 alone (one arrival
        # per warpgroup) let the loader overwrite a stage that warps 1-3 were still reading (on the H200: wrong
        # rows 16-63 of each 64 behind a GELU epilogue); `inflight` 0: the group just issued; 1: the one before.
        # `wg_release`: the warpgroup's four warps meet at its named barrier first, then one thread releases
        if tile.wg_release:
            if kt >= inflight:
                T.cuda.func_call("tvmfuse_bar_sync", 2 + cw, 128, source_code=BAR_SRC)
        if tx % releaser == 0 and kt >= inflight:
            T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[(g0 + kt - inflight) % stages]))
            if cluster == 2:  # the other CTA's loader multicasts into this stage too
                T.cuda.func_call("tvmfuse_arrive_cluster", T.address_of(empty[(g0 + kt - inflight) % stages]), 1 - rank,
                                 source_code=REMOTE_ARRIVE_SRC)

    @T.macro
    def load_stage(bx, by, g0, kt, As, Bs, full, a_map, b_map, rank, part="ab"):
        """k-tile kt of output tile (bx, by) by TMA into its stage, completing on its full barrier; `part` "b": its B
        alone (the stage's bytes expected), "a": then its A."""
        if part != "a":
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(T.address_of(full[(g0 + kt) % stages]), T.uint32(stage_bytes))
        if share_a:  # this CTA's half of the A tile, to the same place in both CTAs; B whole, its own (a stage loaded
            # in parts, `early_weights`, takes no cluster: check_wgmma_shape)
            T.ptx[multicast](T.address_of(As[(g0 + kt) % stages, rank * half * bk]), T.address_of(a_map), kt * bk, by * bm + rank * half, T.address_of(full[(g0 + kt) % stages]), T.uint16(3))
            T.ptx[tma](T.address_of(Bs[(g0 + kt) % stages, 0]), T.address_of(b_map), kt * bk, bx * bn, T.address_of(full[(g0 + kt) % stages]))
        elif cluster == 2:  # A whole, its own; this CTA's half of the B tile, to the same place in both CTAs
            T.ptx[tma](T.address_of(As[(g0 + kt) % stages, 0]), T.address_of(a_map), kt * bk, by * bm, T.address_of(full[(g0 + kt) % stages]))
            T.ptx[multicast](T.address_of(Bs[(g0 + kt) % stages, rank * half * bk]), T.address_of(b_map), kt * bk, bx * bn + rank * half, T.address_of(full[(g0 + kt) % stages]), T.uint16(3))
        else:
            if part != "b":
                T.ptx[tma](T.address_of(As[(g0 + kt) % stages, 0]), T.address_of(a_map), kt * bk, by * bm, T.address_of(full[(g0 + kt) % stages]))
            if part != "a":
                T.ptx[tma](T.address_of(Bs[(g0 + kt) % stages, 0]), T.address_of(b_map), kt * bk, bx * bn, T.address_of(full[(g0 + kt) % stages]))

    @T.macro
    def load_tile(bx, by, g0, As, Bs, full, empty, a_map, b_map, rank):
        """The loader's k-tiles of output tile (bx, by), from the CTA's k-step g0 on."""
        for kt in T.serial(k_tiles):
            if g0 + kt >= stages:
                wait(empty[(g0 + kt) % stages], ((g0 + kt) // stages + 1) % 2)
                if ahead > 0 and kt + ahead < k_tiles:  # (k-tiles stages .. stages + ahead - 1: before the loop)
                    T.cuda.func_call("tvmfuse_prefetch_l2", T.address_of(b_map), (kt + ahead) * bk, bx * bn,
                                     source_code=PREFETCH_L2_SRC)
            if ablate == "loads" and g0 + kt >= stages:  # diagnostics: the stage completes without its data
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(full[(g0 + kt) % stages]))
            elif early and kt < stages:  # its B is on the way since before the wait
                load_stage(bx, by, g0, kt, As, Bs, full, a_map, b_map, rank, "a")
            else:
                load_stage(bx, by, g0, kt, As, Bs, full, a_map, b_map, rank)

    @T.macro
    def compute_tile(bx, by, g0, acc, As, Bs, full, empty, Cs, desc_a, desc_b, cw, tx, lane, warp, rank):
        """The consumers' output tile (bx, by): its k-tiles from the CTA's k-step g0 on, then the epilogue."""
        for i in T.unroll(acc_n * sets):
            acc[i] = T.float32(0)
        for kt2 in T.serial(k_tiles // sets):
            k_step(acc, 0, kt2 * sets, g0, As, Bs, full, empty, desc_a, desc_b, cw, tx, rank)  # noqa: F821
            if sets == 2:
                k_step(acc, 1, kt2 * 2 + 1, g0, As, Bs, full, empty, desc_a, desc_b, cw, tx, rank)  # noqa: F821
        if k_tiles % sets == 1:
            k_step(acc, 0, k_tiles - 1, g0, As, Bs, full, empty, desc_a, desc_b, cw, tx, rank)  # noqa: F821
        if inflight == 1:
            T.ptx.wgmma.wait_group.sync.aligned(0)
            for i in T.unroll(acc_n * sets):
                T.cuda.func_call("tvmfuse_fence_acc", acc[i], source_code=FENCE_SRC)
            if persistent and tx % 32 == 0:  # the last k-tile's stage, for the loader's next tile
                T.ptx.mbarrier.arrive.shared.b64(T.address_of(empty[(g0 + k_tiles - 1) % stages]))
        if staged:  # every consumer is past its last wgmma: the stage ring holds this tile's rows now
            T.cuda.func_call("tvmfuse_bar_sync", 1, 128 * cons, source_code=BAR_SRC)
            for j in T.unroll(bn // 8):
                for h in T.unroll(2):
                    for c in T.unroll(2):
                        r = T.meta_var(cw * 64 + warp * 16 + lane // 4 + h * 8)
                        col = T.meta_var(bx * bn + j * 8 + (lane % 4) * 2 + c)
                        if by * bm + r < m and col < n:
                            Cs[r * ld + j * 8 + (lane % 4) * 2 + c] = T.Cast(out_dtype, finish(total(acc, j * 4 + h * 2 + c), by * bm + r, col))
            T.cuda.func_call("tvmfuse_bar_sync", 2 + cw, 128, source_code=BAR_SRC)
            for it in T.serial(bn // 2):  # 64 rows x bn per warpgroup, consecutive lanes on consecutive columns
                r = T.meta_var(cw * 64 + (it * 128 + tx % 128) // bn)
                col = T.meta_var(bx * bn + (it * 128 + tx % 128) % bn)
                if by * bm + r < m and col < n:
                    out[place(by * bm + r, col)] = Cs[r * ld + (it * 128 + tx % 128) % bn]
        if not staged:
            for j in T.unroll(bn // 8):  # the epilogue, from the registers (every group already waited for)
                for h in T.unroll(2):
                    row = T.meta_var(by * bm + cw * 64 + warp * 16 + lane // 4 + h * 8)
                    col = T.meta_var(bx * bn + j * 8 + (lane % 4) * 2)
                    if row < m and col < n:  # TVM drops the guards where the tile divides M and N
                        if paired:
                            store(total(acc, j * 4 + h * 2), total(acc, j * 4 + h * 2 + 1), row, col)
                        else:
                            out[place(row, col)] = T.Cast(out_dtype, finish(total(acc, j * 4 + h * 2), row, col))
                            if col + 1 < n:
                                out[place(row, col + 1)] = T.Cast(out_dtype, finish(total(acc, j * 4 + h * 2 + 1), row, col + 1))

    @T.prim_func(check_well_formed=False)
    def gemm():
        a_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", a_map, dt, 2, A.data, *a_args)
        b_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", b_map, dt, 2, B.data, *b_args)

        T.device_entry()
        setup()  # what the epilogue reads declared first (views of 0-d parameters)
        # one grid dimension: with T.cta_id([x, y]) TVM's simplifier took the y extent as x's bound and dropped
        # the column guards of ragged N as always true
        if cluster == 2:
            rank = T.cta_id_in_cluster([2])
        else:
            rank = T.meta_var(0)
        bid = T.cta_id([grid])
        bx = T.meta_var(cta_tile(bid, tiles_m, tiles_n, group, T.min)[0])
        by = T.meta_var(cta_tile(bid, tiles_m, tiles_n, group, T.min)[1])
        tx = T.thread_id([128 * (1 + cons)])
        arena = T.alloc_buffer((stages * (a_stage + b_stage),), dt, scope="shared.dyn", align=1024)
        As = T.decl_buffer((stages, a_stage), dt, data=arena.data, scope="shared.dyn")
        Bs = T.decl_buffer((stages, b_stage), dt, data=arena.data, elem_offset=stages * a_stage, scope="shared.dyn")
        full = T.alloc_shared((stages,), "uint64")
        empty = T.alloc_shared((stages,), "uint64")
        acc = T.alloc_local((acc_n * sets,), "float32")
        Cs = T.decl_buffer((bm * ld,), out_dtype if staged else dt, data=arena.data, scope="shared.dyn")  # staged rows (odd N)
        desc_a: T.uint64
        desc_b: T.uint64
        cw = T.meta_var(tx // 128 - 1)  # consumer warpgroup 0 (or 1 where bm = 128; warpgroup 0 loads)
        lane = T.meta_var(tx % 32)
        warp = T.meta_var((tx % 128) // 32)

        if tx == 0:
            T.ptx.prefetch.tensormap(T.address_of(a_map))  # the descriptors on their way before the first TMA
            T.ptx.prefetch.tensormap(T.address_of(b_map))
            for s in T.unroll(stages):
                T.ptx.mbarrier.init.shared.b64(T.address_of(full[s]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(T.address_of(empty[s]), T.uint32(releases * cons * cluster))
        T.ptx.fence.proxy.async_.shared__cta()
        if cluster == 2:  # the other CTA arrives on these barriers and its loads complete on them
            T.ptx.fence.mbarrier_init.release.cluster()
            T.cuda.cluster_sync()
        else:
            T.cuda.cta_sync()
        if pdl and not early:  # the kernel before has finished and its writes are seen; the next may launch
            if waits:
                T.ptx.griddepcontrol.wait()
            if not late:
                T.ptx.griddepcontrol.launch_dependents()
        if tx < 128:
            if tile.setmaxnreg:  # the loading warpgroup gives registers back for the consumers' accumulators
                T.ptx["setmaxnreg.dec.sync.aligned.u32"](LOADER_REGS)
            if tx == 0:
                if early:  # the weights of the first k-tiles need not wait for the kernel before (A does)
                    for s in T.unroll(min(stages, k_tiles)):
                        load_stage(bx, by, 0, s, As, Bs, full, a_map, b_map, rank, "b")
                if ahead > 0:  # the k-tiles after the ring's first fill, into L2
                    for j in T.serial(stages, max(stages, min(stages + ahead, k_tiles))):
                        T.cuda.func_call("tvmfuse_prefetch_l2", T.address_of(b_map), j * bk, bx * bn,
                                         source_code=PREFETCH_L2_SRC)
                if early:
                    T.ptx.griddepcontrol.wait()
                    if not late:
                        T.ptx.griddepcontrol.launch_dependents()
                if persistent:  # tiles bid, bid + grid, ...: the loader runs on into the next tile's k-tiles
                    for ti in T.serial((tiles_n * tiles_m - bid + grid - 1) // grid):
                        load_tile(tile_of(bid + ti * grid, tiles_m, tiles_n, group, T.min)[0],
                                  tile_of(bid + ti * grid, tiles_m, tiles_n, group, T.min)[1], ti * k_tiles, As, Bs,
                                  full, empty, a_map, b_map, rank)
                else:
                    load_tile(bx, by, 0, As, Bs, full, empty, a_map, b_map, rank)
                if late:  # (one thread's release is its CTA's)
                    T.ptx.griddepcontrol.launch_dependents()
        else:
            if early:  # the epilogue reads and writes what the kernel before may still use
                T.ptx.griddepcontrol.wait()
                if not late:
                    T.ptx.griddepcontrol.launch_dependents()
            if tile.setmaxnreg:
                T.ptx["setmaxnreg.inc.sync.aligned.u32"](consumer_regs(cons))
            if persistent:
                for ti in T.serial((tiles_n * tiles_m - bid + grid - 1) // grid):
                    compute_tile(tile_of(bid + ti * grid, tiles_m, tiles_n, group, T.min)[0],
                                 tile_of(bid + ti * grid, tiles_m, tiles_n, group, T.min)[1], ti * k_tiles, acc, As,
                                 Bs, full, empty, Cs, desc_a, desc_b, cw, tx, lane, warp, rank)
            else:
                compute_tile(bx, by, 0, acc, As, Bs, full, empty, Cs, desc_a, desc_b, cw, tx, lane, warp, rank)
        if cluster == 2:  # neither CTA exits while the other may still arrive on its barriers
            T.cuda.cluster_sync()
    # fmt: on
    return tirx.PrimFunc(params, gemm.body).with_attrs({"global_symbol": name, "tirx.noalias": True,
                                                      TIRX_ATTR: "wgmma",
                                                      "tirx.is_scheduled": True})
