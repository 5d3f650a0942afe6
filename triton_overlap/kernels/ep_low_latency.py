"""Expert-parallel dispatch and combine in low-latency mode: every byte moved by stores from the kernels into the
peers' symmetric receive slots, no host synchronisation, fixed shapes, so a decode step that holds them can be
captured in a CUDA graph and replayed (ops.ep_low_latency has the protocol and the layouts).

Each rank's receive buffers hold two halves of W slots, one slot per source of ``cap`` rows (``cap``: the most
tokens a rank may send, so a source never overflows its slot). Call ``e`` (counted on the device: a replayed graph
counts on) uses half ``e % 2``, and a source raises its flag to ``e`` in every peer once all its stores are out;
flags only grow. A peer stores call ``e + 2`` into the half call ``e`` used only after its call ``e + 1`` ended,
which waited for this rank's call-``e + 1`` flag, raised after this rank's call ``e`` had read that half (kernels of
one stream run in order): the one-shot AllReduce's argument (kernels.all_reduce).

Dispatch, after kernels.ep_routing's count (the record: tokens per owner, pairs per expert):

1. ``ll_send`` (a program per block of tokens and column tile): each (token, owner) row into slot [half][rank] of
   the owner at the token's place among this rank's tokens for that owner, with its metadata [rank, token, each
   choice's local expert at that owner (-1: another owner's), its place among this rank's pairs of that expert,
   the weights' bits, the scales' bits]; program 0 stores the record into every peer's table and the call's
   header; the last program out raises this rank's flag in every peer.
2. ``ll_expand`` (a program per block of a source's slot and column tile): waits for every source's flag
   (bounded), compares headers, checks every source's ids against [0, E) (ERR_BAD_IDS otherwise: the Context
   faults, naming the rank), computes from the received records where each (source, local expert) run starts in the
   expert-sorted layout (``place_runs``: every program the same values), then copies each received row to the
   layout rows of its choices, with what a combine reads; the last program out counts the call.

Combine: ``ll_combine_send`` sums each received row's choices (weight · y, in choice order, float32, rounded once:
kernels.row_sums' arithmetic) and stores the partial into its source's slot [half][rank] at the row's place in the
source's send order, then the last program out raises the flags; ``ll_combine_recv`` waits for every owner's flag
and sums each token's partials in owner order, in float32, rounded once. The same bits as the normal mode. The
combine's header carries the number of the dispatch it combines (``ll_expand`` writes it into the handle): ranks
combining different dispatches fault (ERR_MISMATCH) instead of summing each other's partials.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .ep_routing import pair_places, rows_before, token_owners
from .signal import (ERR_BAD_IDS, ERR_MISMATCH, ERR_OWN_FINGERPRINT, ERR_PEER_HEADER, ERR_SEEN, ERR_WANTED, ERR_WHAT,
                     check_header, claim_fault, wait_for)
from .slot_exchange import publish_header


@triton.jit
def raise_flags_when_done(state_ptr, flag_ptrs, e, rank, world, BLOCK_W: tl.constexpr):
    """The last program out (a ticket at ``state[2]``, acquire-release at system scope, so every program's stores
    are ordered before it) raises this rank's flag to ``e`` in every peer (release)."""
    tl.debug_barrier()
    programs = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(state_ptr + 2, 1, sem="acq_rel", scope="sys") == programs - 1:
        tl.store(state_ptr + 2, 0)
        peers = tl.arange(0, BLOCK_W)
        flags = tl.load(flag_ptrs + peers, mask=peers < world, other=0).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flags + rank, tl.zeros((BLOCK_W,), tl.int32) + e, mask=peers < world, sem="release",
                       scope="sys")


@triton.jit
def count_call_when_done(state_ptr, e):
    """The last program out (a count at ``state[1]``) records call ``e`` as done in ``state[0]``."""
    tl.debug_barrier()
    programs = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, e)


@triton.jit
def wait_every_source(flags_ptr, header_ptr, e, half, waiter, world, fingerprint, CLOCK: tl.constexpr):
    """Every rank's flag for call ``e`` (this rank's own too: it stores into its own slot like a peer), each
    source's header compared with this call's."""
    err_ptr, budget, rank, op = waiter
    for p in range(0, world):
        if wait_for(flags_ptr + p, e, waiter, p, p, CLOCK):
            check_header(header_ptr + (half * world + p) * 4, e, op, fingerprint, err_ptr, rank, p, 4)
    tl.debug_barrier()


@triton.jit
def same_dispatch(header_ptr, number_ptr, e, half, waiter, world, W_PAD: tl.constexpr):
    """Record ERR_MISMATCH, naming the first source whose combine header (its last word) names another dispatch
    than this rank's ``number``, with that header."""
    err_ptr, budget, rank, op = waiter
    mine = tl.load(number_ptr)
    p = tl.arange(0, W_PAD)
    theirs = tl.load(header_ptr + (half * world + p) * 4 + 3, mask=p < world, other=0, volatile=True)
    other = tl.min(tl.where((p < world) & (theirs != mine), p, W_PAD), axis=0)
    if other < W_PAD:
        if claim_fault(err_ptr, ERR_MISMATCH, rank, op, other, e):
            for i in range(0, 4):
                tl.store(err_ptr + ERR_PEER_HEADER + i, tl.load(header_ptr + (half * world + other) * 4 + i,
                                                                volatile=True))
            tl.store(err_ptr + ERR_OWN_FINGERPRINT, tl.load(header_ptr + (half * world + rank) * 4 + 2,
                                                           volatile=True))
            tl.store(err_ptr + ERR_SEEN, mine)


@triton.jit
def ll_send(x_ptr, ids_ptr, wbits_ptr, sbits_ptr, record_ptr, base_ptr, base_e_ptr, pos_ptr, rows_ptrs, meta_ptrs,
            table_ptrs, header_ptrs, flag_ptrs, state_ptr, T, H, E, EL, W, rank, stride_x, G, cap, row_slot,
            meta_slot, table_slot, op, fingerprint, K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr,
            W_PAD: tl.constexpr, BLOCK_H: tl.constexpr, G_PAD: tl.constexpr, REC_PAD: tl.constexpr):
    """Grid (max(blocks, 1), column tiles). ``positions[t, d]`` = d · cap + the token's place among this rank's
    tokens for owner d (-1: not sent there); slots are ``row_slot`` / ``meta_slot`` / ``table_slot`` elements
    apart in the peers' buffers ([2, W, slot] each)."""
    b = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    e = tl.load(state_ptr) + 1
    half = e & 1
    t, ok, raw, c, owner, hit = token_owners(ids_ptr, b, T, E, EL, K, K_PAD, BT, W_PAD)
    d = tl.arange(0, W_PAD)
    dm = d < W
    base = tl.load(base_ptr + b.to(tl.int64) * W + d, mask=dm & (b * BT + tl.zeros_like(d) < T), other=0)
    pos = tl.where(hit > 0, base[None, :] + rows_before(hit, BT), -1)
    tok = t < T
    t64 = t.to(tl.int64)
    slot = half * W + rank
    if h0 == 0:
        tl.store(pos_ptr + t64[:, None] * W + d[None, :], tl.where(pos >= 0, d[None, :] * cap + pos, -1),
                 mask=tok[:, None] & dm[None, :])
        j = tl.arange(0, K_PAD)
        place = pair_places(ids_ptr, base_e_ptr, b, c, ok, T, E, K, K_PAD, BT)
        wb = tl.load(wbits_ptr + t64[:, None] * K + j[None, :], mask=ok, other=0)
        MW = 2 + 3 * K + G
        if G_PAD > 0:
            gi = tl.arange(0, G_PAD)
            gm = tok[:, None] & (gi < G)[None, :]
            sb = tl.load(sbits_ptr + t64[:, None] * G + gi[None, :], mask=gm, other=0)
        for dd in range(0, W):
            p = tl.sum(tl.where(d[None, :] == dd, pos, 0), axis=1)
            has = tok & (p >= 0)
            at = slot.to(tl.int64) * meta_slot + tl.where(has, p, 0).to(tl.int64) * MW
            m = tl.load(meta_ptrs + dd).to(tl.pointer_type(tl.int32)) + at
            tl.store(m, tl.zeros_like(p) + rank, mask=has)
            tl.store(m + 1, t, mask=has)
            tl.store(m[:, None] + 2 + j[None, :], tl.where(owner == dd, c - dd * EL, -1), mask=has[:, None] & ok)
            tl.store(m[:, None] + 2 + K + j[None, :], place, mask=has[:, None] & ok)
            tl.store(m[:, None] + 2 + 2 * K + j[None, :], wb, mask=has[:, None] & ok)
            if G_PAD > 0:
                tl.store(m[:, None] + 2 + 3 * K + gi[None, :], sb, mask=has[:, None] & gm)
        if b == 0:  # the record (what the owners' layouts are made of) and the call's header, into every peer
            i = tl.arange(0, REC_PAD)
            n = 3 + W + E
            rec = tl.load(record_ptr + i, mask=i < n, other=0)
            for dd in range(0, W):
                dest = tl.load(table_ptrs + dd).to(tl.pointer_type(tl.int32)) + slot.to(tl.int64) * table_slot
                tl.store(dest + i, rec, mask=i < n)
            publish_header(header_ptrs, e, half, rank, W, op, fingerprint, T, W_PAD)
    cols = h0 + tl.arange(0, BLOCK_H)
    cm = cols < H
    xv = tl.load(x_ptr + t64[:, None] * stride_x + cols[None, :], mask=tok[:, None] & cm[None, :])
    for dd in range(0, W):
        p = tl.sum(tl.where(d[None, :] == dd, pos, 0), axis=1)
        has = tok & (p >= 0)
        at = slot.to(tl.int64) * row_slot + tl.where(has, p, 0).to(tl.int64) * H
        dest = tl.load(rows_ptrs + dd).to(tl.pointer_type(x_ptr.dtype.element_ty))
        tl.store(dest + at[:, None] + cols[None, :], xv, mask=has[:, None] & cm[None, :])
    raise_flags_when_done(state_ptr, flag_ptrs, e, rank, W, W_PAD)


@triton.jit
def place_runs(table_ptr, place_ptr, offsets_ptr, counts_ptr, received_ptr, waiter, e, half, E, EL, W, table_slot,
               record, W_PAD: tl.constexpr, EL_PAD: tl.constexpr):
    """From the records every source stored here (read once every source's flag is up): ``place[s, i]``, the first
    layout row of source s's pairs of local expert i (the experts before i, then i's pairs from the sources before
    s); ``offsets`` [EL + 1] the layout's expert bounds, ``counts`` [EL] its rows per expert, ``received[s]`` the
    rows source s stored here. Every program of ll_expand stores the same values. Where ``record``: a source's ids
    outside [0, E) are recorded as ERR_BAD_IDS."""
    err_ptr, budget, rank, op = waiter
    i = tl.arange(0, EL_PAD)
    im = i < EL
    s = tl.arange(0, W_PAD)
    sm = s < W
    rec = table_ptr + (half * W + s).to(tl.int64) * table_slot  # [W_PAD] each source's record
    tl.store(received_ptr + s, tl.load(rec + 3 + rank, mask=sm, other=0, cache_modifier=".cg"), mask=sm)
    if record:
        n = tl.load(rec, mask=sm, other=0, cache_modifier=".cg")
        lo = tl.load(rec + 1, mask=sm, other=0, cache_modifier=".cg")
        hi = tl.load(rec + 2, mask=sm, other=0, cache_modifier=".cg")
        bad = sm & (n > 0) & ((lo < 0) | (hi >= E))
        first = tl.min(tl.where(bad, s, W_PAD), axis=0)
        if first < W_PAD:
            if claim_fault(err_ptr, ERR_BAD_IDS, rank, op, first, e):
                tl.store(err_ptr + ERR_WHAT, E)
                tl.store(err_ptr + ERR_SEEN, tl.sum(tl.where(s == first, lo, 0), axis=0))
                tl.store(err_ptr + ERR_WANTED, tl.sum(tl.where(s == first, hi, 0), axis=0))
    pairs = tl.load(rec[:, None] + 3 + W + rank * EL + i[None, :], mask=sm[:, None] & im[None, :], other=0,
                    cache_modifier=".cg")
    total = tl.sum(pairs, axis=0)  # [EL_PAD] every source's pairs of each local expert
    ahead = tl.cumsum(total, axis=0) - total
    tl.store(offsets_ptr + i, ahead, mask=im)
    tl.store(counts_ptr + i, total, mask=im)
    tl.store(offsets_ptr + EL, tl.sum(total, axis=0))
    tl.store(place_ptr + s[:, None] * EL + i[None, :], ahead[None, :] + rows_before(pairs, W_PAD),
             mask=sm[:, None] & im[None, :])


@triton.jit
def ll_expand(table_ptr, header_ptr, flags_ptr, rows_ptr, meta_ptr, place_ptr, offsets_ptr, counts_ptr, received_ptr,
              number_ptr, state_ptr, tokens_ptr, source_ptr, token_ptr, weights_ptr, slots_ptr, slot_w_ptr,
              scales_ptr, waiter, E, H, EL, W, cap, R, G, row_slot, meta_slot, table_slot, fingerprint,
              K: tl.constexpr, K_PAD: tl.constexpr,
              BU: tl.constexpr, BLOCK_H: tl.constexpr, G_PAD: tl.constexpr, W_PAD: tl.constexpr,
              EL_PAD: tl.constexpr, CLOCK: tl.constexpr):
    """Grid (W · blocks of a slot, column tiles). Once every source's flag is up (bounded waits; headers compared),
    the layout (place_runs, in every program), then source s's received rows u of this block (u < received[s]) to
    ``tokens[place[s, i] + k]`` for each choice's local expert i and place k, and (column tile 0) ``source``,
    ``token``, ``weights`` (bits) and ``scales`` (bits) per layout row, ``slots[s · cap + u, j]`` (-1: none) and
    ``slot_w`` (bits) per received row, ``number`` the call's number (what a combine of it names); the last
    program out counts the call. Every choice's metadata and layout row are loaded at once, before any row moves
    (one round of loads, not one per choice)."""
    nbu = tl.cdiv(cap, BU)
    s = tl.program_id(0) // nbu
    u = (tl.program_id(0) % nbu) * BU + tl.arange(0, BU)
    h0 = tl.program_id(1) * BLOCK_H
    e = tl.load(state_ptr) + 1
    half = e & 1
    wait_every_source(flags_ptr, header_ptr, e, half, waiter, W, fingerprint, CLOCK)
    place_runs(table_ptr, place_ptr, offsets_ptr, counts_ptr, received_ptr, waiter, e, half, E, EL, W, table_slot,
               (tl.program_id(0) == 0) & (h0 == 0), W_PAD, EL_PAD)
    tl.store(number_ptr, e)
    tl.debug_barrier()
    rank = waiter[2]
    um = (u < cap) & (u < tl.load(table_ptr + (half * W + s).to(tl.int64) * table_slot + 3 + rank,
                                  cache_modifier=".cg"))
    slot = (half * W + s).to(tl.int64)
    cols = h0 + tl.arange(0, BLOCK_H)
    cm = cols < H
    at = slot * row_slot + u.to(tl.int64) * H
    v = tl.load(rows_ptr + at[:, None] + cols[None, :], mask=um[:, None] & cm[None, :], cache_modifier=".cg")
    MW = 2 + 3 * K + G
    m = meta_ptr + slot * meta_slot + u.to(tl.int64) * MW
    jj = tl.arange(0, K_PAD)
    mk = um[:, None] & (jj < K)[None, :]
    i = tl.load(m[:, None] + 2 + jj[None, :], mask=mk, other=-1, cache_modifier=".cg")
    ok = mk & (i >= 0) & (i < EL)
    p = (tl.load(place_ptr + s * EL + i, mask=ok, other=0, cache_modifier=".cg")
         + tl.load(m[:, None] + 2 + K + jj[None, :], mask=ok, other=0, cache_modifier=".cg"))
    ok = ok & (p >= 0) & (p < R)
    p = tl.where(ok, p, -1)
    g = (s * cap + u).to(tl.int64)  # the received row's index in slots
    if h0 == 0:
        w = tl.load(m[:, None] + 2 + 2 * K + jj[None, :], mask=mk, other=0, cache_modifier=".cg")
        tl.store(slots_ptr + g[:, None] * K + jj[None, :], p, mask=mk)
        tl.store(slot_w_ptr + g[:, None] * K + jj[None, :], w, mask=mk)
        src = tl.load(m, mask=um, other=0, cache_modifier=".cg")
        tok = tl.load(m + 1, mask=um, other=0, cache_modifier=".cg")
        at_p = tl.where(ok, p, 0).to(tl.int64)
        tl.store(source_ptr + at_p, src[:, None] + tl.zeros_like(p), mask=ok)
        tl.store(token_ptr + at_p, tok[:, None] + tl.zeros_like(p), mask=ok)
        tl.store(weights_ptr + at_p, w, mask=ok)
    for j in tl.static_range(K):
        pj = tl.sum(tl.where(jj[None, :] == j, p, 0), axis=1)
        okj = pj >= 0
        to = tl.where(okj, pj, 0).to(tl.int64)
        tl.store(tokens_ptr + to[:, None] * H + cols[None, :], v, mask=okj[:, None] & cm[None, :])
        if h0 == 0:
            if G_PAD > 0:
                gi = tl.arange(0, G_PAD)
                gm = okj[:, None] & (gi < G)[None, :]
                sb = tl.load(m[:, None] + 2 + 3 * K + gi[None, :], mask=gm, other=0, cache_modifier=".cg")
                tl.store(scales_ptr + to[:, None] * G + gi[None, :], sb, mask=gm)
    count_call_when_done(state_ptr, e)


@triton.jit
def ll_combine_send(y_ptr, slots_ptr, slot_w_ptr, received_ptr, number_ptr, back_ptrs, header_ptrs, flag_ptrs,
                    state_ptr, N, W, rank, cap, stride_y, back_slot, op, fingerprint, K: tl.constexpr,
                    K_PAD: tl.constexpr, BU: tl.constexpr, BLOCK_N: tl.constexpr, W_PAD: tl.constexpr):
    """Grid (W · blocks of a slot, column tiles): for source s's received rows u, Σ_j slot_w[g, j] · y[slots[g, j]]
    (g = s · cap + u; in choice order, float32, rounded once to y's dtype) into slot [half][rank] of s's combine
    buffer at row u; program 0 publishes the header (its last word the dispatch's ``number``), the last program out
    raises the flags."""
    nbu = tl.cdiv(cap, BU)
    s = tl.program_id(0) // nbu
    u = (tl.program_id(0) % nbu) * BU + tl.arange(0, BU)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < N
    e = tl.load(state_ptr) + 1
    half = e & 1
    um = (u < cap) & (u < tl.load(received_ptr + s))
    g = (s * cap + u).to(tl.int64)
    jj = tl.arange(0, K_PAD)
    mk = um[:, None] & (jj < K)[None, :]
    slots = tl.load(slots_ptr + g[:, None] * K + jj[None, :], mask=mk, other=-1)  # every choice's at once
    ws = tl.load(slot_w_ptr + g[:, None] * K + jj[None, :], mask=mk & (slots >= 0), other=0.0)
    acc = tl.zeros((BU, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(K):
        idx = tl.sum(tl.where(jj[None, :] == j, slots, 0), axis=1)
        hit = idx >= 0
        vals = tl.load(y_ptr + tl.where(hit, idx, 0).to(tl.int64)[:, None] * stride_y + cols[None, :],
                       mask=hit[:, None] & cm[None, :], other=0.0).to(tl.float32)
        vals = vals * tl.sum(tl.where(jj[None, :] == j, ws, 0.0), axis=1)[:, None]
        acc += vals
    dest = tl.load(back_ptrs + s).to(tl.pointer_type(y_ptr.dtype.element_ty))
    at = (half * W + rank).to(tl.int64) * back_slot + u.to(tl.int64) * N
    tl.store(dest + at[:, None] + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=um[:, None] & cm[None, :])
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        publish_header(header_ptrs, e, half, rank, W, op, fingerprint, tl.load(number_ptr), W_PAD)
    raise_flags_when_done(state_ptr, flag_ptrs, e, rank, W, W_PAD)


@triton.jit
def ll_combine_recv(back_ptr, pos_ptr, out_ptr, number_ptr, header_ptr, flags_ptr, state_ptr, waiter, T, N, W, cap,
                    back_slot, stride_out, fingerprint, W_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, CLOCK: tl.constexpr):
    """Grid (max(blocks of tokens, 1), column tiles): once every owner's flag is up and its header names the same
    dispatch as this rank's (else ERR_MISMATCH), ``out[t]`` = Σ over owners d in rank order of the partial d
    returned for t (``positions[t, d]`` = d · cap + its place; -1: none), in float32, rounded once; the last program
    out counts the call."""
    e = tl.load(state_ptr) + 1
    half = e & 1
    wait_every_source(flags_ptr, header_ptr, e, half, waiter, W, fingerprint, CLOCK)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        same_dispatch(header_ptr, number_ptr, e, half, waiter, W, W_PAD)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < T
    col_ok = cols < N
    dd = tl.arange(0, W_PAD)
    pos = tl.load(pos_ptr + rows[:, None] * W + dd[None, :], mask=row_ok[:, None] & (dd < W)[None, :], other=-1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for d in tl.static_range(W_PAD):
        idx = tl.sum(tl.where(dd[None, :] == d, pos, 0), axis=1)
        hit = idx >= 0
        at = (half * W + idx // cap).to(tl.int64) * back_slot + (idx % cap).to(tl.int64) * N
        vals = tl.load(back_ptr + tl.where(hit, at, 0)[:, None] + cols[None, :], mask=hit[:, None] & col_ok[None, :],
                       other=0.0, cache_modifier=".cg").to(tl.float32)
        acc += vals
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
    count_call_when_done(state_ptr, e)


__all__ = ["ll_combine_recv", "ll_combine_send", "ll_expand", "ll_send", "place_runs"]
