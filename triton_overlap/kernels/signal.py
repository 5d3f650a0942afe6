"""Signals as seen from Triton kernels: bounded waits, notifies, the barrier.

Every flag is an int32 compared with wrap-around, ``(int32)(flag - target) >= 0``,
the same test ``cuStreamWaitValue32(GEQ)`` makes, so values may grow forever.

A wait spins on an acquire load at system scope. It gives up when its budget
runs out (a clock on GPUs, a spin count in the interpreter) or when another
wait of the same Context has already failed, and records (code, rank, op,
index, seen, wanted) in the Context's error word. The caller skips its work
and the kernel ends; the host turns the word into an exception
(``Context.check``). A wait never hangs.
"""
from __future__ import annotations

import functools
import time

import torch
import triton
import triton.language as tl

# Layout of the error word (int32[ERR_WORDS]) a Context owns; wait_flag writes these slots (1 = timed out).
ERR_CODE, ERR_RANK, ERR_OP, ERR_INDEX, ERR_SEEN, ERR_WANTED = range(6)
ERR_WORDS = 8


@triton.jit
def _cuda_globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


try:  # triton's own helper knows the instruction for each gfx generation
    from triton.language.extra.hip.utils import memrealtime as _hip_realtime
except ImportError:  # older triton: the gfx9 (CDNA) instruction

    @triton.jit
    def _hip_realtime():
        return tl.inline_asm_elementwise("s_memrealtime $0\n s_waitcnt lgkmcnt(0)", "=s", [], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def _now(CLOCK: tl.constexpr):
    if CLOCK == 1:
        t = _cuda_globaltimer()
    else:
        t = _hip_realtime()
    return t


@triton.jit
def load_acquire(ptr):
    """An acquire load at system scope (an atomic add of zero, which every backend has)."""
    return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def wait_flag(flag_ptr, target, err_ptr, budget, rank, op, index, CLOCK: tl.constexpr):
    """Spin until ``(int32)(*flag_ptr - target) >= 0``; return True on success.

    On timeout, records the failure in ``err_ptr`` (first failure wins) and
    returns False. Returns False at once if the error word is already set.
    """
    seen = load_acquire(flag_ptr)
    failed = tl.load(err_ptr, volatile=True) != 0
    if CLOCK == 0:
        start = 0
    else:
        start = _now(CLOCK)
    spins = 0
    while (seen - target < 0) & (~failed):
        seen = load_acquire(flag_ptr)
        spins += 1
        if CLOCK == 0:
            elapsed = spins
        else:
            elapsed = _now(CLOCK) - start
        expired = (elapsed > budget) & (seen - target < 0)
        if expired:
            if tl.atomic_cas(err_ptr, 0, 1, sem="acq_rel", scope="gpu") == 0:
                tl.store(err_ptr + 1, rank)
                tl.store(err_ptr + 2, op)
                tl.store(err_ptr + 3, index)
                tl.store(err_ptr + 4, seen)
                tl.store(err_ptr + 5, target)
        failed = expired | (tl.load(err_ptr, volatile=True) != 0)
    return seen - target >= 0


@triton.jit
def notify(flag_ptr, value):
    """Publish ``value`` with release semantics at system scope."""
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def add_release(counter_ptr, value, GPU_SCOPE: tl.constexpr = False):
    """Add to a counter with release semantics (all earlier stores of this program land first), at system
    scope, or with GPU_SCOPE at device scope (the stores and the counter are this GPU's)."""
    if GPU_SCOPE:
        tl.atomic_add(counter_ptr, value, sem="release", scope="gpu")
    else:
        tl.atomic_add(counter_ptr, value, sem="release", scope="sys")


@triton.jit
def spin_kernel(ticks, CLOCK: tl.constexpr):
    """Spin for ``ticks`` of the GPU's wall clock (CLOCK 1: CUDA %globaltimer, ns; 2: AMD s_memrealtime, 100 MHz),
    whatever the SM clock runs at (timing.time_dist's lead)."""
    t0 = _now(CLOCK)
    t = t0
    while t - t0 < ticks:
        t = _now(CLOCK)


@triton.jit
def wait_kernel(flag_ptr, target, err_ptr, budget, rank, op, index, CLOCK: tl.constexpr):
    wait_flag(flag_ptr, target, err_ptr, budget, rank, op, index, CLOCK)


@triton.jit
def barrier_kernel(peer_slots_ptr, local_slots_ptr, count_ptr, err_ptr, budget, rank, world, op,
                   BLOCK_W: tl.constexpr, CLOCK: tl.constexpr):
    """Device-side barrier across ranks, one program.

    Each rank keeps ``count`` (how many barriers it has passed) in its own
    device memory and a slot per peer in symmetric memory. Arrival number
    ``e = count + 1`` is written (release) into slot ``rank`` of every peer;
    then the rank waits until each of its own slots holds a value >= e.

    Why this is correct, also under CUDA-graph replay: all ranks pass the same
    sequence of barriers, so every rank computes the same ``e`` for the same
    barrier. Slot ``p`` on rank ``r`` is written only by rank ``p`` and only
    grows, so seeing ``>= e`` means ``p`` has arrived at barrier ``e`` (it
    cannot be further than ``e + 1``: that needs ``r``'s arrival at ``e + 1``).
    No value is ever reset, so there is no reset to race with, and ``e`` is
    read from device memory at run time, so a replayed graph does not reuse a
    value baked in on the host.
    """
    offs = tl.arange(0, BLOCK_W)
    mask = offs < world
    e = tl.load(count_ptr) + 1
    peer_base = tl.load(peer_slots_ptr + offs, mask=mask, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(peer_base + rank, tl.zeros((BLOCK_W,), tl.int32) + e, mask=mask, sem="release", scope="sys")
    for p in range(0, world):
        wait_flag(local_slots_ptr + p, e, err_ptr, budget, rank, op, p, CLOCK)
    tl.store(count_ptr, e)


@functools.lru_cache(maxsize=1)
def interpreter_spins_per_second() -> float:
    """Measure how many wait iterations the interpreter runs per second (host backend timeouts)."""
    flag = torch.zeros(1, dtype=torch.int32)
    err = torch.zeros(ERR_WORDS, dtype=torch.int32)
    spins = 200
    t0 = time.perf_counter()
    wait_kernel[(1,)](flag, 1, err, spins, 0, 0, 0, CLOCK=0)
    dt = time.perf_counter() - t0
    return spins / max(dt, 1e-6)
