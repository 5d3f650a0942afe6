"""Weighted sums of gathered rows, in float32, in a fixed order: ``out[m] = Σ_j w[m, j] · src[index[m, j]]``.

Expert-parallel combine sums rows twice (ops.expert_parallel): the expert owner sums, for each token it received,
the outputs of the token's choices among its experts, each times its top-k weight; the token's own rank sums the
partials that came back from the owners. ``torch.index_add_`` would do either with one scatter, but on GPUs its
atomic adds land in no fixed order, so two calls (or the overlapped path and the process group's fallback) could
differ in the last bit. Here each output tile walks its K slots in order (choice j, or owner rank), loading only
the rows that exist (``index < 0``: none, read as zero), so the sum is the same on every call and every path, and
each source row is read once. K is a constexpr and its loop unrolled, so a tile's K gathers are in flight together
(docs/decisions.md, Expert-parallel MoE, has the measurements).

``gather_rows_sum_jobs`` makes an owner's partials for every source in one launch: the launch's fastest grid axis
walks the sources, so tiles whose stores cross the link to a peer run beside tiles of the local source, which read
and write this GPU's memory only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import cdiv
from .cached_launch import launch
from .signal import error_code

#: (rows, columns, warps) of a tile on GPUs (docs/decisions.md, Expert-parallel MoE) and in the interpreter
TILE = (8, 256, 4)
TILE_INTERPRETED = (32, 64, 1)


@triton.jit
def _row_offsets(at, parts_ptr, num_parts, stride_src, PARTS: tl.constexpr):
    """Element offsets from ``src`` of source rows ``at`` (int64): ``at * stride_src``, or, with PARTS, rows held in
    ``num_parts`` tensors of consecutive rows: ``parts`` int64 [2, num_parts], each part's first row, then its
    first element's offset from ``src`` (in elements, which may be negative)."""
    if PARTS:
        part = tl.zeros_like(at)
        for i in range(1, num_parts):
            part += (at >= tl.load(parts_ptr + i)).to(tl.int64)
        first = tl.load(parts_ptr + part)
        return tl.load(parts_ptr + num_parts + part) + (at - first) * stride_src
    else:
        return at * stride_src


@triton.jit
def _weighted_rows(src_ptr, index_ptr, weight_ptr, rows, row_ok, cols, col_ok, stride_src, K: tl.constexpr,
                   HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, parts_ptr, num_parts,
                   PARTS: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] sums of index rows ``rows`` (int64) over their K slots, slot 0 first."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(K):
        idx = tl.load(index_ptr + rows * K + j, mask=row_ok, other=-1)
        hit = idx >= 0
        at = _row_offsets(tl.where(hit, idx, 0).to(tl.int64), parts_ptr, num_parts, stride_src, PARTS)
        vals = tl.load(src_ptr + at[:, None] + cols[None, :], mask=hit[:, None] & col_ok[None, :],
                       other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + rows * K + j, mask=hit, other=0.0)
            vals = vals * w[:, None]
        acc += vals
    return acc


@triton.jit
def gather_rows_sum(src_ptr, index_ptr, weight_ptr, out_ptr, M, N, stride_src, stride_out, K: tl.constexpr,
                    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``index`` int32 [M, K] (-1: no row), ``weight`` float32 [M, K] (read where the index is set), ``src`` rows of
    N elements ``stride_src`` apart, ``out`` [M, N] rows ``stride_out`` apart (unit column strides)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = _weighted_rows(src_ptr, index_ptr, weight_ptr, rows, row_ok, cols, col_ok, stride_src, K, HAS_WEIGHT,
                         BLOCK_M, BLOCK_N, index_ptr, 1, False)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def gather_rows_sum_jobs(src_ptr, index_ptr, weight_ptr, out_ptrs, jobs_ptr, err_ptr, N, stride_src, stride_out,
                         K: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """``jobs`` int32 [J, 4]: per job (grid axis 0) the rank whose buffer (``out_ptrs``, int64 base addresses) takes
    its rows, its first index row, its first row there and its row count; axis 1 the job's row tiles (past its
    rows: nothing to do), axis 2 the column tiles. The buffers hold rows ``stride_out`` apart of ``src``'s dtype.
    Nothing is stored once the error word ``err`` holds a fault (the ranks' calls may disagree)."""
    job = jobs_ptr + tl.program_id(0) * 4
    first = tl.load(job + 1).to(tl.int64)
    count = tl.load(job + 3)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    if tl.program_id(1) * BLOCK_M < count:
        base = tl.load(out_ptrs + tl.load(job)).to(tl.pointer_type(src_ptr.dtype.element_ty))
        out_rows = tl.load(job + 2).to(tl.int64) + r
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        row_ok = (r < count) & (tl.full((BLOCK_M,), 1, tl.int1) & (error_code(err_ptr) == 0))
        acc = _weighted_rows(src_ptr, index_ptr, weight_ptr, first + r, row_ok, cols, col_ok, stride_src, K,
                             HAS_WEIGHT, BLOCK_M, BLOCK_N, index_ptr, 1, False)
        tl.store(base + out_rows[:, None] * stride_out + cols[None, :], acc.to(src_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def gather_rows_sum_listed(src_ptr, index_ptr, weight_ptr, out_ptr, dest_ptr, list_ptr, bounds_ptr, err_ptr, N,
                           stride_src, parts_ptr, num_parts, K: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
    """The weighted sums of the index rows ``list[bounds[0]:bounds[1]]`` (``list`` and ``bounds`` int64),
    each stored at element ``dest[u]`` (int64) of ``out``'s memory (rows of out's dtype; ``dest`` may point into
    another buffer mapped here: a peer's); grid axis 0 the list's row tiles (past its end: nothing to do), axis 1
    the column tiles; source rows as _row_offsets. Nothing is stored once ``err`` holds a fault."""
    start = tl.load(bounds_ptr)
    end = tl.load(bounds_ptr + 1)
    if start + tl.program_id(0) * BLOCK_M < end:
        p = start + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = (p < end) & (tl.full((BLOCK_M,), 1, tl.int1) & (error_code(err_ptr) == 0))
        u = tl.load(list_ptr + p, mask=ok, other=0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = _weighted_rows(src_ptr, index_ptr, weight_ptr, u, ok, cols, col_ok, stride_src, K, True, BLOCK_M,
                             BLOCK_N, parts_ptr, num_parts, PARTS)
        dest = tl.load(dest_ptr + u, mask=ok, other=0)
        tl.store(out_ptr + dest[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=ok[:, None] & col_ok[None, :])


def _tile(ctx) -> tuple:
    return TILE_INTERPRETED if ctx.interpreted else TILE


def launch_gather_rows_sum(ctx, src, index, weight, out) -> None:
    """``out`` [M, N] = Σ_j ``weight[m, j]`` (1 where None) · ``src[index[m, j]]`` in float32, rounded once to
    ``out``'s dtype; on the caller's stream."""
    M, N = out.shape
    if M == 0 or N == 0:
        return
    block_m, block_n, warps = _tile(ctx)
    launch(gather_rows_sum, (cdiv(M, block_m), cdiv(N, block_n)), (
        src, index, weight if weight is not None else index, out, M, N, src.stride(0), out.stride(0)),
        dict(K=index.shape[1], HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n), num_warps=warps)
    ctx.after_launch()


def job_table(ctx, jobs: list) -> torch.Tensor:
    """The int32 [J, 4] device table of ``jobs`` ((rank, first index row, first out row, rows), in launch order) for
    launch_gather_rows_sum_jobs."""
    return torch.tensor(jobs, dtype=torch.int32).to(ctx.device, non_blocking=True)


def launch_gather_rows_sum_jobs(ctx, src, index, weight, out_ptrs, jobs: torch.Tensor, most_rows: int,
                                stride_out: int) -> None:
    """For each job of ``jobs`` (job_table) the weighted sums of its ``rows`` index rows from ``first``, stored at
    row ``first out row`` of its rank's buffer (``out_ptrs``); one launch, on the caller's stream. ``most_rows``:
    the largest job's rows. Nothing is stored once the Context has a fault."""
    N = src.shape[1]
    if most_rows == 0 or N == 0:
        return
    block_m, block_n, warps = _tile(ctx)
    launch(gather_rows_sum_jobs, (jobs.shape[0], cdiv(most_rows, block_m), cdiv(N, block_n)), (
        src, index, weight, out_ptrs, jobs, ctx.err, N, src.stride(0), stride_out),
        dict(K=index.shape[1], HAS_WEIGHT=True, BLOCK_M=block_m, BLOCK_N=block_n), num_warps=warps)
    ctx.after_launch()


def launch_gather_rows_sum_listed(ctx, src, index, weight, out, dest, listed, bounds, most_rows: int,
                                  parts: torch.Tensor | None = None) -> None:
    """gather_rows_sum_listed on the caller's stream: the index rows ``listed[bounds[0]:bounds[1]]`` (at most
    ``most_rows``), each row's sum stored at element ``dest[u]`` of ``out``'s memory; ``parts`` (part_table):
    ``src`` is the first of the tensors holding the source rows."""
    N = src.shape[1]
    if most_rows == 0 or N == 0:
        return
    block_m, block_n, warps = _tile(ctx)
    launch(gather_rows_sum_listed, (cdiv(most_rows, block_m), cdiv(N, block_n)), (
        src, index, weight, out, dest, listed, bounds, ctx.err, N, src.stride(0),
        index if parts is None else parts, 1 if parts is None else parts.numel() // 2),
        dict(K=index.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, PARTS=parts is not None), num_warps=warps)
    ctx.after_launch()


def part_table(ctx, parts: list) -> torch.Tensor:
    """The int64 [2, P] device table of ``parts`` (tensors of consecutive source rows, one row stride and dtype,
    the first holding row 0) for launch_gather_rows_sum_listed: each part's first row, then its first element's
    offset from the first part's."""
    firsts, at = [], 0
    for t in parts:
        firsts.append(at)
        at += t.shape[0]
    size, base = parts[0].element_size(), parts[0].data_ptr()
    offsets = [(t.data_ptr() - base) // size for t in parts]
    return torch.tensor([firsts, offsets], dtype=torch.int64).to(ctx.device, non_blocking=True)


__all__ = ["TILE", "gather_rows_sum", "gather_rows_sum_jobs", "gather_rows_sum_listed", "job_table",
           "launch_gather_rows_sum", "launch_gather_rows_sum_jobs", "launch_gather_rows_sum_listed", "part_table"]
