"""The grouped GEMMs of tensor-parallel mixture of experts: persistent kernels whose tiles are rows of one expert.

Rows are (token, k) pairs sorted on the host side of the launch (ops.moe_routing, torch on the device) so that each
expert's rows are contiguous; a tile is up to BLOCK_M consecutive sorted rows of one expert, and the tile table
(int32 [slots, 3]: expert, first row, end row) holds every tile in the order programs should take them. Its length is
a bound fixed by the shapes (sum over experts of ceil(rows / BLOCK_M) <= ceil(rows / BLOCK_M) + experts), so
nothing is read back to the host: slots past the last tile are empty (first row = end row) and skipped.

* ``ag_grouped_gemm`` (AllGather + grouped GEMM): a sorted row's A row is a token of the gathered input, read in
  place from this rank's shard ``x_ptr`` or from the workspace ``ws_ptr`` that copy engines fill chunk by chunk
  (producers.gather). Within an expert, rows are sorted by the arrival position of their token's chunk (this rank's
  own chunks at position 0), so a tile's rows come from a run of positions; the tile waits for the flag of each
  position its rows actually use (``chunk_at``: the chunk at each position), never for chunks only other tiles
  read. The table's order is the routing's (ops.all_gather_moe.route: expert order, a tile needing a peer's chunk
  held back until the chunk is expected).
* ``rs_grouped_gemm`` (grouped GEMM + top-k combine + ReduceScatter): rows are sorted by destination (the owner of
  the token, in GEMM-RS's send order, this rank last), then expert. The work items of each destination are its
  GEMM tiles (a fixed number of slots) and then its combine tiles: a combine tile waits until every GEMM item of
  its destination is done (a device counter), sums ``topk_weights[t, j] * Y[t, j]`` over j in float32 for
  BLOCK_C of the destination's tokens, stores the partial where GEMM-RS's copy variant stages it
  (``ptrs[dest]``, producers.scatter.Staging) and bumps the counters that the copy engines wait on. Items are
  claimed in order through an atomic counter, so a combine tile is taken only once every GEMM item before it has
  been taken by a running program (in Triton's interpreter programs run one after another).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .cached_launch import launch
from .capability import supports_tma
from . import grouped_gemm_hopper as hopper
from .grouped_gemm_hopper_rs import SUB_C, launch_rs_grouped_hopper
from .gemm_device import publish, work_item
from .gemm_operands import aligned
from .signal import WHAT_OWN_TILES, wait_for, waiter


@triton.jit
def _expert_tile(a_rows, row_ok, w, expert, col0, cols, col_ok, K, stride_we, stride_wk, stride_wn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_DESC: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """A[rows, :] @ w[expert][:, cols] in float32: ``a_rows`` the rows' start pointers (unit stride along K),
    ``cols`` = ``col0`` + arange; ``w`` the experts' [E, K, N] weights through pointers (B_DESC 0, any strides)
    or a 3-D tensor descriptor (B_DESC 1: [E, K, N] with blocks [1, BLOCK_K, BLOCK_N]; 2: its transpose [E, N, K],
    blocks [1, BLOCK_N, BLOCK_K]), which fills zeros past the expert's K and N; rows past ``row_ok`` and columns past
    ``col_ok`` read zeros."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_ptr = w
    if B_DESC == 0:
        b_ptr = w + expert.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_rows[:, None] + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if B_DESC == 1:
            b = w.load([expert, k0, col0]).reshape(BLOCK_K, BLOCK_N)
        elif B_DESC == 2:
            b = w.load([expert, col0, k0]).reshape(BLOCK_N, BLOCK_K).T
        else:
            b = tl.load(b_ptr + (k0 + offs_k)[:, None] * stride_wk + cols[None, :] * stride_wn,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:  # Triton's interpreter multiplies 16-bit operands as raw bits
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def rounded_in_interpreter(acc, out_ty: tl.constexpr):
    """float32 ``acc`` rounded to the nearest (ties to even) value of ``out_ty`` (bfloat16 or float16), still float32,
    for kernels that Triton's interpreter runs: it truncates where it narrows float32 (GPUs round), which biases a
    layer's products toward zero; narrowing the rounded value is then exact (float16's normal range)."""
    bits = acc.to(tl.uint32, bitcast=True)
    if out_ty == tl.bfloat16:
        drop = 16
    else:
        drop = 13
    half = (1 << (drop - 1)) - 1
    bits = (bits + half + ((bits >> drop) & 1)) >> drop << drop
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def ag_grouped_gemm(x_ptr, ws_ptr, w, out_ptr, src_ptr, dst_ptr, pos_ptr, chunk_at_ptr, table_ptr, flags_ptr,
                    waiter, slots, M_LOCAL, CHUNKS_PER_RANK, N, K, stride_xm, stride_wsm, stride_we, stride_wk,
                    stride_wn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    B_DESC: tl.constexpr, NUM_PROGRAMS: tl.constexpr, CLOCK: tl.constexpr, DOT_F32: tl.constexpr):
    """out[dst[p]] = x_all[src[p]] @ w[expert of p] for every sorted row p (module doc). ``pos_ptr``: each sorted
    row's chunk position (0: this rank's own rows); ``chunk_at_ptr``: the chunk id at each position; ``flags_ptr``:
    this rank's gather flags, one per chunk."""
    rank = waiter[2]
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for it in range(tl.program_id(0), slots * num_pid_n, NUM_PROGRAMS):
        slot, pid_n = work_item(it, slots, num_pid_n, GROUP_M)
        expert = tl.load(table_ptr + slot * 3)
        first = tl.load(table_ptr + slot * 3 + 1)
        end = tl.load(table_ptr + slot * 3 + 2)
        if end > first:
            offs = first + tl.arange(0, BLOCK_M)
            row_ok = offs < end
            pos = tl.load(pos_ptr + offs, mask=row_ok, other=0)
            # the chunks this tile's rows come from, at each position its rows use (positions are sorted)
            for k in range(tl.maximum(tl.load(pos_ptr + first), 1), tl.load(pos_ptr + end - 1) + 1):
                if tl.sum((pos == k).to(tl.int32), axis=0) > 0:
                    c = tl.load(chunk_at_ptr + k)
                    wait_for(flags_ptr + c, 1, waiter, c // CHUNKS_PER_RANK, c % CHUNKS_PER_RANK, CLOCK)
            tok = tl.load(src_ptr + offs, mask=row_ok, other=0)
            mine = (tok // M_LOCAL) == rank
            a_rows = tl.where(mine, x_ptr + (tok - rank * M_LOCAL).to(tl.int64) * stride_xm,
                              ws_ptr + tok.to(tl.int64) * stride_wsm)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            acc = _expert_tile(a_rows, row_ok, w, expert, pid_n * BLOCK_N, cols, col_ok, K, stride_we, stride_wk,
                               stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, B_DESC, DOT_F32)
            dst = tl.load(dst_ptr + offs, mask=row_ok, other=0).to(tl.int64)
            if DOT_F32:
                acc = rounded_in_interpreter(acc, out_ptr.dtype.element_ty)
            tl.store(out_ptr + dst[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def rs_grouped_gemm(h_ptr, w, y_ptr, src_ptr, pos_ptr, weights_ptr, table_ptr, dests_ptr, done_ptr, tick_ptr,
                    scatter_ptrs, counter_ptrs, waiter, SLOTS, TOPK, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, N, K,
                    stride_hm, stride_we, stride_wk, stride_wn, world,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                    GROUP_M: tl.constexpr, B_DESC: tl.constexpr, NUM_PROGRAMS: tl.constexpr, CLOCK: tl.constexpr,
                    DOT_F32: tl.constexpr,
                    LOCAL_COUNTERS: tl.constexpr):
    """Y[p] = h[src[p]] @ w[expert of p] for every sorted row p, destination by destination (``dests_ptr``: the
    ranks in the order their rows are computed; the table holds SLOTS slots per destination, in that order), and
    after each destination's GEMM items its combine items (module doc). Y is [rows, N], row-major; a token's pair
    (t, j) sits at row ``pos[t * TOPK + j]``."""
    rank = waiter[2]
    num_pid_n = tl.cdiv(N, BLOCK_N)
    gemm_items = SLOTS * num_pid_n
    combine_items = tl.cdiv(M_LOCAL, BLOCK_C) * num_pid_n
    per_dest = gemm_items + combine_items
    for _ in range(tl.program_id(0), world * per_dest, NUM_PROGRAMS):
        item = tl.atomic_add(tick_ptr, 1, sem="relaxed", scope="gpu")  # the next item in order, whoever takes it
        q = item // per_dest
        r = item % per_dest
        if r < gemm_items:
            s, pid_n = work_item(r, SLOTS, num_pid_n, GROUP_M)
            slot = q * SLOTS + s
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            expert = tl.load(table_ptr + slot * 3)
            first = tl.load(table_ptr + slot * 3 + 1)
            end = tl.load(table_ptr + slot * 3 + 2)
            if end > first:
                offs = first + tl.arange(0, BLOCK_M)
                row_ok = offs < end
                src = tl.load(src_ptr + offs, mask=row_ok, other=0).to(tl.int64)
                acc = _expert_tile(h_ptr + src * stride_hm, row_ok, w, expert, pid_n * BLOCK_N, cols, col_ok, K,
                                   stride_we, stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, B_DESC, DOT_F32)
                tl.store(y_ptr + offs.to(tl.int64)[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & col_ok[None, :])
            tl.debug_barrier()  # every thread's stores of the tile come before the release below
            tl.atomic_add(done_ptr + q, 1, sem="release", scope="gpu")  # empty slots count too: the total is fixed
        else:
            cols = (r % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            dest = tl.load(dests_ptr + q)
            # every GEMM item of this destination is done (they were all claimed before this item, and wait on
            # nothing: this wait ends unless the device stops); a timeout says it waited on this rank's own tiles
            wait_for(done_ptr + q, gemm_items, waiter, dest, WHAT_OWN_TILES, CLOCK)
            row0 = ((r - gemm_items) // num_pid_n) * BLOCK_C
            rows = row0 + tl.arange(0, BLOCK_C)
            row_ok = rows < M_LOCAL
            pair0 = (dest * M_LOCAL + rows).to(tl.int64) * TOPK
            acc = tl.zeros((BLOCK_C, BLOCK_N), dtype=tl.float32)
            for j in range(0, TOPK):
                p = tl.load(pos_ptr + pair0 + j, mask=row_ok, other=0).to(tl.int64)
                wt = tl.load(weights_ptr + pair0 + j, mask=row_ok, other=0.0)
                y = tl.load(y_ptr + p[:, None] * N + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                            other=0.0)
                acc += wt[:, None] * y.to(tl.float32)
            base = tl.load(scatter_ptrs + dest).to(tl.pointer_type(y_ptr.dtype.element_ty))
            part = base + (rank * M_LOCAL + rows).to(tl.int64)[:, None] * N + cols[None, :]
            tl.store(part, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            last = tl.minimum(row0 + BLOCK_C, M_LOCAL) - 1
            publish(counter_ptrs, dest * CHUNKS_PER_RANK + row0 // M_PER_CHUNK,
                    dest * CHUNKS_PER_RANK + last // M_PER_CHUNK, rank, CHUNKS_PER_RANK, LOCAL_COUNTERS)


@triton.jit
def stage_own_rows(x_ptr, staged_ptr, src_ptr, pos_ptr, pairs, M_LOCAL, rank, K, stride_xm, stride_sm,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """``staged[p] = x[src[p] - rank * M_LOCAL]`` for every row p of this rank's own tokens (arrival position 0):
    AllGather-MoE's rows sent sorted by expert, this rank's block of them, which its copy engines then send. A
    program with no own rows copies nothing."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < pairs
    own = ok & (tl.load(pos_ptr + rows, mask=ok, other=1) == 0)
    tok = tl.load(src_ptr + rows, mask=own, other=0)
    src_rows = x_ptr + (tok - rank * M_LOCAL).to(tl.int64) * stride_xm
    dst_rows = staged_ptr + rows.to(tl.int64) * stride_sm
    k_end = tl.where(tl.max(own.to(tl.int32), axis=0) > 0, K, 0)
    for k0 in range(0, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = own[:, None] & (cols < K)[None, :]
        tl.store(dst_rows[:, None] + cols[None, :], tl.load(src_rows[:, None] + cols[None, :], mask=m), mask=m)


# ---------------------------------------------------------------------------------------------------- launchers
def _programs(ctx, items: int, free_sm: bool = False) -> int:
    """One program per SM (CU), at most one per item. ``free_sm``: leave one SM to the call's barrier kernel, which
    the copies that the programs wait for follow (as kernels.gemm's GATHER does)."""
    units = ctx.num_compute_units() - (1 if free_sm and not ctx.interpreted else 0)
    return max(1, min(units, items))


def expert_weights(ctx, tiles, w):
    """How the kernels read the experts' weights ``w`` [E, K, N]: (the argument, B_DESC). With ``tiles.tma`` True a
    3-D tensor descriptor where one can describe ``w`` (NVIDIA compute capability 9.0+ or the host backend, 16-byte
    aligned base and strides, unit stride along N (B_DESC 1) or along K (B_DESC 2: a transposed weight,
    ``linear.weight.transpose(1, 2)``'s layout)); else pointers (B_DESC 0), the default: a descriptor measured no
    faster, and spills in the combining kernel (docs/decisions.md, Tensor-parallel MoE)."""
    bk, bn = tiles.block_k, tiles.block_n
    if not tiles.tma or not supports_tma(ctx.backend, w.device, tiles.block_m, bn, bk):
        return w, 0
    E, K, N = w.shape
    if w.stride(1) == 1 and w.stride(2) != 1 and aligned(w, w.stride(0), w.stride(2)):
        return TensorDescriptor(w.transpose(1, 2), [E, N, K], [w.stride(0), w.stride(2), 1], [1, bn, bk]), 2
    if w.stride(2) == 1 and aligned(w, w.stride(0), w.stride(1)):
        return TensorDescriptor(w, [E, K, N], [w.stride(0), w.stride(1), 1], [1, bk, bn]), 1
    return w, 0


def launch_ag_grouped(ctx, tiles, x, ws, w, out, routes, table, flags, layout, op: int = 0,
                      rank: int | None = None, contig: bool = False) -> str:
    """The AllGather grouped GEMM on the caller's stream: on Hopper the warp-specialized Gluon kernel
    (kernels.grouped_gemm_hopper) where it can run and ``tiles.gemm`` is not "triton", else ``ag_grouped_gemm``.
    Returns the kernel's name. ``tiles``: block sizes and warps (MoEGEMMConfig); ``x`` this rank's [m_local, K]
    shard, ``ws`` the [M, K] workspace, ``w`` [E, K, N] (any strides), ``out`` rows of N (row stride
    ``out.stride(0)``, unit column stride); ``routes``: (src, dst, pos, chunk_at) int32 tensors; ``table``: int32
    [slots, 3]; ``flags``: this rank's flags; ``layout``: the gather's ChunkLayout; ``rank``: the rank it runs as
    (None: the Context's; tests simulate a world on one rank); ``contig``: each tile's rows are consecutive rows of
    ``ws`` from ``src`` of its first row, which the Gluon kernel then reads by TMA (AllGather-MoE's rows sent
    sorted by expert, ``x`` this rank's block of ``ws``; a tile that waited for chunks fences the async proxy)."""
    N, K = w.shape[2], w.shape[1]
    slots = table.shape[0]
    steps = hopper.TILES if contig else hopper.GATHER_STEPS  # gathered rows: a deeper pipeline (GATHER_STEPS)
    if tiles.gemm != "triton" and hopper.usable(ctx, tiles, x, w, out, contig, steps):
        programs = _programs(ctx, slots * triton.cdiv(N, hopper.TILES.block_n), free_sm=True)
        hopper.launch_ag_grouped_hopper(ctx, x, ws, w, out, routes, table, flags, layout, programs, op, rank,
                                        contig, steps=steps)
        return "ag_grouped_hopper" + ("+rows" if contig else "")
    programs = _programs(ctx, slots * triton.cdiv(N, tiles.block_n), free_sm=True)
    b, b_desc = expert_weights(ctx, tiles, w)
    launch(ag_grouped_gemm, (programs,), (
        x, ws, b, out, *routes, table, flags, waiter(ctx, op, rank), slots, layout.m_local, layout.chunks_per_rank,
        N, K, x.stride(0), ws.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
    ), dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
            B_DESC=b_desc, NUM_PROGRAMS=programs, CLOCK=ctx.clock, DOT_F32=ctx.interpreted),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    ctx.after_launch()
    return "ag_grouped_gemm"


def reads_rows_by_tma(ctx, tiles, x, w, out) -> bool:
    """Whether ``launch_ag_grouped`` with ``contig`` would run these operands on the Gluon kernel, which reads a
    tile's consecutive rows by TMA (else rows are read one by one, as they are gathered)."""
    return tiles.gemm != "triton" and hopper.usable(ctx, tiles, x, w, out, True, hopper.TILES)


def stage_rows(ctx, x, staged, tokens, pos, m_local: int, rank: int) -> None:
    """``stage_own_rows`` on the caller's stream for every row p of ``staged`` [P, K] whose arrival position
    ``pos[p]`` is 0 (this rank's): ``staged[p] = x[tokens[p] - rank * m_local]``."""
    pairs, K = staged.shape
    launch(stage_own_rows, (triton.cdiv(pairs, 16),), (
        x, staged, tokens, pos, pairs, m_local, rank, K, x.stride(0), staged.stride(0)),
        dict(BLOCK_R=16, BLOCK_K=256), num_warps=4)


def launch_rs_grouped(ctx, tiles, block_c: int, h, w, y, routes, weights, table, dests, counts, target, layout,
                      op: int = 0, contig: bool = False) -> str:
    """The grouped GEMM + top-k combine of MoE-GEMM-ReduceScatter on the caller's stream: on Hopper the
    warp-specialized Gluon kernel (kernels.grouped_gemm_hopper_rs) where it can run and ``tiles.gemm`` is not
    "triton", else ``rs_grouped_gemm``. Returns the kernel's name. ``h`` [rows, K] (unit stride along K), ``w``
    [E, K, N] (any strides), ``y`` [sorted rows, N] contiguous; ``routes``: (src, pos) int32; ``weights`` float32
    [T * topk]; ``table`` int32 [W * slots, 3]; ``dests`` int32 [W]; ``counts``: int32 [W + 1] zeros (W
    destinations' done counters, then the item counter); ``target``: producers.scatter.Staging (where partials go,
    which counters they bump); ``layout``: the scatter's ChunkLayout; ``contig``: each tile's rows are consecutive
    rows of ``h`` (MoERouting.rank_runs), which the Gluon kernel then reads by TMA, at any K."""
    N, K = w.shape[2], w.shape[1]
    W = layout.world
    slots = table.shape[0] // W
    if tiles.gemm != "triton" and block_c % SUB_C == 0 and hopper.usable(ctx, tiles, h, w, y, contig):
        npn = triton.cdiv(N, hopper.TILES.block_n)
        programs = _programs(ctx, W * (slots * npn + triton.cdiv(layout.m_local, block_c) * npn))
        launch_rs_grouped_hopper(ctx, block_c, h, w, y, routes, weights, table, dests, counts, target, layout,
                                 programs, op, contig)
        return "rs_grouped_hopper"
    npn = triton.cdiv(N, tiles.block_n)
    items = W * (slots * npn + triton.cdiv(layout.m_local, block_c) * npn)
    programs = _programs(ctx, items)
    b, b_desc = expert_weights(ctx, tiles, w)
    launch(rs_grouped_gemm, (programs,), (
        h, b, y, *routes, weights, table, dests, counts, counts[W:], target.ptrs, target.counter_ptrs,
        waiter(ctx, op), slots, weights.numel() // (W * layout.m_local), layout.m_local, layout.m_per_chunk,
        layout.chunks_per_rank, N, K, h.stride(0), w.stride(0), w.stride(1), w.stride(2), W,
    ), dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, BLOCK_C=block_c,
            GROUP_M=tiles.group_m, B_DESC=b_desc, NUM_PROGRAMS=programs, CLOCK=ctx.clock, DOT_F32=ctx.interpreted,
            LOCAL_COUNTERS=True),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    ctx.after_launch()
    return "rs_grouped_gemm"
