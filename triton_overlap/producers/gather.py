"""Copy-engine all-gather producers: every rank's rows into every rank's workspace, a flag after each chunk.

Push (``Gather(mode="push")``): rank r copies its own rows, chunk by chunk, into the same rows of every peer's
workspace and sets that peer's flag for the chunk after it, on the same stream, so a flag can only be seen after
its data. Peer ``send_order(r)[i]`` is served on stream ``i % n_streams``, so several links carry data at once.
The local shard is never copied.

Pull (``mode="pull"``): after the barrier, each rank copies its shard into its own workspace rows (the only rows
a peer reads), a second barrier says every rank's rows are in place, then each rank reads its peers' rows from
their workspaces in the order push would deliver them and raises its own flag after each chunk. The first barrier
also keeps a rank from overwriting rows a slow peer is still reading from its previous call. Flags are only ever
written by their owner. The consumer starts after the second barrier (``gate_consumer``): the driver runs a copy
within one GPU on SMs, and beside a consumer that holds every SM it would wait for that consumer's end.

Across hosts (producers.link), push only: this rank's rows go to its own host's peers by copy engine, and to its
counterparts on the other hosts through the process group on one more stream (the last), which receives theirs
into this rank's workspace chunk by chunk, raises this rank's flag for each, and forwards each chunk to this host's
peers by copy engine with their flags.

Copy streams never wait on a memory value (a stream wait-value): a consumer's rows must not depend on a wait that
can block work on the caller's stream (docs/decisions.md).
"""
from __future__ import annotations

from ..plan import GatherSchedule
from .link import link, open_call


class Gather:
    """The producer of one all-gather call (producers.pipeline), executing ``schedule`` (plan.GatherSchedule: its
    mode, each copy stream's peers in order, the counterparts on other hosts, who resets the flags).

    ``pairs``: (source, symmetric workspace) pairs moved together, chunk by chunk (K and V for attention); each
    source holds this rank's ``layout.m_local`` rows along ``dim``, each workspace ``W * m_local``. ``flags``: the
    symmetric int32 flags, one per chunk (``layout.num_chunks``). ``call``: the call's header (Context.call), which
    the opening barrier compares across ranks.
    """

    def __init__(self, ctx, schedule: GatherSchedule, pairs, flags, *, dim: int = 0, call=None):
        self.schedule, self.layout, self.mode = schedule, schedule.layout, schedule.mode
        self.pairs, self.flags, self.dim, self.call = pairs, flags, dim, call
        self.remote = bool(schedule.counterparts)
        self.num_streams = schedule.num_streams
        #: the consumer starts once the exchanges between hosts are done (pipeline step 3)
        self.hold_consumer = schedule.hold_consumer
        #: across hosts the copies are enqueued before the consumer runs (pipeline step 3): the consumer is held, or
        #: the exchanges block the host (not NCCL), and once a consumer fills every SM with programs waiting for
        #: chunks, a blocked host might wait on a copy that needs an SM
        self.copies_first = self.remote
        #: pull: the consumer waits for the opening copy (above); across hosts, for the opening's comparison of the
        #: call with the other hosts' ranks
        self.gate_consumer = self.mode == "pull" or self.remote

    def open(self, ctx, stream) -> None:
        open_call(ctx, stream, self.call)
        if self.mode == "pull":
            rows = slice(ctx.rank * self.layout.m_local, (ctx.rank + 1) * self.layout.m_local)
            for src, ws in self.pairs:
                stream.copy(ws.local.narrow(self.dim, rows.start, self.layout.m_local), src)
            ctx.barrier(stream, self.call)

    def enqueue(self, ctx, streams) -> None:
        local = streams[:-1] if self.remote else streams
        if local:
            plan = ctx.cached(("gather plan", self._key(ctx, local)), lambda: self._plan(ctx, local))
            sources = [src for src, _ in self.pairs]
            for s, steps in plan:
                for copies, flag in steps:
                    ctx.jitter(s)
                    for (prepared, fixed), src in zip(copies, sources):
                        s.copy_planned(prepared, src if fixed is None else fixed)
                    s.write_value(flag, 1)
        if self.remote:  # after the copies within the host: an exchange may block the host (Stream.exchange)
            self._between_hosts(ctx, streams[-1])

    def _between_hosts(self, ctx, s) -> None:
        """Chunk by chunk: this rank's chunk to its counterparts, theirs into this rank's workspace, then this rank's
        flag and the forward of each received chunk to this host's peers, with their flags."""
        layout, dim, r = self.layout, self.dim, ctx.rank
        ln, counterparts = link(ctx), self.schedule.counterparts
        peers = [d for d in self.schedule.local if d != r]
        for j in range(layout.chunks_per_rank):
            mine = layout.local_rows(j)
            sends = [(src.narrow(dim, mine.start, mine.stop - mine.start), c)
                     for c in counterparts for src, _ in self.pairs]
            recvs = []
            for c in counterparts:
                rows = layout.rows(c, j)
                recvs += [(ws.local.narrow(dim, rows.start, rows.stop - rows.start), c) for _, ws in self.pairs]
            ctx.jitter(s)
            ln.exchange(s, sends, recvs, f"gather chunk {j} with ranks {list(counterparts)}",
                        self.call.op if self.call else 0, {c: j for c in counterparts})
            for c in counterparts:
                rows, chunk = layout.rows(c, j), layout.chunk_id(c, j)
                s.write_value(self.flags.local[chunk:chunk + 1], 1)
                for d in peers:
                    for _, ws in self.pairs:
                        s.copy(ws.peer(d).narrow(dim, rows.start, rows.stop - rows.start),
                               ws.local.narrow(dim, rows.start, rows.stop - rows.start))
                    s.write_value(self.flags.peer(d)[chunk:chunk + 1], 1)

    def finish(self, ctx) -> None:
        if self.schedule.reset_by == "producer":
            self.flags.local.zero_()  # every flag was waited for; peers set them again only after the next barrier

    def _key(self, ctx, streams):
        """What the plan depends on: the schedule, the streams, every address it writes to, the sources' layouts."""
        mapped = ctx.local_ranks
        addrs = lambda t: tuple(t.peer(d).data_ptr() for d in mapped)  # noqa: E731 - a grown buffer moves
        return (self.schedule, self.dim, tuple(id(s) for s in streams), addrs(self.flags),
                tuple((tuple(src.shape), tuple(src.stride()), src.dtype, addrs(ws)) for src, ws in self.pairs))

    def _plan(self, ctx, streams):
        """Per stream: [(copies, flag view)] in order, built once per key. A copy is (prepared copy, fixed
        source): push mode reads the call's source tensor (None: it differs from call to call, Stream.plan_copy
        keeps its layout), pull mode a peer's workspace."""
        layout, dim, r = self.layout, self.dim, ctx.rank
        plan = []
        for s, peers in zip(streams, self.schedule.copy_streams):
            steps: list = []
            plan.append((s, steps))
            for d, j in ((d, j) for d in peers for j in range(layout.chunks_per_rank)):
                copies = []
                if self.mode == "push":  # our chunk j into peer d's workspace, then d's flag
                    rows, mine = layout.rows(r, j), layout.local_rows(j)
                    for src, ws in self.pairs:
                        dst = ws.peer(d).narrow(dim, rows.start, rows.stop - rows.start)
                        part = src.narrow(dim, mine.start, mine.stop - mine.start)
                        copies.append((s.plan_copy(dst, part, src), None))
                    c = layout.chunk_id(r, j)
                    flag = self.flags.peer(d)[c:c + 1]
                else:  # peer d's chunk j out of its workspace into ours, then our own flag
                    rows = layout.rows(d, j)
                    for _, ws in self.pairs:
                        theirs = ws.peer(d).narrow(dim, rows.start, rows.stop - rows.start)
                        dst = ws.local.narrow(dim, rows.start, rows.stop - rows.start)
                        copies.append((s.plan_copy(dst, theirs, theirs), theirs))
                    c = layout.chunk_id(d, j)
                    flag = self.flags.local[c:c + 1]
                steps.append((copies, flag))
        return plan
