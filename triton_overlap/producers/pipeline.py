"""The protocol of one overlapped call, written once: an op supplies a producer and a consumer.

Every step is enqueued on streams, with no host synchronisation and nothing baked in that a CUDA-graph replay would
get wrong (every value written is a constant or lives in device memory), so a call can be captured and replayed:

1. **follow**: the first producer stream waits for the caller's stream as it is now (the inputs are ready, and this
   rank's previous call has finished and reset its flags);
2. **open**: the producer's opening steps on that stream, a device-side barrier first (``Context.barrier``: every
   peer has reached step 1 too, so its workspaces and flags may be written, and makes the same call: the barrier
   compares the ranks' call headers), then the other producer streams wait for it. With ``gate`` the caller's
   stream waits for it as well: a consumer that can fill every SM with programs waiting for chunks must not start
   before the barrier kernel has found an SM on every rank. A producer with ``gate_consumer`` asks the same for
   itself: its opening steps need SMs too (a copy within one GPU, which the driver runs on SMs), or, on a group
   that spans hosts, compare the call with the other hosts' ranks (producers.link);
3. **consumer and copies**: the consumer (kernels on the caller's stream) and the producer's copies with their
   flags, in the order asked. ``consumer_first`` launches the consumer before the host enqueues the copies, so the
   GPU computes on local data while the host works, unless the producer asks for ``copies_first``. A producer
   that ``hold_consumer`` enqueues first, and the caller's stream waits for its last stream (the exchanges between
   hosts) before the consumer: NCCL's kernels there need SMs that a consumer's waiting programs could hold.
   A producer's ``after_consumer`` steps come after the consumer in every order (kernels of its own that wait for
   what the consumer produces: on the host backend a launch runs to its end);
4. **join**: the caller's stream waits for every producer stream (also when a step raised, so that a capture of
   the call can end);
5. **finish**: the producer's closing steps on the caller's stream (resetting this rank's flags, where the consumer
   does not do it itself).

A producer with no streams (its whole job is the barrier, or nothing) opens on the caller's stream, before the
consumer. A call whose steps raise on the host (out of memory, a kernel that does not compile) faults the Context
(``guarded``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Protocol

import torch

from ..context.backend import each
from .link import open_call


class Producer(Protocol):
    """What a producer tells the pipeline. ``num_streams``: how many producer streams it uses (0: none);
    ``copies_first``: enqueue before the consumer, whatever the call's ``consumer_first``; ``hold_consumer``: that,
    and the consumer starts after the producer's last stream (step 3); ``gate_consumer``: the consumer starts after
    the opening steps (step 2), as with the call's ``gate``. A producer may also have ``after_consumer(ctx,
    streams)``: the last part of step 3, enqueued after the consumer."""

    num_streams: int
    copies_first: bool
    hold_consumer: bool
    gate_consumer: bool

    def open(self, ctx, stream) -> None:
        """Step 2 on ``stream`` (the first producer stream, or the caller's stream without producer streams)."""

    def enqueue(self, ctx, streams) -> None:
        """Step 3: the copies and flags (nothing without producer streams)."""

    def finish(self, ctx) -> None:
        """Step 5, on the caller's stream."""


class BarrierOnly:
    """A producer that only opens the call with a device barrier on the caller's stream: the consumer writes into
    peers' memory itself (or reads data already in place), once every peer has finished its previous call and made
    the same call (``call``: its header, Context.call)."""

    num_streams = 0
    copies_first = hold_consumer = gate_consumer = False

    def __init__(self, call=None):
        self.call = call

    def open(self, ctx, stream) -> None:
        open_call(ctx, stream, self.call)

    def enqueue(self, ctx, streams) -> None:
        pass

    def finish(self, ctx) -> None:
        pass


_captures = threading.local()  # own: how many of an op's captures of its own calls are open on this thread


@contextlib.contextmanager
def own_capture():
    """Mark the capture an op makes of its own eager call (ops.replay) on this thread: a call that stops on the host
    inside it faults the Context as an eager call does (``guarded``), since the peers run that call eagerly or
    replay it, and wait for this rank's part of it."""
    _captures.own = getattr(_captures, "own", 0) + 1
    try:
        yield
    finally:
        _captures.own -= 1


@contextlib.contextmanager
def guarded(ctx, what: str):
    """Fault ``ctx`` if the body raises, then raise on: a call stopped on the host between its first flag and its
    resets leaves flags and workspaces that its next call would take for its own, so the Context refuses calls
    until ``reset()``, which zeroes them. Not while the caller captures a CUDA graph (every rank captures it, and
    nothing has run); an op's capture of its own call (``own_capture``) faults as the eager call would."""
    try:
        yield
    except BaseException as e:
        if (ctx.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
                or getattr(_captures, "own", 0)):
            first = (str(e).splitlines() or [""])[0][:200]
            ctx.faults.fail(f"rank {ctx.rank}: {what} stopped on the host mid-call ({type(e).__name__}: {first}); "
                            f"its flags and workspaces are as it left them")
        raise


def run(ctx, producer: Producer | None, consumer: Callable[[], None], *, consumer_first: bool = False,
        gate: bool = False, after_copies: bool = False) -> None:
    """Enqueue one call: ``producer`` (None: the consumer alone) around ``consumer`` (a function that launches the
    consumer's kernels on the caller's stream), by the protocol above. ``after_copies``: the consumer starts once
    every producer stream is done (no overlap), for ranks that share one GPU (``ctx.ranks_on_device``) with a
    consumer whose grid is not persistent: their copies are copies within the GPU, which run on SMs, and programs
    waiting for them could hold every SM."""
    if producer is None:
        consumer()
        return
    call = getattr(producer, "call", None)
    what = getattr(producer, "what", None) or (ctx.op_name(call.op) if call is not None else "a call")
    with guarded(ctx, what):
        _steps(ctx, producer, consumer, consumer_first, gate, after_copies)


def _steps(ctx, producer, consumer, consumer_first: bool, gate: bool, after_copies: bool) -> None:
    caller = ctx.current_stream()
    streams = ctx.streams(producer.num_streams) if producer.num_streams else []
    if not streams:
        producer.open(ctx, caller)
        consumer()
        producer.finish(ctx)
        return
    first = streams[0]
    first.wait_stream(caller)  # 1. follow
    forked = [first]
    try:
        producer.open(ctx, first)  # 2. open
        if gate or producer.gate_consumer:
            caller.wait_stream(first)
        for s in streams[1:]:
            s.wait_stream(first)
            forked.append(s)
        # 3. (where a launch runs to its end, the host backend's, copies first)
        if consumer_first and not ctx.synchronous_launches and not (producer.copies_first or producer.hold_consumer
                                                                    or after_copies):
            consumer()
            producer.enqueue(ctx, streams)
        else:
            producer.enqueue(ctx, streams)
            for s in streams if after_copies else streams[-1:] if producer.hold_consumer else []:
                caller.wait_stream(s)
            consumer()
        after = getattr(producer, "after_consumer", None)
        if after is not None:
            after(ctx, streams)
    finally:  # 4. join (after a step that raised too, so that a capture of the call can end), every stream
        each(forked, caller.wait_stream)
    producer.finish(ctx)  # 5. finish
