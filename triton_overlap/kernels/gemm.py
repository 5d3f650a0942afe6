"""The persistent Triton GEMMs every matrix op here is built on, a kernel per job:
``persistent_gemm`` (the plain GEMM: the consumer alone in benchmarks, fp8's
matmul), ``gather_gemm`` (AllGather-GEMM's consumer, GATHER below) and
``scatter_gemm`` (GEMM-RS's producer, SCATTER below). They share their pieces:
the tile orders and GEMM-RS's epilogue (kernels.gemm_device), the K loops
through descriptors or pointers and the plain store (here).

One program per SM (CU) walks the output tiles ``pid, pid + P, ...``. The m-tiles
are visited in the order of ``tile_order`` (a permutation prepared on the host
from the chunk schedule), grouped by GROUP_M for L2 reuse.

The kernels' jobs (GATHER: ``gather_gemm``; SCATTER: ``scatter_gemm``) and their switches (constexpr):

* GATHER: AllGather consumer. Rows of this rank's own block are read in place
  from ``a_ptr`` (the user's shard); all other rows from the workspace
  ``ws_ptr``, after the tile has waited for the flag of every chunk it covers.
* SCATTER: ReduceScatter producer. Row ``r`` of the output belongs to rank
  ``r // M_LOCAL``; the tile is stored straight into that owner's receive slot
  for this rank (``scatter_ptrs[owner]`` + row ``rank * M_LOCAL + r % M_LOCAL``),
  over NVLink for peers, and then the owner's counter of every chunk the tile
  covers (``counter_ptrs[owner]`` + ``rank * CHUNKS_PER_RANK + j``) is bumped
  with release semantics. The owner's reduction waits on those counters.
* REDUCE_OWN (with SCATTER; every rank's rows a whole number of tiles): the
  reduction is this kernel's own. Tiles of this rank's own rows, which the
  tile order puts last, add the peers' partials in their epilogue: after the
  K loop such a tile waits for the counters of the chunks it covers from
  every peer (reaching ``expected_ptr[j]``), adds the peers' partials
  ``c_ptr[s]`` (this rank's receive slots, [W, M_LOCAL, N]) and the bias to its
  float32 accumulator, and stores the output dtype into ``out_ptr``: no
  reduction kernel, and this rank's own partial never goes through memory.
  The L2 grouping restarts where the own rows begin (``split_m`` peer m-tiles
  first). No own-row wait may block a peer tile, whichever programs are
  resident; two ways, chosen by CLAIM (``tick_ptr``, zero at launch):
  CLAIM=1: tiles are handed out in order through a relaxed atomic counter,
  so a program takes an own-row tile only after every peer tile has been
  taken by a running program (the interpreter runs programs one after
  another, so the host backend needs this). CLAIM=0 (GPUs): tiles go
  round-robin as in the other modes, each program counts itself in once at
  its start, and before its first own-row tile waits until every program
  has (index -1 in a timeout's error): then every peer tile belongs to a
  running program, and peer tiles wait on nothing. The per-tile atomic of
  CLAIM=1 (a round trip, and a broadcast through shared memory) is gone.
* RESET_AT_EXIT (with REDUCE_OWN or GATHER): each program counts itself out
  in ``tick_ptr[1]``; the last one zeroes this rank's flags or counters
  (``flags_ptr``, ``world * CHUNKS_PER_RANK`` of them: every peer's has been
  waited on, and peers write the next call's only after the next barrier)
  and ``tick_ptr[0..1]``, so no reset runs after the GEMM on the caller's
  stream.
* DEFER_RELEASE (with SCATTER): a tile's counters are bumped after the next
  tile's K loop instead of right after its stores, so the release (which
  waits for the stores to land) finds them landed instead of stalling the
  program; pending bumps are made before an own-row tile's waits and at the
  end.

SCALED (fp8 e4m3 A and B, AllGather and plain only): the float32 accumulator is
multiplied by ``scale_a * scale_b`` (per-tensor scales, read from memory so a
CUDA graph follows their values) before the bias is added, and the output
(``c_ptr``'s dtype, bf16 or fp16) is stored as usual.

DESC (Hopper and later, and the interpreter): A and B tiles are loaded through
tensor descriptors (TMA on the GPU) instead of pointer arithmetic: ``a_desc``
over A, ``b_desc`` over B as [K, N] or, with B_KMAJOR, over B's transpose
[N, K] (``linear.weight.t()`` passed as B). Out-of-range rows, columns and K
are zero-filled by the load, so no masks. With GATHER, ``a_desc`` is 3-D,
[2, M, K]: plane ``own_plane`` is this rank's shard and plane ``ws_plane`` the
workspace (the host spans both allocations with the plane stride), so every
tile runs the same K loop whatever its source: two loops, one per source,
make ptxas serialise the wgmma pipeline. Gathered row r of this rank is row
r - ``own_shift`` of its plane: rank * M_LOCAL in the shard; 0 where the two
lie too far apart for one descriptor (a plane stride under 2^40 bytes), and
the launcher copies the shard into the workspace's own rows and describes the
workspace alone (``gather_a``). The host takes this path only when
M_LOCAL is a multiple of BLOCK_M (no tile covers rows of two ranks). A tile
that waited on a flag fences the async proxy before its first descriptor
load, so the loads see what the flag published.

DESC_C (AllGather and plain only): C tiles are stored through ``c_desc`` (a TMA
store, clipped at C's edges) in two column halves, so the epilogue needs half a
tile of shared memory and 4 pipeline stages of 128x256x64 still fit on sm_90a.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..plan import ChunkLayout, cdiv
from .cached_launch import launch
from .chunks import chunk_of_row
from .gemm_operands import GemmTiles, ScatterTarget, desc_layout, describable, gather_a
from .gemm_device import (column_halves, fence_async_proxy, grouped_tile, k_loop_desc, k_loop_ptr, own_chunks_ready,
                          publish, reduce_own, remap_xcd, reset_at_exit, rs_tile, store_plain)
from .signal import WHAT_STARTED, error_code, wait_for, waiter


@triton.jit
def persistent_gemm(
    a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_bk, stride_bn, stride_cm, stride_cn, tile_order_ptr,
    a_desc, b_desc, scale_a_ptr, scale_b_ptr, c_desc,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, NUM_XCDS: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr = False, DESC: tl.constexpr = False, B_KMAJOR: tl.constexpr = False,
    SCALED: tl.constexpr = False, DESC_C: tl.constexpr = False,
):
    """C = A @ B (+ bias): the plain GEMM, no waits and no communication (the consumer alone, fp8's matmul)."""
    pid = remap_xcd(tl.program_id(0), NUM_PROGRAMS, NUM_XCDS)
    scale = 1.0
    if SCALED:  # fp8: out = (A @ B) * scale_a * scale_b, per-tensor float32 scales read once per program
        scale = tl.load(scale_a_ptr) * tl.load(scale_b_ptr)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for it in range(pid, num_tiles, NUM_PROGRAMS):
        vm, pid_n = grouped_tile(it, num_pid_m, num_pid_n, GROUP_M)
        row0 = tl.load(tile_order_ptr + vm) * BLOCK_M
        rows = row0 + tl.arange(0, BLOCK_M)
        rows = tl.where(rows < M, rows, M - 1)  # clamp instead of masking the loads
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # not clamped: clamping hides contiguity, so B would load scalar
        col_ok = cols < N
        out_rows = row0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if DESC:
            acc = k_loop_desc(a_desc, 0, row0, b_desc, pid_n * BLOCK_N, K, acc, BLOCK_K, B_KMAJOR, DOT_F32, False)
        else:
            acc = k_loop_ptr(a_ptr, a_ptr, b_ptr, rows, cols, col_ok, K, 0, 0, stride_am, 0, stride_bk, stride_bn,
                              acc, False, BLOCK_K, EVEN_K, DOT_F32)
        if SCALED:
            acc = acc * scale
        store_plain(acc, c_ptr, c_desc, bias_ptr, row0, pid_n * BLOCK_N, out_rows, cols, col_ok, M, stride_cm,
                     stride_cn, HAS_BIAS, DESC_C)


@triton.jit
def gather_gemm(
    a_ptr, ws_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK,
    stride_am, stride_wm, stride_bk, stride_bn, stride_cm, stride_cn, tile_order_ptr, flags_ptr, waiter, tick_ptr,
    world, a_desc, own_plane, ws_plane, own_shift, b_desc, scale_a_ptr, scale_b_ptr, c_desc,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, NUM_XCDS: tl.constexpr, EVEN_K: tl.constexpr,
    CLOCK: tl.constexpr, DOT_F32: tl.constexpr = False, DESC: tl.constexpr = False, B_KMAJOR: tl.constexpr = False,
    SCALED: tl.constexpr = False, DESC_C: tl.constexpr = False, RESET_AT_EXIT: tl.constexpr = False,
):
    """C = all_gather(A) @ B (+ bias), AllGather-GEMM's consumer (module doc: GATHER): a tile of a peer's rows
    waits for the flag of every chunk it covers, then reads them from the workspace ``ws_ptr``; this rank's own
    rows are read in place from ``a_ptr``."""
    rank = waiter[2]  # (waiter: kernels.signal.waiter's error word, budget, rank and op)
    pid = remap_xcd(tl.program_id(0), NUM_PROGRAMS, NUM_XCDS)
    scale = 1.0
    if SCALED:  # fp8: out = (A @ B) * scale_a * scale_b, per-tensor float32 scales read once per program
        scale = tl.load(scale_a_ptr) * tl.load(scale_b_ptr)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for it in range(pid, num_tiles, NUM_PROGRAMS):
        vm, pid_n = grouped_tile(it, num_pid_m, num_pid_n, GROUP_M)
        row0 = tl.load(tile_order_ptr + vm) * BLOCK_M
        c_first = chunk_of_row(row0, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK)
        c_last = chunk_of_row(tl.minimum(row0 + BLOCK_M, M) - 1, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK)
        for c in range(c_first, c_last + 1):
            if c // CHUNKS_PER_RANK != rank:  # our own rows are read in place: nothing to wait for
                wait_for(flags_ptr + c, 1, waiter, c // CHUNKS_PER_RANK, c % CHUNKS_PER_RANK, CLOCK)
        rows = row0 + tl.arange(0, BLOCK_M)
        rows = tl.where(rows < M, rows, M - 1)  # clamp instead of masking the loads
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # not clamped: clamping hides contiguity, so B would load scalar
        col_ok = cols < N
        out_rows = row0 + tl.arange(0, BLOCK_M)
        if DESC:
            # one 3-D descriptor over both sources (see the module doc): one K loop, the plane picks the source
            mine = (row0 // M_LOCAL) == rank
            if not mine:
                fence_async_proxy(CLOCK)
            plane = tl.where(mine, own_plane, ws_plane)
            a_row = tl.where(mine, row0 - own_shift, row0)
            acc = k_loop_desc(a_desc, plane, a_row, b_desc, pid_n * BLOCK_N, K,
                               tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), BLOCK_K, B_KMAJOR, DOT_F32, True)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = k_loop_ptr(a_ptr, ws_ptr, b_ptr, rows, cols, col_ok, K, M_LOCAL, rank, stride_am, stride_wm,
                              stride_bk, stride_bn, acc, True, BLOCK_K, EVEN_K, DOT_F32)
        if SCALED:
            acc = acc * scale
        store_plain(acc, c_ptr, c_desc, bias_ptr, row0, pid_n * BLOCK_N, out_rows, cols, col_ok, M, stride_cm,
                     stride_cn, HAS_BIAS, DESC_C)
    if RESET_AT_EXIT:  # the last program out zeroes this rank's flags and the exit count
        reset_at_exit(tick_ptr, flags_ptr, world * CHUNKS_PER_RANK, NUM_PROGRAMS)


@triton.jit
def scatter_gemm(
    a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK,
    stride_am, stride_bk, stride_bn, stride_cm, stride_cn, tile_order_ptr, flags_ptr, waiter, scatter_ptrs,
    counter_ptrs, out_ptr, stride_om, expected_ptr, tick_ptr, world, split_m, a_desc, b_desc,
    HAS_BIAS: tl.constexpr, REDUCE_OWN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, NUM_XCDS: tl.constexpr,
    EVEN_K: tl.constexpr, CLOCK: tl.constexpr, DOT_F32: tl.constexpr = False, ALIGN_C: tl.constexpr = False,
    DESC: tl.constexpr = False, B_KMAJOR: tl.constexpr = False, WHOLE_TILES: tl.constexpr = False,
    LOCAL_COUNTERS: tl.constexpr = False, SPLIT_EPILOGUE: tl.constexpr = False, CLAIM: tl.constexpr = 1,
    DEFER_RELEASE: tl.constexpr = False, RESET_AT_EXIT: tl.constexpr = False,
):
    """Partial C = A @ B for GEMM-ReduceScatter (module doc: SCATTER): each tile into its rows' owner's receive
    slot, then the owner's counters bumped; with REDUCE_OWN the tiles of this rank's own rows sum the peers'
    partials into ``out_ptr`` instead."""
    err_ptr, budget, rank, op = waiter
    pid = remap_xcd(tl.program_id(0), NUM_PROGRAMS, NUM_XCDS)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if not LOCAL_COUNTERS:  # stores into peers: none after a fault (a peer's call may disagree)
        num_tiles = tl.where(error_code(err_ptr) != 0, 0, num_tiles)
    if REDUCE_OWN and CLAIM == 0:
        tl.atomic_add(tick_ptr, 1, sem="relaxed", scope="gpu")  # this program has started
    all_in = 0  # CLAIM=0: whether every program has been seen started
    pend_first = 0  # DEFER_RELEASE: chunks whose counters the previous tile has still to bump
    pend_last = -1
    for it in range(pid, num_tiles, NUM_PROGRAMS):  # each program's share of the tiles is counted as before
        if REDUCE_OWN:
            tile = it
            if CLAIM == 1:  # ... but which tile comes next is the next in order, from anyone
                tile = tl.atomic_add(tick_ptr, 1, sem="relaxed", scope="gpu")
            vm, pid_n = rs_tile(tile, num_pid_m, num_pid_n, split_m, GROUP_M)
        else:
            vm, pid_n = grouped_tile(it, num_pid_m, num_pid_n, GROUP_M)
        row0 = tl.load(tile_order_ptr + vm) * BLOCK_M
        c_first = chunk_of_row(row0, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK)
        c_last = chunk_of_row(tl.minimum(row0 + BLOCK_M, M) - 1, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK)
        rows = row0 + tl.arange(0, BLOCK_M)
        rows = tl.where(rows < M, rows, M - 1)  # clamp instead of masking the loads
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # not clamped: clamping hides contiguity, so B would load scalar
        col_ok = cols < N
        out_rows = row0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if DESC:
            acc = k_loop_desc(a_desc, 0, row0, b_desc, pid_n * BLOCK_N, K, acc, BLOCK_K, B_KMAJOR, DOT_F32, False)
        else:
            acc = k_loop_ptr(a_ptr, a_ptr, b_ptr, rows, cols, col_ok, K, M_LOCAL, rank, stride_am, 0, stride_bk,
                              stride_bn, acc, False, BLOCK_K, EVEN_K, DOT_F32)
        own_tile = False
        if REDUCE_OWN:
            own_tile = (row0 // M_LOCAL) == rank  # a whole tile of our rows (the host sees to it)
        if DEFER_RELEASE:  # the previous tile's stores have landed during this K loop
            publish(counter_ptrs, pend_first, pend_last, rank, CHUNKS_PER_RANK, LOCAL_COUNTERS)
            pend_last = -1
        if own_tile:  # REDUCE_OWN: add the peers' partials and the bias, store the output
            if CLAIM == 0:
                if all_in == 0:  # every program has started, so every peer tile is being worked on
                    wait_for(tick_ptr, NUM_PROGRAMS, waiter, -1, WHAT_STARTED, CLOCK)
                    all_in = 1
            own_chunks_ready(flags_ptr, expected_ptr, c_first, c_last, CHUNKS_PER_RANK, world, waiter, CLOCK)
            local = rows - rank * M_LOCAL
            if SPLIT_EPILOGUE:  # two column halves, one after the other: fewer live registers (no spills)
                acc_lo, acc_hi = column_halves(acc)
                cols_lo = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
                reduce_own(acc_lo, c_ptr, out_ptr, bias_ptr, local, out_rows, cols_lo, N, M, M_LOCAL, rank, world,
                           stride_cm, stride_cn, stride_om, HAS_BIAS, ALIGN_C)
                reduce_own(acc_hi, c_ptr, out_ptr, bias_ptr, local, out_rows, cols_lo + BLOCK_N // 2, N, M,
                           M_LOCAL, rank, world, stride_cm, stride_cn, stride_om, HAS_BIAS, ALIGN_C)
            else:
                reduce_own(acc, c_ptr, out_ptr, bias_ptr, local, out_rows, cols, N, M, M_LOCAL, rank, world,
                           stride_cm, stride_cn, stride_om, HAS_BIAS, ALIGN_C)
        else:  # a tile of partials into its rows' owner's receive slot for this rank, then the owner's counters
            if HAS_BIAS:
                if not REDUCE_OWN:  # (GEMM-RS adds the bias once, in the owner's own tiles)
                    acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if WHOLE_TILES:  # every tile's rows have one owner: one address from the table
                owner = row0 // M_LOCAL
                base = tl.load(scatter_ptrs + owner).to(tl.pointer_type(c_ptr.dtype.element_ty))
                c_rows = base + (rank * M_LOCAL + rows - owner * M_LOCAL) * stride_cm
            else:
                owner = rows // M_LOCAL  # rows is clamped, so the table index stays in range
                base = tl.load(scatter_ptrs + owner).to(tl.pointer_type(c_ptr.dtype.element_ty))
                c_rows = base + (rank * M_LOCAL + rows % M_LOCAL) * stride_cm
            if ALIGN_C:  # row starts loaded from a table: tell the compiler they are aligned, or stores go scalar
                c_rows = tl.multiple_of(c_rows, 16)
            c_ptrs = c_rows[:, None] + cols[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(out_rows[:, None] < M) & col_ok[None, :])
            if DEFER_RELEASE:
                pend_first = c_first
                pend_last = c_last
            else:
                publish(counter_ptrs, c_first, c_last, rank, CHUNKS_PER_RANK, LOCAL_COUNTERS)
    if DEFER_RELEASE:
        publish(counter_ptrs, pend_first, pend_last, rank, CHUNKS_PER_RANK, LOCAL_COUNTERS)
    if RESET_AT_EXIT:  # the last program out zeroes this rank's counters and the tile counter
        reset_at_exit(tick_ptr, flags_ptr, world * CHUNKS_PER_RANK, NUM_PROGRAMS)


# ---------------------------------------------------------------------------------------------------- launcher
def launch_gemm(ctx, tiles: GemmTiles, a, b, c, *, order, flags, layout: ChunkLayout | None = None, bias=None,
                scales=None, workspace=None, scatter: ScatterTarget | None = None, exit_counts=None, op: int = 0,
                tma_store: bool = True, in_place: bool = True) -> None:
    """``c = a @ b (+ bias)`` on the caller's stream, by the persistent GEMM for the job: ``gather_gemm`` with a
    ``workspace``, ``scatter_gemm`` with a ``scatter``, else ``persistent_gemm``.

    ``order``: the m-tiles in the order programs take them (int32); ``flags``: this rank's flags (GATHER) or
    counters (SCATTER); ``layout``: the chunking of rows among ranks (None: a plain GEMM, one chunk).
    ``workspace`` (GATHER): the [M, K] workspace other ranks' rows land in; ``a`` is this rank's shard, read in
    place. ``scatter``: see ScatterTarget. ``exit_counts`` (RESET_AT_EXIT, with GATHER or REDUCE_OWN): two
    int32s, zero at launch; the last program zeroes them and ``flags``. ``scales``: fp8's (scale_a, scale_b).
    ``tma_store``: store C through a descriptor where it can be described (not with SCATTER). ``in_place`` False
    (GATHER): where A is read through a descriptor, the shard is copied into the workspace first
    (gemm_operands.gather_a)."""
    gather = workspace is not None
    if scatter is not None and (gather or scales is not None):
        raise ValueError("launch_gemm: a scatter (GEMM-RS) takes neither a workspace nor fp8 scales")
    K, N = a.shape[1], b.shape[1]
    if layout is None:
        layout = ChunkLayout(1, a.shape[0], a.shape[0])
    M = layout.world * layout.m_local if gather else a.shape[0]
    num_tiles = cdiv(M, tiles.block_m) * cdiv(N, tiles.block_n)
    units = ctx.num_compute_units()
    free_sm = gather or (scatter is not None and scatter.free_sm)
    if free_sm and not ctx.interpreted:
        units -= 1
    programs = max(1, min(units, num_tiles))
    a_desc = b_desc = None
    planes = (0, 0, 0)
    b_layout = desc_layout(ctx.backend, tiles, a, workspace, b, layout.m_local, gather)
    if b_layout is not None:
        bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
        if gather:
            base, shape, strides, planes = gather_a(a, workspace, M, ctx.rank, in_place)
            a_desc = TensorDescriptor(base, shape, strides, [1, bm, bk])
        else:
            a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [bm, bk])
        if b_layout == "kn":
            b_desc = TensorDescriptor(b, [K, N], [b.stride(0), 1], [bk, bn])
        else:
            b_desc = TensorDescriptor(b.t(), [N, K], [b.stride(1), 1], [bn, bk])
    c_desc = None
    if scatter is None and tma_store and describable(ctx.backend, tiles, c):
        # the kernel stores each tile in two column halves (half the shared memory)
        c_desc = TensorDescriptor(c, [M, N], [c.stride(0), 1], [tiles.block_m, tiles.block_n // 2])
    consts = dict(HAS_BIAS=bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                  GROUP_M=tiles.group_m, NUM_PROGRAMS=programs, NUM_XCDS=tiles.num_xcds,
                  EVEN_K=(K % tiles.block_k == 0), DOT_F32=ctx.interpreted, DESC=b_layout is not None,
                  B_KMAJOR=b_layout == "nk")
    bias_arg = bias if bias is not None else c
    scale_args = scales if scales is not None else (flags, flags)
    if gather:
        launch(gather_gemm, (programs,), (
            a, workspace, b, c, bias_arg, M, N, K, layout.m_local, layout.m_per_chunk, layout.chunks_per_rank,
            a.stride(0), workspace.stride(0), b.stride(0), b.stride(1), c.stride(0), c.stride(1), order, flags,
            waiter(ctx, op), exit_counts if exit_counts is not None else flags, ctx.world_size, a_desc, *planes,
            b_desc, *scale_args, c_desc,
        ), dict(consts, CLOCK=ctx.clock, SCALED=scales is not None, DESC_C=c_desc is not None,
                RESET_AT_EXIT=exit_counts is not None), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    elif scatter is not None:
        reduce_into = scatter.reduce_into
        fused = reduce_into is not None
        launch(scatter_gemm, (programs,), (
            a, b, c, bias_arg, M, N, K, layout.m_local, layout.m_per_chunk, layout.chunks_per_rank,
            a.stride(0), b.stride(0), b.stride(1), c.stride(0), c.stride(1), order, flags, waiter(ctx, op),
            scatter.ptrs, scatter.counter_ptrs, reduce_into if fused else c, reduce_into.stride(0) if fused else 0,
            scatter.expected if fused else flags, exit_counts if exit_counts is not None else flags, ctx.world_size,
            scatter.split_m, a_desc, b_desc,
        ), dict(
            consts, REDUCE_OWN=fused, CLOCK=ctx.clock,
            # every row of a receive slot starts 16-element aligned (cudaMalloc'd base, N % 16 == 0)
            ALIGN_C=N % 16 == 0 and (not fused or (reduce_into.data_ptr() % 16 == 0
                                                   and reduce_into.stride(0) * c.element_size() % 16 == 0)),
            WHOLE_TILES=layout.m_local % tiles.block_m == 0, LOCAL_COUNTERS=scatter.local,
            SPLIT_EPILOGUE=fused and tiles.block_n >= 32,
            CLAIM=1 if ctx.interpreted else scatter.claim,
            DEFER_RELEASE=bool(not scatter.local if scatter.defer_release is None else scatter.defer_release),
            RESET_AT_EXIT=fused and exit_counts is not None,
        ), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    else:
        launch(persistent_gemm, (programs,), (
            a, b, c, bias_arg, M, N, K, a.stride(0), b.stride(0), b.stride(1), c.stride(0), c.stride(1), order,
            a_desc, b_desc, *scale_args, c_desc,
        ), dict(consts, SCALED=scales is not None, DESC_C=c_desc is not None), num_warps=tiles.num_warps,
            num_stages=tiles.num_stages)
    ctx.after_launch()


def plain_gemm(ctx, tiles: GemmTiles, a, b, c, bias=None, scales=None, tma_store: bool = True):
    """A callable that launches the persistent GEMM alone, ``c = a @ b (+ bias)``: no waits, no communication (the
    consumer alone in benchmarks and tuning, and fp8's fallback matmul)."""
    order = torch.arange(cdiv(a.shape[0], tiles.block_m), dtype=torch.int32, device=a.device)
    ready = torch.zeros(1, dtype=torch.int32, device=a.device)
    return lambda: launch_gemm(ctx, tiles, a, b, c, order=order, flags=ready, bias=bias, scales=scales,
                               tma_store=tma_store)
