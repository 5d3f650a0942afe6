"""Flash-attention forward that folds in remote K/V chunks the moment they land.

One program per (block of BLOCK_M local queries, batch x query head). It runs
over the K/V of every rank in arrival order, its own first (read in place),
then each peer's from the workspace, chunk by chunk: one wait on a chunk's
flag, then a loop over the chunk's key blocks.

Causal masking uses global positions (zigzag: local index i of rank s sits at
s*C + i for i < C, and at (2W-1-s)*C + i - C after). For each half of a
source's keys the kernel works out, from the first and last query position of
its block, which keys every row sees (an unmasked loop that Triton can
pipeline), which keys some rows see (a masked loop), and which none sees
(skipped: neither waited for nor read). Program (0, 0) still waits for every
flag before the kernel ends, so the caller can reset them.

Packed documents (VARLEN): rank r holds chunks r and 2W-1-r of every
document, the documents one after another, so every rank's shard has the same
document boundaries (``cu_ptr``, local offsets). A program then takes its
(document, first query row) from a table (``seg_ptr``), reads only that
document's keys from each source, and positions are within the document:
the same causal rules apply document by document.

The running max, sum and accumulator stay in float32; lse is in natural log.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..plan import cdiv
from .attention_device import (key_span, kv_base, piece, pieces, pos_span, segment, unmasked_end, wait_every_chunk,
                               wait_kv, zigzag_pos)
from .cached_launch import launch
from .signal import waiter


@triton.jit
def _fold(acc, m_i, l_i, q, q_pos, kb, vb, s_s, lo, hi, src, world, C, qk_scale,
          MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
          DOT_F32: tl.constexpr):
    """Online softmax over key rows [lo, hi). Unmasked: every row sees every key, and (hi - lo) is a
    multiple of BLOCK_N. Masked: bounds and, if causal, positions are checked per element."""
    offs_d = tl.arange(0, HEAD_D)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            n_ok = offs_n < hi
            k = tl.load(kb + offs_n[None, :] * s_s + offs_d[:, None], mask=n_ok[None, :], other=0.0)
            v = tl.load(vb + offs_n[:, None] * s_s + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k = tl.load(kb + offs_n[None, :] * s_s + offs_d[:, None])
            v = tl.load(vb + offs_n[:, None] * s_s + offs_d[None, :])
        if DOT_F32:  # host backend: Triton's interpreter multiplies bf16 operands as raw bits
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k)
        if MASKED:
            keep = n_ok[None, :]
            if CAUSAL:
                keep = keep & (zigzag_pos(offs_n, src, world, C)[None, :] <= q_pos[:, None])
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet stay at zero
            p = tl.exp2(s - m_use[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            m_use = m_new
            p = tl.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def cp_attention_fwd(
    q_ptr, k_ptr, v_ptr, kws_ptr, vws_ptr, o_ptr, lse_ptr, flags_ptr, waiter, world,
    S_LOCAL, HQ, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK, sm_scale,
    sq_b, sq_s, sq_h, sk_b, sk_h, sw_b, sw_h, s_s, so_b, so_s, so_h, seg_ptr, cu_ptr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
    CLOCK: tl.constexpr, DOT_F32: tl.constexpr, VARLEN: tl.constexpr,
):
    """``s_s``: the sequence stride of k, v and the workspaces (the same: all are [.., S, Hkv, D] contiguous);
    ``waiter``: kernels.signal.waiter's (error word, budget, rank, op)."""
    rank = waiter[2]
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP  # grouped-query attention: K/V move and are read at Hkv heads
    seg0, S_DOC, m0 = segment(pid_m, seg_ptr, cu_ptr, S_LOCAL, BLOCK_M, VARLEN)
    C = S_DOC // 2

    offs_m = m0 + tl.arange(0, BLOCK_M)  # rows within the document
    offs_d = tl.arange(0, HEAD_D)
    m_ok = offs_m < S_DOC
    rows = seg0 + offs_m  # rows within the shard
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_s + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = zigzag_pos(offs_m, rank, world, C)
    q_first, q_last = pos_span(q_pos, m_ok)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_D), tl.float32)

    for step in range(0, world):
        src = (rank - step + world) % world  # arrival order: our own K/V, then peers as they push to us
        kb = kv_base(k_ptr, kws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, s_s, sw_h) + seg0 * s_s
        vb = kv_base(v_ptr, vws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, s_s, sw_h) + seg0 * s_s
        # our own keys in one piece per half; a peer's chunk by chunk, in the order they arrive
        for hh in range(0, 2):
            need, full = key_span(src, world, C, hh, q_first, q_last, CAUSAL)
            h0 = hh * C
            P, j0, j1 = pieces(src, rank, seg0, h0, h0 + need, M_PER_CHUNK)
            for j in range(j0, j1):
                c0, c1 = piece(j, P, seg0, h0, h0 + need)
                wait_kv(flags_ptr, waiter, src, seg0 + c0, seg0 + c1, M_PER_CHUNK, CHUNKS_PER_RANK, CLOCK)
                f1 = unmasked_end(c0, c1, h0 + full, BLOCK_N)
                acc, m_i, l_i = _fold(acc, m_i, l_i, q, q_pos, kb, vb, s_s, c0, f1, src, world, C, qk_scale,
                                      False, CAUSAL, BLOCK_N, HEAD_D, DOT_F32)
                acc, m_i, l_i = _fold(acc, m_i, l_i, q, q_pos, kb, vb, s_s, f1, c1, src, world, C, qk_scale,
                                      True, CAUSAL, BLOCK_N, HEAD_D, DOT_F32)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(o_ptr + b * so_b + h * so_h + rows[:, None] * so_s + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None])
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # back from base 2 to natural log
    tl.store(lse_ptr + bh * S_LOCAL + rows, lse, mask=m_ok)
    if CAUSAL:
        if (pid_m == 0) & (bh == 0):
            wait_every_chunk(flags_ptr, waiter, world, CHUNKS_PER_RANK, CLOCK)


# ---------------------------------------------------------------------------------------------------- launcher
@dataclass(frozen=True)
class Blocks:
    """Tile sizes and launch parameters of one attention kernel (``block_m`` query rows, ``block_n`` key rows).
    ``warp_specialized``: for the forward, run kernels.attention_hopper's kernel where it can (its ``usable``), with
    ``num_stages`` K and V stages and ``warp_groups`` compute warpgroups of 64 query rows each (its tile, in place
    of ``block_m`` rows on ``num_warps`` warps); for the dK/dV kernel, kernels.attention_bwd_hopper's single
    backward kernel (its own tiles) where it can. Elsewhere this module's kernels run with these tiles."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialized: bool = False
    warp_groups: int = 2


@dataclass(frozen=True)
class Documents:
    """Packed documents' tables for one shard layout and block size (``segment_table``)."""
    segments: torch.Tensor  # int32 [n, 2]: (document, first row) of every block, longest documents first
    bounds: torch.Tensor  # int32: the documents' boundaries within the shard
    blocks: int  # n


def segment_table(local_cu, block: int, device) -> Documents:
    """For packed documents with shard boundaries ``local_cu``: (document, first row) of every block of ``block``
    rows, the longest documents first (so that the longest programs start first)."""
    docs = sorted(range(len(local_cu) - 1), key=lambda d: -(local_cu[d + 1] - local_cu[d]))
    rows = [(d, r0) for d in docs for r0 in range(0, local_cu[d + 1] - local_cu[d], block)]
    return Documents(torch.tensor(rows or [(0, 0)], dtype=torch.int32, device=device),
                     torch.tensor(local_cu, dtype=torch.int32, device=device), len(rows))


def sequence_grid(S, block, docs: Documents | None, none: torch.Tensor):
    """(programs along the sequence, table, boundaries): whole-shard blocks, or the packed documents' blocks
    (``none``: any int32 tensor, passed where VARLEN is off and nothing reads it)."""
    if docs is None:
        return cdiv(S, block), none, none
    return docs.blocks, docs.segments, docs.bounds


def persistent_fwd(ctx, q, k, v, kw, vw, docs: Documents | None, blocks: Blocks, out) -> bool:
    """Whether launch_fwd runs the Hopper kernel, whose ``ctx.num_compute_units()`` programs take tiles in turn;
    the other kernel launches a program per query block and head, which can hold every SM."""
    if not blocks.warp_specialized:
        return False
    from . import attention_hopper
    return attention_hopper.usable(ctx, q, k, v, kw, vw, docs, blocks, out)


def launch_fwd(ctx, q, k, v, kw, vw, out, lse, flags, m_per_chunk, chunks_per_rank, scale, causal, blocks: Blocks,
               rank=None, world=None, docs: Documents | None = None, op: int = 0, tiles=None) -> None:
    """The forward kernel on contiguous q [B, S, Hq, D], k/v [B, S, Hkv, D], workspaces [B, W*S, Hkv, D], as
    ``rank`` of ``world`` (default: the Context's). ``docs``: packed documents' tables (B = 1), else None.
    ``tiles``: the Hopper kernel's tile counter (kernels.attention_hopper.launch_fwd_ws), for a caller whose
    launches never run at the same time as each other; None: the counter of the current stream."""
    B, S, Hq, D = q.shape
    if not (k.stride(1) == kw.stride(1) == v.stride(1) == vw.stride(1)):
        raise ValueError("cp_attention: k, v and the workspaces must share a sequence stride")
    n, seg, cu = sequence_grid(S, blocks.block_m, docs, flags)
    if n == 0:
        return
    rank = ctx.rank if rank is None else rank
    world = ctx.world_size if world is None else world
    if persistent_fwd(ctx, q, k, v, kw, vw, docs, blocks, out):
        from . import attention_hopper
        attention_hopper.launch_fwd_ws(ctx, q, k, v, kw, vw, out, lse, flags, m_per_chunk, chunks_per_rank, scale,
                                       causal, blocks, rank, world, op, tiles)
        return
    launch(cp_attention_fwd, (n, B * Hq), (
        q, k, v, kw, vw, out, lse, flags, waiter(ctx, op, rank), world,
        S, Hq, Hq // k.shape[2], m_per_chunk, chunks_per_rank, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(2), kw.stride(0), kw.stride(2), k.stride(1),
        out.stride(0), out.stride(1), out.stride(2), seg, cu,
    ), dict(CAUSAL=causal, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, HEAD_D=D, CLOCK=ctx.clock,
            DOT_F32=ctx.interpreted, VARLEN=docs is not None), num_warps=blocks.num_warps,
        num_stages=blocks.num_stages)
    ctx.after_launch()
