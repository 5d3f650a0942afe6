"""Copy-engine reduce-scatter producer: partial rows move to their owners as the GEMM finishes them.

The GEMM stores the tiles of peers' rows into a local staging buffer and bumps a local counter per chunk (its
SCATTER target, ``Scatter.target``). On a stream pool, each peer chunk's copy waits for its counter to be complete
(a stream wait-value), moves the chunk into the owner's receive slot for this rank and then writes the owner's
counter to its final count, so the owner's reduction waits on the same counters as when the GEMM stores into peers
directly. The copy stream then zeroes the local count for the next call (the GEMM made its last bump of the chunk
before the wait passed). The stream waits depend only on this rank's GEMM, which waits on nothing before its own
rows, so they are enqueued after the GEMM (producers.pipeline's ``consumer_first``).

Across hosts, the chunks of owners on this rank's host move as above; those of owners on other hosts go through the
process group on one more stream (the last), in one of two ways:

* summed within the host first (hosts of several ranks, ``GEMMReduceScatterConfig.reduce_in_host``): a chunk for
  an owner on another host moves by copy engine, as a local peer's would, into the forwarding slots (``Forwarding``)
  of this host's rank at the owner's local index (the forwarder), and the GEMM stores this rank's own partials for
  its counterparts (the owners at its own index) straight into its own slots. For each chunk, the last stream sums
  the host's partials in float32 (kernels.reduce.sum_forwarded, whose waits for the host's ranks are bounded),
  exchanges the sums with the counterparts (one partial per host crosses each link between hosts, in place of one
  per rank), sets this rank's counter for each counterpart to its final count and zeroes the forwarding counters.
  Each sum is launched once this rank's own partials of its chunk are stored (a stream wait on counts its own GEMM
  writes), so its waiting programs never keep a GEMM program from an SM. This runs after the consumer is enqueued
  (``after_consumer``): on the host backend a launch runs to its end, and the sum waits for the GEMM's stores. The
  sums are rounded to the partials' dtype before they cross (one rounding more than the direct path's);
* direct: it waits for a chunk's count for every remote owner, exchanges the chunk with them (this rank's partials
  out, theirs for this rank in), sets this rank's counter for each source to its final count and zeroes the local
  counts (producers.link).

In both the reduction sums the partials after the join (ScatterSchedule.sources: with the sums, this host's ranks
and the counterparts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.reduce import launch_sum_forwarded
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


@dataclass(frozen=True)
class Forwarding:
    """A forwarder's buffers, where a host's partials for an owner on another host are summed before they cross:
    ``slots`` [K, L, m_local, N] (symmetric: slot [k, i] holds the partial of this host's i-th rank for the owner
    at this rank's local index on the k-th other host), ``counters`` [K, L, chunks_per_rank] (symmetric: each
    chunk's count, raised by the copy that brings it, or by this rank's GEMM for its own slot), ``expected``
    [K, chunks_per_rank] (the count each reaches), ``dests`` [K] (the counterparts: where each sum goes, a slot of
    the staging buffer) and ``names`` [L] (this host's ranks, named by a wait that times out)."""
    slots: object
    counters: object
    expected: torch.Tensor
    dests: torch.Tensor
    names: torch.Tensor

    def zero(self, stream, j: int) -> None:
        """Zero every slot's counter of chunk ``j`` on ``stream``, after the sum that waited for them (no rank of the
        host adds to them again before this call's join and the next barrier)."""
        counters = self.counters.local
        for k in range(counters.shape[0]):
            for i in range(counters.shape[1]):
                stream.write_value(counters[k, i, j:j + 1], 0)


def forwarding(ctx, name: str, schedule: ScatterSchedule, n: int, dtype) -> Forwarding | None:
    """The forwarding buffers of op ``name`` for ``schedule`` (None where the partials cross hosts directly):
    symmetric, so every rank of the group asks for them at the same call."""
    cps = schedule.counterparts
    if not cps:
        return None
    layout, L = schedule.layout, len(schedule.local)
    slots = ctx.symmetric(f"{name}.forward", (len(cps), L, layout.m_local, n), dtype)
    counters = ctx.symmetric(f"{name}.forward_counters", (len(cps), L, layout.chunks_per_rank), torch.int32)

    counts = [schedule.counts[d] for d in cps]

    def small():
        dev = ctx.device
        return (torch.tensor(counts, dtype=torch.int32, device=dev), torch.tensor(cps, dtype=torch.int32, device=dev),
                torch.tensor(schedule.local, dtype=torch.int32, device=dev))
    expected, dests, names = ctx.cached(("forwarding", cps, schedule.local, tuple(counts)), small)
    return Forwarding(slots, counters, expected, dests, names)


def staging(ctx, recv, counters, layout: ChunkLayout, forward: Forwarding | None = None,
            schedule: ScatterSchedule | None = None) -> Staging:
    """The staging buffers for this receive buffer and chunking, made once (kept by the Context). With
    ``forward`` (and its ``schedule``), the GEMM stores this rank's partials for its counterparts into its own
    forwarding slots and counts them there."""
    def make():
        W, r = ctx.world_size, ctx.rank
        m_local, N = recv.local.shape[1], recv.local.shape[2]
        partials = torch.empty((W, m_local, N), dtype=recv.local.dtype, device=ctx.device)
        counts = torch.zeros(W * layout.chunks_per_rank, dtype=torch.int32, device=ctx.device)
        shift = r * m_local * N * partials.element_size()  # the kernel adds row ``rank * m_local``
        per_rank = layout.chunks_per_rank * counts.element_size()
        ptrs = [recv.local.data_ptr() if o == r else partials[o].data_ptr() - shift for o in range(W)]
        cptrs = [counters.local.data_ptr() if o == r else counts.data_ptr() + (o - r) * per_rank for o in range(W)]
        if forward is not None:
            i = schedule.local.index(r)
            for k, d in enumerate(schedule.counterparts):
                ptrs[d] = forward.slots.local[k, i].data_ptr() - shift
                cptrs[d] = forward.counters.local[k, i].data_ptr() - r * per_rank
        return Staging(partials, counts, torch.tensor(ptrs, dtype=torch.int64, device=ctx.device),
                       torch.tensor(cptrs, dtype=torch.int64, device=ctx.device))

    key = ("scatter staging", tuple(recv.local.shape), recv.local.dtype, layout.chunks_per_rank,
           recv.local.data_ptr(), counters.local.data_ptr(),
           None if forward is None else (schedule.counterparts, schedule.local, forward.slots.local.data_ptr(),
                                         tuple(forward.slots.local.shape), forward.counters.local.data_ptr()))
    return ctx.cached(key, make)


class Scatter:
    """The producer of one GEMM-RS copy-variant call (producers.pipeline), executing ``schedule``
    (plan.ScatterSchedule: each copy stream's (owner, chunk) steps in order, the owners on other hosts, and
    ``counts[owner][j]``, the count chunk j of each owner's rows reaches once the GEMM has stored every tile over
    it); ``call``: the call's header (Context.call); ``forward``: the forwarding buffers where the host's partials
    are summed before they cross hosts (``forwarding``). Its copies wait for the GEMM, so the GEMM is never held
    (pipeline step 3); across hosts the op sums the partials only after the join (GEMMReduceScatter)."""

    copies_first = hold_consumer = False

    def __init__(self, ctx, schedule: ScatterSchedule, stage: Staging, recv, counters, call=None,
                 forward: Forwarding | None = None):
        self.schedule, self.layout, self.counts = schedule, schedule.layout, schedule.counts
        self.stage, self.recv, self.counters = stage, recv, counters
        self.remote = bool(schedule.remote)
        #: across hosts the GEMM starts after the opening's comparison of the call with the other hosts' ranks
        self.gate_consumer = self.remote
        self.num_streams = schedule.num_streams
        self.call = call
        self.forward = forward
        if bool(forward) != bool(schedule.counterparts):
            raise ValueError("Scatter: forwarding buffers go with a schedule that sums the host's partials")
        self.op_name = ctx.op_name(call.op) if call is not None else "gemm_rs"

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
        if self.remote and self.forward is None:  # after the copies within the host: an exchange may block the
            self._between_hosts(ctx, streams[-1])  # host (Stream.exchange)

    def after_consumer(self, ctx, streams) -> None:
        if self.forward is not None:
            self._sums_between_hosts(ctx, streams[-1])

    def _between_hosts(self, ctx, s) -> None:
        r, cpr = ctx.rank, self.layout.chunks_per_rank
        remote = list(self.schedule.remote)
        for j in range(cpr):
            rows = self.layout.local_rows(j)
            counts = [self.stage.counts[d * cpr + j:d * cpr + j + 1] for d in remote]
            for d, count in zip(remote, counts):
                s.wait_value(count, self.counts[d][j], f"rank {r} {self.op_name} chunk {j} for rank {d}")
            ctx.jitter(s)
            link(ctx).exchange(s, [(self.stage.partials[d, rows], d) for d in remote],
                               [(self.recv.local[d, rows], d) for d in remote],
                               f"{self.op_name} chunk {j} with ranks {remote}", self.call.op, {d: j for d in remote},
                               guarded=True)
            for d, count in zip(remote, counts):
                s.write_value(self.counters.local[d * cpr + j:d * cpr + j + 1], self.counts[r][j])
                s.write_value(count, 0)

    def _sums_between_hosts(self, ctx, s) -> None:
        """Per chunk, on the last stream: the host's partials for the counterparts summed (a bounded wait for each
        of the host's ranks), the sums exchanged with the counterparts, their counters raised, the forwarding
        counters zeroed (Forwarding.zero)."""
        r, cpr, fw = ctx.rank, self.layout.chunks_per_rank, self.forward
        cps = list(self.schedule.counterparts)
        i = self.schedule.local.index(r)
        for j in range(cpr):
            rows = self.layout.local_rows(j)
            # the sum's programs start only once this rank's GEMM has stored its own partials of the chunk (values
            # its own kernel writes, which waits on nothing): by then every GEMM program holds its SM, and none waits
            # behind a sum program spinning for the host's other partials
            for k, d in enumerate(cps):
                s.wait_value(fw.counters.local[k, i, j:j + 1], self.counts[d][j],
                             f"rank {r} {self.op_name} chunk {j} for rank {d}")
            ctx.jitter(s)
            with ctx.use_stream(s):
                launch_sum_forwarded(ctx, fw.slots.local, fw.counters.local, fw.expected, self.stage.partials,
                                     fw.dests, fw.names, self.layout, j, op=self.call.op)
            link(ctx).exchange(s, [(self.stage.partials[d, rows], d) for d in cps],
                               [(self.recv.local[d, rows], d) for d in cps],
                               f"{self.op_name} chunk {j} (this host's sums) with ranks {cps}", self.call.op,
                               {d: j for d in cps}, guarded=True)
            for d in cps:
                s.write_value(self.counters.local[d * cpr + j:d * cpr + j + 1], self.counts[r][j])
            fw.zero(s, j)

    def finish(self, ctx) -> None:
        pass

    def _key(self, ctx, streams):
        """What the plan depends on: the schedule, the streams, every buffer's address (a grown one moves) and the
        layouts its copy pieces were cut for."""
        mapped, partials, recv = ctx.local_ranks, self.stage.partials, self.recv.local
        forward = () if self.forward is None else (
            tuple(self.forward.slots.peer(d).data_ptr() for d in mapped),
            tuple(self.forward.counters.peer(d).data_ptr() for d in mapped), tuple(self.forward.slots.local.shape))
        return (self.schedule, tuple(id(s) for s in streams), partials.data_ptr(), tuple(partials.shape),
                partials.dtype, tuple(recv.shape), tuple(recv.stride()), self.stage.counts.data_ptr(),
                tuple(self.recv.peer(d).data_ptr() for d in mapped),
                tuple(self.counters.peer(d).data_ptr() for d in mapped), forward)

    def _plan(self, ctx, streams):
        """Per stream: [(local count, its final value, what a timeout names, the planned copy, the counter it
        raises)] in order, built once per key, as the gather's plan is: no views sliced or copy pieces cut per
        call. A chunk for an owner on another host goes to the forwarder's slot for this rank."""
        r, cpr, sched = ctx.rank, self.layout.chunks_per_rank, self.schedule
        partials, plan = self.stage.partials, []
        i = sched.local.index(r)
        for s, steps in zip(streams, sched.copy_streams):
            planned = []
            plan.append((s, planned))
            for d, j in steps:
                rows = self.layout.local_rows(j)
                if d in sched.local:
                    dst, counter = self.recv.peer(d)[r, rows], self.counters.peer(d)[r * cpr + j:r * cpr + j + 1]
                else:
                    f, k = sched.forwarder(d), sched.other_host(d)
                    dst, counter = self.forward.slots.peer(f)[k, i, rows], self.forward.counters.peer(f)[k, i, j:j + 1]
                planned.append((self.stage.counts[d * cpr + j:d * cpr + j + 1], self.counts[d][j],
                                f"rank {r} {self.op_name} chunk {j} for rank {d}",
                                s.plan_copy(dst, partials[d, rows], partials), counter))
        return plan
