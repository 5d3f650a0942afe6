"""One-shot AllReduce in one kernel: every rank stores its input into every peer's receive slot, raises a flag per
block in every peer, then sums the W slots of each block in float32 as their flags arrive.

The workspace of each rank holds two halves of W slots ([2, W, cap]); call number ``e`` (counted on the device, so
a replayed CUDA graph counts on) uses half ``e % 2``. A peer that stores call ``e + 1``'s data has finished call
``e``, and so has read this rank's call ``e - 1`` data, which is what half ``(e + 1) % 2`` held: no barrier is needed
between calls, only the per-block flags, which carry the call number and only grow. Before its flags, every program
stores the call's header (call, op, fingerprint, size) into every peer; a rank whose peer's header differs from its
own records ERR_MISMATCH, so ranks that pass different sizes get an error, not a sum of mismatched buffers.

Every program first stores all its blocks, then waits: with at most one program per compute unit (all resident) no
program waits for one that cannot run. The W slots are summed in rank order on every rank, so every rank's result
is the same to the bit.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .signal import ERR_CALL, ERR_MISMATCH, ERR_OP, ERR_OWN_FINGERPRINT, ERR_PEER, ERR_PEER_HEADER, ERR_RANK, \
    load_acquire, wait_flag


@triton.jit
def one_shot_all_reduce(x_ptr, out_ptr, data_ptrs, flag_ptrs, header_ptrs, local_data, local_flags, local_header,
                        state_ptr, n, cap, max_blocks, err_ptr, budget, rank, world, op, fingerprint,
                        BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, CLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    e = tl.load(state_ptr) + 1  # this call's number, the same on every rank
    half = e % 2
    n_blocks = tl.cdiv(n, BLOCK)
    peers = tl.arange(0, BLOCK_W)
    to_peer = peers < world
    zero = tl.zeros((BLOCK_W,), tl.int32)
    # the header, into every peer's table at [half][rank]
    hdr = tl.load(header_ptrs + peers, mask=to_peer, other=0).to(tl.pointer_type(tl.int32)) + (half * world + rank) * 4
    tl.store(hdr, zero + e, mask=to_peer)
    tl.store(hdr + 1, zero + op, mask=to_peer)
    tl.store(hdr + 2, zero + fingerprint, mask=to_peer)
    tl.store(hdr + 3, zero + n, mask=to_peer)
    # this rank's blocks, into every peer's slot [half][rank]; then the block's flag in every peer
    for b in range(pid, n_blocks, programs):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside)
        for p in range(0, world):
            base = tl.load(data_ptrs + p).to(tl.pointer_type(x_ptr.dtype.element_ty))
            tl.store(base + (half * world + rank) * cap + offs, x, mask=inside)
        tl.debug_barrier()  # every store of the program comes before its flags
        flags = tl.load(flag_ptrs + peers, mask=to_peer, other=0).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flags + rank * max_blocks + b, zero + e, mask=to_peer, sem="release", scope="sys")
    # each block: every peer's flag, then the sum of the W slots in rank order
    for b in range(pid, n_blocks, programs):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        acc = tl.zeros((BLOCK,), tl.float32)
        for p in range(0, world):
            if p == rank:
                acc += tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
            else:
                if wait_flag(local_flags + p * max_blocks + b, e, err_ptr, budget, rank, op, p, b, CLOCK):
                    h = local_header + (half * world + p) * 4
                    bad = (load_acquire(h) != e) | (tl.load(h + 1, volatile=True) != op)
                    bad = bad | (tl.load(h + 2, volatile=True) != fingerprint)
                    if bad:
                        if tl.atomic_cas(err_ptr, 0, ERR_MISMATCH, sem="acq_rel", scope="gpu") == 0:
                            tl.store(err_ptr + ERR_RANK, rank)
                            tl.store(err_ptr + ERR_OP, op)
                            tl.store(err_ptr + ERR_PEER, p)
                            tl.store(err_ptr + ERR_CALL, e)
                            for i in range(0, 4):
                                tl.store(err_ptr + ERR_PEER_HEADER + i, tl.load(h + i, volatile=True))
                            tl.store(err_ptr + ERR_OWN_FINGERPRINT, fingerprint)
                tl.debug_barrier()  # the flag's acquire comes before every thread's loads
                slot = local_data + (half * world + p) * cap
                acc += tl.load(slot + offs, mask=inside, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=inside)
    # the last program out counts the call (every program has read the count by then)
    tl.debug_barrier()
    if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, e)
