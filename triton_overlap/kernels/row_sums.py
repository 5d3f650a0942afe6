"""Weighted sums of gathered rows, in float32, in a fixed order: ``out[m] = Σ_j w[m, j] · src[index[m, j]]``.

Expert-parallel combine sums rows twice (ops.expert_parallel): the expert owner sums, for each token it received,
the outputs of the token's choices among its experts, each times its top-k weight; the token's own rank sums the
partials that came back from the owners. ``torch.index_add_`` would do either with one scatter, but on GPUs its
atomic adds land in no fixed order, so two calls (or the overlapped path and the process group's fallback) could
differ in the last bit. Here each output tile walks its K slots in order (choice j, or owner rank), loading only
the rows that exist (``index < 0``: none, read as zero), so the sum is the same on every call and every path, and
each source row is read once.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..plan import cdiv
from .cached_launch import launch
from .signal import error_code


@triton.jit
def gather_rows_sum(src_ptr, index_ptr, weight_ptr, out_ptr, err_ptr, M, N, K, stride_src, stride_out,
                    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PEER: tl.constexpr):
    """``index`` int32 [M, K] (-1: no row), ``weight`` float32 [M, K] (read where the index is set), ``src`` rows of
    N elements ``stride_src`` apart, ``out`` [M, N] rows ``stride_out`` apart (unit column strides). PEER: ``out``
    is a peer's memory, where nothing is stored once the error word ``err`` holds a fault (the ranks' calls may
    disagree)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, K):
        idx = tl.load(index_ptr + rows * K + j, mask=row_ok, other=-1)
        hit = idx >= 0
        at = tl.where(hit, idx, 0).to(tl.int64)
        vals = tl.load(src_ptr + at[:, None] * stride_src + cols[None, :], mask=hit[:, None] & col_ok[None, :],
                       other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + rows * K + j, mask=hit, other=0.0)
            vals = vals * w[:, None]
        acc += vals
    if PEER:
        row_ok = row_ok & (tl.full((BLOCK_M,), 1, tl.int1) & (error_code(err_ptr) == 0))
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def launch_gather_rows_sum(ctx, src, index, weight, out, peer: bool = False) -> None:
    """``out`` [M, N] = Σ_j ``weight[m, j]`` (1 where None) · ``src[index[m, j]]`` in float32, rounded once to
    ``out``'s dtype; on the caller's stream. ``peer``: ``out`` is in a peer's memory (nothing is stored once the
    Context has a fault)."""
    M, N = out.shape
    if M == 0 or N == 0:
        return
    block_m, block_n, warps = (32, 64, 1) if ctx.interpreted else (16, 256, 4)
    launch(gather_rows_sum, (cdiv(M, block_m), cdiv(N, block_n)), (
        src, index, weight if weight is not None else index, out, ctx.err if peer else index, M, N, index.shape[1],
        src.stride(0), out.stride(0)), dict(HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                                            PEER=peer), num_warps=warps)
    ctx.after_launch()


__all__ = ["gather_rows_sum", "launch_gather_rows_sum"]
