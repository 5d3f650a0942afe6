"""Copy-engine all-to-all producer: each rank's block for each peer into that peer's symmetric receive buffer, then
one flag per source on the peer.

Rank r serves its peers in ``send_order(r)`` (r + 1, r + 2, ...: at step i every rank sends to a different peer, so
every link carries data at once), dealt out to the copy streams in turn (``deal``). For each peer d it enqueues the
copies of its block for d (at the place the caller computed: the prefix of the counts there) and then writes
``flags.peer(d)[r] := 1`` on the same stream, so d sees the flag only after the data. The flag is written even where
the block is empty: a receiver waits for every source, and needs no count to know whom to wait for. Blocks from a
rank to itself are the caller's business (a local copy on its own stream, or read in place).

Flags are reset by their owner, on the caller's stream after the join (``finish``), once the consumer has waited
for every one of them; peers write them again only after a later call's barrier, which this rank reaches only
after that reset (producers.pipeline, step 1). A call may make several exchanges (counts, then rows): the first
opens with the barrier and the call's header (``call``), the later ones open with nothing, their receive buffers
and flags being free from the moment the barrier passed.
"""
from __future__ import annotations

from ..plan import send_order
from .link import open_call


def raise_flags(ctx, flags) -> None:
    """This rank's flag in every peer's ``flags`` (``flags.peer(d)[r] := 1``, in send order) on the caller's stream,
    after its earlier work: for an exchange whose data a kernel stored into the peers, with no copy to wait for. A
    stream write is preceded by a memory fence, so a peer sees the flag only after that kernel's stores. The owner
    resets its flags once it has waited for them, as ``AllToAll.finish`` does."""
    stream, r = ctx.current_stream(), ctx.rank
    for d in send_order(r, ctx.world_size):
        stream.write_value(flags.peer(d)[r:r + 1], 1)


def deal(rank: int, world: int, num_streams: int | None) -> tuple[tuple[int, ...], ...]:
    """Rank ``rank``'s peers in send order, dealt out to ``num_streams`` copy streams in turn (None: one per peer;
    at most one per peer): each stream's peers, in the order it serves them."""
    peers = send_order(rank, world)
    if not peers:
        return ()
    n = max(1, min(num_streams or len(peers), len(peers)))
    return tuple(tuple(peers[s::n]) for s in range(n))


class AllToAll:
    """The producer of one all-to-all exchange (producers.pipeline).

    ``copy_streams``: each stream's peers in order (``deal``); ``blocks``: {peer: [(destination view in the peer's
    symmetric memory, source view)]} (a peer with no entry gets its flag only); ``flags``: the symmetric int32 [W]
    flags, one per source; ``call``: the call's header (Context.call) for an exchange that opens the call with the
    barrier, None for a later exchange of the same call."""

    copies_first = hold_consumer = gate_consumer = False

    def __init__(self, copy_streams, blocks: dict, flags, *, call=None):
        self.copy_streams, self.blocks, self.flags, self.call = copy_streams, blocks, flags, call
        self.num_streams = len(copy_streams)

    def open(self, ctx, stream) -> None:
        if self.call is not None:
            open_call(ctx, stream, self.call)

    def enqueue(self, ctx, streams) -> None:
        r = ctx.rank
        for s, peers in zip(streams, self.copy_streams):
            for d in peers:
                ctx.jitter(s)
                for dst, src in self.blocks.get(d, ()):
                    s.copy(dst, src)
                s.write_value(self.flags.peer(d)[r:r + 1], 1)

    def finish(self, ctx) -> None:
        self.flags.local.zero_()  # every flag was waited for by the consumer, earlier on this stream


__all__ = ["AllToAll", "deal", "raise_flags"]
