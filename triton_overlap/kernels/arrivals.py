"""Waiting on the caller's stream for one flag per source: a one-program kernel whose bounded waits name the source.

An all-to-all (producers.exchange) raises one flag per source on each receiver: flag ``p`` of rank r's flags is set
by rank p once its block for r has landed. Where the rows that follow are read by torch (a gather, a sum) rather
than by a kernel that waits tile by tile, the caller's stream waits for every source first with ``wait_sources``:
one program that walks the sources in rank order and waits for each flag in turn (kernels.signal.wait_for: an
acquire load at system scope in a bounded spin). A source that never sends is recorded in the Context's error word
as "chunk p of rank p" (one chunk per source, numbered as a gather with one chunk per rank numbers them), so the
fault names the rank, the op, the peer and its block; the waits after it give up at once.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .cached_launch import launch
from .signal import wait_for, waiter


@triton.jit
def wait_sources(flags_ptr, target, waiter, world, CLOCK: tl.constexpr):
    """Wait until ``flags[p] >= target`` for every rank p but this one (``waiter``: kernels.signal.waiter's (error
    word, budget, rank, op))."""
    rank = waiter[2]
    for p in range(0, world):
        if p != rank:
            wait_for(flags_ptr + p, target, waiter, p, p, CLOCK)


def launch_wait_sources(ctx, flags, op: int, target: int = 1) -> None:
    """On the caller's stream: wait for every peer's flag in ``flags`` (this rank's int32 [W] view) to reach
    ``target``; a wait that times out records op ``op`` (Context.op_id) and the source it waited for."""
    launch(wait_sources, (1,), (flags, target, waiter(ctx, op), ctx.world_size), dict(CLOCK=ctx.clock), num_warps=1)
    ctx.after_launch()


__all__ = ["launch_wait_sources", "wait_sources"]
