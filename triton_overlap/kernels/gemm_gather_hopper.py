"""AllGather-GEMM's GEMM for Hopper (sm_90), warp-specialized in Gluon: the TMA loads of the next tile start while
this tile's K loop runs, and a tile's stores run beside the next tile's K loop.

Why a second kernel: kernels.gemm loads a tile's operands only once its K loop starts, so every tile pays the
pipeline's fill, and its epilogue leaves the tensor cores idle. Triton's pipeliner cannot prefetch across tiles
here: a peer tile's loads must follow its wait on the chunk flags, and a flattened loop would issue them before the
wait. Gluon states the order and the partitions outright. It is kernels.gemm_warp_specialized's pipeline with
AllGather's waits and a plain epilogue; docs/decisions.md has the measurements.

Each program (one per SM but one, persistent) takes the tiles ``pid, pid + P, ...`` of kernels.gemm's GATHER order
(m-tiles by ``tile_order``, grouped by GROUP_M). Two partitions:

* the K loop (the default partition, 8 warps: two warpgroups, 64 rows of the 128 x 256 tile each, on wgmma). The
  same warps issue the TMA loads of A and B NUM_STAGES - 1 K steps ahead, across tiles, into a ring of stages
  guarded by "ready" mbarriers; a stage is refilled once both warpgroups' wgmma reading it has finished. Before the
  first load of a tile of a peer's rows they wait (bounded, kernels.signal.wait_flag) for the flag of every chunk
  the tile covers and fence the async proxy, so the loads see what the flag published. A is one 3-D descriptor
  whose two planes are the shard and the workspace: our own rows are read in place from the shard's plane, the
  peers' from the workspace's. The wait and the choice of plane sit outside the K loop's inner loop (``_k_loops``).
  Where the two lie too far apart for one descriptor (a plane stride is under 2^40 bytes; torch's allocator and
  cudaMalloc can place them 100 TB apart), the shard is first copied into the workspace's own rows, which nothing
  else writes in push mode, and the descriptor has the workspace as its only plane (kernels.gemm_operands.gather_a).
  After the K loop they add the bias in float32 and write the tile, as the output dtype, into a shared tile buffer
  ("full");
* the stores (a worker partition of STORE_WARPS warps): SUB_M rows of the buffer at a time into C, then "free".

The last program out zeroes the flags (RESET_AT_EXIT). Only for NVIDIA sm_90, 16-bit operands, every rank's rows
whole 128-row tiles, at least NUM_STAGES - 1 K steps, the operands describable by tensor descriptors
(``layout_for``). Gluon does not run in Triton's interpreter, so the
host backend, fp8 and other GPUs take kernels.gemm.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ..plan import ChunkLayout, cdiv
from .cached_launch import launch
from .capability import gluon_available, is_sm90
from .chunks import chunk_of_row
from .gemm_device import fence_async_proxy, grouped_tile, reset_at_exit
from .gemm_hopper_tiles import EPILOGUE_REGS, EPILOGUE_WARPS, MAXNREG, TILES, programs
from .gemm_operands import aligned, desc_layout, gather_a
from .gluon_shims import b_descriptor, barrier, shared_layout, tma_load
from .signal import wait_for, waiter


@gluon.jit
def _tile(it, num_pid_m, num_pid_n, tile_order_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          GROUP_M: gl.constexpr):
    """Tile ``it`` of the order (kernels.gemm_device.grouped_tile over ``tile_order``): (first row, first column)."""
    vm, pid_n = grouped_tile(it, num_pid_m, num_pid_n, GROUP_M)
    return gl.load(tile_order_ptr + vm) * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _arrived(row0, flags_ptr, waiter, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, BLOCK_M: gl.constexpr,
             CLOCK: gl.constexpr):
    """Before the first load of the tile at ``row0``: if it holds a peer's rows, wait (bounded) for the flag of
    every chunk it covers, then order those acquires before the TMA loads that follow."""
    if row0 // M_LOCAL != waiter[2]:  # (the waiter's rank: ours)
        c_first = chunk_of_row(row0, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK)
        c_last = chunk_of_row(row0 + BLOCK_M - 1, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK)
        for c in range(c_first, c_last + 1):
            wait_for(flags_ptr + c, 1, waiter, c // CHUNKS_PER_RANK, c % CHUNKS_PER_RANK, CLOCK)
        fence_async_proxy(CLOCK)


@gluon.jit
def _load(p, ld, row0, col0, k, B_KMAJOR: gl.constexpr):
    """Issue the TMA loads of K step ``k`` of the tile at (``row0``, ``col0``) into stage ``ld % NUM_STAGES``. A's
    descriptor spans two planes, the shard and the workspace: our rows are read from the shard's, a peer's from the
    workspace's, by the plane index rather than a branch."""
    a_desc, b_desc, a_bufs, b_bufs, ready, tile_order_ptr = p[0]
    flags_ptr, waiter, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, own_plane, ws_plane, own_shift = p[1]
    rank = waiter[2]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    s = ld % STAGES
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    mine = (row0 // M_LOCAL == rank).to(gl.int32)
    plane = ws_plane + (own_plane - ws_plane) * mine
    tma_load(a_desc, [plane, row0 - own_shift * mine, k * BLOCK_K], bar, a_bufs.index(s))
    if B_KMAJOR:
        tma_load(b_desc, [col0, k * BLOCK_K], bar, b_bufs.index(s))
    else:
        tma_load(b_desc, [k * BLOCK_K, col0], bar, b_bufs.index(s))


@gluon.jit
def _step(p, acc, g, B_KMAJOR: gl.constexpr):
    """Consume K step ``g`` (this program's count): wait for its stage, issue its wgmma, and wait for the previous
    step's (both warpgroups'), whose stage is then free."""
    a_desc, b_desc, a_bufs, b_bufs, ready, tile_order_ptr = p[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    s = g % STAGES
    mbarrier.wait(ready.index(s), (g // STAGES) & 1)
    a_tile = a_bufs.index(s).reshape([a_desc.block_type.shape[1], a_desc.block_type.shape[2]])
    if B_KMAJOR:
        acc = warpgroup_mma(a_tile, b_bufs.index(s).permute((1, 0)), acc, is_async=True)
    else:
        acc = warpgroup_mma(a_tile, b_bufs.index(s), acc, is_async=True)
    acc = warpgroup_mma_wait(1, deps=(acc, ))
    barrier()
    return acc


@gluon.jit
def _k_loops(p, q, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
             B_KMAJOR: gl.constexpr, HAS_BIAS: gl.constexpr, CLOCK: gl.constexpr):
    """Every tile of this program: the K loop on wgmma (two warpgroups, 64 rows each), its TMA loads issued
    LEAD = NUM_STAGES - 1 steps ahead, the bias added in float32, then the tile as the output dtype into the shared
    tile buffer for the store partition.

    A tile's K loop is a loop over its first k_tiles - LEAD steps, which load the same tile's later steps, and LEAD
    steps written out, which load the next tile's first ones; the wait for the next tile's chunks (_arrived) sits in
    the first of those, outside any loop, where the first of its loads is issued (k_tiles >= LEAD: layout_for)."""
    a_desc, b_desc, a_bufs, b_bufs, ready, tile_order_ptr = p[0]
    flags_ptr, waiter, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, own_plane, ws_plane, own_shift = p[1]
    c_buf, tile_full, tile_free, c_ptr, bias_ptr, stride_cm, M, N, K, pid = q
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[2]
    LEAD: gl.constexpr = a_bufs.type.shape[0] - 1
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    k_tiles = gl.cdiv(K, BLOCK_K)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    row0, col0 = _tile(pid, num_pid_m, num_pid_n, tile_order_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    _arrived(row0, flags_ptr, waiter, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, BLOCK_M, CLOCK)
    for j in gl.static_range(LEAD):
        _load(p, j, row0, col0, j, B_KMAJOR)
    g = 0  # K steps consumed so far
    t = 0  # tiles handed to the store partition so far
    for it in range(pid, num_tiles, NUM_PROGRAMS):
        has_next = it + NUM_PROGRAMS < num_tiles
        next_row0, next_col0 = _tile(gl.minimum(it + NUM_PROGRAMS, num_tiles - 1), num_pid_m, num_pid_n,
                                     tile_order_ptr, BLOCK_M, BLOCK_N, GROUP_M)
        acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
        for k in range(k_tiles - LEAD):
            acc = _step(p, acc, g, B_KMAJOR)
            _load(p, g + LEAD, row0, col0, k + LEAD, B_KMAJOR)
            g += 1
        for j in gl.static_range(LEAD):
            acc = _step(p, acc, g, B_KMAJOR)
            if has_next:
                if j == 0:
                    _arrived(next_row0, flags_ptr, waiter, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, BLOCK_M, CLOCK)
                _load(p, g + LEAD, next_row0, next_col0, j, B_KMAJOR)
            g += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        if HAS_BIAS:
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
            acc += gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
        mbarrier.wait(tile_free, t & 1)  # the store partition has read the previous tile
        c_buf.store(acc.to(c_buf.dtype))
        barrier()  # every warp's part of the tile is in the buffer
        mbarrier.arrive(tile_full)
        t += 1
        row0, col0 = next_row0, next_col0


@gluon.jit
def _stores(p, q, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, SUB_M: gl.constexpr,
            ALIGN_C: gl.constexpr):
    """Every tile of this program, from the shared tile buffer into C, SUB_M rows at a time, beside the next tile's
    K loop."""
    a_desc, b_desc, a_bufs, b_bufs, ready, tile_order_ptr = p[0]
    c_buf, tile_full, tile_free, c_ptr, bias_ptr, stride_cm, M, N, K, pid = q
    BLOCK_M: gl.constexpr = c_buf.shape[0]
    # each thread 16 bytes of a row, a warp a row of 256 columns
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [gl.num_warps(), 1],
                                                 [1, 0])
    rows_off = gl.arange(0, SUB_M, layout=gl.SliceLayout(1, rows_layout))
    cols_off = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, rows_layout))
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    mbarrier.arrive(tile_free)
    t = 0
    for it in range(pid, num_pid_m * num_pid_n, NUM_PROGRAMS):
        row0, col0 = _tile(it, num_pid_m, num_pid_n, tile_order_ptr, BLOCK_M, BLOCK_N, GROUP_M)
        cols = col0 + cols_off
        col_ok = cols < N
        mbarrier.wait(tile_full, t & 1)
        t += 1
        for sub in gl.static_range(BLOCK_M // SUB_M):
            vals = c_buf.slice(sub * SUB_M, SUB_M).load(rows_layout)
            if sub == BLOCK_M // SUB_M - 1:
                barrier()  # every warp of the partition has read the buffer
                mbarrier.arrive(tile_free)
            c_rows = c_ptr + (row0 + sub * SUB_M + rows_off) * stride_cm
            if ALIGN_C:
                c_rows = gl.multiple_of(c_rows, 16)
            gl.store(c_rows[:, None] + cols[None, :], vals, mask=col_ok[None, :])


@gluon.jit
def stage_buffers(b_desc, c_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """What the Hopper GEMMs' partitions share besides A's stages (the caller allocates those first): NUM_STAGES
    stages of B's blocks, the tile buffer [BLOCK_M, BLOCK_N] of C's dtype the store partition reads, a "ready"
    mbarrier per stage and the tile buffer's "full" and "free" mbarriers, initialised."""
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_buf = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N],
                                      gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N],
                                                                           c_ptr.dtype.element_ty))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    tile_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # full, free
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(tile_bars.index(0), count=1)
    mbarrier.init(tile_bars.index(1), count=1)
    return b_bufs, c_buf, ready, tile_bars


@gluon.jit
def ag_gemm_hopper(a_desc, b_desc, c_ptr, bias_ptr, flags_ptr, tile_order_ptr, tick_ptr, waiter, world, M, N, K,
                   M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, stride_cm, own_plane, ws_plane, own_shift,
                   BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                   NUM_STAGES: gl.constexpr, B_KMAJOR: gl.constexpr, HAS_BIAS: gl.constexpr, CLOCK: gl.constexpr,
                   ALIGN_C: gl.constexpr, STORE_WARPS: gl.constexpr, STORE_REGS: gl.constexpr, SUB_M: gl.constexpr,
                   RESET_AT_EXIT: gl.constexpr = True):
    """C = all_gather(A) @ B (+ bias) (module doc). ``a_desc``: [2, M, K] in [1, BLOCK_M, BLOCK_K] blocks, plane
    ``own_plane`` this rank's rows, gathered row r at row r - ``own_shift`` (rank * M_LOCAL in the shard; 0 where the
    shard was copied into the workspace's own rows), plane ``ws_plane`` the workspace the peers' rows land in (one
    plane, both indices 0, when this rank is the only one or its shard was copied there); ``b_desc``: B [K, N] in
    [BLOCK_K, BLOCK_N] blocks or, with B_KMAJOR, B's transpose [N, K] in [BLOCK_N, BLOCK_K] blocks; ``c_ptr``: C
    [M, N], unit column stride. ``flags_ptr``: this rank's chunk flags; ``tick_ptr``: two int32s, zero at launch
    (RESET_AT_EXIT); ``waiter``: kernels.signal.waiter's (error word, budget, rank, op). The other arguments are
    kernels.gemm's of the same name."""
    pid = gl.program_id(0)
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs, c_buf, ready, tile_bars = stage_buffers(b_desc, c_ptr, BLOCK_M, BLOCK_N, NUM_STAGES)
    p = ((a_desc, b_desc, a_bufs, b_bufs, ready, tile_order_ptr),
         (flags_ptr, waiter, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, own_plane, ws_plane, own_shift))
    q = (c_buf, tile_bars.index(0), tile_bars.index(1), c_ptr, bias_ptr, stride_cm, M, N, K, pid)
    gl.warp_specialize([
        (_k_loops, (p, q, BLOCK_N, GROUP_M, NUM_PROGRAMS, B_KMAJOR, HAS_BIAS, CLOCK)),
        (_stores, (p, q, BLOCK_N, GROUP_M, NUM_PROGRAMS, SUB_M, ALIGN_C)),
    ], [STORE_WARPS], [STORE_REGS])
    if RESET_AT_EXIT:
        reset_at_exit(tick_ptr, flags_ptr, world * CHUNKS_PER_RANK, NUM_PROGRAMS)


# ---------------------------------------------------------------------------------------------------- launcher
#: The store partition's warps and the registers (setmaxnreg) a thread of it may use, the rows it stores at a time,
#: and the kernel-wide cap that 12 warps leave (ptxas, sm_90a: 168 registers): kernels.gemm_warp_specialized's.
STORE_WARPS = EPILOGUE_WARPS
STORE_REGS = EPILOGUE_REGS
SUB_M = 32


def layout_for(ctx, a, ws, w, c, m_local: int) -> str | None:
    """How B is described if this call can run on this kernel ("kn" or "nk", as kernels.gemm_operands.desc_layout says),
    else None: the cuda backend on compute capability 9.0, 16-bit operands, every rank's rows whole 128-row tiles,
    at least NUM_STAGES - 1 K steps, the shard, the workspace and B describable, C's columns unit stride."""
    if (ctx.backend != "cuda" or a.dtype not in (torch.bfloat16, torch.float16) or m_local % TILES.block_m
            or not is_sm90(a.device.index) or not gluon_available()):
        return None
    if ws.stride(1) != 1 or not aligned(ws, ws.stride(0)) or c.stride(1) != 1:
        return None
    if cdiv(a.shape[1], TILES.block_k) < TILES.num_stages - 1:  # a tile's K loop spans the loads' lead
        return None
    return desc_layout(ctx.backend, TILES, a, None, w, m_local, False)


def launch_ag_gemm(ctx, b_layout: str, a, ws, w, c, bias, layout: ChunkLayout, order, flags, exit_counts,
                   op: int = 0, rank: int | None = None, world: int | None = None, in_place: bool = True) -> None:
    """The AllGather GEMM on the caller's stream: ``c`` [W * m_local, N] = the gathered rows (``a``, this rank's
    shard, read in place; the peers' from ``ws``, the [W * m_local, K] workspace, once their flags are set) @ ``w``
    (+ ``bias``). ``order``: the m-tiles in the order programs take them; ``flags``: this rank's chunk flags;
    ``exit_counts``: two int32s, zero at launch, zeroed again with the flags by the last program. ``rank`` /
    ``world``: as which rank of how many (None: the Context's). ``in_place`` False: the shard is copied into the
    workspace first (kernels.gemm_operands.gather_a)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    W = ctx.world_size if world is None else world
    rank = ctx.rank if rank is None else rank
    m_local, K = a.shape
    M, N = W * m_local, w.shape[1]
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    base, shape, strides, planes = gather_a(a, ws, M, rank, in_place)
    block = [1, TILES.block_m, TILES.block_k]
    a_desc = TensorDescriptor(base, shape, strides, block, shared_layout(block, gdt))
    grid = programs(ctx, M, N, peer_stores=False)  # an SM left to the producer's barrier kernel
    b_desc = b_descriptor(w, b_layout, gdt, TILES.block_k, TILES.block_n)
    launch(ag_gemm_hopper, (grid,), (
        a_desc, b_desc, c, bias if bias is not None else c, flags, order, exit_counts,
        waiter(ctx, op, rank), W, M, N, K, m_local, layout.m_per_chunk, layout.chunks_per_rank, c.stride(0), *planes,
    ), dict(BLOCK_N=TILES.block_n, GROUP_M=TILES.group_m, NUM_PROGRAMS=grid, NUM_STAGES=TILES.num_stages,
            B_KMAJOR=b_layout == "nk", HAS_BIAS=bias is not None, CLOCK=ctx.clock,
            ALIGN_C=N % 16 == 0 and aligned(c, c.stride(0)), STORE_WARPS=STORE_WARPS, STORE_REGS=STORE_REGS,
            SUB_M=SUB_M, RESET_AT_EXIT=True), num_warps=8, maxnreg=MAXNREG)
    ctx.after_launch()


def plain_gemm_hopper(ctx, a, w, c, bias=None):
    """A callable that launches this kernel alone, ``c = a @ w (+ bias)``, as the only rank: every row is its own,
    read in place, so nothing is waited for (AllGather-GEMM's consumer alone in benchmarks, beside
    kernels.gemm.plain_gemm). Raises ValueError where the kernel cannot run (``layout_for``)."""
    M = a.shape[0]
    b_layout = layout_for(ctx, a, a, w, c, M)
    if b_layout is None:
        raise ValueError("plain_gemm_hopper: needs the cuda backend on compute capability 9.0, 16-bit operands, "
                         "whole 128-row tiles and operands and output a tensor descriptor can describe")
    dev = a.device
    order = torch.arange(cdiv(M, TILES.block_m), dtype=torch.int32, device=dev)
    counts = torch.zeros(3, dtype=torch.int32, device=dev)  # a flag, and the two exit counts
    layout = ChunkLayout(1, M, M)
    return lambda: launch_ag_gemm(ctx, b_layout, a, a, w, c, bias, layout, order, counts[0:1], counts[1:3],
                                  rank=0, world=1)
