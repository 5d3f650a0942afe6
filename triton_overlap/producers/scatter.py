"""Copy-engine reduce-scatter producer: partial rows move to their owners as the GEMM finishes them.

The GEMM stores the tiles of peers' rows into a local staging buffer and bumps a local counter per chunk (its
SCATTER target, ``Scatter.target``). On a stream pool, each peer chunk's copy waits for its counter to be complete
(a stream wait-value), moves the chunk into the owner's receive slot for this rank and then writes the owner's
counter to its final count, so the owner's reduction waits on the same counters as when the GEMM stores into peers
directly. The copy stream then zeroes the local count for the next call (the GEMM made its last bump of the chunk
before the wait passed). The stream waits depend only on this rank's GEMM, which waits on nothing before its own
rows, so they are enqueued after the GEMM (producers.pipeline's ``consumer_first``).

Across hosts, the chunks of owners on this rank's host move as above; those of owners on other hosts go through the
process group on one more stream (the last): it waits for a chunk's count for every remote owner, exchanges the
chunk with them (this rank's partials out, theirs for this rank in), sets this rank's counter for each source to
its final count and zeroes the local counts (producers.link).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan import ChunkLayout, ScatterSchedule
from .link import link, open_call


@dataclass(frozen=True)
class Staging:
    """The copy variant's local buffers: ``partials`` [W, m_local, N] (peers' rows before they move), ``counts``
    [W * chunks_per_rank] (the GEMM's local counters), and the GEMM's store and counter address tables (int64 [W]):
    peers' tiles land in partials[owner] and bump counts[owner * chunks + j], this rank's own rows go to its
    receive slot and counters, as when the GEMM stores into peers."""
    partials: torch.Tensor
    counts: torch.Tensor
    ptrs: torch.Tensor
    counter_ptrs: torch.Tensor


def staging(ctx, recv, counters, layout: ChunkLayout) -> Staging:
    """The staging buffers for this receive buffer and chunking, made once (kept by the Context)."""
    def make():
        W, r = ctx.world_size, ctx.rank
        m_local, N = recv.local.shape[1], recv.local.shape[2]
        partials = torch.empty((W, m_local, N), dtype=recv.local.dtype, device=ctx.device)
        counts = torch.zeros(W * layout.chunks_per_rank, dtype=torch.int32, device=ctx.device)
        shift = r * m_local * N * partials.element_size()  # the kernel adds row ``rank * m_local``
        per_rank = layout.chunks_per_rank * counts.element_size()
        ptrs = [recv.local.data_ptr() if o == r else partials[o].data_ptr() - shift for o in range(W)]
        cptrs = [counters.local.data_ptr() if o == r else counts.data_ptr() + (o - r) * per_rank for o in range(W)]
        return Staging(partials, counts, torch.tensor(ptrs, dtype=torch.int64, device=ctx.device),
                       torch.tensor(cptrs, dtype=torch.int64, device=ctx.device))

    key = ("scatter staging", tuple(recv.local.shape), recv.local.dtype, layout.chunks_per_rank,
           recv.local.data_ptr(), counters.local.data_ptr())
    return ctx.cached(key, make)


class Scatter:
    """The producer of one GEMM-RS copy-variant call (producers.pipeline), executing ``schedule``
    (plan.ScatterSchedule: each copy stream's (owner, chunk) steps in order, the owners on other hosts, and
    ``counts[owner][j]``, the count chunk j of each owner's rows reaches once the GEMM has stored every tile over
    it); ``call``: the call's header (Context.call). Its copies wait for the GEMM, so the GEMM is never held
    (pipeline step 3); across hosts over NCCL the op sums the partials only after the join (GEMMReduceScatter)."""

    copies_first = hold_consumer = False

    def __init__(self, ctx, schedule: ScatterSchedule, stage: Staging, recv, counters, call=None):
        self.schedule, self.layout, self.counts = schedule, schedule.layout, schedule.counts
        self.stage, self.recv, self.counters = stage, recv, counters
        self.remote = bool(schedule.remote)
        #: across hosts the GEMM starts after the opening's comparison of the call with the other hosts' ranks
        self.gate_consumer = self.remote
        self.num_streams = schedule.num_streams
        self.call = call

    def open(self, ctx, stream) -> None:
        open_call(ctx, stream, self.call)  # every owner has reduced its previous call and reset its counters

    def enqueue(self, ctx, streams) -> None:
        local = streams[:-1] if self.remote else streams
        if local:
            partials = self.stage.partials
            for s, steps in ctx.cached(("scatter plan", self._key(ctx, local)), lambda: self._plan(ctx, local)):
                for count, want, what, copy, counter in steps:
                    s.wait_value(count, want, what)
                    ctx.jitter(s)
                    s.copy_planned(copy, partials)
                    s.write_value(counter, want)
                    s.write_value(count, 0)
        if self.remote:  # after the copies within the host: an exchange may block the host (Stream.exchange)
            self._between_hosts(ctx, streams[-1])

    def _between_hosts(self, ctx, s) -> None:
        r, cpr = ctx.rank, self.layout.chunks_per_rank
        remote = list(self.schedule.remote)
        for j in range(cpr):
            rows = self.layout.local_rows(j)
            counts = [self.stage.counts[d * cpr + j:d * cpr + j + 1] for d in remote]
            for d, count in zip(remote, counts):
                s.wait_value(count, self.counts[d][j], f"rank {r} gemm_rs chunk {j} for rank {d}")
            ctx.jitter(s)
            link(ctx).exchange(s, [(self.stage.partials[d, rows], d) for d in remote],
                               [(self.recv.local[d, rows], d) for d in remote],
                               f"gemm_rs chunk {j} with ranks {remote}", self.call.op, {d: j for d in remote})
            for d, count in zip(remote, counts):
                s.write_value(self.counters.local[d * cpr + j:d * cpr + j + 1], self.counts[r][j])
                s.write_value(count, 0)

    def finish(self, ctx) -> None:
        pass

    def _key(self, ctx, streams):
        """What the plan depends on: the schedule, the streams, every buffer's address (a grown one moves) and the
        layouts its copy pieces were cut for."""
        mapped, partials, recv = ctx.local_ranks, self.stage.partials, self.recv.local
        return (self.schedule, tuple(id(s) for s in streams), partials.data_ptr(), tuple(partials.shape),
                partials.dtype, tuple(recv.shape), tuple(recv.stride()), self.stage.counts.data_ptr(),
                tuple(self.recv.peer(d).data_ptr() for d in mapped),
                tuple(self.counters.peer(d).data_ptr() for d in mapped))

    def _plan(self, ctx, streams):
        """Per stream: [(local count, its final value, what a timeout names, the planned copy, the owner's
        counter)] in order, built once per key, as the gather's plan is: no views sliced or copy pieces cut per
        call."""
        r, cpr = ctx.rank, self.layout.chunks_per_rank
        partials, plan = self.stage.partials, []
        for s, steps in zip(streams, self.schedule.copy_streams):
            planned = []
            plan.append((s, planned))
            for d, j in steps:
                rows = self.layout.local_rows(j)
                planned.append((self.stage.counts[d * cpr + j:d * cpr + j + 1], self.counts[d][j],
                                f"rank {r} gemm_rs chunk {j} for rank {d}",
                                s.plan_copy(self.recv.peer(d)[r, rows], partials[d, rows], partials),
                                self.counters.peer(d)[r * cpr + j:r * cpr + j + 1]))
        return plan
