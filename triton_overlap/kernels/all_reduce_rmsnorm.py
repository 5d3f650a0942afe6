"""The one-shot AllReduce of an [rows, hidden] tensor with one block per row (``BLOCK`` >= hidden), and each row's
residual add and RMSNorm as the epilogue of its sum, so the three steps are one launch (ops.all_reduce_rmsnorm):
``residual_out = residual + sum``, rounded once to its dtype, and ``out = residual_out * rsqrt(mean(residual_out **
2) + eps) * weight`` in float32 from the rounded residual (so ``out`` is the norm of exactly the residual returned).
Every rank sums in rank order and normalises the same bits, so every rank's outputs are equal. ``FP8_MAX`` > 0 (the
fp8 format's largest value): ``out`` is fp8 with a per-row float32 scale, ``scale[r] = max(|norm row|) / FP8_MAX``
(at least 2^-126) and ``out = norm / scale``, so ``out * scale`` is the norm.

Two kernels, one per protocol (kernels.all_reduce has both protocols' reasoning): ``one_shot_all_reduce_rmsnorm``
over tagged words (one trip over the link, twice the bytes: small messages) and ``one_shot_all_reduce_rmsnorm_flags``
over plain slots and a flag per row (larger ones). Both hold a row as two halves, the values at even and at odd
places (kernels.tagged_exchange.load_bits), and share the epilogue, ``norm_row``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .slot_exchange import close_call, count_call, notify_block, open_call, publish_header, push, wait_block
from .tagged_exchange import (join_bits, load_bits, load_halves, pack, publish_tagged_header, split_bits,
                              store_bits, sum_words, words_below)


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
def norm_row(lo, hi, r, residual_ptr, weight_ptr, out_ptr, scale_ptr, residual_out_ptr, hidden, eps, wcols,
             PACK: tl.constexpr, WORD_IO: tl.constexpr, FP8_MAX: tl.constexpr):
    """Row ``r``'s epilogue: its sum over ranks (float32 halves ``lo``, ``hi``, load_bits' places) plus the
    residual into ``residual_out``, and that residual's RMSNorm times the weight into ``out`` (with its scale where
    FP8_MAX > 0)."""
    dt = residual_out_ptr.dtype.element_ty
    res_lo, res_hi = split_bits(load_bits(residual_ptr + r * hidden, wcols, hidden, PACK, WORD_IO), dt, PACK)
    h_lo = (lo + res_lo.to(tl.float32)).to(dt)
    h_hi = (hi + res_hi.to(tl.float32)).to(dt)
    store_bits(residual_out_ptr + r * hidden, wcols, hidden, join_bits(h_lo, h_hi, PACK), PACK, WORD_IO)
    f_lo = h_lo.to(tl.float32)  # masked columns are 0: they add nothing to the mean
    f_hi = h_hi.to(tl.float32)
    squares = tl.sum(f_lo * f_lo, axis=0)
    if PACK == 2:  # (where PACK = 1 the high half repeats the low one)
        squares += tl.sum(f_hi * f_hi, axis=0)
    rstd = 1.0 / tl.sqrt(squares / hidden + eps)
    if weight_ptr.dtype.element_ty == dt:
        w_lo, w_hi = split_bits(load_bits(weight_ptr, wcols, hidden, PACK, WORD_IO), dt, PACK)
    else:  # a float32 weight
        w_lo, w_hi = load_halves(weight_ptr, wcols, hidden, PACK)
    y_lo = f_lo * rstd * w_lo.to(tl.float32)
    y_hi = f_hi * rstd * w_hi.to(tl.float32)
    if FP8_MAX > 0:
        amax = tl.max(tl.abs(y_lo), axis=0)
        if PACK == 2:
            amax = tl.maximum(amax, tl.max(tl.abs(y_hi), axis=0))
        scale = tl.maximum(tl.div_rn(amax, FP8_MAX), 1.1754943508222875e-38)
        tl.store(scale_ptr + r, scale)
        y_lo = e4m3_grid(tl.div_rn(y_lo, scale))  # (correctly rounded divisions: torch's, not the fast one)
        y_hi = e4m3_grid(tl.div_rn(y_hi, scale))
        c = wcols * PACK  # one byte a value: the two halves' places, one store each
        tl.store(out_ptr + r * hidden + c, y_lo.to(out_ptr.dtype.element_ty), mask=c < hidden)
        if PACK == 2:
            tl.store(out_ptr + r * hidden + c + 1, y_hi.to(out_ptr.dtype.element_ty), mask=c + 1 < hidden)
    else:
        od = out_ptr.dtype.element_ty
        store_bits(out_ptr + r * hidden, wcols, hidden, join_bits(y_lo.to(od), y_hi.to(od), PACK), PACK, WORD_IO)


@triton.jit
def one_shot_all_reduce_rmsnorm(x_ptr, residual_ptr, weight_ptr, out_ptr, scale_ptr, residual_out_ptr, word_ptrs,
                                header_ptrs, local_words, local_header, state_ptr, rows, hidden, eps, cap, waiter,
                                world, fingerprint, BLOCK: tl.constexpr, PACK: tl.constexpr, WORD_IO: tl.constexpr,
                                BLOCK_W: tl.constexpr, CLOCK: tl.constexpr, ONE_PROGRAM: tl.constexpr,
                                FP8_MAX: tl.constexpr = 0.0, PDL: tl.constexpr = False):
    """Over tagged words: row ``r`` is ``BLOCK // PACK`` words at word ``r * BLOCK // PACK`` of each slot.
    ``PDL``: launched as a programmatic dependent (slot_exchange.open_call)."""
    open_call(PDL)
    rank = waiter[2]
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    e = tl.load(state_ptr) + 1
    half = e & 1
    WORDS: tl.constexpr = BLOCK // PACK
    publish_tagged_header(header_ptrs, e, half, rank, world, waiter[3], fingerprint, rows * hidden, BLOCK_W)
    wcols = tl.arange(0, WORDS)
    for r in range(pid, rows, programs):
        bits = load_bits(x_ptr + r * hidden, wcols, hidden, PACK, WORD_IO)
        push(pack(bits, e), word_ptrs, r * WORDS + wcols, wcols < words_below(hidden, PACK, WORD_IO), cap, half,
                   rank, world)
    for r in range(pid, rows, programs):
        lo, hi = sum_words(x_ptr + r * hidden, hidden, wcols, local_words, local_header, r * WORDS + wcols, cap, e,
                           half, rows * hidden, waiter, world, fingerprint, r, PACK, WORD_IO, CLOCK)
        norm_row(lo, hi, r, residual_ptr, weight_ptr, out_ptr, scale_ptr, residual_out_ptr, hidden, eps, wcols, PACK,
                 WORD_IO, FP8_MAX)
    close_call(state_ptr, e, ONE_PROGRAM)


@triton.jit
def one_shot_all_reduce_rmsnorm_flags(x_ptr, residual_ptr, weight_ptr, out_ptr, scale_ptr, residual_out_ptr,
                                      data_ptrs, flag_ptrs, header_ptrs, local_data, local_flags, local_header,
                                      state_ptr, rows, hidden, eps, cap, max_blocks, waiter, world, fingerprint,
                                      BLOCK: tl.constexpr, PACK: tl.constexpr, WORD_IO: tl.constexpr,
                                      BLOCK_W: tl.constexpr, CLOCK: tl.constexpr, FP8_MAX: tl.constexpr = 0.0,
                                      PDL: tl.constexpr = False):
    """Over plain slots: row ``r`` at element ``r * hidden`` of each slot, then the row's flag in every peer.
    ``PDL`` as in the tagged kernel."""
    open_call(PDL)
    rank = waiter[2]
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    e = tl.load(state_ptr) + 1
    half = e & 1
    publish_header(header_ptrs, e, half, rank, world, waiter[3], fingerprint, rows * hidden, BLOCK_W)
    cols = tl.arange(0, BLOCK)
    for r in range(pid, rows, programs):
        offs = r * hidden + cols
        push(tl.load(x_ptr + offs, mask=cols < hidden), data_ptrs, offs, cols < hidden, cap, half, rank, world)
        notify_block(flag_ptrs, e, rank, r, max_blocks, world, BLOCK_W)
    wcols = tl.arange(0, BLOCK // PACK)
    dt = x_ptr.dtype.element_ty
    for r in range(pid, rows, programs):
        lo = tl.zeros(wcols.shape, tl.float32)
        hi = tl.zeros(wcols.shape, tl.float32)
        for p in range(0, world):  # in rank order
            if p == rank:
                bits = load_bits(x_ptr + r * hidden, wcols, hidden, PACK, WORD_IO)
            else:
                wait_block(local_flags, local_header, p, r, max_blocks, e, half, waiter, world, fingerprint, CLOCK)
                bits = load_bits(local_data + (half * world + p) * cap + r * hidden, wcols, hidden, PACK, WORD_IO,
                                 True)
            part_lo, part_hi = split_bits(bits, dt, PACK)
            lo += part_lo.to(tl.float32)
            hi += part_hi.to(tl.float32)
        norm_row(lo, hi, r, residual_ptr, weight_ptr, out_ptr, scale_ptr, residual_out_ptr, hidden, eps, wcols, PACK,
                 WORD_IO, FP8_MAX)
    count_call(state_ptr, e)
