"""The ReduceScatter consumer: sum W partial row blocks in float32 as they land.

Each tile of this rank's [M_LOCAL, N] output waits, for every peer, on the
counters of the chunks its rows cover (bounded waits), then adds the W
partials ``recv[s]`` (this rank's own partial sits in slot ``rank``) and the
bias, and stores the output dtype.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..plan import ChunkLayout, cdiv
from .cached_launch import launch
from .signal import wait_for, waiter


@triton.jit
def reduce_partials(recv_ptr, out_ptr, bias_ptr, counters_ptr, expected_ptr, waiter, world, M_LOCAL, N, M_PER_CHUNK,
                    CHUNKS_PER_RANK, stride_om,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    NUM_PROGRAMS: tl.constexpr, CLOCK: tl.constexpr):
    """``waiter``: kernels.signal.waiter's (error word, budget, rank, op)."""
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
        for s in range(0, world):
            if s != rank:  # our own partial came from our own GEMM, earlier on this stream
                for j in range(j_first, j_last + 1):
                    wait_for(counters_ptr + s * CHUNKS_PER_RANK + j, tl.load(expected_ptr + j), waiter, s, j, CLOCK)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M_LOCAL) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, world):
            acc += tl.load(recv_ptr + s * M_LOCAL * N + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_reduce(ctx, recv, out, bias, counters, expected, layout: ChunkLayout, op: int = 0) -> None:
    """``out`` (this rank's [m_local, N] rows) = the sum of the W partials in ``recv`` (this rank's receive slots
    [W, m_local, N]) + ``bias``, chunk by chunk as each peer's counter reaches ``expected``."""
    m_local, N = out.shape
    block_m, block_n = (32, 32) if ctx.interpreted else (64, 128)
    programs = max(1, min(ctx.num_compute_units(), cdiv(m_local, block_m) * cdiv(N, block_n)))
    launch(reduce_partials, (programs,), (
        recv, out, bias if bias is not None else out, counters, expected, waiter(ctx, op), ctx.world_size, m_local, N,
        layout.m_per_chunk, layout.chunks_per_rank, out.stride(0),
    ), dict(HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, NUM_PROGRAMS=programs, CLOCK=ctx.clock),
        num_warps=4)
    ctx.after_launch()
