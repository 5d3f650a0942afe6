"""What the backward's dK/dV kernels (kernels.attention_bwd's in Triton, kernels.attention_bwd_hopper's in Gluon)
share around their launches:

* the scratch a backward writes besides its outputs (``BackwardScratch``): delta, the single pass's float32 dQ
  buffer, and where each key block's query heads are split over programs, their partials and tickets
  (``split_scratch``; ``zero_tickets`` before each launch);
* the single pass's frame (``single_pass``): delta and the zeroed dQ buffer before the kernel (``bwd_prologue``),
  dQ = the buffer times the softmax scale after it (``bwd_epilogue``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..plan import cdiv
from .cached_launch import launch


@dataclass
class BackwardScratch:
    """What one backward writes besides dq and the dK/dV partials, and which kernels it runs (``path``: "hopper",
    kernels.attention_bwd_hopper's single kernel; "single pass", the same algorithm in Triton on the host backend;
    "two kernels"). ``delta``: rowsum(dO * O), float32 [B, Hq, S]; ``acc``: the single pass's float32 dQ buffer
    [B, S, Hq, D] (None for two kernels); ``part`` and ``ticket``: the head split's partials and tickets over
    ``split`` programs per key block (both ``flags`` where the split is 1). Allocated before the call is enqueued,
    so that an op replaying its calls (ops.replay) keys them by these addresses too."""

    path: str
    split: int
    delta: torch.Tensor
    acc: torch.Tensor | None
    part: torch.Tensor
    ticket: torch.Tensor

    def tensors(self) -> tuple:
        return self.delta, self.acc, self.part, self.ticket


def split_scratch(flags, blocks: int, split: int, block_n: int, D: int):
    """The dK/dV kernels' scratch for ``split`` shares of the query heads over ``blocks`` key blocks (sources x
    batch x K/V heads x blocks): float32 partials [blocks, split, 2, block_n, D] and an int32 ticket per block
    (zeroed by zero_tickets before each launch). With split 1 neither is read, and ``flags`` stands in for both."""
    if split == 1:
        return flags, flags
    return (torch.empty((blocks, split, 2, block_n, D), dtype=torch.float32, device=flags.device),
            torch.empty(blocks, dtype=torch.int32, device=flags.device))


def zero_tickets(scratch: BackwardScratch) -> None:
    """Enqueue the zeroing of the head split's tickets (nothing where the split is 1: no tickets)."""
    if scratch.split > 1:
        scratch.ticket.zero_()


@triton.jit
def bwd_prologue(do_ptr, o_ptr, delta_ptr, acc_ptr, S_LOCAL, HQ, BLOCK: tl.constexpr, HEAD_D: tl.constexpr):
    """delta = rowsum(dO * O) for BLOCK rows of one (batch, head); the float32 dQ buffer's rows zeroed."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < S_LOCAL
    at = ((bh // HQ * S_LOCAL + rows) * HQ + bh % HQ)[:, None] * HEAD_D + tl.arange(0, HEAD_D)[None, :]
    do = tl.load(do_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
    o = tl.load(o_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh * S_LOCAL + rows, tl.sum(do * o, axis=1), mask=ok)
    tl.store(acc_ptr + at, tl.zeros((BLOCK, HEAD_D), tl.float32), mask=ok[:, None])


@triton.jit
def bwd_epilogue(acc_ptr, dq_ptr, N_ELEM, sm_scale, BLOCK: tl.constexpr):
    """dQ = the float32 buffer times the softmax scale, in dQ's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N_ELEM
    tl.store(dq_ptr + offs, (tl.load(acc_ptr + offs, mask=ok) * sm_scale).to(dq_ptr.dtype.element_ty), mask=ok)


#: rows per program of bwd_prologue
PROLOGUE_ROWS = 64


def single_pass(ctx, dout, out, dq, scale, kernel, scratch: BackwardScratch):
    """The frame of a backward that adds dQ up in the pass over (key block, query block) pairs: delta and the
    float32 dQ buffer of ``scratch``, the buffer zeroed (bwd_prologue), ``kernel(delta, buffer)``, then dQ = the
    buffer times ``scale`` (bwd_epilogue). ``dout``, ``out`` and ``dq`` contiguous, shaped like q. Returns what
    ``kernel`` returns."""
    B, S, Hq, D = dq.shape
    delta, acc = scratch.delta, scratch.acc
    launch(bwd_prologue, (cdiv(S, PROLOGUE_ROWS), B * Hq), (dout, out, delta, acc, S, Hq),
           dict(BLOCK=PROLOGUE_ROWS, HEAD_D=D), num_warps=4)
    ctx.after_launch()
    result = kernel(delta, acc)
    block = 4096
    launch(bwd_epilogue, (cdiv(acc.numel(), block),), (acc, dq, acc.numel(), scale), dict(BLOCK=block), num_warps=4)
    ctx.after_launch()
    return result
