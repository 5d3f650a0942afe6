"""AllReduce in one kernel. One-shot: every rank stores its input into every peer's receive slot, raises a flag per
block in every peer, then sums the W slots of each block in float32 as their flags arrive. Two-shot (larger
messages): each block is summed by one owner, which sends the sum to every peer.

The workspace of each rank holds two halves of W slots ([2, W, cap]); call number ``e`` (counted on the device, so
a replayed CUDA graph counts on) uses half ``e % 2``. A peer that stores call ``e + 1``'s data into this rank's
slots has finished call ``e``, for which it waited on this rank's call-``e`` flags: this rank had started call ``e``,
so it had finished reading half ``(e + 1) % 2`` in call ``e - 1``. That holds because the halves of consecutive
calls never overlap: ``cap`` is the whole buffer's slot until the buffer grows (ops.all_reduce.slot_elements),
and a grown buffer is new memory. No barrier is needed between calls, only the per-block flags, which carry the
call number and only grow. Before its flags, every program stores the call's header (call, op, fingerprint, size)
into every peer; a rank whose peer's header differs from its own records ERR_MISMATCH, so ranks that pass
different sizes get an error, not a sum of mismatched buffers.

Every program stores all its blocks before it waits on a peer's, and the two-shot's sums wait only on parts: with
at most one program per compute unit (all resident) no program waits for one that cannot run. The W parts of a
block are summed in rank order, so every rank's result is the same to the bit.

``one_shot_all_reduce_rmsnorm`` is the one-shot with a block per row and the residual add and RMSNorm of the row
as the epilogue of its sum (ops.all_reduce_rmsnorm).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .slot_exchange import count_call, notify_block, publish_header, push, sum_parts, wait_block


@triton.jit
def one_shot_all_reduce(x_ptr, out_ptr, data_ptrs, flag_ptrs, header_ptrs, local_data, local_flags, local_header,
                        state_ptr, n, cap, max_blocks, waiter, world, fingerprint,
                        BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, CLOCK: tl.constexpr):
    """``waiter``: kernels.signal.waiter's (error word, budget, rank, op)."""
    err_ptr, budget, rank, op = waiter
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    e = tl.load(state_ptr) + 1  # this call's number, the same on every rank
    half = e % 2
    n_blocks = tl.cdiv(n, BLOCK)
    publish_header(header_ptrs, e, half, rank, world, op, fingerprint, n, BLOCK_W)
    # this rank's blocks, into every peer's slot [half][rank]; then the block's flag in every peer
    for b in range(pid, n_blocks, programs):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        push(tl.load(x_ptr + offs, mask=inside), data_ptrs, offs, inside, cap, half, rank, world)
        notify_block(flag_ptrs, e, rank, b, max_blocks, world, BLOCK_W)
    # each block: every peer's flag, then the sum of the W slots in rank order
    for b in range(pid, n_blocks, programs):
        offs = b * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        acc = sum_parts(tl.zeros((BLOCK,), tl.float32), x_ptr, local_data, local_flags, local_header, b, offs,
                        inside, cap, max_blocks, e, half, waiter, world, fingerprint, CLOCK)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=inside)
    count_call(state_ptr, e)



@triton.jit
def e4m3_grid(y):
    """float32 ``y`` (|y| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still in float32: the
    mantissa cut to 3 bits for normal values, multiples of 2^-9 below 2^-6 (e4m3's subnormals). The conversion of
    the result to fp8 is then exact on every backend (Triton's interpreter rounds some values wrongly itself)."""
    mag = tl.abs(y)
    bits = mag.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    small = ((mag * 512.0 + 12582912.0) - 12582912.0) / 512.0  # (adding 1.5 * 2^23 rounds to an integer)
    r = tl.where(mag < 0.015625, small, normal)
    sign = y.to(tl.int32, bitcast=True) & -2147483648  # (-0.0 stays -0.0)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def one_shot_all_reduce_rmsnorm(x_ptr, residual_ptr, weight_ptr, out_ptr, scale_ptr, residual_out_ptr, data_ptrs,
                                flag_ptrs, header_ptrs, local_data, local_flags, local_header, state_ptr, rows, hidden,
                                eps, cap, max_blocks, waiter, world, fingerprint, BLOCK: tl.constexpr,
                                BLOCK_W: tl.constexpr, CLOCK: tl.constexpr, FP8_MAX: tl.constexpr = 0.0):
    """The one-shot AllReduce of an [rows, hidden] tensor with one block per row (``BLOCK`` >= hidden), and each
    row's residual add and RMSNorm as the epilogue of its sum, so the three steps are one launch:
    ``residual_out = residual + sum``, rounded once to its dtype, and ``out = residual_out * rsqrt(mean(residual_out
    ** 2) + eps) * weight`` in float32 from the rounded residual (so ``out`` is the norm of exactly the residual
    returned). Every rank sums in rank order and normalises the same bits, so every rank's outputs are equal.
    ``FP8_MAX`` > 0 (the fp8 format's largest value): ``out`` is fp8 with a per-row float32 scale, ``scale[r] =
    max(|norm row|) / FP8_MAX`` (at least 2^-126) and ``out = norm / scale``, so ``out * scale`` is the norm."""
    err_ptr, budget, rank, op = waiter
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    e = tl.load(state_ptr) + 1
    half = e % 2
    publish_header(header_ptrs, e, half, rank, world, op, fingerprint, rows * hidden, BLOCK_W)
    cols = tl.arange(0, BLOCK)
    in_row = cols < hidden
    for r in range(pid, rows, programs):
        offs = r * hidden + cols
        push(tl.load(x_ptr + offs, mask=in_row), data_ptrs, offs, in_row, cap, half, rank, world)
        notify_block(flag_ptrs, e, rank, r, max_blocks, world, BLOCK_W)
    for r in range(pid, rows, programs):
        offs = r * hidden + cols
        acc = sum_parts(tl.zeros((BLOCK,), tl.float32), x_ptr, local_data, local_flags, local_header, r, offs,
                        in_row, cap, max_blocks, e, half, waiter, world, fingerprint, CLOCK)
        acc += tl.load(residual_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
        h = acc.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + offs, h, mask=in_row)
        hf = h.to(tl.float32)  # masked columns are 0: they add nothing to the mean
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
        w = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)  # per row: fewer live registers
        y = hf * rstd * w
        if FP8_MAX > 0:
            scale = tl.maximum(tl.div_rn(tl.max(tl.abs(y), axis=0), FP8_MAX), 1.1754943508222875e-38)
            tl.store(scale_ptr + r, scale)
            y = e4m3_grid(tl.div_rn(y, scale))  # (correctly rounded divisions: torch's, not the fast one)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=in_row)
    count_call(state_ptr, e)

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
    half = e % 2
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
