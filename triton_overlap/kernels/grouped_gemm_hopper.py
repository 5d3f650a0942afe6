"""The MoE ops' grouped GEMM for Hopper (sm_90), warp-specialized in Gluon: a tile's rows are gathered token by
token with cp.async while the tensor cores work on the previous K steps, the next tile's first loads are issued
during this tile's last steps, and a tile's stores run beside the next tile's K loop. AllGather-MoE's kernel is
here; MoE-GEMM-ReduceScatter's (kernels.grouped_gemm_hopper_rs) shares its K loop (``grouped_k_loops``).

Why a second kernel: kernels.grouped_gemm's K loop is not pipelined and its epilogue idles the tensor cores
(docs/decisions.md, Tensor-parallel MoE); Gluon states the pipeline and the partitions outright.

It computes what ``ag_grouped_gemm`` does from the same routing (kernels.routing: the tile table of (expert, first
row, end row) slots, each sorted row's token ``src``, output row ``dst`` and chunk position ``pos``), taking the
same work items in the same order (``work_item``: groups of GROUP_M slots take each column tile in turn), a
program per SM but one, round-robin. Two partitions:

* the K loop (the default partition, 8 warps: two warpgroups, 64 rows of the 128 x 256 tile each, on wgmma). The
  same warps issue the loads NUM_STAGES - 1 K steps ahead, across tiles, into a ring of stages: A's rows by
  cp.async, 16 bytes a copy (each row's token read in place from this rank's shard or from the workspace the copy
  engines fill; rows past the tile's end repeat its last row), one commit group per K step; B by TMA from a 3-D
  descriptor of the experts' weights (zeros past N), on a "ready" mbarrier per stage. A step waits for its own
  cp.async group, fences it for the tensor cores and meets its partition at a barrier, then waits for B. Before
  the first load of a tile whose rows come from a peer's chunks they wait (bounded) for the flag of each chunk
  position its rows use, as ``ag_grouped_gemm`` does, and only then read the rows' sources ``src`` (an
  expert-parallel dispatch's peers store them with the rows: ops.ep_experts). Where each tile's rows are
  consecutive rows of A (CONTIG: MoE-GEMM-ReduceScatter on the expert-sorted layout, MoERouting.rank_runs, and
  AllGather-MoE where the ranks send their rows sorted by expert, ``MoEGEMMConfig.send_rows``), A comes by TMA on the
  same barrier as B instead, with no copies to issue, wait for or fence (faster on every model shape measured, and
  without a K limit: docs/decisions.md, Tensor-parallel MoE); a tile that waited for a peer's chunks then fences the
  async proxy before its loads. After the K loop the tile goes, as the output dtype, into a shared tile buffer
  ("full");
* the stores (a worker partition of STORE_WARPS warps): SUB_M rows of the buffer at a time, each row into its
  output row ``dst``, then "free".

Only for NVIDIA sm_90, 16-bit operands, 128 x 256 tiles (the routing's ``block_m`` must be 128), K steps 64 deep
(32 where A is gathered: GATHER_STEPS), K a whole number of steps, at least NUM_STAGES - 1 and (rows gathered) at
most MAX_K deep, and weights a tensor descriptor can describe (``usable``). Gluon does not run in Triton's
interpreter, so the host backend and other GPUs take kernels.grouped_gemm.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .cached_launch import launch
from .capability import gluon_available, is_sm90
from .gemm_device import fence_async_proxy, work_item
from .gemm_gather_hopper import stage_buffers
from .gemm_hopper_tiles import EPILOGUE_REGS, EPILOGUE_WARPS, MAXNREG, SUB_M, TILES
from .gemm_operands import aligned
from .gluon_shims import barrier, cp_async_load, shared_layout, tma_descriptor, tma_load
from .signal import wait_for, waiter


@gluon.jit
def grouped_item(t, it, num_pid_n, GROUP_M: gl.constexpr):
    """Work item ``it`` (clamped to the last) as (expert, first row, end row, column tile, whether it is a GEMM tile
    with rows). ``t`` = (table, slots, combine tiles, destinations): the items are, destination by destination,
    ``slots`` table slots by ``num_pid_n`` column tiles (``work_item``'s order), then ``combine tiles`` by
    ``num_pid_n`` items of MoE-GEMM-ReduceScatter's top-k combine (none in AllGather-MoE, one destination), but
    the last destination's combine items, which the programs claim as they finish (``static_items``)."""
    table_ptr, slots, combine, dests = t
    gemm_items = slots * num_pid_n
    per_dest = gemm_items + combine * num_pid_n
    total = static_items(t, num_pid_n)
    at = gl.minimum(it, total - 1)
    rr = at % per_dest
    s, pid_n = work_item(gl.minimum(rr, gemm_items - 1), slots, num_pid_n, GROUP_M)
    slot = (at // per_dest) * slots + s
    first = gl.load(table_ptr + slot * 3 + 1)
    end = gl.load(table_ptr + slot * 3 + 2)
    return gl.load(table_ptr + slot * 3), first, end, pid_n, (it < total) & (rr < gemm_items) & (end > first)


@gluon.jit
def static_items(t, num_pid_n):
    """How many work items ``grouped_item`` deals out round-robin: every destination's GEMM and combine items but
    the last destination's combine items (``t``: grouped_item's)."""
    return t[3] * (t[1] + t[2]) * num_pid_n - t[2] * num_pid_n


@gluon.jit
def _rows(r, first, end, LD: gl.constexpr, BLOCK_M: gl.constexpr, CONTIG: gl.constexpr):
    """The A row pointers of sorted rows [first, first + BLOCK_M), in the layout of A's loads: each row's token,
    read in place from the shard ``x_ptr`` if it is this rank's, else from the workspace. Rows past ``end`` repeat
    the tile's last row (their products are never stored), so the loads need no mask; an empty slot (the table's
    unused slots are (0, 0, 0): a next item that has no rows) reads sorted row 0's token, never the word before
    ``src``. CONTIG: the tile's rows are rows src[first], src[first] + 1, ... of A, and TMA takes the first's
    index."""
    x_ptr, ws_ptr, src_ptr, stride_xm, stride_wsm, M_LOCAL, rank = r[0], r[1], r[2], r[3], r[4], r[5], r[6]
    if CONTIG:
        rows = gl.load(src_ptr + first)
    else:
        last = gl.where(end > first, end - 1, 0)
        offs = gl.minimum(first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD)), last)
        tok = gl.load(src_ptr + offs)
        mine = (tok // M_LOCAL) == rank
        rows = gl.where(mine, x_ptr + (tok - rank * M_LOCAL).to(gl.int64) * stride_xm,
                        ws_ptr + tok.to(gl.int64) * stride_wsm)
    return rows


@gluon.jit
def _arrived(f, first, end, BLOCK_M: gl.constexpr, CLOCK: gl.constexpr, CONTIG: gl.constexpr):
    """Before the first load of the tile of sorted rows [first, end): wait (bounded) for the flag of the chunk at
    each arrival position its rows use (positions are sorted within a tile; position 0, this rank's rows, needs
    none); with CONTIG (A by TMA) then order those acquires before the loads."""
    pos_ptr, chunk_at_ptr, flags_ptr, waiter, CHUNKS_PER_RANK = f
    lo = gl.maximum(gl.load(pos_ptr + first), 1)
    hi = gl.load(pos_ptr + end - 1)
    if hi >= lo:
        offs = first + gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
        pos = gl.load(pos_ptr + offs, mask=offs < end, other=0)
        for k in range(lo, hi + 1):
            if gl.sum((pos == k).to(gl.int32), axis=0) > 0:
                c = gl.load(chunk_at_ptr + k)
                wait_for(flags_ptr + c, 1, waiter, c // CHUNKS_PER_RANK, c % CHUNKS_PER_RANK, CLOCK)
        if CONTIG:
            fence_async_proxy(CLOCK)


@gluon.jit
def _gather(buf, rows, k, BLOCK_K: gl.constexpr):
    """K step ``k`` of the rows at pointers ``rows`` into ``buf`` by cp.async, 16 bytes a copy, one commit group."""
    offs_k = k * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, rows.type.layout.parent))
    # each row's run of BLOCK_K elements is contiguous and 16-byte aligned (Triton cannot see it through the
    # partition's arguments)
    ptrs = gl.max_contiguous(gl.multiple_of(rows[:, None] + offs_k[None, :], [1, 16]), [1, BLOCK_K])
    cp_async_load(buf, ptrs)
    async_copy.commit_group()


@gluon.jit
def _load(p, ld, rows, expert, col0, k, B_KMAJOR: gl.constexpr, CONTIG: gl.constexpr):
    """Issue K step ``k``'s loads into stage ``ld % NUM_STAGES``: A's rows by cp.async (``_gather``), or by TMA with
    CONTIG (from row ``rows``); B's block of ``expert`` at ``col0`` by TMA; TMA on the stage's "ready"."""
    a_bufs, b_desc, b_bufs, ready, K, N, a_desc = p
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    s = ld % STAGES
    bar = ready.index(s)
    if CONTIG:
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma_load(a_desc, [rows, k * BLOCK_K], bar, a_bufs.index(s))
    else:
        _gather(a_bufs.index(s), rows, k, BLOCK_K)
        mbarrier.expect(bar, b_desc.block_type.nbytes)
    if B_KMAJOR:
        tma_load(b_desc, [expert, col0, k * BLOCK_K], bar, b_bufs.index(s))
    else:
        tma_load(b_desc, [expert, k * BLOCK_K, col0], bar, b_bufs.index(s))


@gluon.jit
def _landed(LEAD: gl.constexpr):
    """Every thread's cp.async group of the step being consumed has landed (LEAD - 1 newer may pend), fenced."""
    async_copy.wait_group(LEAD - 1)
    fence_async_shared()
    barrier()


@gluon.jit
def _step(p, acc, g, B_KMAJOR: gl.constexpr, CONTIG: gl.constexpr):
    """Consume K step ``g`` (this program's count): wait for its A rows (``_landed``; with CONTIG they come on the
    stage's barrier) and its B block, issue its wgmma, and wait for the previous step's (both warpgroups'), whose
    stage is then free."""
    a_bufs, b_desc, b_bufs, ready, K, N, a_desc = p
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_KMAJOR else b_desc.block_type.shape[2]
    s = g % STAGES
    if not CONTIG:
        _landed(STAGES - 1)
    mbarrier.wait(ready.index(s), (g // STAGES) & 1)
    if B_KMAJOR:
        b_tile = b_bufs.index(s).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))
    else:
        b_tile = b_bufs.index(s).reshape([BLOCK_K, BLOCK_N])
    acc = warpgroup_mma(a_bufs.index(s), b_tile, acc, is_async=True)
    acc = warpgroup_mma_wait(1, deps=(acc, ))
    barrier()
    return acc


@gluon.jit
def grouped_k_loops(p, r, f, t, c, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, B_KMAJOR: gl.constexpr,
                    WAIT: gl.constexpr, CLOCK: gl.constexpr, CONTIG: gl.constexpr):
    """Every GEMM tile of this program (``grouped_item``): the K loop on wgmma, its loads issued LEAD =
    NUM_STAGES - 1 steps ahead, then the tile as the output dtype into the shared tile buffer (``c``'s first three:
    the buffer, "full", "free") for the store partition. WAIT: wait for the chunk flags of a tile's rows first.
    CONTIG: each tile's rows are consecutive rows of A (``src[first]`` onwards), loaded by TMA through ``p``'s
    last, A's descriptor, with B on the stage's barrier; else gathered row by row by cp.async.

    A tile's K loop is its first k_tiles - LEAD steps, which load the same tile's later steps, and LEAD steps
    written out, which load the next item's first ones when the program's next item is a GEMM tile with rows (else
    commit empty groups, so that each step's wait counts the same groups); a tile whose first loads were not issued
    so issues them when it starts."""
    a_bufs, b_desc, b_bufs, ready, K, N, a_desc = p
    c_buf, tile_full, tile_free = c[0], c[1], c[2]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = c_buf.type.shape[1]
    LEAD: gl.constexpr = a_bufs.type.shape[0] - 1
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [gl.num_warps(), 1], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    k_tiles = gl.cdiv(K, BLOCK_K)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    total = static_items(t, num_pid_n)
    g = 0  # K steps consumed so far
    done = 0  # tiles handed to the store partition so far
    prefetched = 0  # whether this tile's first LEAD loads were issued by the previous tile
    for it in range(gl.program_id(0), total, NUM_PROGRAMS):
        expert, first, end, pid_n, busy = grouped_item(t, it, num_pid_n, GROUP_M)
        if busy:
            if WAIT and prefetched == 0:
                _arrived(f, first, end, BLOCK_M, CLOCK, CONTIG)
            rows = _rows(r, first, end, LD, BLOCK_M, CONTIG)
            if prefetched == 0:
                for j in gl.static_range(LEAD):
                    _load(p, g + j, rows, expert, pid_n * BLOCK_N, j, B_KMAJOR, CONTIG)
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma)
            for k in range(k_tiles - LEAD):
                acc = _step(p, acc, g, B_KMAJOR, CONTIG)
                _load(p, g + LEAD, rows, expert, pid_n * BLOCK_N, k + LEAD, B_KMAJOR, CONTIG)
                g += 1
            n_expert, n_first, n_end, n_pid_n, has_next = grouped_item(t, it + NUM_PROGRAMS, num_pid_n, GROUP_M)
            if WAIT and has_next:  # before the next tile's rows are read: their sources may write ``src`` too
                _arrived(f, n_first, n_end, BLOCK_M, CLOCK, CONTIG)
            n_rows = _rows(r, n_first, n_end, LD, BLOCK_M, CONTIG)
            for j in gl.static_range(LEAD):
                acc = _step(p, acc, g, B_KMAJOR, CONTIG)
                if has_next:
                    _load(p, g + LEAD, n_rows, n_expert, n_pid_n * BLOCK_N, j, B_KMAJOR, CONTIG)
                elif not CONTIG:
                    async_copy.commit_group()
                g += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.wait(tile_free, done & 1)  # the store partition has read the previous tile
            c_buf.store(acc.to(c_buf.dtype))
            barrier()  # every warp's part of the tile is in the buffer
            mbarrier.arrive(tile_full)
            done += 1
            prefetched = has_next.to(gl.int32)


@gluon.jit
def _stores(p, r, f, t, c, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, SUB_M: gl.constexpr):
    """Every tile of this program, from the shared tile buffer into the output rows ``dst`` of its sorted rows,
    SUB_M rows at a time, beside the next tile's K loop."""
    N = p[5]
    c_buf, tile_free = c[0], c[2]
    BLOCK_N: gl.constexpr = c_buf.type.shape[1]
    rows_off, cols_off = store_offsets(c_buf, SUB_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    total = t[1] * num_pid_n
    mbarrier.arrive(tile_free)
    done = 0
    for it in range(gl.program_id(0), total, NUM_PROGRAMS):
        expert, first, end, pid_n, busy = grouped_item(t, it, num_pid_n, GROUP_M)
        if busy:
            store_tile(c, done, first, end, pid_n * BLOCK_N + cols_off, N, rows_off, True)
            done += 1


@gluon.jit
def store_offsets(c_buf, SUB_M: gl.constexpr):
    """A store partition's row offsets [SUB_M] and column offsets [BLOCK_N] into the tile buffer ``c_buf``, in the
    layout its stores take: each thread 16 bytes of a row, a warp a row of 256 columns."""
    BLOCK_N: gl.constexpr = c_buf.type.shape[1]
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [gl.num_warps(), 1],
                                                 [1, 0])
    return (gl.arange(0, SUB_M, layout=gl.SliceLayout(1, rows_layout)),
            gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, rows_layout)))


@gluon.jit
def store_tile(c, done, first, end, cols, N, rows_off, SCATTER: gl.constexpr):
    """A store partition's part of a GEMM tile of sorted rows [first, end): wait until the tile buffer holds it (the
    ``done``-th tile handed over), store it SUB_M rows (``rows_off``' length) at a time, columns ``cols`` (those below
    N), then hand the buffer back. ``c`` = (buffer, "full", "free", out, dst, row stride): with SCATTER each sorted
    row into its output row ``dst``, else into the same row of ``out``."""
    c_buf, tile_full, tile_free, out_ptr, dst_ptr, stride_om = c
    SUB_M: gl.constexpr = rows_off.shape[0]
    col_ok = cols < N
    mbarrier.wait(tile_full, done & 1)
    for sub in gl.static_range(c_buf.type.shape[0] // SUB_M):
        if first + sub * SUB_M < end:
            vals = c_buf.slice(sub * SUB_M, SUB_M).load(rows_off.type.layout.parent)
            rows = first + sub * SUB_M + rows_off
            ok = rows < end
            if SCATTER:
                rows = gl.load(dst_ptr + rows, mask=ok, other=0)
            gl.store(out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :], vals,
                     mask=ok[:, None] & col_ok[None, :])
    barrier()  # every warp of the partition has read the buffer and stored its rows
    mbarrier.arrive(tile_free)


@gluon.jit
def grouped_buffers(a_ptr, b_desc, out_ptr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr,
                    B_KMAJOR: gl.constexpr):
    """The kernels' shared memory: NUM_STAGES stages of A [BLOCK_M, BLOCK_K] (A's dtype) and of B's blocks, the
    tile buffer [BLOCK_M, BLOCK_N] of the output dtype, a "ready" mbarrier per stage and the tile buffer's "full"
    and "free" mbarriers, initialised."""
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_KMAJOR else b_desc.block_type.shape[2]
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype))
    b_bufs, c_buf, ready, tile_bars = stage_buffers(b_desc, out_ptr, BLOCK_M, BLOCK_N, NUM_STAGES)
    return a_bufs, b_bufs, c_buf, ready, tile_bars


@gluon.jit
def ag_grouped_hopper(x_ptr, ws_ptr, a_desc, b_desc, out_ptr, src_ptr, dst_ptr, pos_ptr, chunk_at_ptr, table_ptr,
                      flags_ptr, waiter, slots, M_LOCAL, CHUNKS_PER_RANK, N, K, stride_xm, stride_wsm,
                      stride_om,
                      BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                      NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr, B_KMAJOR: gl.constexpr,
                      CLOCK: gl.constexpr, STORE_WARPS: gl.constexpr, STORE_REGS: gl.constexpr,
                      SUB_M: gl.constexpr, CONTIG: gl.constexpr):
    """out[dst[p]] = x_all[src[p]] @ w[expert of p] for every sorted row p (module doc; the arguments are
    ``ag_grouped_gemm``'s). ``b_desc``: the experts' weights [E, K, N] in [1, BLOCK_K, BLOCK_N] blocks or, with
    B_KMAJOR, their transpose [E, N, K] in [1, BLOCK_N, BLOCK_K] blocks. CONTIG: ``a_desc`` describes the
    workspace, whose rows each tile reads consecutively (``grouped_k_loops``); else it is not read."""
    a_bufs, b_bufs, c_buf, ready, tile_bars = grouped_buffers(x_ptr, b_desc, out_ptr, BLOCK_M, BLOCK_K, NUM_STAGES,
                                                              B_KMAJOR)
    p = (a_bufs, b_desc, b_bufs, ready, K, N, a_desc)
    r = (x_ptr, ws_ptr, src_ptr, stride_xm, stride_wsm, M_LOCAL, waiter[2])
    f = (pos_ptr, chunk_at_ptr, flags_ptr, waiter, CHUNKS_PER_RANK)
    t = (table_ptr, slots, 0, 1)
    c = (c_buf, tile_bars.index(0), tile_bars.index(1), out_ptr, dst_ptr, stride_om)
    gl.warp_specialize([
        (grouped_k_loops, (p, r, f, t, c, GROUP_M, NUM_PROGRAMS, B_KMAJOR, True, CLOCK, CONTIG)),
        (_stores, (p, r, f, t, c, GROUP_M, NUM_PROGRAMS, SUB_M)),
    ], [STORE_WARPS], [STORE_REGS])


# ---------------------------------------------------------------------------------------------------- launcher
#: The deepest K this kernel takes with A's rows gathered: past it the Triton kernel's K loop was measured faster
#: (docs/decisions.md, Tensor-parallel MoE). Rows read by TMA (CONTIG) have no such limit.
MAX_K = 4096
#: AllGather-MoE's K steps where A's rows are gathered (not CONTIG): 32 deep in 6 stages, TILES' shared memory with
#: 160 of K in flight, not 128 (docs/decisions.md, Tensor-parallel MoE); where all of A comes by TMA, TILES'.
GATHER_STEPS = replace(TILES, block_k=32, num_stages=6)


def weights_layout(w) -> str | None:
    """How a tensor descriptor describes the experts' weights ``w`` [E, K, N]: "kn" (unit stride along N), "nk" (along
    K: ``linear.weight.transpose(1, 2)``'s layout), or None (neither, or a base or stride not 16-byte aligned)."""
    if w.stride(2) == 1 and aligned(w, w.stride(0), w.stride(1)):
        return "kn"
    if w.stride(1) == 1 and aligned(w, w.stride(0), w.stride(2)):
        return "nk"
    return None


def weights_descriptor(w, steps=TILES):
    """A Gluon tensor descriptor of the experts' weights ``w`` [E, K, N] in ``steps``' blocks: [1, BLOCK_K, BLOCK_N]
    blocks of ``w`` ("kn"), or [1, BLOCK_N, BLOCK_K] blocks of its transpose [E, N, K] ("nk")."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, K, N = w.shape
    gdt = gl.bfloat16 if w.dtype == torch.bfloat16 else gl.float16
    bk, bn = steps.block_k, steps.block_n
    if weights_layout(w) == "kn":
        block = [1, bk, bn]
        return TensorDescriptor(w, [E, K, N], [w.stride(0), w.stride(1), 1], block, shared_layout(block, gdt))
    block = [1, bn, bk]
    return TensorDescriptor(w.transpose(1, 2), [E, N, K], [w.stride(0), w.stride(2), 1], block,
                            shared_layout(block, gdt))


def rows_descriptor(a, steps=TILES):
    """A Gluon tensor descriptor of A's rows ``a`` [R, K] (unit stride along K) in [BLOCK_M, BLOCK_K] blocks
    (``steps``'), for the kernels' CONTIG loads (rows past R read as zeros)."""
    gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    return tma_descriptor(a, list(a.shape), a.stride(0), [steps.block_m, steps.block_k], gdt)


def usable(ctx, tiles, x, w, out, contig: bool = False, steps=TILES) -> bool:
    """Whether this kernel can run the call in K steps ``steps``: cuda, sm_90, Gluon, 16-bit operands, 128-row tiles
    (``tiles.block_m``), K a whole number of steps, at least NUM_STAGES - 1 and, gathered (not ``contig``), at most
    MAX_K deep, A's and the output's rows 16-byte aligned, the weights describable (``weights_layout``)."""
    if (ctx.backend != "cuda" or x.dtype not in (torch.bfloat16, torch.float16) or tiles.block_m != TILES.block_m
            or not is_sm90(x.device.index) or not gluon_available()):
        return False
    K = w.shape[1]
    if (K % steps.block_k or K < (steps.num_stages - 1) * steps.block_k or (K > MAX_K and not contig)
            or out.stride(-1) != 1):
        return False
    return aligned(x, x.stride(0)) and aligned(out, out.stride(0)) and weights_layout(w) is not None


def launch_ag_grouped_hopper(ctx, x, ws, w, out, routes, table, flags, layout, programs: int, op: int = 0,
                             rank: int | None = None, contig: bool = False, *, steps) -> None:
    """``ag_grouped_hopper`` on the caller's stream, with kernels.grouped_gemm.launch_ag_grouped's arguments
    (``usable`` must hold; ``programs``: the grid). ``contig``: each tile's rows are consecutive rows of ``ws``,
    read by TMA; ``steps``: the K steps (``usable``'s)."""
    E, K, N = w.shape
    b_desc = weights_descriptor(w, steps)
    launch(ag_grouped_hopper, (programs,), (
        x, ws, rows_descriptor(ws, steps) if contig else b_desc, b_desc, out, *routes, table, flags,
        waiter(ctx, op, rank), table.shape[0], layout.m_local, layout.chunks_per_rank, N, K, x.stride(0),
        ws.stride(0), out.stride(0),
    ), dict(BLOCK_M=TILES.block_m, BLOCK_K=steps.block_k, GROUP_M=TILES.group_m, NUM_PROGRAMS=programs,
            NUM_STAGES=steps.num_stages, B_KMAJOR=weights_layout(w) == "nk", CLOCK=ctx.clock,
            STORE_WARPS=EPILOGUE_WARPS, STORE_REGS=EPILOGUE_REGS, SUB_M=SUB_M, CONTIG=contig), num_warps=8,
           maxnreg=MAXNREG)
    ctx.after_launch()


__all__ = ["GATHER_STEPS", "MAX_K", "SUB_M", "TILES", "ag_grouped_hopper", "grouped_buffers", "grouped_item",
           "grouped_k_loops", "launch_ag_grouped_hopper", "rows_descriptor", "static_items", "store_offsets",
           "store_tile", "usable", "weights_descriptor", "weights_layout"]
