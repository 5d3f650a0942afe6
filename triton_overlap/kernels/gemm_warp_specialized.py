"""GEMM-ReduceScatter's GEMM for Hopper (sm_90), warp-specialized in Gluon: the epilogue of one tile runs while
the next tile's K loop runs.

Why a second kernel: in kernels.gemm every warp of a program runs a tile's K loop and then its epilogue, so the
epilogue (stores, counter bumps, and in the own-row tiles the waits for the peers' partials and their loads) leaves
the tensor cores idle. Triton does not warp-specialize that kernel on sm_90a; Gluon states the partitions
outright. docs/decisions.md has the profile and the measurements that made it GEMM-RS's default on Hopper.

Each program (one per SM, persistent) takes the same tiles in the same order as kernels.gemm with REDUCE_OWN
and CLAIM=0 (peers' rows first in send order, our own rows last, round-robin over programs). Two partitions:

* the K loop (the default partition, 8 warps: two warpgroups, 64 rows of the 128 x 256 tile each, on wgmma). The
  same warps issue the TMA loads of A and B NUM_STAGES - 1 K steps ahead, across tiles, into a ring of stages
  guarded by "ready" mbarriers; a stage is refilled once both warpgroups' wgmma reading it has finished (a wait
  and a barrier of the partition). At the end of a tile they write it, as the output dtype, into a shared tile
  buffer and arrive on "full";
* the epilogue (a worker partition of EPILOGUE_WARPS warps), SUB_M rows of the buffer at a time, then arrives on
  "free" (when the K loop's warps may write the buffer again):
  * a peer's tile is stored through ``scatter_ptrs[owner]``, then, after a barrier of the partition, every chunk
    counter it covers is bumped with a release. Copy variant: into the local staging buffer, local counters
    (device scope), and copy engines move each chunk on. Store variant (PEER_STORES): straight into the owner's
    receive slot over NVLink, the owner's counters at system scope, beside the next tile's K loop;
  * a tile of our own rows waits (bounded, kernels.signal.wait_flag), while the K loop runs, until every program
    has started (so every peer tile belongs to a running program) and for every peer's counter of the chunks it
    covers to reach ``expected``; after the K loop it adds the peers' partials (our receive slots, ``c_ptr``) and
    the bias in float32 (kernels.gemm_device.reduce_own) and stores the output;
  * a program's last tile has no K loop after it to hide those loads: if it holds our rows, the epilogue waits and
    sums its partials and bias into the buffer while its K loop runs (before arriving on "free"; with PRELOAD_TMA
    one peer's partial comes by a single TMA load rather than the epilogue warps' loads), and the K loop's warps
    add the buffer to their accumulator before writing the tile back; the epilogue then only stores it.

The store variant needs no barrier before the launch: program 0 adds one to this rank's slot of every peer's start
counts when the kernel starts (our receive slots are free: our previous call has ended), and before its first
tile for a peer a program waits for that peer's count here to be at least one. The last program out takes one
off each count (_peer_started says why that is a semaphore and needs no epoch).

So an own-row tile's partial is rounded to the output dtype once, as every peer's partial is, before the float32
sum (the last tile: the peers' partials and the bias are summed and rounded once, then added to our float32
accumulator). The last program out zeroes this rank's counters and the tick (RESET_AT_EXIT). Only for NVIDIA
sm_90 (wgmma), 16-bit operands, every rank's rows whole 128-row tiles (``layout_for`` says when a call can take
it); GEMM-RS takes it where its config's ``warp_specialized`` allows and otherwise uses kernels.gemm. Gluon does
not run in Triton's interpreter, so the host backend never takes this path. 12 warps in all, so ptxas caps a
thread at 168 registers (the K loop's accumulator takes 128).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..plan import ChunkLayout, cdiv
from .cached_launch import launch
from .capability import gluon_available, is_sm90
from .chunks import chunk_of_row
from .gemm_device import own_chunks_ready, publish, reduce_own, reset_at_exit, rs_tile
from .gemm_hopper_tiles import EPILOGUE_REGS, EPILOGUE_WARPS, MAXNREG, SUB_M, TILES, programs
from .gemm_operands import desc_layout
from .gluon_shims import b_descriptor, barrier, tma_descriptor, tma_load
from .signal import WHAT_PEER_STARTED, WHAT_STARTED, error_code, wait_for, waiter


@gluon.jit
def _announce_start(start_ptrs, rank, world):
    """PEER_STORES: add one to our slot of every peer's start counts (``start_ptrs``: each rank's int32 [world]),
    with a system-scope release: this rank's call has started, so its previous call no longer reads its receive
    slots or counters."""
    for o in range(0, world):
        if o != rank:
            slots = gl.load(start_ptrs + o).to(gl.pointer_type(gl.int32))
            gl.atomic_add(slots + rank, 1, sem="release", scope="sys")


@gluon.jit
def _peer_started(start_ptrs, owner, started, waiter, CLOCK: gl.constexpr):
    """PEER_STORES, before this program's first store into ``owner``'s receive slot: wait (bounded) until owner's
    start count here is at least one (its call has started; _announce_start). Returns ``started`` with bit owner
    set. The counts make a semaphore: owner adds one when each call starts, we take one off when each call ends
    (_count_off_starts), so a count of one or more at our call n means owner has started its call n, even if its
    start arrived before our call n - 1 ended."""
    rank = waiter[2]
    if owner != rank:
        if ((started >> owner) & 1) == 0:
            mine = gl.load(start_ptrs + rank).to(gl.pointer_type(gl.int32))
            wait_for(mine + owner, 1, waiter, owner, WHAT_PEER_STARTED, CLOCK)
            started = started | (1 << owner)
    return started


@gluon.jit
def _count_off_starts(start_ptrs, rank, world):
    """PEER_STORES, by the last program out: one start of each peer used up (_peer_started)."""
    mine = gl.load(start_ptrs + rank).to(gl.pointer_type(gl.int32))
    for o in range(0, world):
        if o != rank:
            gl.atomic_add(mine + o, -1, sem="relaxed", scope="sys")


@gluon.jit
def _tile(it, M, N, split_m, tile_order_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile ``it`` of the order (kernels.gemm_device.rs_tile): (first row, first column)."""
    vm, pid_n = rs_tile(it, gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), split_m, GROUP_M)
    return gl.load(tile_order_ptr + vm) * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _load_next(a_desc, b_desc, a_bufs, b_bufs, ready, cursor, k_tiles, num_tiles, M, N, split_m, tile_order_ptr,
               BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, B_KMAJOR: gl.constexpr):
    """Issue the TMA loads of the load cursor's K step into its stage and advance the cursor. ``cursor``: (step
    count, tile, K step of the tile, the tile's first row, its first column)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ld, it, k, row0, col0 = cursor
    s = ld % STAGES
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [row0, k * BLOCK_K], bar, a_bufs.index(s))
    if B_KMAJOR:
        tma_load(b_desc, [col0, k * BLOCK_K], bar, b_bufs.index(s))
    else:
        tma_load(b_desc, [k * BLOCK_K, col0], bar, b_bufs.index(s))
    k += 1
    if k == k_tiles:  # the program's next tile
        k = 0
        it += NUM_PROGRAMS
        if it < num_tiles:
            row0, col0 = _tile(it, M, N, split_m, tile_order_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    return ld + 1, it, k, row0, col0


@gluon.jit
def _mma(p, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, B_KMAJOR: gl.constexpr):
    """Every tile of this program: the K loop on wgmma (two warpgroups, 64 rows each), its TMA loads issued
    NUM_STAGES - 1 steps ahead (across tiles), then the tile as the output dtype into the shared tile buffer for
    the epilogue partition."""
    a_desc, b_desc, a_bufs, b_bufs, ready, tile_order_ptr, M, N, K, split_m, pid = p[0]
    (c_ptr, out_ptr, bias_ptr, scatter_ptrs, counter_ptrs, flags_ptr, expected_ptr, tick_ptr, waiter, world, M_LOCAL,
     M_PER_CHUNK, CHUNKS_PER_RANK, stride_cm, stride_om, start_ptrs) = p[1]
    err_ptr, budget, rank, op = waiter
    tile_buf, tile_full, tile_free, preload_bar, c_desc = p[2]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    k_tiles = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    steps = gl.cdiv(num_tiles - pid, NUM_PROGRAMS) * k_tiles  # K steps of all this program's tiles
    row0, col0 = _tile(pid, M, N, split_m, tile_order_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    cursor = (0, pid, 0, row0, col0)  # the next K step to load (_load_next)
    for _ in gl.static_range(STAGES - 1):
        if cursor[0] < steps:
            cursor = _load_next(a_desc, b_desc, a_bufs, b_bufs, ready, cursor, k_tiles, num_tiles, M, N, split_m,
                                tile_order_ptr, BLOCK_N, GROUP_M, NUM_PROGRAMS, B_KMAJOR)
    g = 0  # K steps consumed so far
    t = 0  # tiles handed to the epilogue so far
    for it in range(pid, num_tiles, NUM_PROGRAMS):
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        for k in range(k_tiles):
            s = g % STAGES
            mbarrier.wait(ready.index(s), (g // STAGES) & 1)
            if B_KMAJOR:
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            else:
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
            # the previous step's wgmma (both warpgroups') has finished: its stage takes step g + STAGES - 1
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            barrier()
            if cursor[0] < steps:
                cursor = _load_next(a_desc, b_desc, a_bufs, b_bufs, ready, cursor, k_tiles, num_tiles, M, N, split_m,
                                    tile_order_ptr, BLOCK_N, GROUP_M, NUM_PROGRAMS, B_KMAJOR)
            g += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.wait(tile_free, t & 1)  # the epilogue has read the previous tile (and preloaded, see below)
        if it + NUM_PROGRAMS >= num_tiles:  # our last tile: the epilogue has preloaded its partials
            row0, col0 = _tile(it, M, N, split_m, tile_order_ptr, BLOCK_M, BLOCK_N, GROUP_M)
            if row0 // M_LOCAL == rank:
                acc += tile_buf.load(mma).to(gl.float32)
        tile_buf.store(acc.to(tile_buf.dtype))
        mbarrier.arrive(tile_full)
        t += 1


@gluon.jit
def _own_wait(row0, all_in, flags_ptr, expected_ptr, tick_ptr, waiter, world, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK,
              BLOCK_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, CLOCK: gl.constexpr):
    """For the tile at ``row0`` if it holds our rows: wait (bounded) until every program has started (once:
    ``all_in``), so every peer tile is being worked on, and until every peer's partial of its chunks has landed.
    Returns all_in."""
    if row0 // M_LOCAL == waiter[2]:  # (the waiter's rank: ours)
        if all_in == 0:
            wait_for(tick_ptr, NUM_PROGRAMS, waiter, -1, WHAT_STARTED, CLOCK)
            all_in = 1
        own_chunks_ready(flags_ptr, expected_ptr, chunk_of_row(row0, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK),
                         chunk_of_row(row0 + BLOCK_M - 1, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK), CHUNKS_PER_RANK,
                         world, waiter, CLOCK)
    return all_in


@gluon.jit
def _preload(p, it, all_in, rows_off, cols_off, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
             NUM_PROGRAMS: gl.constexpr, HAS_BIAS: gl.constexpr, CLOCK: gl.constexpr, SUB_M: gl.constexpr,
             LAYOUT: gl.constexpr, PRELOAD_TMA: gl.constexpr):
    """A program's last tile ``it``, if it holds our rows: wait for its partials (_own_wait), then sum them and the
    bias in float32 into the tile buffer as the output dtype while the K loop runs, for the K loop's partition to
    add to its accumulator (so no load is left after the last K loop). With PRELOAD_TMA one peer's partial comes
    into the buffer by a single TMA load (``c_desc``), and a pass over the buffer adds the other peers' and the
    bias where there are any. Returns all_in."""
    a_desc, b_desc, a_bufs, b_bufs, ready, tile_order_ptr, M, N, K, split_m, pid = p[0]
    (c_ptr, out_ptr, bias_ptr, scatter_ptrs, counter_ptrs, flags_ptr, expected_ptr, tick_ptr, waiter, world, M_LOCAL,
     M_PER_CHUNK, CHUNKS_PER_RANK, stride_cm, stride_om, start_ptrs) = p[1]
    err_ptr, budget, rank, op = waiter
    tile_buf, tile_full, tile_free, preload_bar, c_desc = p[2]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    row0, col0 = _tile(it, M, N, split_m, tile_order_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    all_in = _own_wait(row0, all_in, flags_ptr, expected_ptr, tick_ptr, waiter, world, M_LOCAL, M_PER_CHUNK,
                       CHUNKS_PER_RANK, BLOCK_M, NUM_PROGRAMS, CLOCK)
    if row0 // M_LOCAL == rank:
        first = (rank + 1) % world  # PRELOAD_TMA: the peer whose partial the TMA load brings
        if PRELOAD_TMA:
            fence_async_shared()  # every warp of the partition is done reading the buffer (the previous tile)
            barrier()
            mbarrier.expect(preload_bar, c_desc.block_type.nbytes)
            tma_load(c_desc, [first * M_LOCAL + row0 - rank * M_LOCAL, col0], preload_bar, tile_buf)
            mbarrier.wait(preload_bar, 0)  # (once per program: its last tile)
        more = world > 2  # partials or a bias still to add
        if HAS_BIAS or not PRELOAD_TMA:
            more = world > 0
        if more:
            cols = col0 + cols_off
            col_ok = cols < N
            for sub in gl.static_range(BLOCK_M // SUB_M):
                local = row0 - rank * M_LOCAL + sub * SUB_M + rows_off
                if PRELOAD_TMA:
                    acc = tile_buf.slice(sub * SUB_M, SUB_M).load(LAYOUT).to(gl.float32)
                else:
                    acc = gl.zeros((SUB_M, BLOCK_N), gl.float32, LAYOUT)
                if HAS_BIAS:
                    acc += gl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(gl.float32)[None, :]
                for s in range(0, world):
                    if (s != rank) & ((s != first) | (not PRELOAD_TMA)):
                        part = c_ptr + (s * M_LOCAL + local)[:, None] * stride_cm + cols[None, :]
                        acc += gl.load(part, mask=col_ok[None, :], other=0.0).to(gl.float32)
                tile_buf.slice(sub * SUB_M, SUB_M).store(acc.to(tile_buf.dtype))
    return all_in


@gluon.jit
def _epilogue(p, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, HAS_BIAS: gl.constexpr,
              CLOCK: gl.constexpr, ALIGN_C: gl.constexpr, SUB_M: gl.constexpr,
              PRELOAD_TMA: gl.constexpr, PEER_STORES: gl.constexpr):
    """Every tile of this program, from the shared tile buffer, SUB_M rows at a time (module doc)."""
    a_desc, b_desc, a_bufs, b_bufs, ready, tile_order_ptr, M, N, K, split_m, pid = p[0]
    (c_ptr, out_ptr, bias_ptr, scatter_ptrs, counter_ptrs, flags_ptr, expected_ptr, tick_ptr, waiter, world, M_LOCAL,
     M_PER_CHUNK, CHUNKS_PER_RANK, stride_cm, stride_om, start_ptrs) = p[1]
    err_ptr, budget, rank, op = waiter
    tile_buf, tile_full, tile_free, preload_bar, c_desc = p[2]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    dtype: gl.constexpr = c_ptr.dtype.element_ty
    # each thread 16 bytes of a row, a warp a row of 256 columns
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [gl.num_warps(), 1],
                                                 [1, 0])
    rows_off = gl.arange(0, SUB_M, layout=gl.SliceLayout(1, rows_layout))
    cols_off = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, rows_layout))
    num_tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    all_in = 0  # whether every program has been seen started
    started = 0  # PEER_STORES: bit o set once owner o's call has been seen started
    if pid + NUM_PROGRAMS >= num_tiles:  # our only tile: its partials, before the K loop ends
        all_in = _preload(p, pid, all_in, rows_off, cols_off, BLOCK_N, GROUP_M, NUM_PROGRAMS, HAS_BIAS, CLOCK, SUB_M,
                          rows_layout, PRELOAD_TMA)
    mbarrier.arrive(tile_free)
    t = 0
    for it in range(pid, num_tiles, NUM_PROGRAMS):
        row0, col0 = _tile(it, M, N, split_m, tile_order_ptr, BLOCK_M, BLOCK_N, GROUP_M)
        cols = col0 + cols_off
        col_ok = cols < N
        owner = row0 // M_LOCAL
        preloaded = it + NUM_PROGRAMS >= num_tiles  # this program's last tile
        preload_next = (it + NUM_PROGRAMS < num_tiles) & (it + 2 * NUM_PROGRAMS >= num_tiles)  # the next is
        if not preloaded:  # while the K loop runs: wait for the peers' partials of these rows
            all_in = _own_wait(row0, all_in, flags_ptr, expected_ptr, tick_ptr, waiter, world, M_LOCAL, M_PER_CHUNK,
                               CHUNKS_PER_RANK, BLOCK_M, NUM_PROGRAMS, CLOCK)
        if PEER_STORES:  # and, before the first tile for a peer, for that peer's call to have started
            started = _peer_started(start_ptrs, owner, started, waiter, CLOCK)
        mbarrier.wait(tile_full, t & 1)
        t += 1
        if owner == rank:  # our rows: the output
            for sub in gl.static_range(BLOCK_M // SUB_M):
                local = row0 - rank * M_LOCAL + sub * SUB_M + rows_off
                vals = tile_buf.slice(sub * SUB_M, SUB_M).load(rows_layout)
                if sub == BLOCK_M // SUB_M - 1 and not preload_next:
                    mbarrier.arrive(tile_free)
                if preloaded:  # the sum already
                    o_rows = out_ptr + local * stride_om
                    if ALIGN_C:
                        o_rows = gl.multiple_of(o_rows, 16)
                    gl.store(o_rows[:, None] + cols[None, :], vals, mask=col_ok[None, :])
                else:  # add the peers' partials and the bias
                    reduce_own(vals.to(gl.float32), c_ptr, out_ptr, bias_ptr, local, row0 + sub * SUB_M + rows_off,
                               cols, N, M, M_LOCAL, rank, world, stride_cm, 1, stride_om, HAS_BIAS, ALIGN_C)
        else:  # a peer's rows: into its staging slot, then bump the counters of the chunks the tile covers
            base = gl.load(scatter_ptrs + owner).to(gl.pointer_type(dtype))
            # PEER_STORES: nothing goes into a peer after a fault (its call may not have started, or may disagree)
            active = (error_code(err_ptr) == 0) | (not PEER_STORES)
            for sub in gl.static_range(BLOCK_M // SUB_M):
                vals = tile_buf.slice(sub * SUB_M, SUB_M).load(rows_layout)
                if sub == BLOCK_M // SUB_M - 1 and not preload_next:
                    mbarrier.arrive(tile_free)
                c_rows = base + (rank * M_LOCAL + row0 - owner * M_LOCAL + sub * SUB_M + rows_off) * stride_cm
                if ALIGN_C:
                    c_rows = gl.multiple_of(c_rows, 16)
                gl.store(c_rows[:, None] + cols[None, :], vals, mask=col_ok[None, :] & active)
            if active:
                publish(counter_ptrs, chunk_of_row(row0, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK),
                        chunk_of_row(row0 + BLOCK_M - 1, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK), rank,
                        CHUNKS_PER_RANK, not PEER_STORES)  # the staging buffer's counters are local; a peer's, NVLink
        if preload_next:  # the last tile's partials (after this tile's counters: a peer may be waiting for them)
            all_in = _preload(p, it + NUM_PROGRAMS, all_in, rows_off, cols_off, BLOCK_N, GROUP_M, NUM_PROGRAMS,
                              HAS_BIAS, CLOCK, SUB_M, rows_layout, PRELOAD_TMA)
            mbarrier.arrive(tile_free)


@gluon.jit
def rs_gemm_ws(a_desc, b_desc, c_desc, c_ptr, out_ptr, bias_ptr, scatter_ptrs, counter_ptrs, flags_ptr, expected_ptr,
               tick_ptr, tile_order_ptr, start_ptrs, waiter, world, split_m,
               M, N, K, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, stride_cm, stride_om,
               BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr,
               B_KMAJOR: gl.constexpr, HAS_BIAS: gl.constexpr, CLOCK: gl.constexpr, ALIGN_C: gl.constexpr,
               EPILOGUE_WARPS: gl.constexpr, EPILOGUE_REGS: gl.constexpr, SUB_M: gl.constexpr,
               PRELOAD_TMA: gl.constexpr, RESET_AT_EXIT: gl.constexpr = True,
               PEER_STORES: gl.constexpr = False):
    """C = A @ B for GEMM-ReduceScatter with the reduction fused (module doc): the copy variant, or with PEER_STORES
    the store variant (``start_ptrs``: each rank's int32 [world] start counts, symmetric). ``a_desc``: A
    [M, K] in [BLOCK_M, BLOCK_K] blocks; ``b_desc``: B [K, N] in [BLOCK_K, BLOCK_N] blocks or, with B_KMAJOR, B's
    transpose [N, K] in [BLOCK_N, BLOCK_K] blocks. ``c_desc``: with PRELOAD_TMA, ``c_ptr``'s [W * M_LOCAL, N] in
    [BLOCK_M, BLOCK_N] blocks of the tile buffer's layout (the last tile's first peer partial is loaded through
    it). ``waiter``: kernels.signal.waiter's (error word, budget, rank, op). The other arguments are kernels.gemm's
    of the same name."""
    rank = waiter[2]
    pid = gl.program_id(0)
    gl.atomic_add(tick_ptr, 1, sem="relaxed", scope="gpu")  # this program has started
    if PEER_STORES:
        if pid == 0:  # our receive slots are free (our previous call has ended): peers may store into them
            _announce_start(start_ptrs, rank, world)
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    tile_buf = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N],
                                                                              c_ptr.dtype.element_ty))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    tile_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())  # full, free, preload
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
    mbarrier.init(tile_bars.index(0), count=1)
    mbarrier.init(tile_bars.index(1), count=1)
    mbarrier.init(tile_bars.index(2), count=1)
    # what the partitions take (the loader and the K loop do not read the epilogue's part)
    p = ((a_desc, b_desc, a_bufs, b_bufs, ready, tile_order_ptr, M, N, K, split_m, pid),
         (c_ptr, out_ptr, bias_ptr, scatter_ptrs, counter_ptrs, flags_ptr, expected_ptr, tick_ptr, waiter, world,
          M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, stride_cm, stride_om, start_ptrs),
         (tile_buf, tile_bars.index(0), tile_bars.index(1), tile_bars.index(2), c_desc))
    gl.warp_specialize([
        (_mma, (p, BLOCK_N, GROUP_M, NUM_PROGRAMS, B_KMAJOR)),
        (_epilogue, (p, BLOCK_N, GROUP_M, NUM_PROGRAMS, HAS_BIAS, CLOCK, ALIGN_C, SUB_M, PRELOAD_TMA,
                     PEER_STORES)),
    ], [EPILOGUE_WARPS], [EPILOGUE_REGS])
    if RESET_AT_EXIT:
        last = reset_at_exit(tick_ptr, flags_ptr, world * CHUNKS_PER_RANK, NUM_PROGRAMS)
        if PEER_STORES:
            if last:  # every program is past its waits: this call's start of each peer is used up
                _count_off_starts(start_ptrs, rank, world)


# ---------------------------------------------------------------------------------------------------- launcher
def layout_for(ctx, a, w, m_local: int) -> str | None:
    """How B is described if this call can run on this kernel ("kn" or "nk", as kernels.gemm_operands.desc_layout says),
    else None: the cuda backend on compute capability 9.0, every rank's rows whole 128-row tiles, A and B
    describable."""
    if ctx.backend != "cuda" or m_local % TILES.block_m or not is_sm90(a.device.index) or not gluon_available():
        return None
    return desc_layout(ctx.backend, TILES, a, None, w, m_local, False)


def launch_gemm_rs(ctx, b_layout: str, a, w, c, out, bias, layout: ChunkLayout, order, expected, counters,
                   scatter_ptrs, counter_ptrs, exit_counts, starts=None, op: int = 0, rank: int | None = None,
                   world: int | None = None, preload: bool = True) -> None:
    """The fused GEMM-RS GEMM on the caller's stream. ``c``: this rank's receive slots [W * m_local, N] (own-row
    tiles add the peers' partials from there); ``out``: the output [m_local, N]; ``scatter_ptrs`` and
    ``counter_ptrs``: where peers' tiles and their counts go (int64 [W]); ``counters``: this rank's counters,
    which own-row tiles wait on; ``exit_counts``: two int32s, zero at launch, zeroed again by the last program with
    ``counters``. ``starts`` (store variant, PEER_STORES): the symmetric start counts (int32 [W]); None: the copy
    variant (peers' tiles go to a local staging buffer). ``rank`` / ``world``: as which rank of how many (None:
    the Context's); ``preload`` False: the last own-row tile's partials by the epilogue's loads, never by TMA."""
    W = ctx.world_size if world is None else world
    rank = ctx.rank if rank is None else rank
    (M, K), N = a.shape, w.shape[1]
    m_local = layout.m_local
    bm, bn, bk = TILES.block_m, TILES.block_n, TILES.block_k
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_desc = tma_descriptor(a, [M, K], a.stride(0), [bm, bk], gdt)
    b = b_descriptor(w, b_layout, gdt, TILES.block_k, TILES.block_n)
    grid = programs(ctx, M, N, peer_stores=starts is not None)
    align = N % 16 == 0 and out.data_ptr() % 16 == 0 and out.stride(0) * out.element_size() % 16 == 0
    preload_tma = preload and c.data_ptr() % 16 == 0 and c.stride(0) * c.element_size() % 16 == 0
    c_desc = tma_descriptor(c, [W * m_local, N], c.stride(0), [bm, bn], gdt) if preload_tma else b
    launch(rs_gemm_ws, (grid,), (
        a_desc, b, c_desc, c, out, bias if bias is not None else out, scatter_ptrs, counter_ptrs, counters,
        expected, exit_counts, order, exit_counts if starts is None else starts.ptrs, waiter(ctx, op, rank),
        W, (W - 1) * m_local // bm, M, N, K, m_local, layout.m_per_chunk, layout.chunks_per_rank,
        c.stride(0), out.stride(0),
    ), dict(BLOCK_N=bn, GROUP_M=TILES.group_m, NUM_PROGRAMS=grid, NUM_STAGES=TILES.num_stages,
            B_KMAJOR=b_layout == "nk", HAS_BIAS=bias is not None, CLOCK=ctx.clock, ALIGN_C=align,
            EPILOGUE_WARPS=EPILOGUE_WARPS, EPILOGUE_REGS=EPILOGUE_REGS, SUB_M=SUB_M, PRELOAD_TMA=preload_tma,
            RESET_AT_EXIT=True, PEER_STORES=starts is not None),
           num_warps=8, maxnreg=MAXNREG)
    ctx.after_launch()


def plain_gemm_ws(ctx, a, w, c, bias=None):
    """A callable that launches this kernel alone, ``c = a @ w (+ bias)``, as the only rank: every tile holds
    its own rows and has no partials to wait for or add, so nothing is communicated (GEMM-RS's consumer alone in
    benchmarks, beside kernels.gemm.plain_gemm). Raises ValueError where the kernel cannot run (``layout_for``)."""
    M = a.shape[0]
    b_layout = layout_for(ctx, a, w, M)
    if b_layout is None:
        raise ValueError("plain_gemm_ws: needs the cuda backend on compute capability 9.0, whole 128-row tiles and "
                         "operands a tensor descriptor can describe")
    dev = a.device
    order = torch.arange(cdiv(M, TILES.block_m), dtype=torch.int32, device=dev)
    counts = torch.zeros(4, dtype=torch.int32, device=dev)  # expected, counter, and the two exit counts
    ptrs = torch.tensor([c.data_ptr(), counts[1:2].data_ptr()], dtype=torch.int64, device=dev)
    layout = ChunkLayout(1, M, M)
    return lambda: launch_gemm_rs(ctx, b_layout, a, w, c, c, bias, layout, order, counts[0:1], counts[1:2],
                                  ptrs[0:1], ptrs[1:2], counts[2:4], rank=0, world=1, preload=False)
