"""The plan of an expert-parallel dispatch's overlapped grouped GEMM (ops.ep_experts), made on the device from the
counts table every rank holds, in one small launch: each layout row's arrival position and the tile table.

Computing them on the host (torch on the CPU, then a copy) took about 0.4 ms a call on the host on Qwen3-30B-A3B's
shapes, on the critical path of a layer whose forward is bound by its host; here the host only sizes the outputs."""
from __future__ import annotations

import triton
import triton.language as tl

from .cached_launch import launch
from .routing import pow2


@triton.jit
def ep_gemm_plan(table_ptr, pos_ptr, tiles_ptr, rank, E, EL, W, BLOCK_M: tl.constexpr, W_PAD: tl.constexpr,
                 EL_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (EL,): program i, for this rank's local expert i (global id rank * EL + i), from the counts table (every
    rank's record, rows ``3 + W + E`` wide: its pairs per expert from word 3 + W): ``pos[p]`` = source rank + 1 for
    each of the expert's layout rows p (the owner's layout: by local expert, then source rank), and its tiles of up
    to BLOCK_M rows, ``tiles[t] = (i, first row, end row)``, after the tiles of the experts before it."""
    i = tl.program_id(0)
    width = 3 + W + E
    s = tl.arange(0, W_PAD)
    j = tl.arange(0, EL_PAD)
    c = tl.load(table_ptr + s[:, None] * width + 3 + W + rank * EL + j[None, :],
                mask=(s < W)[:, None] & (j < EL)[None, :], other=0)  # [sources, experts]: rows
    n = tl.sum(c, axis=0)
    first = tl.sum(tl.where(j < i, n, 0), axis=0)
    ntiles = (n + BLOCK_M - 1) // BLOCK_M
    t0 = tl.sum(tl.where(j < i, ntiles, 0), axis=0)
    mine = tl.sum(tl.where(j[None, :] == i, c, 0), axis=1)  # [sources]: expert i's rows from each
    ni = tl.sum(mine, axis=0)
    ends = tl.sum(tl.where(s[None, :] <= s[:, None], mine[None, :], 0), axis=1)  # each source's run's end
    for r0 in range(0, ni, BLOCK):
        rr = r0 + tl.arange(0, BLOCK)
        src = tl.sum((ends[None, :] <= rr[:, None]).to(tl.int32), axis=1)  # (padded sources end at ni)
        tl.store(pos_ptr + first + rr, src + 1, mask=rr < ni)
    ti = tl.sum(tl.where(j == i, ntiles, 0), axis=0)
    for q0 in range(0, ti, BLOCK):
        q = q0 + tl.arange(0, BLOCK)
        qm = q < ti
        start = first + q * BLOCK_M
        at = tiles_ptr + (t0 + q) * 3
        tl.store(at, tl.zeros_like(q) + i, mask=qm)
        tl.store(at + 1, start, mask=qm)
        tl.store(at + 2, tl.minimum(start + BLOCK_M, first + ni), mask=qm)


def launch_gemm_plan(table, pos, tiles, rank: int, E: int, W: int, block_m: int) -> None:
    """ep_gemm_plan on the current stream: ``table`` int32 [W, 3 + W + E] the counts table on the device, ``pos``
    int32 [R] and ``tiles`` int32 [tiles, 3] sized by the caller (ops.ep_experts.experts_plan)."""
    EL = E // W
    launch(ep_gemm_plan, (EL,), (table, pos, tiles, rank, E, EL, W),
           dict(BLOCK_M=block_m, W_PAD=pow2(W), EL_PAD=pow2(EL), BLOCK=256), num_warps=4)


__all__ = ["ep_gemm_plan", "launch_gemm_plan"]
