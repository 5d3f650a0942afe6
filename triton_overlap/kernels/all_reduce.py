"""AllReduce in one kernel. One-shot: every rank stores its input into every peer's receive slot as tagged words
(kernels.tagged_exchange: each word carries the call number, so it is its own flag), then sums the W slots of each
block in float32 as their words arrive. Two-shot: each block is summed by one owner, which sends the sum to every
peer; its parts and sums are flagged per block (kernels.slot_exchange).

The workspace of each rank holds two halves of W slots ([2, W, cap]); call number ``e`` (counted on the device, so
a replayed CUDA graph counts on) uses half ``e % 2``. A peer that stores call ``e + 1``'s data into this rank's
slots has finished call ``e``, for which it waited on this rank's call-``e`` data: this rank had started call
``e``, so it had finished reading half ``(e + 1) % 2`` in call ``e - 1``. That holds because the halves of
consecutive calls never overlap: ``cap`` is the whole buffer's slot until the buffer grows
(ops.all_reduce.slot_elements), and a grown buffer is new memory. No barrier is needed between calls, only the
call numbers in the words or the per-block flags, which only grow. Before its data every program stores the call's
header (call, op, fingerprint, size) into every peer; a rank whose peer's header differs from its own records
ERR_MISMATCH, so ranks that pass different sizes get an error, not a sum of mismatched buffers.

Every program stores all its blocks before it waits on a peer's, and the two-shot's sums wait only on parts: with
at most one program per compute unit (all resident) no program waits for one that cannot run. The W parts of a
block are summed in rank order, so every rank's result is the same to the bit.

kernels.all_reduce_rmsnorm has the one-shot with the residual add and RMSNorm of each row as its epilogue.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .slot_exchange import (close_call, count_call, notify_block, open_call, publish_header, push, sum_parts,
                            wait_block)
from .tagged_exchange import (join_bits, load_bits, pack, publish_tagged_header, store_bits, sum_words,
                              words_below)


@triton.jit
def one_shot_all_reduce(x_ptr, out_ptr, word_ptrs, header_ptrs, local_words, local_header, state_ptr, n, cap, waiter,
                        world, fingerprint, BLOCK: tl.constexpr, PACK: tl.constexpr, WORD_IO: tl.constexpr,
                        BLOCK_W: tl.constexpr, CLOCK: tl.constexpr, ONE_PROGRAM: tl.constexpr,
                        PDL: tl.constexpr = False):
    """The one-shot over the tagged exchange: block ``b`` of ``BLOCK`` elements is ``BLOCK // PACK`` tagged words
    at word ``b * BLOCK // PACK`` of each slot (PACK: values a word, 2 for 16-bit dtypes, 1 for float32; WORD_IO:
    x and out read and written 32 bits at a time, kernels.tagged_exchange.load_bits). ``ONE_PROGRAM``: the launch
    has one program (it counts the call without an atomic). ``PDL``: launched as a programmatic dependent
    (slot_exchange.open_call)."""
    open_call(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rank = waiter[2]
    e = tl.load(state_ptr) + 1  # this call's number, the same on every rank
    half = e & 1
    n_blocks = tl.cdiv(n, BLOCK)
    WORDS: tl.constexpr = BLOCK // PACK
    publish_tagged_header(header_ptrs, e, half, rank, world, waiter[3], fingerprint, n, BLOCK_W)
    wcols = tl.arange(0, WORDS)
    for b in range(pid, n_blocks, programs):
        bits = load_bits(x_ptr + b * BLOCK, wcols, n - b * BLOCK, PACK, WORD_IO)
        push(pack(bits, e), word_ptrs, b * WORDS + wcols, wcols < words_below(n - b * BLOCK, PACK, WORD_IO), cap,
                   half, rank, world)
    dt = out_ptr.dtype.element_ty
    for b in range(pid, n_blocks, programs):
        lo, hi = sum_words(x_ptr + b * BLOCK, n - b * BLOCK, wcols, local_words, local_header, b * WORDS + wcols, cap,
                           e, half, n, waiter, world, fingerprint, b, PACK, WORD_IO, CLOCK)
        store_bits(out_ptr + b * BLOCK, wcols, n - b * BLOCK, join_bits(lo.to(dt), hi.to(dt), PACK), PACK, WORD_IO)
    close_call(state_ptr, e, ONE_PROGRAM)


@triton.jit
def two_shot_all_reduce(x_ptr, out_ptr, data_ptrs, flag_ptrs, header_ptrs, local_data, local_flags, local_header,
                        state_ptr, n, cap, max_blocks, waiter, world, fingerprint,
                        BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, CLOCK: tl.constexpr):
    """Block ``b`` belongs to rank ``b % W``. Every rank stores its part of each block into the block's owner (slot
    [half][rank]); the owner sums the W parts and stores the sum into every peer (slot [half][owner]); every rank
    copies the sums of the blocks it does not own. Each rank sends 2 (W - 1) / W of the message instead of W - 1
    times it (one-shot), at the cost of a second wait; the slots the parts land in (blocks this rank owns) and those
    the sums land in (blocks the sender owns) never overlap. The same parity argument as the one-shot's holds: a
    rank's slots are written for call e + 1 only by ranks that have seen its part or its sum of call e or later."""
    err_ptr, budget, rank, op = waiter
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    e = tl.load(state_ptr) + 1
    half = e & 1
    n_blocks = tl.cdiv(n, BLOCK)
    publish_header(header_ptrs, e, half, rank, world, op, fingerprint, n, BLOCK_W)
    # parts: this rank's part of every block another rank owns, into the owner
    for b in range(pid, n_blocks, programs):
        owner = b % world
        if owner != rank:
            offs = b * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n)
            base = tl.load(data_ptrs + owner).to(tl.pointer_type(x_ptr.dtype.element_ty))
            tl.store(base + (half * world + rank) * cap + offs, x, mask=offs < n)
            tl.debug_barrier()
            tl.atomic_xchg(tl.load(flag_ptrs + owner).to(tl.pointer_type(tl.int32)) + rank * max_blocks + b, e,
                           sem="release", scope="sys")
    # sums: the blocks this rank owns, from every peer's part, into every peer
    for b in range(pid, n_blocks, programs):
        if b % world == rank:
            offs = b * BLOCK + tl.arange(0, BLOCK)
            inside = offs < n
            acc = sum_parts(tl.zeros((BLOCK,), tl.float32), x_ptr, local_data, local_flags, local_header, b, offs,
                            inside, cap, max_blocks, e, half, waiter, world, fingerprint, CLOCK)
            y = acc.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + offs, y, mask=inside)
            push(y, data_ptrs, offs, inside, cap, half, rank, world)
            notify_block(flag_ptrs, e, rank, b, max_blocks, world, BLOCK_W)
    # the sums of the blocks others own
    for b in range(pid, n_blocks, programs):
        owner = b % world
        if owner != rank:
            offs = b * BLOCK + tl.arange(0, BLOCK)
            wait_block(local_flags, local_header, owner, b, max_blocks, e, half, waiter, world, fingerprint, CLOCK)
            y = tl.load(local_data + (half * world + owner) * cap + offs, mask=offs < n, cache_modifier=".cg")
            tl.store(out_ptr + offs, y, mask=offs < n)
    count_call(state_ptr, e)
