"""GEMM + AllReduce in one kernel: ``out = sum over ranks of a_r @ w_r (+ bias)``, the row-parallel GEMM of a layer
without sequence parallelism.

A persistent kernel (at most one program per compute unit) walks the output tiles ``pid, pid + P, ...`` twice.
First pass: each tile's partial product is computed in float32 (rank 0 adds the bias), rounded to the output dtype
and stored into slot [half][rank] of every rank, this one included (its own part is read back from there), and
the tile's flag is raised in every rank, so a tile travels while the program computes its next one. Second pass:
each tile waits for its flag from every peer and sums the W slots in float32, in rank order, so every rank gets
the same bits. No separate GEMM output goes through memory and there is one launch, where ``matmul`` + AllReduce
take two.

The workspace protocol is the two-shot AllReduce's flag protocol (kernels.all_reduce, kernels.slot_exchange): two
halves of W slots, the call number counted on the device (graph-safe), flags that carry it and only grow, and
every program's header into every peer before its first flag, compared on a tile's first wait per peer (a rank
whose peer's call differs records ERR_MISMATCH). Every program stores all its tiles before it waits on a peer's:
with all programs resident no program waits for one that cannot run.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .slot_exchange import count_call, notify_block, publish_header, push, sum_parts


@triton.jit
def _tile_product(a_ptr, b_ptr, rows, cols, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT_F32: tl.constexpr, SWAP_AB: tl.constexpr):
    """A[rows, :] @ B[:, cols] in float32 (rows and columns outside the matrices read as zero). SWAP_AB: computed as
    (B[:, cols].T @ A[rows, :].T).T, B's columns the MMA's tall side, for tiles of a few rows (the weight streams
    through full-height MMAs: docs/decisions.md, Decode's local products)."""
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    if SWAP_AB:
        a_ptrs = a_ptr + rows[None, :] * stride_am + offs_k[:, None] * stride_ak  # A.T's [BLOCK_K, BLOCK_M]
        b_ptrs = b_ptr + offs_k[None, :] * stride_bk + cols[:, None] * stride_bn  # B.T's [BLOCK_N, BLOCK_K]
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if SWAP_AB and EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
        elif SWAP_AB:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:  # host backend: Triton's interpreter multiplies bf16 operands as raw bits
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SWAP_AB:
            acc_t = tl.dot(b, a, acc_t)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SWAP_AB:
        acc = tl.trans(acc_t)
    return acc


@triton.jit
def gemm_all_reduce(a_ptr, b_ptr, bias_ptr, out_ptr, data_ptrs, flag_ptrs, header_ptrs, local_data, local_flags,
                    local_header, state_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_bias, cap,
                    max_tiles, waiter, world, fingerprint,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_W: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, CLOCK: tl.constexpr,
                    SWAP_AB: tl.constexpr = False):
    """``waiter``: kernels.signal.waiter's (error word, budget, rank, op)."""
    err_ptr, budget, rank, op = waiter
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    e = tl.load(state_ptr) + 1  # this call's number, the same on every rank
    half = e & 1
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    publish_header(header_ptrs, e, half, rank, world, op, fingerprint, M * N, BLOCK_W)
    slot = (half * world + rank) * cap
    # this rank's partial tiles, into every rank's slot [half][rank]; then the tile's flag in every rank
    for t in range(pid, tiles, programs):
        rows = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _tile_product(a_ptr, b_ptr, rows, cols, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_F32, SWAP_AB)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        part = acc.to(out_ptr.dtype.element_ty)
        offs = rows[:, None] * N + cols[None, :]
        inside = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(local_data + slot + offs, part, mask=inside)  # this rank's part, read back by the second pass
        push(part, data_ptrs, offs, inside, cap, half, rank, world)
        notify_block(flag_ptrs, e, rank, t, max_tiles, world, BLOCK_W)
    # each tile: every peer's flag, then the sum of the W slots in rank order
    for t in range(pid, tiles, programs):
        rows = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs = rows[:, None] * N + cols[None, :]
        inside = (rows < M)[:, None] & (cols < N)[None, :]
        acc = sum_parts(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), local_data + slot, local_data, local_flags,
                        local_header, t, offs, inside, cap, max_tiles, e, half, waiter, world, fingerprint, CLOCK)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=inside)
    count_call(state_ptr, e)
