"""Expert-parallel routing on the device: this rank's record of what it sends, its packed rows per owner with each
choice's row in the owner's expert-sorted layout, and the received rows expanded into that layout, in a few kernels
each parallel over blocks of tokens or rows (in place of some fifty torch operations and a sort per dispatch, which
kept the call's host busier than its GPU).

Rank ``d`` owns experts ``[d * EL, (d + 1) * EL)``. Tokens go in blocks of ``BT``:

1. ``ep_count`` (a program per block): the block's smallest and largest id, its tokens per owner (a token counts
   once per owner, however many of its choices the owner has) and its pairs per expert (ids clamped into [0, E));
   then kernels.routing's ``scan_counts`` gives each block's first place among this rank's pairs of each expert.
2. ``ep_record`` (one program): the record (T, smallest id, largest id, tokens per owner, then the pairs per expert
   that scan_counts wrote as its totals: what the ranks exchange) and, per block and owner, the owner's tokens in
   the blocks before it. With a few blocks (ONE_LAUNCH_BLOCKS: decode) and a ticket from the caller, 1 and 2 are
   one launch, ``ep_count_record``, whose last program out does the scan and the record.
3. ``ep_dest`` (one program, once every rank's record is in the counts table): where this rank's pairs of expert e
   start in its owner's layout (the owner's experts before e, then e's pairs from the ranks before this one), and
   this rank's own experts' offsets in its layout.
4. ``ep_pack`` (a program per block and column tile): each (token, owner) row's place in the send order (owner-major,
   then token order), written as ``positions`` [T, W] (-1: not sent there), the row's metadata [rank, token, the
   owner's layout row of each choice (-1: another owner's), the choices' weights as float32 bits, for fp8 rows the
   token's scales' bits] and the row (fp8 rows as their bytes), into a staging buffer, or (PUSH) straight into
   each owner's receive buffers at this rank's block there, from the counts table on the device.
5. ``ep_expand`` (a program per block of received rows and column tile): each received row copied to the layout
   rows its metadata names, with what a combine reads back.

The layout orders an owner's rows by (local expert, source rank, token, choice). All of it is exact integer
arithmetic (the one atomic, ep_count_record's ticket, only picks the program that finishes), so the layouts do not
depend on the launch or the GPU.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .cached_launch import launch, triton_interprets
from .routing import pow2, scan_counts
from .signal import error_code

INT32_MAX: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def token_owners(ids_ptr, b, T, E, EL, K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr, W_PAD: tl.constexpr):
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
def rows_before(h, N: tl.constexpr):
    """``h`` [N, C] -> the sums of the rows before each row (an exclusive prefix sum along axis 0), as a masked sum
    rather than tl.cumsum, whose lowering in Triton 3.6 fails on some of these small layouts (two columns)."""
    i = tl.arange(0, N)
    return tl.sum((i[None, :] < i[:, None]).to(tl.int32)[:, :, None] * h[None, :, :], axis=1)


@triton.jit
def pair_places(ids_ptr, base_e_ptr, b, c, ok, T, E, K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr):
    """[BT, K_PAD]: each (token, choice) pair's place among this rank's pairs of its expert ``c`` (in token, then
    choice order): the block's first place (``base_e`` from scan_counts), plus the block's pairs of the same expert
    before it, each pair compared with the block's pairs a chunk of 32 at a time (the chunks' ids loaded anew, all
    independent loads: no chain of dependent ones, and no [pairs, pairs] tile held whole)."""
    N: tl.constexpr = BT * K_PAD
    CH: tl.constexpr = 32 if N > 32 else N
    flat = tl.reshape(tl.where(ok, c, -1), (N,))
    q = tl.arange(0, N)
    within = tl.zeros((N,), dtype=tl.int32)
    for q0 in tl.static_range(0, N, CH):
        r = q0 + tl.arange(0, CH)
        t = b * BT + r // K_PAD
        j = r % K_PAD
        m = (t < T) & (j < K)
        cv = tl.load(ids_ptr + t.to(tl.int64) * K + j, mask=m, other=0).to(tl.int64)
        cv = tl.where(m, tl.minimum(tl.maximum(cv, 0), E - 1).to(tl.int32), -2)
        within += tl.sum(((flat[:, None] == cv[None, :]) & (r[None, :] < q[:, None])).to(tl.int32), axis=1)
    return tl.load(base_e_ptr + b.to(tl.int64) * E + c, mask=ok, other=0) + tl.reshape(within, (BT, K_PAD))


@triton.jit
def ep_count(ids_ptr, part_ptr, hist_ptr, T, E, EL, W, K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr,
             W_PAD: tl.constexpr, E_CHUNK: tl.constexpr):
    """Grid (blocks,): ``part[b]`` = [smallest id, largest id (both clamped into int32), tokens per owner (W)] of
    block b's tokens, ``hist[b, e]`` its pairs of expert e."""
    count_block(ids_ptr, part_ptr, hist_ptr, tl.program_id(0), T, E, EL, W, K, K_PAD, BT, W_PAD, E_CHUNK)


@triton.jit
def count_block(ids_ptr, part_ptr, hist_ptr, b, T, E, EL, W, K: tl.constexpr, K_PAD: tl.constexpr,
                BT: tl.constexpr, W_PAD: tl.constexpr, E_CHUNK: tl.constexpr):
    t, ok, raw, c, owner, hit = token_owners(ids_ptr, b, T, E, EL, K, K_PAD, BT, W_PAD)
    wide = tl.minimum(tl.maximum(raw, -INT32_MAX - 1), INT32_MAX)
    lo = tl.min(tl.min(tl.where(ok, wide, INT32_MAX), axis=1), axis=0)
    hi = tl.max(tl.max(tl.where(ok, wide, -INT32_MAX - 1), axis=1), axis=0)
    row = part_ptr + b.to(tl.int64) * (2 + W)
    tl.store(row, lo.to(tl.int32))
    tl.store(row + 1, hi.to(tl.int32))
    d = tl.arange(0, W_PAD)
    tl.store(row + 2 + d, tl.sum(hit, axis=0), mask=d < W)
    flat = tl.reshape(tl.where(ok, c, -1), (BT * K_PAD,))
    for e0 in range(0, E, E_CHUNK):
        bins = e0 + tl.arange(0, E_CHUNK)
        n = tl.sum((flat[:, None] == bins[None, :]).to(tl.int32), axis=0)
        tl.store(hist_ptr + b.to(tl.int64) * E + bins, n, mask=bins < E)


@triton.jit
def ep_record(part_ptr, record_ptr, base_ptr, NB, T, W, W_PAD: tl.constexpr, SCAN_B: tl.constexpr):
    """Grid (1,): ``record``'s first 3 + W words = [T, smallest id, largest id (0, 0 without tokens), tokens per
    owner (W)] over the blocks (scan_counts writes the pairs per expert after them), and ``base[b, d]``: owner d's
    tokens in the blocks before b."""
    record_blocks(part_ptr, record_ptr, base_ptr, NB, T, W, W_PAD, SCAN_B)


@triton.jit
def record_blocks(part_ptr, record_ptr, base_ptr, NB, T, W, W_PAD: tl.constexpr, SCAN_B: tl.constexpr):
    width = 2 + W
    d = tl.arange(0, W_PAD)
    hits = tl.zeros((W_PAD,), dtype=tl.int32)
    lo = tl.full((SCAN_B,), INT32_MAX, tl.int32)
    hi = tl.full((SCAN_B,), -INT32_MAX - 1, tl.int32)
    for b0 in range(0, NB, SCAN_B):
        r = b0 + tl.arange(0, SCAN_B)
        rm = r < NB
        at = part_ptr + r.to(tl.int64) * width
        lo = tl.minimum(lo, tl.load(at, mask=rm, other=INT32_MAX))
        hi = tl.maximum(hi, tl.load(at + 1, mask=rm, other=-INT32_MAX - 1))
        h = tl.load(at[:, None] + 2 + d[None, :], mask=rm[:, None] & (d < W)[None, :], other=0)
        tl.store(base_ptr + r.to(tl.int64)[:, None] * W + d[None, :], rows_before(h, SCAN_B) + hits[None, :],
                 mask=rm[:, None] & (d < W)[None, :])
        hits += tl.sum(h, axis=0)
    tl.store(record_ptr, T)
    tl.store(record_ptr + 1, tl.where(T > 0, tl.min(lo, axis=0), 0))
    tl.store(record_ptr + 2, tl.where(T > 0, tl.max(hi, axis=0), 0))
    tl.store(record_ptr + 3 + d, hits, mask=d < W)


@triton.jit
def ep_count_record(ids_ptr, part_ptr, hist_ptr, base_e_ptr, record_ptr, base_ptr, ticket_ptr, T, E, EL, W, NB,
                    K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr, W_PAD: tl.constexpr,
                    E_CHUNK: tl.constexpr, NB_PAD: tl.constexpr, E_TILE: tl.constexpr):
    """Grid (NB,), NB <= NB_PAD: ep_count's block, then the last program out does scan_counts' and ep_record's work
    for every block: one launch in place of three, for decode's few blocks. ``ticket`` int32 [1], zero before and
    after: each program counts itself out (acquire-release at GPU scope, so every program's part and hist rows are
    visible to the last one) and the last one sets it back to zero."""
    count_block(ids_ptr, part_ptr, hist_ptr, tl.program_id(0), T, E, EL, W, K, K_PAD, BT, W_PAD, E_CHUNK)
    tl.debug_barrier()
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == NB - 1:
        tl.store(ticket_ptr, 0)
        r = tl.arange(0, NB_PAD)
        for e0 in range(0, E, E_TILE):
            bins = e0 + tl.arange(0, E_TILE)
            m = (r < NB)[:, None] & (bins < E)[None, :]
            at = r.to(tl.int64)[:, None] * E + bins[None, :]
            h = tl.load(hist_ptr + at, mask=m, other=0)
            tl.store(base_e_ptr + at, tl.cumsum(h, axis=0) - h, mask=m)
            tl.store(record_ptr + 3 + W + bins, tl.sum(h, axis=0), mask=bins < E)
        record_blocks(part_ptr, record_ptr, base_ptr, NB, T, W, W_PAD, NB_PAD)


@triton.jit
def ep_dest(table_ptr, dest_ptr, offsets_ptr, counts_ptr, rank, E, EL, W, W_PAD: tl.constexpr, E_PAD: tl.constexpr,
            E_CHUNK: tl.constexpr):
    """Grid (1,): from the counts table (every rank's record, rows ``3 + W + E`` wide), ``dest[e]``: the first row
    of this rank's pairs of expert e in its owner's layout (the owner's experts before e, then e's pairs from the
    ranks before this one), ``offsets[i]`` (EL + 1): this rank's expert i's first row in its own layout, and
    ``counts[i]`` (EL): its rows."""
    width = 3 + W + E
    s = tl.arange(0, W_PAD)
    e = tl.arange(0, E_PAD)
    em = e < E
    x = tl.load(table_ptr + s[:, None] * width + 3 + W + e[None, :], mask=(s < W)[:, None] & em[None, :], other=0)
    before = tl.sum(tl.where((s < rank)[:, None], x, 0), axis=0)  # e's pairs from the ranks before this one
    ahead = tl.zeros((E_PAD,), dtype=tl.int32)  # the owner's experts before e: their pairs from every rank
    for e0 in range(0, E, E_CHUNK):
        f = e0 + tl.arange(0, E_CHUNK)
        tot = tl.sum(tl.load(table_ptr + s[:, None] * width + 3 + W + f[None, :],
                             mask=(s < W)[:, None] & (f < E)[None, :], other=0), axis=0)
        same = (f[None, :] < e[:, None]) & ((f // EL)[None, :] == (e // EL)[:, None])
        ahead += tl.sum(tl.where(same, tot[None, :], 0), axis=1)
    tl.store(dest_ptr + e, ahead + before, mask=em)
    mine = (e >= rank * EL) & (e < (rank + 1) * EL)
    tl.store(offsets_ptr + e - rank * EL, ahead, mask=mine)
    tl.store(counts_ptr + e - rank * EL, tl.sum(x, axis=0), mask=mine)
    total = tl.sum(tl.where(mine[None, :] & (s < W)[:, None], x, 0), axis=1)
    tl.store(offsets_ptr + EL, tl.sum(total, axis=0))


@triton.jit
def ep_pack(x_ptr, ids_ptr, wbits_ptr, sbits_ptr, record_ptr, base_ptr, base_e_ptr, dest_ptr, rows_ptr, meta_ptr,
            pos_ptr, rows_ptrs, meta_ptrs, gather_ptrs, table_ptr, err_ptr, T, H, E, EL, W, rank, stride_x, G, cap,
            K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr, W_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
            G_PAD: tl.constexpr, PUSH: tl.constexpr, GATHER: tl.constexpr):
    """Grid (blocks, column tiles): row ``p`` of the send order for each (token, owner) of block b: the row's columns
    of this tile copied from x, and (column tile 0) ``positions[t, d] = p`` (-1: not sent there) and ``meta[p]`` =
    [rank, t, each choice's row in the owner's layout (-1: another owner's), each choice's weight bits, then (G_PAD
    > 0) the token's G scales' bits from ``sbits`` [T, G]]. A pair's
    layout row: ``dest[e]`` (ep_dest) + the block's first place among this rank's pairs of e (``base_e``) + the
    pairs of e before it in the block.

    PUSH: the row and its metadata go straight into owner d's receive buffers (``rows_ptrs[d]``, ``meta_ptrs[d]``:
    every rank's, ``cap`` rows each) at this rank's block there (the rows of the ranks before it, from the counts
    table, first), in place of ``rows`` and ``meta``; where any rank's ids leave [0, E) or any owner would receive
    more than ``cap`` rows, nothing is stored (every rank decides the same from the same table), nor once the error
    word ``err`` holds a fault (the ranks' calls may disagree).

    GATHER: also, for each choice, the row its token takes in the owner's receive buffer, stored at the choice's
    layout row of owner d's gather index (``gather_ptrs[d]``, int32): what lets the owner's grouped GEMM read its
    rows in layout order straight from the receive buffer, before any expansion (ops.expert_parallel). Under PUSH it
    moves with the rows (nothing where nothing moves); else the owners' indexes must hold their layouts' rows."""
    b = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    t, ok, raw, c, owner, hit = token_owners(ids_ptr, b, T, E, EL, K, K_PAD, BT, W_PAD)
    d = tl.arange(0, W_PAD)
    dm = d < W
    sent = tl.load(record_ptr + 3 + d, mask=dm, other=0)
    start = tl.sum(tl.where(d[None, :] < d[:, None], sent[None, :], 0), axis=1)  # owner d's first row in the order
    go = tl.full((BT,), 1, tl.int1)  # (PUSH: whether the rows move; one value for every token)
    shift = tl.zeros((W_PAD,), dtype=tl.int32)  # (PUSH: a send-order row's place at its owner, less the row)
    if PUSH or GATHER:  # sources along axis 0, owners along axis 1
        width = 3 + W + E
        n = tl.load(table_ptr + d * width, mask=dm, other=0)
        lo = tl.load(table_ptr + d * width + 1, mask=dm, other=0)
        hi = tl.load(table_ptr + d * width + 2, mask=dm, other=0)
        rows = tl.load(table_ptr + d[:, None] * width + 3 + d[None, :], mask=dm[:, None] & dm[None, :], other=0)
        bad = tl.sum(((n > 0) & ((lo < 0) | (hi >= E))).to(tl.int32), axis=0)
        over = tl.sum((tl.sum(rows, axis=0) > cap).to(tl.int32), axis=0)
        if PUSH:
            go = go & (bad == 0) & (over == 0) & (error_code(err_ptr) == 0)
        shift = tl.sum(tl.where((d < rank)[:, None], rows, 0), axis=0) - start  # send-order row -> owner's row
    base = tl.load(base_ptr + b.to(tl.int64) * W + d, mask=dm, other=0)
    pos = tl.where(hit > 0, start[None, :] + base[None, :] + rows_before(hit, BT), -1)
    tok = t < T
    t64 = t.to(tl.int64)
    if h0 == 0:
        tl.store(pos_ptr + t64[:, None] * W + d[None, :], pos, mask=tok[:, None] & dm[None, :])
        j = tl.arange(0, K_PAD)
        row_of = tl.load(dest_ptr + c, mask=ok, other=0) + pair_places(ids_ptr, base_e_ptr, b, c, ok, T, E, K, K_PAD,
                                                                         BT)
        wb = tl.load(wbits_ptr + t64[:, None] * K + j[None, :], mask=ok, other=0)
        MW = 2 + 2 * K + G
        if G_PAD > 0:
            gi = tl.arange(0, G_PAD)
            gm = tok[:, None] & (gi < G)[None, :]
            sb = tl.load(sbits_ptr + t64[:, None] * G + gi[None, :], mask=gm, other=0)
        for dd in range(0, W):
            p = tl.sum(tl.where(d[None, :] == dd, pos, 0), axis=1)
            has = tok & (p >= 0) & go
            there = p + tl.sum(tl.where(d == dd, shift, 0), axis=0)  # the row in the owner's receive buffer
            q = tl.where(has, there if PUSH else p, 0).to(tl.int64)  # where the row is stored
            if GATHER:
                g = tl.load(gather_ptrs + dd).to(tl.pointer_type(tl.int32))
                tl.store(g + tl.where(owner == dd, row_of, 0), there[:, None] + tl.zeros_like(row_of),
                         mask=has[:, None] & ok & (owner == dd))
            if PUSH:
                m = tl.load(meta_ptrs + dd).to(tl.pointer_type(tl.int32)) + q * MW
            else:
                m = meta_ptr + q * MW
            tl.store(m, tl.zeros_like(p) + rank, mask=has)
            tl.store(m + 1, t, mask=has)
            tl.store(m[:, None] + 2 + j[None, :], tl.where(owner == dd, row_of, -1), mask=has[:, None] & ok)
            tl.store(m[:, None] + 2 + K + j[None, :], wb, mask=has[:, None] & ok)
            if G_PAD > 0:
                tl.store(m[:, None] + 2 + 2 * K + gi[None, :], sb, mask=has[:, None] & gm)
    cols = h0 + tl.arange(0, BLOCK_H)
    cm = cols < H
    xv = tl.load(x_ptr + t64[:, None] * stride_x + cols[None, :], mask=tok[:, None] & cm[None, :])
    for dd in range(0, W):
        p = tl.sum(tl.where(d[None, :] == dd, pos, 0), axis=1)
        has = tok & (p >= 0) & go
        q = tl.where(has, p + tl.sum(tl.where(d == dd, shift, 0), axis=0) if PUSH else p, 0).to(tl.int64)
        if PUSH:
            to = tl.multiple_of(tl.load(rows_ptrs + dd).to(tl.pointer_type(xv.dtype)), 16)
        else:
            to = rows_ptr
        tl.store(to + q[:, None] * H + cols[None, :], xv, mask=has[:, None] & cm[None, :])


@triton.jit
def ep_expand(rows_ptr, meta_ptr, tokens_ptr, source_ptr, token_ptr, weights_ptr, slots_ptr, slot_w_ptr, scales_ptr,
              U, R, H, stride_rows, G, K: tl.constexpr, BU: tl.constexpr, BLOCK_H: tl.constexpr,
              G_PAD: tl.constexpr):
    """Grid (blocks of received rows, column tiles): received row u's columns of this tile to ``tokens[p]`` for each
    choice's layout row p in its metadata (rows outside [0, R): none, as where a wait gave up and the metadata is
    stale), and (column tile 0) ``source[p]``, ``token[p]``, ``weights[p]`` (bits), ``slots[u, j] = p`` (-1: none)
    and ``slot_w[u, j]`` (bits), and (G_PAD > 0) ``scales[p]`` [G] (bits) from the metadata's last G words."""
    u = tl.program_id(0) * BU + tl.arange(0, BU)
    h0 = tl.program_id(1) * BLOCK_H
    um = u < U
    u64 = u.to(tl.int64)
    cols = h0 + tl.arange(0, BLOCK_H)
    cm = cols < H
    v = tl.load(rows_ptr + u64[:, None] * stride_rows + cols[None, :], mask=um[:, None] & cm[None, :])
    MW = 2 + 2 * K + G
    m = meta_ptr + u64 * MW
    for j in tl.static_range(K):
        p = tl.load(m + 2 + j, mask=um, other=-1)
        ok = um & (p >= 0) & (p < R)
        at = tl.where(ok, p, 0).to(tl.int64)
        tl.store(tokens_ptr + at[:, None] * H + cols[None, :], v, mask=ok[:, None] & cm[None, :])
        if h0 == 0:
            w = tl.load(m + 2 + K + j, mask=um, other=0)
            tl.store(source_ptr + at, tl.load(m, mask=ok, other=0), mask=ok)
            tl.store(token_ptr + at, tl.load(m + 1, mask=ok, other=0), mask=ok)
            tl.store(weights_ptr + at, w, mask=ok)
            tl.store(slots_ptr + u64 * K + j, tl.where(ok, p, -1), mask=um)
            tl.store(slot_w_ptr + u64 * K + j, w, mask=um)
            if G_PAD > 0:  # (loaded per choice: a tile kept across the choices spills)
                gi = tl.arange(0, G_PAD)
                gm = ok[:, None] & (gi < G)[None, :]
                sb = tl.load(m[:, None] + 2 + 2 * K + gi[None, :], mask=gm, other=0)
                tl.store(scales_ptr + at[:, None] * G + gi[None, :], sb, mask=gm)


#: (tokens a block, columns a tile) on GPUs
GPU_TILES = (16, 512)


def backend_tiles() -> tuple[int, int]:
    """(tokens a block, columns a tile): smaller in the interpreter, whose cost grows with the tensors."""
    return (8, 64) if triton_interprets() else GPU_TILES


tiles = backend_tiles

#: the most blocks of tokens whose counts take one launch (ep_count_record): decode's calls (256 tokens on GPUs)
ONE_LAUNCH_BLOCKS = 16


def launch_count(ids, part, hist, base_e, groups, record, base, T: int, E: int, W: int, ticket=None) -> None:
    """ep_count, scan_counts (its totals: the record's pairs per expert) and ep_record on the current stream:
    ``ids`` [T, K] int32/int64 contiguous; int32 ``part`` [NB, 2 + W], ``hist`` and ``base_e`` [NB, E], ``groups``
    [[0, NB, 0]], ``record`` [3 + W + E] contiguous, ``base`` [NB, W] (NB: blocks of tiles()[0] tokens).
    ``ticket``: an int32 [1] tensor at zero that no other launch uses until this one is done: with at most
    ONE_LAUNCH_BLOCKS blocks, the three as one launch (ep_count_record)."""
    K = ids.shape[1]
    bt = tiles()[0]
    nb = part.shape[0]
    w_pad, e_pad = pow2(W), pow2(E)
    if ticket is not None and 1 <= nb <= ONE_LAUNCH_BLOCKS:
        nb_pad = max(pow2(nb), 2)
        launch(ep_count_record, (nb,), (ids, part, hist, base_e, record, base, ticket, T, E, E // W, W, nb),
               dict(K=K, K_PAD=pow2(K), BT=bt, W_PAD=w_pad, E_CHUNK=min(e_pad, 64), NB_PAD=nb_pad,
                    E_TILE=max(16, min(e_pad, 4096 // nb_pad))), num_warps=4)
        return
    if nb:
        launch(ep_count, (nb,), (ids, part, hist, T, E, E // W, W),
               dict(K=K, K_PAD=pow2(K), BT=bt, W_PAD=w_pad, E_CHUNK=min(e_pad, 64)), num_warps=4)
    e_tile = min(e_pad, 32)
    launch(scan_counts, (1, -(-E // e_tile)), (hist, groups, base_e, record[3 + W:], E),
           dict(E_TILE=e_tile, SCAN_B=64), num_warps=4)
    launch(ep_record, (1,), (part, record, base, nb, T, W), dict(W_PAD=w_pad, SCAN_B=32), num_warps=4)


def launch_pack(x, ids, wbits, sbits, record, base, base_e, table, dest, offsets, counts, rows, meta, positions,
                E: int, W: int, rank: int, push=None, err=None, gather=None) -> None:
    """ep_dest then ep_pack on the current stream (after launch_count of the same ids; ``table`` int32 [W, 3 + W +
    E] every rank's record): ``dest`` int32 [E], ``offsets`` int32 [E / W + 1] this rank's experts' offsets and
    ``counts`` int32 [E / W] their rows;
    ``sbits`` int32 [T, G] the scales' bits to carry in the metadata, or None. ``push``: None (into ``rows`` and
    ``meta``), or (rows_ptrs, meta_ptrs, cap): into the owners' receive buffers (ep_pack's PUSH; ``rows`` and
    ``meta`` then give only the dtypes; ``err``: the Context's error word). ``gather``: None, or the owners' gather
    indexes' pointers (ep_pack's GATHER)."""
    T, H = x.shape
    K = ids.shape[1]
    bt, bh = tiles()
    e_pad = pow2(E)
    launch(ep_dest, (1,), (table, dest, offsets, counts, rank, E, E // W, W),
           dict(W_PAD=pow2(W), E_PAD=e_pad, E_CHUNK=min(e_pad, 32)), num_warps=4)
    if T == 0:
        return
    G = 0 if sbits is None else sbits.shape[1]
    rows_ptrs, meta_ptrs, cap = (record, record, 0) if push is None else push
    launch(ep_pack, (-(-T // bt), -(-H // bh)),
           (x, ids, wbits, wbits if sbits is None else sbits, record, base, base_e, dest, rows, meta, positions,
            rows_ptrs, meta_ptrs, record if gather is None else gather, table, record if err is None else err, T, H,
            E, E // W, W, rank, x.stride(0), G, cap),
           dict(K=K, K_PAD=pow2(K), BT=bt, W_PAD=pow2(W), BLOCK_H=bh, G_PAD=pow2(G) if G else 0,
                PUSH=push is not None, GATHER=gather is not None), num_warps=4)


def launch_expand(rows, meta, tokens, source, token, wbits, slots, slot_wbits, sbits, K: int) -> None:
    """ep_expand on the current stream: ``rows`` [U, H] (unit column stride) into ``tokens`` [R, H]; ``sbits`` int32
    [R, G] the scales' bits out of the metadata, or None."""
    U, H = rows.shape
    if U == 0:
        return
    bu, bh = tiles()
    G = 0 if sbits is None else sbits.shape[1]
    launch(ep_expand, (-(-U // bu), -(-H // bh)), (rows, meta, tokens, source, token, wbits, slots, slot_wbits,
                                                    wbits if sbits is None else sbits, U, tokens.shape[0], H,
                                                    rows.stride(0), G),
           dict(K=K, BU=bu, BLOCK_H=bh, G_PAD=pow2(G) if G else 0), num_warps=4)


__all__ = ["GPU_TILES", "ONE_LAUNCH_BLOCKS", "backend_tiles", "count_block", "ep_count", "ep_count_record",
           "ep_dest", "ep_expand", "ep_pack", "ep_record", "launch_count", "launch_expand", "launch_pack",
           "pair_places", "record_blocks", "rows_before", "tiles", "token_owners"]
