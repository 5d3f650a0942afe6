"""Copy-engine all-to-all producer: each rank's block for each peer into that peer's symmetric receive buffer, then
one flag per source on the peer.

Rank r serves its peers in ``send_order(r)`` (r + 1, r + 2, ...: at step i every rank sends to a different peer, so
every link carries data at once), dealt out to the copy streams in turn (``deal``). For each peer d it enqueues the
copies of its block for d (at the place the caller computed: the prefix of the counts there) and then writes
``flags.peer(d)[r] := 1`` on the same stream, so d sees the flag only after the data. The flag is written even where
the block is empty: a receiver waits for every source, and needs no count to know whom to wait for. Blocks from a
rank to itself are the caller's business (a local copy on its own stream, or read in place).

Across hosts (producers.link) the peers on this rank's host are served as above, and the ranks on other hosts
through the process group on one more stream (the last): one exchange per call's step with every remote rank (this
rank's blocks out, theirs into this rank's receive buffers), then this rank's own flag for each of them, so the
consumer waits on the same flags either way.

Flags are reset by their owner, on the caller's stream after the join (``finish``), once the consumer has waited
for every one of them; peers write them again only after a later call's barrier, which this rank reaches only
after that reset (producers.pipeline, step 1). A call may make several exchanges (counts, then rows): the first
opens with the barrier and the call's header (``call``), the later ones open with nothing, their receive buffers
and flags being free from the moment the barrier passed.
"""
from __future__ import annotations

from ..plan import send_order
from .link import link, open_call


def raise_flags(ctx, flags) -> None:
    """This rank's flag in every peer's ``flags`` on its host (``flags.peer(d)[r] := 1``, in send order) on the
    caller's stream, after its earlier work: for an exchange whose data a kernel stored into the peers, with no copy
    to wait for. A stream write is preceded by a memory fence, so a peer sees the flag only after that kernel's
    stores. The owner resets its flags once it has waited for them, as ``AllToAll.finish`` does."""
    stream, r, mapped = ctx.current_stream(), ctx.rank, set(ctx.local_ranks)
    for d in send_order(r, ctx.world_size):
        if d in mapped:
            stream.write_value(flags.peer(d)[r:r + 1], 1)


def between_hosts(ctx, stream, remote: dict, flags, what: str, op: int) -> None:
    """On ``stream``: one exchange through the Link with every rank in ``remote`` ({rank on another host: (tensors
    this rank sends it, this rank's tensors that receive its data)}; empty tensors are left out, so both sides must
    derive the sizes from what every rank holds), then this rank's flag for each of those ranks. Every rank makes
    the exchange, even one with nothing to move: the Link's tags count exchanges. ``op``: what a timeout names,
    with the late rank's block as chunk (as kernels.arrivals names a source within the host)."""
    sends = [(t, d) for d, (out, _) in remote.items() for t in out if t.numel()]
    recvs = [(t, d) for d, (_, into) in remote.items() for t in into if t.numel()]
    link(ctx).exchange(stream, sends, recvs, what, op, {d: d for d in remote}, guarded=True)
    for d in remote:
        stream.write_value(flags.local[d:d + 1], 1)


def deal(rank: int, world: int, num_streams: int | None, local=None) -> tuple[tuple[int, ...], ...]:
    """Rank ``rank``'s peers in send order (those in ``local`` only, where given: the ranks of its host), dealt out
    to ``num_streams`` copy streams in turn (None: one per peer; at most one per peer): each stream's peers, in the
    order it serves them."""
    peers = [d for d in send_order(rank, world) if local is None or d in local]
    if not peers:
        return ()
    n = max(1, min(num_streams or len(peers), len(peers)))
    return tuple(tuple(peers[s::n]) for s in range(n))


class AllToAll:
    """The producer of one all-to-all exchange (producers.pipeline).

    ``copy_streams``: each stream's peers in order (``deal``); ``blocks``: {peer: [(destination view in the peer's
    symmetric memory, source view)]} (a peer with no entry gets its flag only); ``flags``: the symmetric int32 [W]
    flags, one per source; ``call``: the call's header (Context.call) for an exchange that opens the call with the
    barrier, None for a later exchange of the same call. ``remote``: on a group that spans hosts, the exchange
    with the ranks of other hosts (``between_hosts``; None on one host), and ``what`` and ``op`` name it;
    ``holds_for_link``: the Context's (where NCCL carries that exchange, the consumer starts after it: docs/hosts.md).
    """

    def __init__(self, copy_streams, blocks: dict, flags, *, call=None, remote: dict | None = None,
                 what: str = "", op: int = 0, holds_for_link: bool = False):
        self.copy_streams, self.blocks, self.flags, self.call = copy_streams, blocks, flags, call
        self.remote, self.what, self.op = remote, what, op
        self.num_streams = len(copy_streams) + (remote is not None)
        #: across hosts the copies are enqueued before the consumer (an exchange may block the host), and the
        #: consumer starts after the opening's comparison of the call with the other hosts' ranks
        self.copies_first = self.gate_consumer = remote is not None
        #: over NCCL no consumer waits for the exchange between hosts: it starts once that exchange is done
        self.hold_consumer = remote is not None and holds_for_link

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
        if self.remote is not None:  # after the copies within the host: an exchange may block the host
            between_hosts(ctx, streams[-1], self.remote, self.flags, self.what, self.op)

    def finish(self, ctx) -> None:
        self.flags.local.zero_()  # every flag was waited for by the consumer, earlier on this stream


__all__ = ["AllToAll", "between_hosts", "deal", "raise_flags"]
