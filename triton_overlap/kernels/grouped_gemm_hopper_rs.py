"""MoE-GEMM-ReduceScatter's grouped GEMM and top-k combine for Hopper (sm_90), warp-specialized in Gluon:
kernels.grouped_gemm_hopper's K loop, with ``rs_grouped_gemm``'s work items and its combine done by the store
partition beside the next tiles' K loops.

It computes what ``rs_grouped_gemm`` does from the same routing (rows sorted by destination, then expert; the
table's SLOTS slots per destination; each destination's GEMM items, then its combine items), but each program takes
the items ``pid, pid + P, ...`` rather than claiming them through a counter: every program is resident (one per
SM), each runs its items in order, and a combine item waits only for GEMM items before it, so the earliest
unfinished item can always run. The exception is the last destination's combine (this rank's own tokens), which
no GEMM is left to overlap: both partitions of every program claim its items through a counter once they are done
with their own, so the whole GPU sums them. Two partitions:

* the K loop (kernels.grouped_gemm_hopper.grouped_k_loops): a GEMM item's A rows are the rows ``src`` of ``h``,
  gathered by cp.async, or read by TMA where they are consecutive (CONTIG); the tile goes into the shared tile
  buffer; combine items are skipped; then the last destination's combine items;
* the stores and the combine (STORE_WARPS warps): a GEMM item's tile into Y's rows (the sorted rows, contiguous),
  then a release on its destination's done counter (empty slots count too: the total is fixed); a combine item
  waits (bounded) until its destination's GEMM items are all done, sums ``topk_weights[t, j] * Y[pos[t, j]]`` over
  j in float32 for BLOCK_C of the destination's tokens, SUB_C at a time, stores the partial where the copy variant
  of GEMM-RS stages it (``scatter_ptrs[dest]``) and bumps the local counters the copy engines wait on.

Only where kernels.grouped_gemm_hopper.usable holds (h for A, Y for the output). Gluon does not run in Triton's
interpreter, so the host backend and other GPUs take ``rs_grouped_gemm``.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .cached_launch import launch
from .gemm_device import publish
from .gemm_hopper_tiles import EPILOGUE_REGS, EPILOGUE_WARPS, MAXNREG, SUB_M, TILES
from .grouped_gemm_hopper import (grouped_buffers, grouped_item, grouped_k_loops, rows_descriptor, static_items,
                                  store_offsets, store_tile, weights_descriptor, weights_layout)
from .signal import WHAT_OWN_TILES, wait_for, waiter

#: The tokens a combine item sums at a time: 8 tokens by 256 columns, 16 float32 registers a thread of the store
#: partition for the sum and 8 for each of the k rows' loads, all in flight at once (32 tokens spilled).
SUB_C = 8


@gluon.jit
def _combine(y_ptr, cols, col_ok, dest, row0, m, TOPK: gl.constexpr, BLOCK_C: gl.constexpr, SUB_C: gl.constexpr):
    """Combine item: the destination's tokens [row0, row0 + BLOCK_C), columns ``cols``, summed over their top-k
    rows of Y in float32, SUB_C tokens at a time (in the layout ``cols`` is a slice of), and stored as the output
    dtype into the destination's staging rows for this rank."""
    LAYOUT: gl.constexpr = cols.type.layout.parent
    pos_ptr, weights_ptr, scatter_ptrs, counter_ptrs, waiter, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, N = m
    rank = waiter[2]
    base = gl.load(scatter_ptrs + dest).to(gl.pointer_type(y_ptr.dtype.element_ty))
    for sub in gl.static_range(BLOCK_C // SUB_C):
        rows = row0 + sub * SUB_C + gl.arange(0, SUB_C, layout=gl.SliceLayout(1, LAYOUT))
        ok = rows < M_LOCAL
        pair0 = (dest * M_LOCAL + rows).to(gl.int64) * TOPK
        acc = gl.zeros([SUB_C, cols.shape[0]], gl.float32, LAYOUT)
        for j in gl.static_range(TOPK):  # unrolled: the k rows' loads all in flight before their sums
            p = gl.load(pos_ptr + pair0 + j, mask=ok, other=0).to(gl.int64)
            wt = gl.load(weights_ptr + pair0 + j, mask=ok, other=0.0)
            y = gl.load(y_ptr + p[:, None] * N + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
            acc += wt[:, None] * y.to(gl.float32)
        part = base + (rank * M_LOCAL + rows).to(gl.int64)[:, None] * N + cols[None, :]
        gl.store(part, acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & col_ok[None, :])
    last = gl.minimum(row0 + BLOCK_C, M_LOCAL) - 1
    publish(counter_ptrs, dest * CHUNKS_PER_RANK + row0 // M_PER_CHUNK, dest * CHUNKS_PER_RANK + last // M_PER_CHUNK,
            rank, CHUNKS_PER_RANK, True)


@gluon.jit
def _stores(p, r, f, t, c, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, SUB_M: gl.constexpr,
            TOPK: gl.constexpr, BLOCK_C: gl.constexpr, SUB_C: gl.constexpr, CLOCK: gl.constexpr):
    """Every item of this program in order: a GEMM tile from the shared tile buffer into Y, SUB_M rows at a time,
    then its destination's done counter; a combine item once that counter is full (module doc)."""
    c_buf, tile_full, tile_free, y_ptr, done_ptr, dests_ptr, m = c
    waiter = m[4]
    N = p[5]
    BLOCK_N: gl.constexpr = c_buf.type.shape[1]
    rows_off, cols_off = store_offsets(c_buf, SUB_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    gemm_items = t[1] * num_pid_n
    per_dest = gemm_items + t[2] * num_pid_n
    mbarrier.arrive(tile_free)
    done = 0
    for it in range(gl.program_id(0), static_items(t, num_pid_n), NUM_PROGRAMS):
        q = it // per_dest
        rr = it % per_dest
        if rr < gemm_items:
            expert, first, end, pid_n, busy = grouped_item(t, it, num_pid_n, GROUP_M)
            if busy:
                store_tile((c_buf, tile_full, tile_free, y_ptr, y_ptr, N), done, first, end,
                           pid_n * BLOCK_N + cols_off, N, rows_off, False)
                done += 1
            gl.atomic_add(done_ptr + q, 1, sem="release", scope="gpu")
        else:
            cols = ((rr - gemm_items) % num_pid_n) * BLOCK_N + cols_off
            dest = gl.load(dests_ptr + q)
            # every GEMM item of this destination is done (each comes before this item in some program's order);
            # a timeout says it waited on this rank's own tiles
            wait_for(done_ptr + q, gemm_items, waiter, dest, WHAT_OWN_TILES, CLOCK)
            _combine(y_ptr, cols, cols < N, dest, ((rr - gemm_items) // num_pid_n) * BLOCK_C, m, TOPK, BLOCK_C,
                     SUB_C)
    _last_combines(c, t, N, cols_off, TOPK, BLOCK_C, SUB_C, CLOCK)


@gluon.jit
def _last_combines(c, t, N, cols_off, TOPK: gl.constexpr, BLOCK_C: gl.constexpr, SUB_C: gl.constexpr,
                   CLOCK: gl.constexpr):
    """The last destination's combine items, claimed one at a time from its claim counter by whichever partition
    of any program is done with its own items (both partitions of every program end here): nothing of the GEMM
    is left to overlap them, so every warp of the GPU joins in. Each waits (bounded) for the destination's GEMM
    items, as a combine item in ``_stores`` does."""
    y_ptr, done_ptr, dests_ptr, m = c[3], c[4], c[5], c[6]
    BLOCK_N: gl.constexpr = c[0].type.shape[1]
    num_pid_n = gl.cdiv(N, BLOCK_N)
    q = t[3] - 1
    dest = gl.load(dests_ptr + q)
    items = t[2] * num_pid_n
    u = gl.atomic_add(done_ptr + t[3], 1, sem="relaxed", scope="gpu")
    while u < items:
        wait_for(done_ptr + q, t[1] * num_pid_n, m[4], dest, WHAT_OWN_TILES, CLOCK)
        cols = (u % num_pid_n) * BLOCK_N + cols_off
        _combine(y_ptr, cols, cols < N, dest, (u // num_pid_n) * BLOCK_C, m, TOPK, BLOCK_C, SUB_C)
        u = gl.atomic_add(done_ptr + t[3], 1, sem="relaxed", scope="gpu")


@gluon.jit
def _k_loops(p, r, f, t, c, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, B_KMAJOR: gl.constexpr,
             SUB_M: gl.constexpr, TOPK: gl.constexpr, BLOCK_C: gl.constexpr, SUB_C: gl.constexpr,
             CLOCK: gl.constexpr, CONTIG: gl.constexpr):
    """The K loop of every GEMM item of this program (kernels.grouped_gemm_hopper.grouped_k_loops), then the last
    destination's combine items that are left."""
    grouped_k_loops(p, r, f, t, c, GROUP_M, NUM_PROGRAMS, B_KMAJOR, False, CLOCK, CONTIG)
    _, cols_off = store_offsets(c[0], SUB_M)
    _last_combines(c, t, p[5], cols_off, TOPK, BLOCK_C, SUB_C, CLOCK)


@gluon.jit
def rs_grouped_hopper(h_ptr, a_desc, b_desc, y_ptr, src_ptr, pos_ptr, weights_ptr, table_ptr, dests_ptr, done_ptr,
                      scatter_ptrs, counter_ptrs, waiter, SLOTS, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, N, K,
                      stride_hm, world, TOPK: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_C: gl.constexpr, GROUP_M: gl.constexpr,
                      NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr, B_KMAJOR: gl.constexpr,
                      CLOCK: gl.constexpr, STORE_WARPS: gl.constexpr, STORE_REGS: gl.constexpr,
                      SUB_M: gl.constexpr, SUB_C: gl.constexpr, CONTIG: gl.constexpr):
    """Y[p] = h[src[p]] @ w[expert of p] for every sorted row p, destination by destination, and each
    destination's top-k combine after its GEMM items (module doc; the arguments are ``rs_grouped_gemm``'s, but
    ``b_desc``: kernels.grouped_gemm_hopper.weights_descriptor's, and ``done_ptr``: the W done counters, then the
    last destination's claim counter)."""
    a_bufs, b_bufs, c_buf, ready, tile_bars = grouped_buffers(h_ptr, b_desc, y_ptr, BLOCK_M, BLOCK_K, NUM_STAGES,
                                                              B_KMAJOR)
    p = (a_bufs, b_desc, b_bufs, ready, K, N, a_desc)
    r = (h_ptr, h_ptr, src_ptr, stride_hm, stride_hm, 1, -1)  # rank -1: every row is read from h (the "workspace")
    f = (pos_ptr, pos_ptr, done_ptr, waiter, CHUNKS_PER_RANK)  # (no chunk waits: WAIT is False)
    t = (table_ptr, SLOTS, gl.cdiv(M_LOCAL, BLOCK_C), world)
    m = (pos_ptr, weights_ptr, scatter_ptrs, counter_ptrs, waiter, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, N)
    c = (c_buf, tile_bars.index(0), tile_bars.index(1), y_ptr, done_ptr, dests_ptr, m)
    gl.warp_specialize([
        (_k_loops, (p, r, f, t, c, GROUP_M, NUM_PROGRAMS, B_KMAJOR, SUB_M, TOPK, BLOCK_C, SUB_C, CLOCK, CONTIG)),
        (_stores, (p, r, f, t, c, GROUP_M, NUM_PROGRAMS, SUB_M, TOPK, BLOCK_C, SUB_C, CLOCK)),
    ], [STORE_WARPS], [STORE_REGS])


def launch_rs_grouped_hopper(ctx, block_c: int, h, w, y, routes, weights, table, dests, counts, target, layout,
                             programs: int, op: int = 0, contig: bool = False) -> None:
    """``rs_grouped_hopper`` on the caller's stream, with kernels.grouped_gemm.launch_rs_grouped's arguments
    (kernels.grouped_gemm_hopper.usable must hold for ``h``, ``w`` and ``y``; ``block_c`` a multiple of SUB_C;
    ``programs``: the grid, at most one per SM). ``contig``: each tile's rows are consecutive rows of ``h``, read
    by TMA."""
    E, K, N = w.shape
    W = layout.world
    b_desc = weights_descriptor(w)
    launch(rs_grouped_hopper, (programs,), (
        h, rows_descriptor(h) if contig else b_desc, b_desc, y, *routes, weights, table, dests, counts, target.ptrs,
        target.counter_ptrs, waiter(ctx, op), table.shape[0] // W, layout.m_local, layout.m_per_chunk,
        layout.chunks_per_rank, N, K, h.stride(0), W,
    ), dict(TOPK=weights.numel() // (W * layout.m_local), BLOCK_M=TILES.block_m, BLOCK_K=TILES.block_k,
            BLOCK_C=block_c, GROUP_M=TILES.group_m,
            NUM_PROGRAMS=programs, NUM_STAGES=TILES.num_stages, B_KMAJOR=weights_layout(w) == "nk", CLOCK=ctx.clock,
            STORE_WARPS=EPILOGUE_WARPS, STORE_REGS=EPILOGUE_REGS, SUB_M=SUB_M, SUB_C=SUB_C, CONTIG=contig), num_warps=8,
        maxnreg=MAXNREG)
    ctx.after_launch()


__all__ = ["SUB_C", "launch_rs_grouped_hopper", "rs_grouped_hopper"]
