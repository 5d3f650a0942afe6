"""Sorting an MoE call's (token, k) pairs by expert on the device, in four small kernels instead of a torch radix sort
and some forty torch operations.

A pair ``q = t * topk + j`` is token ``t``'s ``j``-th choice. The pairs come in segments: runs of whole tokens
(int32 [S, 3]: first token, tokens, tag), given in the order the sort keeps them apart or together. The sort is a
stable counting sort: the result orders pairs by (group, expert, segment, pair), where a group is ``segs_per_group``
consecutive segments (one group of every segment: expert-major, as AllGather-MoE sorts by expert, then chunk
arrival; one group a segment: segment-major, as MoE-ReduceScatter sorts by destination, then expert).

1. ``count_experts``: each block of ``BLOCK`` pairs of a segment counts its experts (hist [blocks, E]).
2. ``scan_counts``: per group, each expert's total and offset, and each block's first row per expert.
3. ``place_pairs``: each pair's row = its block's first row for its expert + the pairs of that expert before it in
   the block; writes the permutation both ways and what the grouped GEMM reads per row.
4. ``cut_tiles``: each group's rows of one expert cut into tiles of ``block_m`` rows, a fixed number of slots per
   group, optionally ordered (stably) by the tag of each tile's last row: AllGather-MoE's tiles by the last chunk they
   need. Unused slots are (0, 0, 0).

Every count and position is exact integer arithmetic, so the result does not depend on the launch or the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cached_launch import launch, triton_interprets


@triton.jit
def _block_pairs(seg_ptr, s, b, topk, BLOCK: tl.constexpr):
    """Pairs ``b * BLOCK ...`` of segment ``s``: (pair indices int64, in range, the segment's tag)."""
    first = tl.load(seg_ptr + s * 3).to(tl.int64) * topk
    n = tl.load(seg_ptr + s * 3 + 1).to(tl.int64) * topk
    i = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    return first + i, i < n, tl.load(seg_ptr + s * 3 + 2)


@triton.jit
def count_experts(ids_ptr, seg_ptr, hist_ptr, topk, E, NB, BLOCK: tl.constexpr, E_CHUNK: tl.constexpr):
    """Grid (segments, NB): ``hist[s * NB + b, e]`` = pairs of expert e in block b of segment s."""
    s = tl.program_id(0)
    b = tl.program_id(1)
    q, ok, _ = _block_pairs(seg_ptr, s, b, topk, BLOCK)
    e = tl.load(ids_ptr + q, mask=ok, other=-1).to(tl.int32)
    row = (s * NB + b).to(tl.int64) * E
    for e0 in range(0, E, E_CHUNK):
        bins = e0 + tl.arange(0, E_CHUNK)
        n = tl.sum((e[:, None] == bins[None, :]).to(tl.int32), axis=0)
        tl.store(hist_ptr + row + bins, n, mask=bins < E)


@triton.jit
def scan_counts(hist_ptr, seg_ptr, base_ptr, totals_ptr, offsets_ptr, topk, E, NB, SEGS_PER_GROUP,
                E_PAD: tl.constexpr, SCAN_B: tl.constexpr, S_PAD: tl.constexpr):
    """Grid (groups,): group g's expert totals (``totals[g, e]``), first rows (``offsets[g, :E + 1]``, from the
    pairs of the groups before it) and each of its blocks' first row per expert (``base[block, e]``)."""
    g = tl.program_id(0)
    bins = tl.arange(0, E_PAD)
    bok = bins < E
    segs = tl.arange(0, S_PAD)
    before = tl.load(seg_ptr + segs * 3 + 1, mask=segs < g * SEGS_PER_GROUP, other=0).to(tl.int64)
    start = tl.sum(before, axis=0) * topk
    blocks = SEGS_PER_GROUP * NB
    first_block = g * blocks
    total = tl.zeros((E_PAD,), dtype=tl.int64)
    for r0 in range(0, blocks, SCAN_B):
        r = r0 + tl.arange(0, SCAN_B)
        h = tl.load(hist_ptr + (first_block + r).to(tl.int64)[:, None] * E + bins[None, :],
                    mask=(r < blocks)[:, None] & bok[None, :], other=0)
        total += tl.sum(h.to(tl.int64), axis=0)
    off = start + tl.cumsum(total, axis=0) - total
    tl.store(totals_ptr + g * E + bins, total.to(tl.int32), mask=bok)
    tl.store(offsets_ptr + g * (E + 1) + bins, off.to(tl.int32), mask=bok)
    tl.store(offsets_ptr + g * (E + 1) + E, (start + tl.sum(total, axis=0)).to(tl.int32))
    running = off
    for r0 in range(0, blocks, SCAN_B):
        r = r0 + tl.arange(0, SCAN_B)
        at = (first_block + r).to(tl.int64)[:, None] * E + bins[None, :]
        m = (r < blocks)[:, None] & bok[None, :]
        h = tl.load(hist_ptr + at, mask=m, other=0).to(tl.int64)
        tl.store(base_ptr + at, (tl.cumsum(h, axis=0) - h + running[None, :]).to(tl.int32), mask=m)
        running += tl.sum(h, axis=0)


@triton.jit
def place_pairs(ids_ptr, seg_ptr, base_ptr, remap_ptr, position_ptr, order_ptr, src_ptr, dst_ptr, tag_ptr, topk,
                E, NB, SRC_DIV, HAS_REMAP: tl.constexpr, DST: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (segments, NB): pair q's row p (stable within its expert); ``position[q] = p`` (int32), ``order[p] = q``
    (int64), ``src[p]`` = (``remap[q]`` or q) // SRC_DIV, ``tag[p]`` its segment's tag, and ``dst[p]`` = q (DST 1),
    p (DST 2) or nothing (DST 0)."""
    s = tl.program_id(0)
    b = tl.program_id(1)
    q, ok, tag = _block_pairs(seg_ptr, s, b, topk, BLOCK)
    e = tl.load(ids_ptr + q, mask=ok, other=-1).to(tl.int32)
    i = tl.arange(0, BLOCK)
    before = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(before.to(tl.int32), axis=1)
    row = (s * NB + b).to(tl.int64) * E
    p = tl.load(base_ptr + row + tl.where(ok, e, 0), mask=ok, other=0) + rank
    tl.store(position_ptr + q, p, mask=ok)
    tl.store(order_ptr + p, q, mask=ok)
    if HAS_REMAP:
        src = tl.load(remap_ptr + q, mask=ok, other=0).to(tl.int64)
    else:
        src = q
    tl.store(src_ptr + p, (src // SRC_DIV).to(tl.int32), mask=ok)
    tl.store(tag_ptr + p, tl.zeros_like(p) + tag, mask=ok)
    if DST == 1:
        tl.store(dst_ptr + p, q.to(tl.int32), mask=ok)
    if DST == 2:
        tl.store(dst_ptr + p, p, mask=ok)


@triton.jit
def _slot_tiles(totals_ptr, offsets_ptr, tag_ptr, g, s, E, SLOTS, LAST_TAG, BLOCK_M: tl.constexpr,
                E_PAD: tl.constexpr):
    """Slots ``s`` of group g: (expert, first row, end row, the tag of the last row; LAST_TAG for unused slots)."""
    bins = tl.arange(0, E_PAD)
    bok = bins < E
    count = tl.load(totals_ptr + g * E + bins, mask=bok, other=0)
    tiles = (count + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    done = (tile_end[None, :] <= s[:, None]) & bok[None, :]
    e = tl.sum(done.to(tl.int32), axis=1)
    used = (e < E) & (s < SLOTS)
    tile_start = tl.max(tl.where(done, tile_end[None, :], 0), axis=1)
    ec = tl.minimum(e, E - 1)
    first_row = tl.load(offsets_ptr + g * (E + 1) + ec)
    first = first_row + (s - tile_start) * BLOCK_M
    end = tl.minimum(first + BLOCK_M, first_row + tl.load(totals_ptr + g * E + ec))
    need = tl.load(tag_ptr + tl.where(used, end - 1, 0), mask=used, other=LAST_TAG)
    return tl.where(used, e, 0), tl.where(used, first, 0), tl.where(used, end, 0), tl.where(used, need, LAST_TAG)


@triton.jit
def cut_tiles(totals_ptr, offsets_ptr, tag_ptr, table_ptr, E, SLOTS, LAST_TAG, BLOCK_M: tl.constexpr,
              E_PAD: tl.constexpr, BS: tl.constexpr, BY_TAG: tl.constexpr, TAG_PAD: tl.constexpr):
    """Grid (groups,): group g's tiles into ``table[g * SLOTS ...]`` (int32 [.., 3]: expert, first row, end row) in
    expert order, or with BY_TAG stably ordered by the tag of their last row (tags in [0, LAST_TAG], unused slots
    LAST_TAG, last)."""
    g = tl.program_id(0)
    if not BY_TAG:
        for s0 in range(0, SLOTS, BS):
            s = s0 + tl.arange(0, BS)
            e, first, end, _ = _slot_tiles(totals_ptr, offsets_ptr, tag_ptr, g, s, E, SLOTS, LAST_TAG, BLOCK_M, E_PAD)
            at = (g * SLOTS + s).to(tl.int64) * 3
            ok = s < SLOTS
            tl.store(table_ptr + at, e, mask=ok)
            tl.store(table_ptr + at + 1, first, mask=ok)
            tl.store(table_ptr + at + 2, end, mask=ok)
    else:
        tags = tl.arange(0, TAG_PAD)
        hist = tl.zeros((TAG_PAD,), dtype=tl.int32)
        for s0 in range(0, SLOTS, BS):
            s = s0 + tl.arange(0, BS)
            _, _, _, need = _slot_tiles(totals_ptr, offsets_ptr, tag_ptr, g, s, E, SLOTS, LAST_TAG, BLOCK_M, E_PAD)
            hist += tl.sum(((need[:, None] == tags[None, :]) & (s < SLOTS)[:, None]).to(tl.int32), axis=0)
        running = tl.cumsum(hist, axis=0) - hist
        i = tl.arange(0, BS)
        for s0 in range(0, SLOTS, BS):
            s = s0 + i
            ok = s < SLOTS
            e, first, end, need = _slot_tiles(totals_ptr, offsets_ptr, tag_ptr, g, s, E, SLOTS, LAST_TAG, BLOCK_M,
                                              E_PAD)
            hot = (need[:, None] == tags[None, :]) & ok[:, None]
            before = (need[:, None] == need[None, :]) & (i[None, :] < i[:, None]) & ok[None, :]
            dest = tl.sum(tl.where(hot, running[None, :], 0), axis=1) + tl.sum(before.to(tl.int32), axis=1)
            at = (g * SLOTS + dest).to(tl.int64) * 3
            tl.store(table_ptr + at, e, mask=ok)
            tl.store(table_ptr + at + 1, first, mask=ok)
            tl.store(table_ptr + at + 2, end, mask=ok)
            running += tl.sum(hot.to(tl.int32), axis=0)


def _pow2(n: int) -> int:
    """The least power of two >= n (>= 1), in plain Python (triton's helpers are slower from the host)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def sort_segments(ids, segments, seg_tokens: list[int], segs_per_group: int, num_experts: int, block_m: int,
                  slots: int, *, remap=None, src_div: int = 1, dst: int = 0, by_tag: int | None = None) -> dict:
    """Launch the four kernels on the current stream; returns the tensors they write. ``ids`` [T, topk] int32 or
    int64, contiguous; ``segments`` int32 [S, 3] on the device and ``seg_tokens`` its token counts on the host (they
    size the grids); ``remap``, ``src_div``, ``dst``: what ``src`` and ``dst`` hold (place_pairs); ``by_tag``: order
    each group's tiles by the tag of their last row, tags in [0, by_tag] (None: expert order). Returned, int32 but
    ``order``: ``position`` [pairs], ``order`` int64 [pairs], ``src``, ``tag``, ``dst`` (DST 1 or 2) [pairs],
    ``totals`` [groups, E], ``offsets`` [groups, E + 1], ``table`` [groups * slots, 3]; four allocations in all."""
    topk, E, pairs = ids.shape[1], num_experts, ids.numel()
    S = len(seg_tokens)
    groups = S // segs_per_group
    block = 32 if triton_interprets() else 128
    nb = blocks_per_segment(seg_tokens, topk, block)
    sizes = {"src": pairs, "tag": pairs, "dst": pairs if dst else 0, "totals": groups * E,
             "table": groups * slots * 3, "hist": S * nb * E, "base": S * nb * E}
    padded = {k: -(-n // 4) * 4 for k, n in sizes.items()}  # 16-byte aligned views
    buf = torch.empty(sum(padded.values()), dtype=torch.int32, device=ids.device)
    out, at = {}, 0
    for k, n in sizes.items():
        out[k] = buf[at:at + n]
        at += padded[k]
    out["totals"], out["table"] = out["totals"].view(groups, E), out["table"].view(groups * slots, 3)
    # what MoERouting keeps, each its own tensor (outputs of a custom op must not share storage)
    out["order"] = torch.empty(pairs, dtype=torch.int64, device=ids.device)
    out["position"] = torch.empty(pairs, dtype=torch.int32, device=ids.device)
    out["offsets"] = torch.empty((groups, E + 1), dtype=torch.int32, device=ids.device)
    e_pad = _pow2(E)
    if nb > 0:
        launch(count_experts, (S, nb), (ids, segments, out["hist"], topk, E, nb),
               dict(BLOCK=block, E_CHUNK=min(e_pad, 64)), num_warps=4)
    launch(scan_counts, (groups,), (out["hist"], segments, out["base"], out["totals"], out["offsets"], topk, E, nb,
                                    segs_per_group),
           dict(E_PAD=e_pad, SCAN_B=max(1, min(64, 8192 // e_pad)), S_PAD=_pow2(S)), num_warps=4)
    if nb > 0:
        launch(place_pairs, (S, nb), (ids, segments, out["base"], out["position"] if remap is None else remap,
                                      out["position"], out["order"], out["src"], out["dst"] if dst else out["src"],
                                      out["tag"], topk, E, nb, src_div),
               dict(HAS_REMAP=remap is not None, DST=dst, BLOCK=block), num_warps=4)
    last = 0 if by_tag is None else by_tag
    launch(cut_tiles, (groups,), (out["totals"], out["offsets"], out["tag"], out["table"], E, slots, last),
           dict(BLOCK_M=block_m, E_PAD=e_pad, BS=max(16, min(128, 8192 // e_pad)), BY_TAG=by_tag is not None,
                TAG_PAD=_pow2(last + 1)), num_warps=4)
    for k in ("hist", "base"):
        del out[k]
    return out


def blocks_per_segment(seg_tokens: list[int], topk: int, block: int) -> int:
    """Blocks of ``block`` pairs the largest segment needs (the grids' second dimension)."""
    return -(-max(seg_tokens, default=0) * topk // block)


__all__ = ["blocks_per_segment", "count_experts", "cut_tiles", "place_pairs", "scan_counts", "sort_segments"]
