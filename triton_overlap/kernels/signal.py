"""Signals as seen from Triton kernels: bounded waits, notifies, the barrier that checks every rank makes the same
call.

Every flag is an int32 compared with wrap-around, ``(int32)(flag - target) >= 0``, the same test
``cuStreamWaitValue32(GEQ)`` makes, so values may grow forever.

A wait spins on an acquire load at system scope. It gives up when its budget runs out or when another wait of the
same Context has already failed, and records in the Context's error word what it waited for (the rank it waited
on, which chunk or step, the value it saw and the one it wanted), how long it waited and in which call. The caller
skips its work and the kernel ends; the host turns the word into an exception (``Context.check``). A wait never
hangs.

A kernel that waits takes what its waits share as one argument, ``waiter`` = (error word, budget, rank, op), built on
the host by ``waiter(ctx, op)``, unpacks the rank (and the error word) where it needs them and hands the tuple on to
``wait_for`` and the helpers that wait; CLOCK stays a constexpr of its own, since it picks code when the kernel is
compiled. ``wait_flag`` takes the four one by one, for kernels that hold them apart (the barrier, whose budget and op
are not specialised).

Clocks (``CLOCK``): 1, CUDA's ``%globaltimer`` (ns); 2, AMD's ``s_memrealtime`` (100 MHz); 0, the host backend's,
milliseconds that a thread of the Context writes into the error word (Triton's interpreter has no clock of its own).
On the host backend a wait sleeps ``HOST_POLL_S`` between polls: each rank is a process running the kernels in the
interpreter, and a spinning wait would take a core from the ranks that have work where ranks outnumber cores.
"""
from __future__ import annotations

import time

import triton
import triton.language as tl

# The error word (int32[ERR_WORDS]) a Context owns, slot by slot (Triton reads globals only as constexpr; the host
# indexes with them as with ints). ERR_CODE: ERR_TIMEOUT or ERR_MISMATCH (the first failure wins).
ERR_CODE, ERR_RANK, ERR_OP, ERR_PEER, ERR_WHAT, ERR_SEEN, ERR_WANTED, ERR_ELAPSED_US, ERR_CALL = (
    tl.constexpr(i) for i in range(9))
#: written by every barrier: the call it opened (a wait that fails copies it into ERR_CALL)
ERR_CURRENT_CALL = tl.constexpr(9)
#: the host backend's clock (CLOCK 0), in milliseconds
ERR_NOW_MS = tl.constexpr(10)
#: ERR_MISMATCH: the peer's header (HEADER_WORDS slots from here) and this rank's fingerprint
ERR_PEER_HEADER = tl.constexpr(11)
ERR_OWN_FINGERPRINT = tl.constexpr(19)
#: ERR_RELAYED: the code of the fault on the rank it came from (ERR_RANK)
ERR_ORIGIN_CODE = tl.constexpr(20)
#: the code of this rank's own fault, written with its fields: a peer's relay may overwrite ERR_CODE with
#: ERR_RELAYED between this rank's compare-and-swap and its fields (context.errors, ``observe``)
ERR_OWN_CODE = tl.constexpr(21)
ERR_WORDS = 24
#: ERR_RELAYED: another rank's fault, written into this rank's word by that rank, so that every wait here stops too;
#: ERR_BAD_IDS: a peer's expert ids, seen on the device, leave [0, E) (ERR_PEER the rank, ERR_SEEN and ERR_WANTED its
#: smallest and largest id, ERR_WHAT E)
ERR_TIMEOUT, ERR_MISMATCH, ERR_RELAYED, ERR_BAD_IDS = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3), tl.constexpr(4)
#: ERR_WHAT below zero: what was waited for, when it was not a chunk (WHAT_ANSWER: a host-side exchange;
#: WHAT_OWN_TILES: this rank's own GEMM tiles for a peer's rows, a wait on nothing remote)
WHAT_STARTED, WHAT_PEER_STARTED, WHAT_ARRIVAL, WHAT_PARTIALS, WHAT_ANSWER, WHAT_OWN_TILES = (
    tl.constexpr(i) for i in (-1, -2, -3, -4, -5, -6))

#: how long a host-backend wait sleeps between polls (seconds)
HOST_POLL_S = 5e-4


def _host_pause():
    time.sleep(HOST_POLL_S)


#: called by the waits only where CLOCK is 0 (Triton's interpreter, which runs plain Python); held as a constexpr,
#: which the GPU compilers accept as a reference and never build, the branch that calls it being dead there
HOST_PAUSE = tl.constexpr(_host_pause)

#: a call's header, as the barrier publishes it: (call, op, fingerprint, d0, d1, d2, d3, 0)
HEADER_WORDS = 8


#: How often each wait clock (a kernel's CLOCK) ticks in a second: 0, the milliseconds the host backend's clock
#: thread writes into the error word; 1, CUDA's %globaltimer (ns); 2, AMD's s_memrealtime (100 MHz).
TICKS_PER_SECOND = (1000, 10 ** 9, 10 ** 8)
_US_PER_HOST_TICK = tl.constexpr(10 ** 6 // TICKS_PER_SECOND[0])
_CUDA_TICKS_PER_US = tl.constexpr(TICKS_PER_SECOND[1] // 10 ** 6)
_HIP_TICKS_PER_US = tl.constexpr(TICKS_PER_SECOND[2] // 10 ** 6)


@triton.jit
def _cuda_globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _cuda_all_threads(x):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; bar.red.and.pred q, 0, p; selp.s32 $0, 1, 0, q; }", "=r,r", [x],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def all_threads(pred, CLOCK: tl.constexpr):
    """Whether ``pred`` (a scalar) holds in every thread of the program, the same answer in each: a wait that
    branches on what it read from memory a peer is writing must branch alike in every thread, and a reduction does
    not make it so where the layout holds an element in several threads (a tensor smaller than the program: each
    copy is loaded on its own, and a copy loaded before the peer's store and one after reduce to different
    answers; the threads that leave the loop then meet barriers the others never reach, and the kernel hangs past
    any timeout). CUDA: one barrier-reduction of the program (``bar.red.and``). The interpreter runs the program as
    one thread; on HIP, the reduction's answer (a vote is not built there)."""
    if CLOCK == 1:
        out = _cuda_all_threads(pred.to(tl.int32)) != 0
    else:
        out = pred
    return out


try:  # triton's own helper knows the instruction for each gfx generation
    from triton.language.extra.hip.utils import memrealtime as _hip_realtime
except ImportError:  # older triton: the gfx9 (CDNA) instruction

    @triton.jit
    def _hip_realtime():
        return tl.inline_asm_elementwise("s_memrealtime $0\n s_waitcnt lgkmcnt(0)", "=s", [], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def now(err_ptr, CLOCK: tl.constexpr):
    """The wait clock's reading (``CLOCK``: see the module doc)."""
    if CLOCK == 0:
        t = tl.load(err_ptr + ERR_NOW_MS, volatile=True).to(tl.int64)
    elif CLOCK == 1:
        t = _cuda_globaltimer()
    else:
        t = _hip_realtime()
    return t


@triton.jit
def to_us(ticks, CLOCK: tl.constexpr):
    """``ticks`` of the wait clock in microseconds."""
    if CLOCK == 0:
        us = ticks * _US_PER_HOST_TICK
    elif CLOCK == 1:
        us = ticks // _CUDA_TICKS_PER_US
    else:
        us = ticks // _HIP_TICKS_PER_US
    return us


@triton.jit
def load_acquire(ptr):
    """An acquire load at system scope (an atomic add of zero, which every backend has)."""
    return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


@triton.jit
def error_code(err_ptr):
    """The error word's code, read by an atomic: one thread reads it and hands it to the others, so every thread of
    the program (of the partition) sees the same value and takes the same branch on it."""
    return tl.atomic_add(err_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def record_timeout(err_ptr, rank, op, peer, what, seen, wanted, elapsed, call, CLOCK: tl.constexpr):
    """The details of a timeout, once its compare-and-swap of ERR_TIMEOUT into the error word has won: the rank, op,
    peer, what was waited for (a chunk or a WHAT_* code), the value seen and the one wanted, how long (``elapsed``
    ticks of ``CLOCK``) and in which call. Stores only: no barrier, so a branch taken by one thread may call it."""
    tl.store(err_ptr + ERR_RANK, rank)
    tl.store(err_ptr + ERR_OP, op)
    tl.store(err_ptr + ERR_PEER, peer)
    tl.store(err_ptr + ERR_WHAT, what)
    tl.store(err_ptr + ERR_SEEN, seen)
    tl.store(err_ptr + ERR_WANTED, wanted)
    tl.store(err_ptr + ERR_ELAPSED_US, to_us(elapsed, CLOCK).to(tl.int32))
    tl.store(err_ptr + ERR_CALL, call)
    tl.store(err_ptr + ERR_OWN_CODE, ERR_TIMEOUT)


@triton.jit
def wait_flag(flag_ptr, target, err_ptr, budget, rank, op, peer, what, CLOCK: tl.constexpr):
    """Spin until ``(int32)(*flag_ptr - target) >= 0``; return True on success.

    ``peer``: the rank whose write this waits for (-1: none in particular); ``what``: the chunk, or one of the
    WHAT_* codes. On timeout, records the failure in the error word (the first failure wins) and returns False.
    Returns False at once if the error word is already set.

    Every branch here is taken alike by all threads of the program: Triton makes one thread do a scalar atomic and
    hands its result to the others through a barrier of the whole program (of the partition, in a warp-specialized
    kernel), so a thread that left the loop while another stayed would leave that barrier waiting forever. The flag
    and the error word are read by atomics (the same value everywhere), and the compare-and-swap that records a
    timeout runs on every pass, swapping in ERR_TIMEOUT only where the clock ran out (zero for zero elsewhere).
    Threads read the clock at slightly different times, so they do not branch on it.
    """
    seen = load_acquire(flag_ptr)
    failed = error_code(err_ptr) != 0
    start = now(err_ptr, CLOCK)
    while (seen - target < 0) & (~failed):
        if CLOCK == 0:
            HOST_PAUSE()
        seen = load_acquire(flag_ptr)
        elapsed = now(err_ptr, CLOCK) - start
        expired = (elapsed > budget) & (seen - target < 0)
        code = tl.atomic_cas(err_ptr, 0, tl.where(expired, ERR_TIMEOUT, 0), sem="acq_rel", scope="gpu")
        if expired & (code == 0):  # this swap recorded the timeout (stores only: no barrier in this branch)
            record_timeout(err_ptr, rank, op, peer, what, seen, target, elapsed,
                           tl.load(err_ptr + ERR_CURRENT_CALL, volatile=True), CLOCK)
        failed = code != 0  # after a recording swap, the next pass's swap sees the code and ends the loop
    return seen - target >= 0


@triton.jit
def wait_for(flag_ptr, target, waiter, peer, what, CLOCK: tl.constexpr):
    """``wait_flag`` for a kernel that holds its waits' common arguments as one ``waiter`` (see ``waiter``)."""
    err_ptr, budget, rank, op = waiter
    return wait_flag(flag_ptr, target, err_ptr, budget, rank, op, peer, what, CLOCK)


def waiter(ctx, op: int, rank: int | None = None) -> tuple:
    """What every wait of a kernel launched for ``ctx``'s op ``op`` shares, as one kernel argument that the kernel
    hands on to its waits (``wait_for``): (the error word, the budget, the rank it runs as, the op). ``rank``: None,
    the Context's. Triton specialises a tuple's ints one by one, as it would separate arguments."""
    return (ctx.err, ctx.budget, ctx.rank if rank is None else rank, op)


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
    t0 = now(0, CLOCK)
    t = t0
    while t - t0 < ticks:
        if CLOCK == 0:
            HOST_PAUSE()
        t = now(0, CLOCK)


@triton.jit
def wait_kernel(flag_ptr, target, err_ptr, budget, rank, op, peer, what, CLOCK: tl.constexpr):
    wait_flag(flag_ptr, target, err_ptr, budget, rank, op, peer, what, CLOCK)


@triton.jit
def claim_fault(err_ptr, code, rank, op, peer, call):
    """Record fault ``code`` in the error word if none is there yet (the first failure wins), with the rank, op, peer
    and call; returns whether this call recorded it, so that the caller adds the fault's own details. The answer is
    the same in every thread (a scalar atomic), so the caller may reduce in the branch it takes on it."""
    won = tl.atomic_cas(err_ptr, 0, code, sem="acq_rel", scope="gpu") == 0
    if won:
        tl.store(err_ptr + ERR_RANK, rank)
        tl.store(err_ptr + ERR_OP, op)
        tl.store(err_ptr + ERR_PEER, peer)
        tl.store(err_ptr + ERR_CALL, call)
        tl.store(err_ptr + ERR_OWN_CODE, code)
    return won


@triton.jit
def check_header(h, e, op, fingerprint, err_ptr, rank, peer, N_WORDS: tl.constexpr):
    """Compare peer ``peer``'s header at ``h`` (call, op, fingerprint, then sizes; read after the wait that saw the
    peer arrive) with this call's: a difference is recorded as ERR_MISMATCH with the peer's first N_WORDS words."""
    bad = (tl.load(h, volatile=True) != e) | (tl.load(h + 1, volatile=True) != op)
    bad = bad | (tl.load(h + 2, volatile=True) != fingerprint)
    if bad:
        if claim_fault(err_ptr, ERR_MISMATCH, rank, op, peer, e):
            for i in range(0, N_WORDS):
                tl.store(err_ptr + ERR_PEER_HEADER + i, tl.load(h + i, volatile=True))
            tl.store(err_ptr + ERR_OWN_FINGERPRINT, fingerprint)


@triton.jit(do_not_specialize=["budget", "op", "fingerprint", "d0", "d1", "d2", "d3"])
def barrier_kernel(peer_slots_ptr, local_slots_ptr, count_ptr, header_ptrs, local_header_ptr, err_ptr, budget, rank,
                   world, op, fingerprint, d0, d1, d2, d3, BLOCK_W: tl.constexpr, CLOCK: tl.constexpr):
    """Device-side barrier across ranks that also checks every rank makes the same call; one program.

    Each rank keeps ``count`` (how many barriers it has passed) in its own device memory and a slot per peer in
    symmetric memory. Arrival number ``e = count + 1`` is written (release) into slot ``rank`` of every peer; then
    the rank waits until each of its own slots holds a value >= e. All ranks pass the same sequence of barriers, so
    every rank computes the same ``e`` for the same barrier; slot ``p`` on rank ``r`` is written only by rank ``p``
    and only grows, so seeing ``>= e`` means ``p`` has arrived at barrier ``e`` (it cannot be further than
    ``e + 1``: that needs ``r``'s arrival at ``e + 1``). No value is ever reset, so there is no reset to race with,
    and ``e`` is read from device memory at run time, so a replayed CUDA graph does not reuse a value baked in on
    the host.

    Peers whose slot address is 0 are on another host (not mapped): the barrier is then among this host's ranks,
    and calls are compared across hosts by the headers the ranks send each other (remote_header_kernel).

    Before its arrival a rank writes its call's header (``e``, ``op``, ``fingerprint``, ``d0..d3``: what it is
    about to read and write) into every peer's header table, at [e % 2][rank] (a peer at most one barrier ahead
    writes the other half). Once peer ``p`` has arrived, the rank compares p's header with its own: any difference
    (another call number, op or fingerprint) is recorded as ERR_MISMATCH with both headers, before any data of the
    call moves, and every wait of the Context then gives up at once.
    """
    offs = tl.arange(0, BLOCK_W)
    mask = (offs < world) & (tl.load(peer_slots_ptr + offs, mask=offs < world, other=0) != 0)  # mapped peers
    e = tl.load(count_ptr) + 1
    half = e & 1
    peer_hdr = tl.load(header_ptrs + offs, mask=mask, other=0).to(tl.pointer_type(tl.int32))
    at = peer_hdr + (half * world + rank) * 8  # 8: HEADER_WORDS
    zero = tl.zeros((BLOCK_W,), tl.int32)
    tl.store(at, zero + e, mask=mask)
    tl.store(at + 1, zero + op, mask=mask)
    tl.store(at + 2, zero + fingerprint, mask=mask)
    tl.store(at + 3, zero + d0, mask=mask)
    tl.store(at + 4, zero + d1, mask=mask)
    tl.store(at + 5, zero + d2, mask=mask)
    tl.store(at + 6, zero + d3, mask=mask)
    tl.debug_barrier()  # every header store comes before the arrival below
    peer_base = tl.load(peer_slots_ptr + offs, mask=mask, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(peer_base + rank, zero + e, mask=mask, sem="release", scope="sys")
    tl.store(err_ptr + ERR_CURRENT_CALL, e)
    for p in range(0, world):
        if tl.load(peer_slots_ptr + p) != 0:
            if wait_flag(local_slots_ptr + p, e, err_ptr, budget, rank, op, p, WHAT_ARRIVAL, CLOCK):
                check_header(local_header_ptr + (half * world + p) * 8, e, op, fingerprint, err_ptr, rank, p, 7)
    tl.store(count_ptr, e)


@triton.jit(do_not_specialize=["op", "fingerprint", "peer"])
def remote_header_kernel(h_ptr, count_ptr, err_ptr, rank, peer, op, fingerprint):
    """Compare the header that peer ``peer`` on another host sent for its call (at ``h_ptr``, received after this
    rank's barrier of the call) with this rank's call, ``count_ptr`` holding its number: a difference is recorded as
    ERR_MISMATCH, before any of the peer's chunks is flagged ready."""
    check_header(h_ptr, tl.load(count_ptr), op, fingerprint, err_ptr, rank, peer, 7)


@triton.jit
def remote_status_kernel(status_ptr, peers_ptr, num_peers, err_ptr, N_WORDS: tl.constexpr):
    """Read the error words that ranks on other hosts sent along with data a kernel of theirs made (producers.link,
    ``Link.exchange``'s ``guarded``): ``status_ptr`` [world, N_WORDS], the rows of the ``num_peers`` ranks at
    ``peers_ptr``. A sender whose word held a fault may have sent what a wait that gave up left behind: its fault is
    recorded here as relayed from the rank it began on (ERR_RELAYED), before anything received is flagged ready, so
    that every wait of this rank stops and the host raises rather than return that data."""
    for i in range(0, num_peers):
        s = status_ptr + tl.load(peers_ptr + i) * N_WORDS
        code = tl.load(s + ERR_CODE, volatile=True)
        if code != 0:
            origin_code = tl.where(code == ERR_RELAYED, tl.load(s + ERR_ORIGIN_CODE), code)
            if claim_fault(err_ptr, ERR_RELAYED, tl.load(s + ERR_RANK), tl.load(s + ERR_OP), tl.load(s + ERR_PEER),
                           tl.load(s + ERR_CALL)):
                tl.store(err_ptr + ERR_WHAT, tl.load(s + ERR_WHAT))
                tl.store(err_ptr + ERR_ORIGIN_CODE, origin_code)


def build_remote_status(device, world: int, num_peers: int) -> None:
    """Run ``remote_status_kernel`` once on scratch memory where no rank has faulted, specialised as a Link launches
    it (``num_peers`` ranks on other hosts): it is built and loaded at a Context's set-up, before any consumer can
    spin, since loading a module while a kernel that waits on peers occupies the GPU may wait for that kernel (the
    caller synchronises)."""
    import torch

    from .cached_launch import launch

    status = torch.zeros((world, ERR_WORDS), dtype=torch.int32, device=device)
    peers = torch.zeros(num_peers, dtype=torch.int32, device=device)
    err = torch.zeros(ERR_WORDS, dtype=torch.int32, device=device)
    launch(remote_status_kernel, (1,), (status, peers, num_peers, err), {"N_WORDS": ERR_WORDS})


def relay_status(status, peers, err) -> None:
    """``remote_status_kernel`` where streams are threads of the host (the host backend): the first fault of the
    ``peers``' rows of ``status`` recorded in the error word ``err`` (its code last), unless it holds one."""
    code, relayed, origin_code = int(ERR_CODE), int(ERR_RELAYED), int(ERR_ORIGIN_CODE)
    for p in peers:
        s = [int(v) for v in status[p]]
        if s[code] == 0 or int(err[code]) != 0:
            continue
        for i in (ERR_RANK, ERR_OP, ERR_PEER, ERR_CALL, ERR_WHAT):
            err[int(i)] = s[int(i)]
        err[origin_code] = s[origin_code] if s[code] == relayed else s[code]
        err[int(ERR_OWN_CODE)] = relayed
        err[code] = relayed
