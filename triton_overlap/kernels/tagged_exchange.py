"""Device code of the tagged slot exchange, the one-shot AllReduce kernels' protocol (kernels.all_reduce): every
8-byte word a rank stores into a peer carries 4 bytes of data in its low half and the call number in its high half,
so each word is its own flag. The reader spins on the words themselves until every one holds this call's number,
and the values it spun on are the data: no fence between the data and a flag, no flag to wait for after the data,
one trip over the link instead of two. It relies on an aligned 8-byte store (a part of a 16-byte vector store) and
an aligned 8-byte load being performed whole, so a word is never seen half written: what NCCL's LL protocol relies
on too; PTX promises it for strong accesses only, and the loads here are volatile, the stores plain. The price is
twice the bytes on the link, which costs less than the round trip it saves up to a few hundred KB
(docs/decisions.md, AllReduce).

Slot [half][p] of the receiving rank holds sender ``p``'s words of calls of parity ``half``; a word holding any
other call's number (an older call's, or zero in new or reset memory) is waited past. The comparison is of 32 bits,
so a word left unwritten for exactly a multiple of 2^32 calls of its op would pass for this call's. Before its data
a sender stores its call's header (op, fingerprint, size) as tagged words too; the reader compares it with its own
call as soon as it carries this call's number: a difference is ERR_MISMATCH, so ranks that pass different sizes get
an error, never a sum of mismatched buffers.

* ``load_bits`` / ``store_bits``, ``split_bits`` / ``join_bits``, ``pack``: a block of 16- or 32-bit values to and
  from the 32 data bits of its words (two 16-bit values a word, at even and odd places), and the bits tagged;
* ``publish_tagged_header``: the call's header into every peer;
* a block's words go into every peer's slot through kernels.slot_exchange.push, as any block does;
* ``wait_words``: a block's words from a peer, once tagged with this call (bounded, as every wait), header checked;
* ``sum_words``: a block's sum over ranks, in rank order.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .signal import (ERR_MISMATCH, ERR_OWN_FINGERPRINT, ERR_PEER_HEADER, ERR_SEEN, ERR_TIMEOUT, HOST_PAUSE, all_threads,
                     claim_fault, error_code, now, record_timeout)

#: words of a call's tagged header: (op, fingerprint, size, 0), each tagged with the call
TAGGED_HEADER_WORDS = tl.constexpr(4)


@triton.jit
def words_below(limit, PACK: tl.constexpr, WORD_IO: tl.constexpr):
    """How many words hold the elements below ``limit`` (a word with one of its two values below it counts). Word
    masks compare word indices with this, not element indices with ``limit``: Triton then sees that a mask is
    constant over a vector's words and loads and stores 16 bytes at a time."""
    if PACK == 1:
        words = limit
    elif WORD_IO:
        words = limit // 2  # (``limit`` even)
    else:
        words = (limit + 1) // 2
    return words


@triton.jit
def load_bits(base, wcols, limit, PACK: tl.constexpr, WORD_IO: tl.constexpr, CG: tl.constexpr = False):
    """The 32 data bits of words ``wcols``, from ``base`` (elements below ``limit``; 0 past it): PACK = 1, the
    32-bit value ``base[w]``; PACK = 2, the 16-bit values ``base[2 w]`` (low half) and ``base[2 w + 1]`` (high half).
    ``WORD_IO`` (PACK = 2, ``base`` 16-byte aligned, ``limit`` a multiple of 8): one 32-bit load a word, vectorised
    (the pointer's cast would hide its alignment from Triton, so it is restated); else two loads of 16-bit values,
    for other sizes and unaligned tensors. ``CG``: past the SM's L1 (``.cg``), for memory a peer has just written."""
    if PACK == 1:
        bits = load_cached(base + wcols, wcols < limit, CG).to(tl.int32, bitcast=True)
    elif WORD_IO:
        bits = load_cached(tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16) + wcols, wcols < limit // 2, CG)
    else:
        lo, hi = load_halves(base, wcols, limit, PACK, CG)
        bits = join_bits(lo, hi, PACK)
    return bits


@triton.jit
def store_bits(base, wcols, limit, bits, PACK: tl.constexpr, WORD_IO: tl.constexpr):
    """``load_bits``' converse: the values that ``bits`` hold, of ``base``'s dtype, into ``base``."""
    if PACK == 1:
        tl.store(base + wcols, bits.to(base.dtype.element_ty, bitcast=True), mask=wcols < limit)
    elif WORD_IO:
        tl.store(tl.multiple_of(base.to(tl.pointer_type(tl.int32)), 16) + wcols, bits, mask=wcols < limit // 2)
    else:
        lo, hi = split_bits(bits, base.dtype.element_ty, PACK)
        tl.store(base + 2 * wcols, lo, mask=2 * wcols < limit)
        tl.store(base + 2 * wcols + 1, hi, mask=2 * wcols + 1 < limit)


@triton.jit
def load_cached(ptrs, mask, CG: tl.constexpr):
    """``tl.load`` of ``ptrs`` (0 where not ``mask``), with the ``.cg`` cache modifier where ``CG``."""
    if CG:
        v = tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg")
    else:
        v = tl.load(ptrs, mask=mask, other=0)
    return v


@triton.jit
def load_halves(base, wcols, limit, PACK: tl.constexpr, CG: tl.constexpr = False):
    """The values of words ``wcols``' places in ``base`` (of any dtype), as ``(lo, hi)``: ``base[2 w]`` and
    ``base[2 w + 1]`` where PACK = 2, ``base[w]`` twice where PACK = 1; 0 from ``limit`` on."""
    c = wcols * PACK
    lo = load_cached(base + c, c < limit, CG)
    if PACK == 2:
        hi = load_cached(base + c + 1, c + 1 < limit, CG)
    else:
        hi = lo
    return lo, hi


@triton.jit
def split_bits(bits, dtype: tl.constexpr, PACK: tl.constexpr):
    """The values ``(lo, hi)`` of ``dtype`` in 32 bits (PACK = 1: ``hi`` is ``lo``, the one 32-bit value)."""
    if PACK == 1:
        lo = bits.to(dtype, bitcast=True)
        hi = lo
    else:
        lo = bits.to(tl.int16).to(dtype, bitcast=True)
        hi = (bits >> 16).to(tl.int16).to(dtype, bitcast=True)
    return lo, hi


@triton.jit
def join_bits(lo, hi, PACK: tl.constexpr):
    """``split_bits``' converse (``hi`` unused where PACK = 1)."""
    if PACK == 1:
        bits = lo.to(tl.int32, bitcast=True)
    else:
        low = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits = low | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)
    return bits


@triton.jit
def pack(bits, e):
    """32 data bits a word, as int64 words tagged with call ``e`` (its high half)."""
    return (bits.to(tl.int64) & 0xFFFFFFFF) | (e.to(tl.int64) << 32)


@triton.jit
def header_values(word, op, fingerprint, n):
    """The call header's values at its words ``word``: (op, fingerprint, size, 0)."""
    return tl.where(word == 0, op, tl.where(word == 1, fingerprint, tl.where(word == 2, n, 0)))


@triton.jit
def publish_tagged_header(header_ptrs, e, half, rank, world, op, fingerprint, n, BLOCK_W: tl.constexpr):
    """This call's header (op, fingerprint, size, 0), tagged with ``e``, into every peer's table at [half][rank]."""
    peers = tl.arange(0, BLOCK_W)
    to_peer = peers < world
    tag = e.to(tl.int64) << 32
    word = tl.arange(0, TAGGED_HEADER_WORDS)
    value = (header_values(word, op, fingerprint, n).to(tl.int64) & 0xFFFFFFFF) | tag
    base = tl.load(header_ptrs + peers, mask=to_peer, other=0).to(tl.pointer_type(tl.int64))
    at = base[:, None] + (half * world + rank) * TAGGED_HEADER_WORDS + word[None, :]
    tl.store(at, tl.zeros((BLOCK_W, TAGGED_HEADER_WORDS), tl.int64) + value[None, :], mask=to_peer[:, None])


@triton.jit
def _tagged(v, mask, e):
    """Whether every word of ``v`` under ``mask`` carries call ``e``: in each thread, for the copies of the words it
    holds (a thread's answer can differ from another's that holds other copies: ``all_threads`` makes it one)."""
    return tl.min(((v >> 32).to(tl.int32) == e) | ~mask, axis=0).to(tl.int1)


#: reads of a block's words between two looks at the clock and the error word (an atomic) in a wait
SPINS = tl.constexpr(8)


@triton.jit
def _header_differs(h, hword, e, n, fingerprint, err_ptr, rank, op, p):
    """Whether peer ``p``'s tagged header ``h`` (this call's) differs from this call's (op, fingerprint, size ``n``):
    then ERR_MISMATCH is recorded with the peer's header (the first failure wins). The same answer in every thread."""
    low = (h & 0xFFFFFFFF).to(tl.int32)
    differs = tl.max((low != header_values(hword, op, fingerprint, n)).to(tl.int32), axis=0) > 0
    if differs:
        if claim_fault(err_ptr, ERR_MISMATCH, rank, op, p, e):
            tl.store(err_ptr + ERR_PEER_HEADER, e)  # (call, op, fingerprint, size), as kernels.signal's header
            tl.store(err_ptr + ERR_PEER_HEADER + 1 + hword, low, mask=hword < 3)
            tl.store(err_ptr + ERR_OWN_FINGERPRINT, fingerprint)
    return differs


@triton.jit
def wait_words(local_words, local_header, p, woffs, wmask, cap, e, half, n, waiter, world, fingerprint, b,
               CLOCK: tl.constexpr):
    """Peer ``p``'s words of this call at word offsets ``woffs`` of slot [half][p], waited for (bounded) until all of
    them and its header carry call ``e``. Its header is compared with this call's (``fingerprint``, size ``n``) as
    soon as it carries ``e``: a difference is ERR_MISMATCH and ends the wait, so a peer that sends fewer words faults
    at once, not at the timeout. On timeout the failure is recorded (the peer, block ``b``, the smallest call number
    seen); after a failure the words returned are not this call's, and the host raises before anyone reads the
    result.

    Every branch is taken alike by all threads: the tag tests are put to a vote of the program (``all_threads``:
    the header's four words are held by many threads, each loading its copy), the error word is read by an atomic
    (kernels.signal.wait_flag has the reasoning)."""
    err_ptr, budget, rank, op = waiter
    slot = local_words + (half * world + p) * cap + woffs
    hword = tl.arange(0, TAGGED_HEADER_WORDS)
    hdr_ptr = local_header + (half * world + p) * TAGGED_HEADER_WORDS + hword
    v = tl.load(slot, mask=wmask, other=0, volatile=True)
    h = tl.load(hdr_ptr, volatile=True)
    ready = all_threads(_tagged(v, wmask, e) & _tagged(h, hword >= 0, e), CLOCK)
    failed = error_code(err_ptr) != 0
    start = now(err_ptr, CLOCK)
    won = False
    while (~ready) & (~failed):
        for _ in range(0, SPINS):  # the clock, the error word and the header once every SPINS reads of the words
            if ~ready:
                if CLOCK == 0:
                    HOST_PAUSE()
                v = tl.load(slot, mask=wmask, other=0, volatile=True)
                h = tl.load(hdr_ptr, volatile=True)
                ready = all_threads(_tagged(v, wmask, e) & _tagged(h, hword >= 0, e), CLOCK)
        elapsed = now(err_ptr, CLOCK) - start
        expired = (elapsed > budget) & ~ready
        code = tl.atomic_cas(err_ptr, 0, tl.where(expired, ERR_TIMEOUT, 0), sem="acq_rel", scope="gpu")
        if expired & (code == 0):  # this swap recorded the timeout (its ERR_SEEN below, after the loop)
            record_timeout(err_ptr, rank, op, p, b, 0, e, elapsed, e, CLOCK)
            won = True
        failed = code != 0
        header_here = all_threads(_tagged(h, hword >= 0, e), CLOCK)
        if (~ready) & (~failed) & header_here:  # the header is here, not every word yet
            failed = _header_differs(h, hword, e, n, fingerprint, err_ptr, rank, op, p)
    if ~ready:  # (a reduction: in a branch every thread takes, not in the one only the recording thread may take)
        seen = tl.min(tl.where(wmask, (v >> 32).to(tl.int32), e), axis=0)
        if won:
            tl.store(err_ptr + ERR_SEEN, seen)
    else:
        _header_differs(h, hword, e, n, fingerprint, err_ptr, rank, op, p)
    return v


@triton.jit
def sum_words(x_base, limit, wcols, local_words, local_header, woffs, cap, e, half, n, waiter, world, fingerprint, b,
              PACK: tl.constexpr, WORD_IO: tl.constexpr, CLOCK: tl.constexpr):
    """Block ``b``'s sum over ranks in float32 as ``(lo, hi)`` (split_bits' halves), in rank order: this rank's part
    from ``x_base`` (elements below ``limit``, words ``wcols``: load_bits), each peer's from its tagged words at slot
    offsets ``woffs`` once they carry call ``e``."""
    rank = waiter[2]
    wmask = wcols < words_below(limit, PACK, WORD_IO)
    dtype = x_base.dtype.element_ty
    acc_lo = tl.zeros(wcols.shape, tl.float32)
    acc_hi = tl.zeros(wcols.shape, tl.float32)
    for p in range(0, world):
        if p == rank:
            bits = load_bits(x_base, wcols, limit, PACK, WORD_IO)
        else:
            words = wait_words(local_words, local_header, p, woffs, wmask, cap, e, half, n, waiter, world,
                               fingerprint, b, CLOCK)
            bits = (words & 0xFFFFFFFF).to(tl.int32)
        lo, hi = split_bits(bits, dtype, PACK)
        acc_lo += lo.to(tl.float32)
        acc_hi += hi.to(tl.float32)
    return acc_lo, acc_hi
