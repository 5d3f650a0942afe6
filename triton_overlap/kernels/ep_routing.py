"""Expert-parallel routing on the device: this rank's record of what it sends, its packed rows per owner, and the
received rows expanded into expert order, in a few kernels each parallel over blocks of tokens or rows (in place
of some fifty torch operations per dispatch, which kept the call's host busier than its GPU).

Rank ``d`` owns experts ``[d * EL, (d + 1) * EL)``. Tokens go in blocks of ``BT``:

1. ``ep_count`` (a program per block): the block's smallest and largest id, its tokens per owner (a token counts
   once per owner, however many of its choices the owner has) and its pairs per expert (ids clamped into [0, E)).
2. ``ep_record`` (one program): the record (T, smallest id, largest id, tokens per owner, pairs per expert: what the
   ranks exchange) and, per block and owner, the tokens of that owner in the blocks before it.
3. ``ep_pack`` (a program per block and column tile, after the counts are in): each (token, owner) row's place in
   the send order (owner-major, then token order), written as ``positions`` [T, W] (-1: not sent there), the row's
   metadata [rank, token, the owner's local expert of each choice (EL: another owner's), the choices' weights as
   float32 bits] and the row itself.
4. ``ep_expand`` (a program per block of rows and column tile): the received rows in expert order, from the stable
   counting sort of the (row, choice) pairs by local expert (kernels.routing, local expert EL sorting last).

All of it is exact integer arithmetic (no atomics), so the layouts do not depend on the launch or the GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .cached_launch import launch, triton_interprets

INT32_MAX: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def _owners(ids_ptr, b, T, E, EL, K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr, W_PAD: tl.constexpr):
    """Block b's tokens ``t`` [BT], the mask of real (token, choice) slots [BT, K_PAD], the raw ids (int64), the
    ids clamped into [0, E) (int32), each choice's owner, and ``hit`` [BT, W_PAD] (1: the token goes to owner d)."""
    t = b * BT + tl.arange(0, BT)
    j = tl.arange(0, K_PAD)
    ok = (t < T)[:, None] & (j < K)[None, :]
    raw = tl.load(ids_ptr + t.to(tl.int64)[:, None] * K + j[None, :], mask=ok, other=0).to(tl.int64)
    c = tl.minimum(tl.maximum(raw, 0), E - 1).to(tl.int32)
    owner = c // EL
    d = tl.arange(0, W_PAD)
    hit = tl.max(((owner[:, :, None] == d[None, None, :]) & ok[:, :, None]).to(tl.int32), axis=1)
    return t, ok, raw, c, owner, hit


@triton.jit
def _before(h, N: tl.constexpr):
    """``h`` [N, C] -> the sums of the rows before each row (an exclusive prefix sum along axis 0), as a masked sum
    rather than tl.cumsum, whose lowering in Triton 3.6 fails on some of these small layouts (two columns)."""
    i = tl.arange(0, N)
    return tl.sum((i[None, :] < i[:, None]).to(tl.int32)[:, :, None] * h[None, :, :], axis=1)


@triton.jit
def ep_count(ids_ptr, part_ptr, T, E, EL, W, K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr,
             W_PAD: tl.constexpr, E_CHUNK: tl.constexpr):
    """Grid (blocks,): ``part[b]`` = [smallest id, largest id (both clamped into int32), tokens per owner (W),
    pairs per expert (E)] of block b's tokens."""
    b = tl.program_id(0)
    t, ok, raw, c, owner, hit = _owners(ids_ptr, b, T, E, EL, K, K_PAD, BT, W_PAD)
    wide = tl.minimum(tl.maximum(raw, -INT32_MAX - 1), INT32_MAX)
    lo = tl.min(tl.min(tl.where(ok, wide, INT32_MAX), axis=1), axis=0)
    hi = tl.max(tl.max(tl.where(ok, wide, -INT32_MAX - 1), axis=1), axis=0)
    row = part_ptr + b.to(tl.int64) * (2 + W + E)
    tl.store(row, lo.to(tl.int32))
    tl.store(row + 1, hi.to(tl.int32))
    d = tl.arange(0, W_PAD)
    tl.store(row + 2 + d, tl.sum(hit, axis=0), mask=d < W)
    flat = tl.reshape(tl.where(ok, c, -1), (BT * K_PAD,))
    for e0 in range(0, E, E_CHUNK):
        bins = e0 + tl.arange(0, E_CHUNK)
        n = tl.sum((flat[:, None] == bins[None, :]).to(tl.int32), axis=0)
        tl.store(row + 2 + W + bins, n, mask=bins < E)


@triton.jit
def ep_record(part_ptr, record_ptr, base_ptr, NB, T, E, W, W_PAD: tl.constexpr, E_PAD: tl.constexpr,
              SCAN_B: tl.constexpr):
    """Grid (1,): ``record`` = [T, smallest id, largest id (0, 0 without tokens), tokens per owner (W), pairs per
    expert (E)] summed over the blocks, and ``base[b, d]``: owner d's tokens in the blocks before b."""
    width = 2 + W + E
    d = tl.arange(0, W_PAD)
    e = tl.arange(0, E_PAD)
    hits = tl.zeros((W_PAD,), dtype=tl.int32)
    experts = tl.zeros((E_PAD,), dtype=tl.int32)
    lo = tl.full((SCAN_B,), INT32_MAX, tl.int32)
    hi = tl.full((SCAN_B,), -INT32_MAX - 1, tl.int32)
    for b0 in range(0, NB, SCAN_B):
        r = b0 + tl.arange(0, SCAN_B)
        rm = r < NB
        at = part_ptr + r.to(tl.int64) * width
        lo = tl.minimum(lo, tl.load(at, mask=rm, other=INT32_MAX))
        hi = tl.maximum(hi, tl.load(at + 1, mask=rm, other=-INT32_MAX - 1))
        h = tl.load(at[:, None] + 2 + d[None, :], mask=rm[:, None] & (d < W)[None, :], other=0)
        tl.store(base_ptr + r.to(tl.int64)[:, None] * W + d[None, :], _before(h, SCAN_B) + hits[None, :],
                 mask=rm[:, None] & (d < W)[None, :])
        hits += tl.sum(h, axis=0)
        experts += tl.sum(tl.load(at[:, None] + 2 + W + e[None, :], mask=rm[:, None] & (e < E)[None, :], other=0),
                          axis=0)
    tl.store(record_ptr, T)
    tl.store(record_ptr + 1, tl.where(T > 0, tl.min(lo, axis=0), 0))
    tl.store(record_ptr + 2, tl.where(T > 0, tl.max(hi, axis=0), 0))
    tl.store(record_ptr + 3 + d, hits, mask=d < W)
    tl.store(record_ptr + 3 + W + e, experts, mask=e < E)


@triton.jit
def ep_pack(x_ptr, ids_ptr, wbits_ptr, record_ptr, base_ptr, rows_ptr, meta_ptr, pos_ptr, T, H, E, EL, W, rank,
            stride_x, K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr, W_PAD: tl.constexpr,
            BLOCK_H: tl.constexpr):
    """Grid (blocks, column tiles): row ``p`` of the send order for each (token, owner) of block b: ``positions[t,
    d] = p`` (-1: not sent there), the row's columns of this tile copied from x, and (column tile 0) its metadata
    ``meta[p]`` = [rank, t, local expert of each choice (EL: another owner's), each choice's weight bits]."""
    b = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    t, ok, raw, c, owner, hit = _owners(ids_ptr, b, T, E, EL, K, K_PAD, BT, W_PAD)
    d = tl.arange(0, W_PAD)
    dm = d < W
    sent = tl.load(record_ptr + 3 + d, mask=dm, other=0)
    start = tl.sum(tl.where(d[None, :] < d[:, None], sent[None, :], 0), axis=1)  # owner d's first row in the order
    base = tl.load(base_ptr + b.to(tl.int64) * W + d, mask=dm, other=0)
    pos = tl.where(hit > 0, start[None, :] + base[None, :] + _before(hit, BT), -1)
    tok = t < T
    t64 = t.to(tl.int64)
    cols = h0 + tl.arange(0, BLOCK_H)
    cm = cols < H
    xv = tl.load(x_ptr + t64[:, None] * stride_x + cols[None, :], mask=tok[:, None] & cm[None, :])
    MW = 2 + 2 * K
    j = tl.arange(0, K_PAD)
    wb = tl.load(wbits_ptr + t64[:, None] * K + j[None, :], mask=ok, other=0)
    if h0 == 0:
        tl.store(pos_ptr + t64[:, None] * W + d[None, :], pos, mask=tok[:, None] & dm[None, :])
    for dd in range(0, W):
        p = tl.sum(tl.where(d[None, :] == dd, pos, 0), axis=1)
        has = tok & (p >= 0)
        at = tl.where(has, p, 0).to(tl.int64)
        tl.store(rows_ptr + at[:, None] * H + cols[None, :], xv, mask=has[:, None] & cm[None, :])
        if h0 == 0:
            m = meta_ptr + at * MW
            tl.store(m, tl.zeros_like(p) + rank, mask=has)
            tl.store(m + 1, t, mask=has)
            local = tl.where(owner == dd, c - dd * EL, EL)
            tl.store(m[:, None] + 2 + j[None, :], local, mask=has[:, None] & ok)
            tl.store(m[:, None] + 2 + K + j[None, :], wb, mask=has[:, None] & ok)


@triton.jit
def ep_expand(rows_ptr, meta_ptr, order_ptr, tokens_ptr, source_ptr, token_ptr, weights_ptr, R, H, stride_rows,
              K: tl.constexpr, BR: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (row blocks, column tiles): expanded row ``p`` is pair ``q = order[p]``, choice ``q % K`` of received
    row ``q // K``: ``tokens[p]`` that row's columns of this tile, and (column tile 0) ``source[p]``, ``token[p]``
    and ``weights[p]`` (bits) from its metadata."""
    p = tl.program_id(0) * BR + tl.arange(0, BR)
    h0 = tl.program_id(1) * BLOCK_H
    pm = p < R
    q = tl.load(order_ptr + p, mask=pm, other=0).to(tl.int64)
    row = q // K
    cols = h0 + tl.arange(0, BLOCK_H)
    cm = cols < H
    m2 = pm[:, None] & cm[None, :]
    v = tl.load(rows_ptr + row[:, None] * stride_rows + cols[None, :], mask=m2)
    tl.store(tokens_ptr + p.to(tl.int64)[:, None] * H + cols[None, :], v, mask=m2)
    if h0 == 0:
        MW = 2 + 2 * K
        tl.store(source_ptr + p, tl.load(meta_ptr + row * MW, mask=pm, other=0), mask=pm)
        tl.store(token_ptr + p, tl.load(meta_ptr + row * MW + 1, mask=pm, other=0), mask=pm)
        tl.store(weights_ptr + p, tl.load(meta_ptr + row * MW + 2 + K + q % K, mask=pm, other=0), mask=pm)


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


#: (tokens a block, columns a tile) on GPUs
GPU_TILES = (16, 512)


def tiles() -> tuple[int, int]:
    """(tokens a block, columns a tile): smaller in the interpreter, whose cost grows with the tensors."""
    return (8, 64) if triton_interprets() else GPU_TILES


def launch_count(ids, part, record, base, T: int, E: int, W: int) -> None:
    """ep_count then ep_record on the current stream: ``ids`` [T, K] int32/int64 contiguous, ``part`` int32
    [NB, 2 + W + E], ``record`` int32 [3 + W + E], ``base`` int32 [NB, W] (NB = blocks of tiles()[0] tokens)."""
    K = ids.shape[1]
    bt = tiles()[0]
    nb = part.shape[0]
    w_pad, e_pad = _pow2(W), _pow2(E)
    if nb:
        launch(ep_count, (nb,), (ids, part, T, E, E // W, W),
               dict(K=K, K_PAD=_pow2(K), BT=bt, W_PAD=w_pad, E_CHUNK=min(e_pad, 64)), num_warps=4)
    launch(ep_record, (1,), (part, record, base, nb, T, E, W), dict(W_PAD=w_pad, E_PAD=e_pad, SCAN_B=32),
           num_warps=4)


def launch_pack(x, ids, wbits, record, base, rows, meta, positions, E: int, W: int, rank: int) -> None:
    """ep_pack on the current stream (after launch_count of the same ids)."""
    T, H = x.shape
    K = ids.shape[1]
    bt, bh = tiles()
    if T == 0:
        return
    launch(ep_pack, (-(-T // bt), -(-H // bh)),
           (x, ids, wbits, record, base, rows, meta, positions, T, H, E, E // W, W, rank, x.stride(0)),
           dict(K=K, K_PAD=_pow2(K), BT=bt, W_PAD=_pow2(W), BLOCK_H=bh), num_warps=4)


def launch_expand(rows, meta, order, tokens, source, token, wbits, K: int) -> None:
    """ep_expand on the current stream: ``tokens`` [R, H] from ``rows`` (unit column stride) by ``order``."""
    R, H = tokens.shape
    if R == 0:
        return
    br, bh = tiles()
    launch(ep_expand, (-(-R // br), -(-H // bh)), (rows, meta, order, tokens, source, token, wbits, R, H,
                                                    rows.stride(0)),
           dict(K=K, BR=br, BLOCK_H=bh), num_warps=4)


__all__ = ["ep_count", "ep_expand", "ep_pack", "ep_record", "launch_count", "launch_expand", "launch_pack", "tiles"]
