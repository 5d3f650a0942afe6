"""Sorting an MoE call's (token, k) pairs by expert on the device: a stable counting sort in a few small kernels,
each parallel over blocks of pairs, experts or tile slots, instead of a torch radix sort and some forty torch
operations.

A pair ``q = t * topk + j`` is token ``t``'s ``j``-th choice. The pairs come in runs of whole tokens (segments), in
the order the sort keeps them apart or together; the host cuts them into blocks of at most ``BLOCK`` pairs (``Blocks``:
int32 [blocks, 4]: first pair, pairs, tag, group) and groups of consecutive blocks. The result orders pairs by
(group, expert, block, pair): one group of every segment sorts expert-major (AllGather-MoE: by expert, then chunk
arrival); one group a segment sorts segment-major (MoE-ReduceScatter: by destination, then expert).

1. ``count_experts`` (a program per block): the block's pairs per expert (hist [blocks, E]).
2. ``scan_counts`` (a program per group and tile of experts): each expert's total in the group and each block's
   first row for it, counted from the expert's first row.
3. ``expert_offsets`` (a program per group): each expert's first row (the group's first row + the totals before it).
4. ``place_pairs`` (a program per block): a pair's row = its expert's first row + its block's start for the expert +
   the pairs of that expert before it in the block; writes the permutation both ways and what the grouped GEMM
   reads per row.
5. ``cut_tiles`` (a program per group and block of slots): each group's rows of one expert in tiles of ``block_m``
   rows, a fixed number of slots a group, unused slots (0, 0, 0). Ordered by the tag of each tile's last row
   (AllGather-MoE's tiles by the last chunk they need), or by that tag raised to the tile's lane in expert order
   (sort_segments' ``lag``), it writes the tiles and a histogram of keys per block of slots, and ``order_tiles``
   moves each to its place (stable).

Every count and position is exact integer arithmetic, so the result does not depend on the launch or the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cached_launch import launch, triton_interprets


@triton.jit
def _block_pairs(blocks_ptr, b, BLOCK: tl.constexpr):
    """Block b's pairs: (pair indices int64, in range, tag, group)."""
    first = tl.load(blocks_ptr + b * 4).to(tl.int64)
    n = tl.load(blocks_ptr + b * 4 + 1)
    i = tl.arange(0, BLOCK)
    return first + i, i < n, tl.load(blocks_ptr + b * 4 + 2), tl.load(blocks_ptr + b * 4 + 3)


@triton.jit
def count_experts(ids_ptr, blocks_ptr, hist_ptr, E, BLOCK: tl.constexpr, E_CHUNK: tl.constexpr):
    """Grid (blocks,): ``hist[b, e]`` = block b's pairs of expert e."""
    b = tl.program_id(0)
    q, ok, _, _ = _block_pairs(blocks_ptr, b, BLOCK)
    e = tl.load(ids_ptr + q, mask=ok, other=-1).to(tl.int32)
    row = b.to(tl.int64) * E
    for e0 in range(0, E, E_CHUNK):
        bins = e0 + tl.arange(0, E_CHUNK)
        n = tl.sum((e[:, None] == bins[None, :]).to(tl.int32), axis=0)
        tl.store(hist_ptr + row + bins, n, mask=bins < E)


@triton.jit
def scan_counts(hist_ptr, groups_ptr, base_ptr, totals_ptr, E, E_TILE: tl.constexpr, SCAN_B: tl.constexpr):
    """Grid (groups, expert tiles): for experts ``[j * E_TILE, ...)`` of group g, ``totals[g, e]`` and
    ``base[b, e]``, block b's first row for expert e counted from the expert's first row in the group."""
    g = tl.program_id(0)
    bins = tl.program_id(1) * E_TILE + tl.arange(0, E_TILE)
    bok = bins < E
    first = tl.load(groups_ptr + g * 3)
    blocks = tl.load(groups_ptr + g * 3 + 1)
    running = tl.zeros((E_TILE,), dtype=tl.int32)
    for r0 in range(0, blocks, SCAN_B):
        r = r0 + tl.arange(0, SCAN_B)
        at = (first + r).to(tl.int64)[:, None] * E + bins[None, :]
        m = (r < blocks)[:, None] & bok[None, :]
        h = tl.load(hist_ptr + at, mask=m, other=0)
        tl.store(base_ptr + at, tl.cumsum(h, axis=0) - h + running[None, :], mask=m)
        running += tl.sum(h, axis=0)
    tl.store(totals_ptr + g * E + bins, running, mask=bok)


@triton.jit
def expert_offsets(totals_ptr, groups_ptr, offsets_ptr, E, E_PAD: tl.constexpr):
    """Grid (groups,): ``offsets[g, :E + 1]``, each expert's first row in group g, then the group's end."""
    g = tl.program_id(0)
    bins = tl.arange(0, E_PAD)
    total = tl.load(totals_ptr + g * E + bins, mask=bins < E, other=0)
    start = tl.load(groups_ptr + g * 3 + 2)
    tl.store(offsets_ptr + g * (E + 1) + bins, start + tl.cumsum(total, axis=0) - total, mask=bins < E)
    tl.store(offsets_ptr + g * (E + 1) + E, start + tl.sum(total, axis=0))


@triton.jit
def place_pairs(ids_ptr, blocks_ptr, base_ptr, offsets_ptr, remap_ptr, position_ptr, order_ptr, src_ptr, dst_ptr,
                tag_ptr, E, SRC_DIV, HAS_REMAP: tl.constexpr, DST: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (blocks,): pair q's row p (stable within its expert); ``position[q] = p`` (int32), ``order[p] = q``
    (int64), ``src[p]`` = (``remap[q]`` or q) // SRC_DIV, ``tag[p]`` its block's tag, and ``dst[p]`` = q (DST 1),
    p (DST 2) or nothing (DST 0)."""
    b = tl.program_id(0)
    q, ok, tag, g = _block_pairs(blocks_ptr, b, BLOCK)
    e = tl.load(ids_ptr + q, mask=ok, other=-1).to(tl.int32)
    i = tl.arange(0, BLOCK)
    before = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(before.to(tl.int32), axis=1)
    ec = tl.where(ok, e, 0)
    p = (tl.load(offsets_ptr + g * (E + 1) + ec, mask=ok, other=0)
         + tl.load(base_ptr + b.to(tl.int64) * E + ec, mask=ok, other=0) + rank)
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
def cut_tiles(totals_ptr, offsets_ptr, tag_ptr, table_ptr, need_ptr, tag_hist_ptr, E, SLOTS, LAST_TAG, LAG, LANES,
              BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BS: tl.constexpr, BY_TAG: tl.constexpr,
              TAG_PAD: tl.constexpr):
    """Grid (groups, slot blocks): slots ``s`` of group g hold its tiles in expert order (expert, first row, end
    row), unused slots (0, 0, 0), into ``table[g * SLOTS + s]``; with BY_TAG also each slot's key into ``need`` and
    the block's histogram of keys into ``tag_hist[g, block]``. A used slot's key: the tag of its last row, raised to
    its lane ``min(s // LAG, LANES)`` where LAG > 0 (LANES where LAG = 0, none where LAG < 0); LAST_TAG where
    unused."""
    g = tl.program_id(0)
    sb = tl.program_id(1)
    s = sb * BS + tl.arange(0, BS)
    bins = tl.arange(0, E_PAD)
    bok = bins < E
    count = tl.load(totals_ptr + g * E + bins, mask=bok, other=0)
    tile_end = tl.cumsum((count + BLOCK_M - 1) // BLOCK_M, axis=0)
    done = (tile_end[None, :] <= s[:, None]) & bok[None, :]
    e = tl.sum(done.to(tl.int32), axis=1)
    ok = s < SLOTS
    used = (e < E) & ok
    ec = tl.minimum(e, E - 1)
    first_row = tl.load(offsets_ptr + g * (E + 1) + ec)
    first = first_row + (s - tl.max(tl.where(done, tile_end[None, :], 0), axis=1)) * BLOCK_M
    end = tl.minimum(first + BLOCK_M, first_row + tl.load(totals_ptr + g * E + ec))
    at = (g * SLOTS + s).to(tl.int64)
    tl.store(table_ptr + at * 3, tl.where(used, e, 0), mask=ok)
    tl.store(table_ptr + at * 3 + 1, tl.where(used, first, 0), mask=ok)
    tl.store(table_ptr + at * 3 + 2, tl.where(used, end, 0), mask=ok)
    if BY_TAG:
        need = tl.load(tag_ptr + tl.where(used, end - 1, 0), mask=used, other=LAST_TAG)
        lane = tl.where(LAG > 0, tl.minimum(s // tl.maximum(LAG, 1), LANES), tl.where(LAG == 0, LANES, 0))
        need = tl.where(used, tl.maximum(need, lane), need)
        tl.store(need_ptr + at, need, mask=ok)
        tags = tl.arange(0, TAG_PAD)
        hist = tl.sum(((need[:, None] == tags[None, :]) & ok[:, None]).to(tl.int32), axis=0)
        tl.store(tag_hist_ptr + (g * tl.num_programs(1) + sb) * TAG_PAD + tags, hist)


@triton.jit
def order_tiles(tiles_ptr, need_ptr, tag_hist_ptr, table_ptr, SLOTS, BS: tl.constexpr, TAG_PAD: tl.constexpr,
                NB_PAD: tl.constexpr):
    """Grid (groups, slot blocks): each slot of ``tiles`` (cut_tiles' table) to its place in ``table``, the slots
    of group g stably ordered by ``need``: the tag's first place (tiles of smaller tags before it), + the slots of
    the same tag in earlier blocks, + those before it in its block."""
    g = tl.program_id(0)
    sb = tl.program_id(1)
    nb = tl.num_programs(1)
    tags = tl.arange(0, TAG_PAD)
    blocks = tl.arange(0, NB_PAD)
    hist = tl.load(tag_hist_ptr + (g * nb + blocks)[:, None] * TAG_PAD + tags[None, :],
                   mask=(blocks < nb)[:, None], other=0)
    per_tag = tl.sum(hist, axis=0)
    start = (tl.cumsum(per_tag, axis=0) - per_tag
             + tl.sum(tl.where((blocks < sb)[:, None], hist, 0), axis=0))
    i = tl.arange(0, BS)
    s = sb * BS + i
    ok = s < SLOTS
    at = (g * SLOTS + s).to(tl.int64)
    need = tl.load(need_ptr + at, mask=ok, other=-1)
    before = (need[:, None] == need[None, :]) & (i[None, :] < i[:, None])
    dest = (tl.sum(tl.where(need[:, None] == tags[None, :], start[None, :], 0), axis=1)
            + tl.sum(before.to(tl.int32), axis=1))
    to = (g * SLOTS + dest).to(tl.int64) * 3
    for c in range(3):
        tl.store(table_ptr + to + c, tl.load(tiles_ptr + at * 3 + c, mask=ok), mask=ok)


def pow2(n: int) -> int:
    """The least power of two >= n (>= 1), in plain Python (triton's helpers are slower from the host)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def block_size() -> int:
    """Pairs a program of count_experts and place_pairs takes: 128 on GPUs, 32 in the interpreter (whose cost grows
    with BLOCK²)."""
    return 32 if triton_interprets() else 128


def cut_blocks(runs: list[tuple[int, int, int]], topk: int, segs_per_group: int, block: int):
    """The host's tables for ``runs`` of (first token, tokens, tag): (blocks [[first pair, pairs, tag, group]],
    groups [[first block, blocks, first row]]); a group is ``segs_per_group`` consecutive runs; empty runs have no
    blocks."""
    blocks, groups, row = [], [], 0
    for g in range(len(runs) // segs_per_group):
        first_block, first_row = len(blocks), row
        for first, n, tag in runs[g * segs_per_group:(g + 1) * segs_per_group]:
            for i in range(0, n * topk, block):
                blocks.append((first * topk + i, min(block, n * topk - i), tag, g))
            row += n * topk
        groups.append((first_block, len(blocks) - first_block, first_row))
    return blocks, groups


def sort_segments(ids, blocks: torch.Tensor, groups: torch.Tensor, num_experts: int, block_m: int, slots: int, *,
                  block: int, remap=None, src_div: int = 1, dst: int = 0, by_tag: int | None = None,
                  lag: int = -1, lanes: int = 0) -> dict:
    """Launch the kernels on the current stream; returns the tensors they write. ``ids`` [T, topk] int32 or int64,
    contiguous; ``blocks`` int32 [NB, 4] and ``groups`` int32 [G, 3] on the device (cut_blocks, with ``block``);
    ``remap`` int32 [pairs] contiguous, ``src_div``, ``dst``: what ``src`` and ``dst`` hold (place_pairs); ``by_tag``:
    order each group's tiles by the tag of their last row, tags in [0, by_tag] (None: expert order); ``lag`` (with
    ``by_tag``): a tile's key is its tag or its lane, whichever is larger, ``lanes`` the largest lane: slot ``s`` of
    the expert order (a tile's place there) is in lane ``min(s // lag, lanes)`` where lag > 0, so each tile runs at
    its place in expert order, or once the tiles before the tag's lane have run, whichever comes later (lag = 0:
    expert order; lag < 0: by tag alone). Returned, int32
    but ``order``: ``position`` [pairs], ``order`` int64 [pairs], ``src``, ``tag``, ``dst`` (DST 1 or 2) [pairs],
    ``totals`` [G, E], ``offsets`` [G, E + 1], ``table`` [G * slots, 3]."""
    if lag >= 0 and not (by_tag is not None and 0 <= lanes < by_tag):
        raise ValueError(f"sort_segments: lag {lag} needs by_tag and 0 <= lanes < by_tag, got {by_tag}, {lanes}")
    E, pairs, dev = num_experts, ids.numel(), ids.device
    nblk, G = blocks.shape[0], groups.shape[0]
    e_pad = pow2(E)
    bs = max(16, min(128, 8192 // e_pad))
    nsb = -(-slots // bs)
    tag_pad = pow2((by_tag or 0) + 1)
    sizes = {"src": pairs, "tag": pairs, "dst": pairs if dst else 0, "totals": G * E, "table": G * slots * 3}
    if by_tag is not None:
        sizes.update(tiles=G * slots * 3, need=G * slots, tag_hist=G * nsb * tag_pad)
    padded = {k: -(-n // 4) * 4 for k, n in sizes.items()}  # 16-byte aligned views
    buf = torch.empty(sum(padded.values()), dtype=torch.int32, device=dev)
    out, at = {}, 0
    for k, n in sizes.items():
        out[k] = buf[at:at + n]
        at += padded[k]
    out["totals"], out["table"] = out["totals"].view(G, E), out["table"].view(G * slots, 3)
    # what MoERouting keeps, each its own tensor (outputs of a custom op must not share storage); and the scratch
    out["order"] = torch.empty(pairs, dtype=torch.int64, device=dev)
    out["position"] = torch.empty(pairs, dtype=torch.int32, device=dev)
    out["offsets"] = torch.empty((G, E + 1), dtype=torch.int32, device=dev)
    hist = torch.empty((2, nblk, E), dtype=torch.int32, device=dev)
    if nblk:
        launch(count_experts, (nblk,), (ids, blocks, hist[0], E), dict(BLOCK=block, E_CHUNK=min(e_pad, 64)),
               num_warps=4)
    e_tile = min(e_pad, 32)
    launch(scan_counts, (G, -(-E // e_tile)), (hist[0], groups, hist[1], out["totals"], E),
           dict(E_TILE=e_tile, SCAN_B=64), num_warps=4)
    launch(expert_offsets, (G,), (out["totals"], groups, out["offsets"], E), dict(E_PAD=e_pad), num_warps=4)
    if nblk:
        launch(place_pairs, (nblk,), (ids, blocks, hist[1], out["offsets"], out["position"] if remap is None else remap,
                                      out["position"], out["order"], out["src"], out["dst"] if dst else out["src"],
                                      out["tag"], E, src_div),
               dict(HAS_REMAP=remap is not None, DST=dst, BLOCK=block), num_warps=4)
    if slots:
        tiles = out["table"] if by_tag is None else out["tiles"]
        need, tag_hist = (out["need"], out["tag_hist"]) if by_tag is not None else (tiles, tiles)
        launch(cut_tiles, (G, nsb), (out["totals"], out["offsets"], out["tag"], tiles, need, tag_hist, E, slots,
                                     by_tag or 0, lag, lanes),
               dict(BLOCK_M=block_m, E_PAD=e_pad, BS=bs, BY_TAG=by_tag is not None, TAG_PAD=tag_pad), num_warps=4)
        if by_tag is not None:
            launch(order_tiles, (G, nsb), (tiles, need, tag_hist, out["table"], slots),
                   dict(BS=bs, TAG_PAD=tag_pad, NB_PAD=pow2(nsb)), num_warps=4)
    for k in ("tiles", "need", "tag_hist"):
        out.pop(k, None)
    return out


__all__ = ["block_size", "count_experts", "cut_blocks", "cut_tiles", "expert_offsets", "order_tiles", "place_pairs",
           "pow2", "scan_counts", "sort_segments"]
