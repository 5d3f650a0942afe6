"""The ReduceScatter consumer: sum partial row blocks in float32 as they land.

Each tile of this rank's [M_LOCAL, N] output waits, for every source rank, on
the counters of the chunks its rows cover (bounded waits), then adds the
sources' partials ``recv[s]`` (this rank's own partial sits in slot ``rank``)
and the bias, and stores the output dtype. The sources are every rank, or,
where a host's partials are summed before they cross to another host
(producers.scatter), this host's ranks and the sums' senders.

``sum_forwarded`` is that within-host sum: for one chunk, the partials of the
host's L ranks for each owner on another host, summed in float32 into the
buffer that the sum crosses from.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import ChunkLayout, cdiv
from .cached_launch import launch
from .signal import wait_for, waiter


@triton.jit
def reduce_partials(recv_ptr, out_ptr, bias_ptr, counters_ptr, expected_ptr, waiter, sources_ptr, num_sources, M_LOCAL,
                    N, M_PER_CHUNK, CHUNKS_PER_RANK, stride_om,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    NUM_PROGRAMS: tl.constexpr, CLOCK: tl.constexpr):
    """``waiter``: kernels.signal.waiter's (error word, budget, rank, op); ``sources_ptr``: the ``num_sources``
    ranks whose slots are summed."""
    rank = waiter[2]
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M_LOCAL, BLOCK_M) * num_pid_n
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        pid_m = tile // num_pid_n
        pid_n = tile % num_pid_n
        row0 = pid_m * BLOCK_M
        j_first = row0 // M_PER_CHUNK
        j_last = (tl.minimum(row0 + BLOCK_M, M_LOCAL) - 1) // M_PER_CHUNK
        for i in range(0, num_sources):
            s = tl.load(sources_ptr + i)
            if s != rank:  # our own partial came from our own GEMM, earlier on this stream
                for j in range(j_first, j_last + 1):
                    wait_for(counters_ptr + s * CHUNKS_PER_RANK + j, tl.load(expected_ptr + j), waiter, s, j, CLOCK)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M_LOCAL) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, num_sources):
            s = tl.load(sources_ptr + i).to(tl.int64)
            acc += tl.load(recv_ptr + s * M_LOCAL * N + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_forwarded(slots_ptr, counters_ptr, expected_ptr, out_ptr, dests_ptr, names_ptr, waiter, K, L, M_LOCAL, N,
                  ROW0, ROWS, J, CHUNKS_PER_RANK, WHAT,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_PROGRAMS: tl.constexpr, CLOCK: tl.constexpr):
    """Rows ``ROW0 .. ROW0 + ROWS`` (chunk ``J``) of ``out[dests[k]]`` = the sum over ``i < L`` of ``slots[k, i]``
    ([K, L, M_LOCAL, N]: the host's i-th rank's partial for the owner on the k-th other host), each slot once its
    counter ``counters[k, i, J]`` reaches ``expected[k, J]`` (bounded waits naming ``names[i]``, the rank that
    sends it, and ``WHAT``: the chunk, or a WHAT_* code)."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_k = tl.cdiv(ROWS, BLOCK_M) * num_pid_n
    for tile in range(pid, K * per_k, NUM_PROGRAMS):
        k = tile // per_k
        pid_m = (tile % per_k) // num_pid_n
        pid_n = tile % num_pid_n
        want = tl.load(expected_ptr + k * CHUNKS_PER_RANK + J)
        for i in range(0, L):
            wait_for(counters_ptr + (k * L + i) * CHUNKS_PER_RANK + J, want, waiter, tl.load(names_ptr + i), WHAT,
                     CLOCK)
        rows = ROW0 + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < ROW0 + ROWS) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, L):
            slot = (k * L + i).to(tl.int64) * M_LOCAL * N
            acc += tl.load(slots_ptr + slot + offs, mask=mask, other=0.0).to(tl.float32)
        dest = tl.load(dests_ptr + k).to(tl.int64) * M_LOCAL * N
        tl.store(out_ptr + dest + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _blocks(ctx) -> tuple[int, int]:
    return (32, 32) if ctx.interpreted else (64, 128)


def launch_reduce(ctx, recv, out, bias, counters, expected, layout: ChunkLayout, op: int = 0,
                  sources: tuple | None = None) -> None:
    """``out`` (this rank's [m_local, N] rows) = the sum of the partials in ``recv`` (this rank's receive slots
    [W, m_local, N]) of ``sources`` (None: every rank) + ``bias``, chunk by chunk as each source's counter reaches
    ``expected``."""
    m_local, N = out.shape
    block_m, block_n = _blocks(ctx)
    sources = tuple(range(ctx.world_size)) if sources is None else tuple(sources)
    ranks = ctx.cached(("reduce sources", sources), lambda: torch.tensor(sources, dtype=torch.int32,
                                                                         device=ctx.device))
    programs = max(1, min(ctx.num_compute_units(), cdiv(m_local, block_m) * cdiv(N, block_n)))
    launch(reduce_partials, (programs,), (
        recv, out, bias if bias is not None else out, counters, expected, waiter(ctx, op), ranks, len(sources),
        m_local, N, layout.m_per_chunk, layout.chunks_per_rank, out.stride(0),
    ), dict(HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, NUM_PROGRAMS=programs, CLOCK=ctx.clock),
        num_warps=4)
    ctx.after_launch()


def launch_sum_forwarded(ctx, slots, counters, expected, out, dests, names, layout: ChunkLayout, j: int,
                         op: int = 0, what: int | None = None) -> None:
    """Chunk ``j`` of the host's partials for the owners on other hosts, summed (sum_forwarded): ``slots``
    [K, L, m_local, N], ``counters`` [K, L, chunks_per_rank], ``expected`` [K, chunks_per_rank] and ``dests``
    [K] (int32: the slot of ``out`` [W, m_local, N] each sum goes to), ``names`` [L] (int32: the host's ranks);
    ``what``: what a wait that times out names (None: chunk ``j``)."""
    K, L, m_local, N = slots.shape
    rows = layout.local_rows(j)
    block_m, block_n = _blocks(ctx)
    tiles = K * cdiv(rows.stop - rows.start, block_m) * cdiv(N, block_n)
    # a quarter of the SMs at most: it runs beside the GEMM's programs, which hold their SMs already (the stream
    # waits for this rank's own partials of the chunk first: producers.scatter)
    programs = max(1, min(max(1, ctx.num_compute_units() // 4), tiles))
    launch(sum_forwarded, (programs,), (
        slots, counters, expected, out, dests, names, waiter(ctx, op), K, L, m_local, N, rows.start,
        rows.stop - rows.start, j, layout.chunks_per_rank, j if what is None else int(what),
    ), dict(BLOCK_M=block_m, BLOCK_N=block_n, NUM_PROGRAMS=programs, CLOCK=ctx.clock), num_warps=4)
    ctx.after_launch()
