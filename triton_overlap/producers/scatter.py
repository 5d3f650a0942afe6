"""Copy-engine reduce-scatter producer: partial rows move to their owners as the GEMM finishes them.

The GEMM stores the tiles of peers' rows into a local staging buffer and bumps a local counter per chunk (its
SCATTER target, ``Scatter.target``). On a stream pool, each peer chunk's copy waits for its counter to be complete
(a stream wait-value), moves the chunk into the owner's receive slot for this rank and then writes the owner's
counter to its final count, so the owner's reduction waits on the same counters as when the GEMM stores into peers
directly. The copy stream then zeroes the local count for the next call (the GEMM made its last bump of the chunk
before the wait passed). The stream waits depend only on this rank's GEMM, which waits on nothing before its own
rows, so they are enqueued after the GEMM (producers.pipeline's ``consumer_first``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan import ChunkLayout, send_order


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


def copy_stream_count(layout: ChunkLayout, num_streams: int | None) -> int:
    """How many copy streams: ``num_streams`` (None: one per peer), at most one per chunk sent."""
    sends = (layout.world - 1) * layout.chunks_per_rank
    return max(1, min(num_streams or (layout.world - 1), sends))


def copy_stream_index(world: int, n_streams: int, i: int, j: int) -> int:
    """The stream that copies chunk ``j`` to the ``i``-th peer in send order (1-based): with more streams than
    peers, a peer's chunks take turns among them and copy side by side, on more copy engines."""
    return ((i - 1) + (world - 1) * j) % n_streams


class Scatter:
    """The producer of one GEMM-RS copy-variant call (producers.pipeline). ``counts``: ``[owner][j]``, the count
    chunk j of each owner's rows reaches once the GEMM has stored every tile over it (ChunkLayout.tile_stores);
    ``call``: the call's header (Context.call)."""

    def __init__(self, layout: ChunkLayout, stage: Staging, recv, counters, counts, num_streams: int, call=None):
        self.layout, self.stage, self.recv, self.counters, self.counts = layout, stage, recv, counters, counts
        self.num_streams = num_streams
        self.call = call

    def open(self, ctx, stream) -> None:
        ctx.barrier(stream, self.call)  # every owner has reduced its previous call and reset its counters

    def enqueue(self, ctx, streams) -> None:
        W, r, cpr = ctx.world_size, ctx.rank, self.layout.chunks_per_rank
        for i, d in enumerate(send_order(r, W), start=1):
            for j in range(cpr):
                s = streams[copy_stream_index(W, len(streams), i, j)]
                rows = self.layout.local_rows(j)
                count = self.stage.counts[d * cpr + j:d * cpr + j + 1]
                want = self.counts[d][j]
                s.wait_value(count, want, f"rank {r} gemm_rs chunk {j} for rank {d}")
                ctx.jitter(s)
                s.copy(self.recv.peer(d)[r, rows], self.stage.partials[d, rows])
                s.write_value(self.counters.peer(d)[r * cpr + j:r * cpr + j + 1], want)
                s.write_value(count, 0)

    def finish(self, ctx) -> None:
        pass
