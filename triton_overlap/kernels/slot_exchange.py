"""Device code of the flag protocol that the two-shot AllReduce and the larger messages of AllReduce + RMSNorm
(kernels.all_reduce, whose module doc has the protocol; kernels.all_reduce_rmsnorm) and GEMM + AllReduce
(kernels.gemm_all_reduce) share: every rank stores its part of each block into its slot [half][rank] of every peer
and raises the block's flag there, then sums the W slots of each block in rank order as their flags arrive. (The
one-shot's tagged words: kernels.tagged_exchange.)

* ``publish_header``: the call's header into every peer, before any flag of the call;
* ``push`` and ``notify_block``: a block into every peer's slot, then its flag in every peer;
* ``sum_parts`` (by way of ``wait_block``): a block's sum over ranks, each peer's part once its flag is up and its
  header matches this rank's call;
* ``count_call`` (``close_call``): the last program out records the call as done;
* ``open_call``: where launched as a programmatic dependent, the wait for the kernel before it.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .signal import check_header, wait_for


@triton.jit
def publish_header(header_ptrs, e, half, rank, world, op, fingerprint, n, BLOCK_W: tl.constexpr):
    """This call's header (call, op, fingerprint, size) into every peer's table at [half][rank]."""
    peers = tl.arange(0, BLOCK_W)
    to_peer = peers < world
    zero = tl.zeros((BLOCK_W,), tl.int32)
    hdr = tl.load(header_ptrs + peers, mask=to_peer, other=0).to(tl.pointer_type(tl.int32)) + (half * world + rank) * 4
    tl.store(hdr, zero + e, mask=to_peer)
    tl.store(hdr + 1, zero + op, mask=to_peer)
    tl.store(hdr + 2, zero + fingerprint, mask=to_peer)
    tl.store(hdr + 3, zero + n, mask=to_peer)


@triton.jit
def notify_block(flag_ptrs, e, rank, b, max_blocks, world, BLOCK_W: tl.constexpr):
    """Block ``b``'s flag from this rank := e in every peer (release: the program's stores land first)."""
    tl.debug_barrier()
    peers = tl.arange(0, BLOCK_W)
    flags = tl.load(flag_ptrs + peers, mask=peers < world, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(flags + rank * max_blocks + b, tl.zeros((BLOCK_W,), tl.int32) + e, mask=peers < world,
                   sem="release", scope="sys")


@triton.jit
def wait_block(local_flags, local_header, p, b, max_blocks, e, half, waiter, world, fingerprint, CLOCK: tl.constexpr):
    """Wait (bounded) until peer ``p`` has raised block ``b``'s flag for call ``e``, then compare its header with this
    rank's: a difference is ERR_MISMATCH. Every thread of the program is ordered after the wait."""
    err_ptr, budget, rank, op = waiter
    if wait_for(local_flags + p * max_blocks + b, e, waiter, p, b, CLOCK):
        check_header(local_header + (half * world + p) * 4, e, op, fingerprint, err_ptr, rank, p, 4)
    tl.debug_barrier()


@triton.jit
def push(x, data_ptrs, offs, inside, cap, half, rank, world):
    """``x`` (a block at ``offs``) into slot [half][rank] of every peer."""
    for p in range(0, world):
        if p != rank:
            base = tl.multiple_of(tl.load(data_ptrs + p).to(tl.pointer_type(x.dtype)), 16)  # (a heap allocation)
            tl.store(base + (half * world + rank) * cap + offs, x, mask=inside)


@triton.jit
def sum_parts(acc, x_ptr, local_data, local_flags, local_header, b, offs, inside, cap, max_blocks, e, half, waiter,
              world, fingerprint, CLOCK: tl.constexpr):
    """``acc`` (float32 zeros of the block's shape) plus block ``b``'s sum over ranks, in rank order: this rank's part
    from ``x``, each peer's from its slot once its flag is up."""
    rank = waiter[2]
    for p in range(0, world):
        if p == rank:
            acc += tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        else:
            wait_block(local_flags, local_header, p, b, max_blocks, e, half, waiter, world, fingerprint, CLOCK)
            acc += tl.load(local_data + (half * world + p) * cap + offs, mask=inside, other=0.0,
                           cache_modifier=".cg").to(tl.float32)
    return acc


@triton.jit
def count_call(state_ptr, e):
    """The last program out records call ``e`` as done (every program has read the count by then)."""
    tl.debug_barrier()
    if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, e)


@triton.jit
def open_call(PDL: tl.constexpr):
    """A kernel's first step where it is launched as a programmatic dependent (``PDL``, Hopper on): wait until the
    kernel before it on the stream has finished and its stores are visible (nothing is read before this: the call
    count, the inputs), then let the next kernel launch at once, so that its launch overlaps this call instead of
    following it."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def close_call(state_ptr, e, ONE_PROGRAM: tl.constexpr):
    """Record call ``e`` as done: ``count_call``, or where the launch has one program (``ONE_PROGRAM``) a plain store,
    which the next launch on the stream sees (no atomic on the kernel's last step)."""
    if ONE_PROGRAM:
        tl.store(state_ptr, e)
    else:
        count_call(state_ptr, e)
