"""Copy-engine all-gather producer (push).

Rank r copies its own rows, chunk by chunk, into the same rows of every peer's
workspace and sets the peer's flag for that chunk after each chunk, on the
same stream, so a flag can only be seen after its data. Peer
``(r + i) % W`` is served at step i, on stream ``(i - 1) % n_streams``, so
several links carry data at once. The local shard is never copied.

Protocol per call, all on streams (no host synchronisation, nothing baked in
that a CUDA-graph replay would get wrong: every value written is a constant,
every flag is reset before it can be set again, and the barrier keeps its
count in device memory):

1. the streams wait for the caller's stream: inputs are ready, and this
   rank's previous consumer has finished and reset its flags;
2. the device-side barrier (Context.barrier) on the first stream: every peer
   has reached step 1 too, so its workspace and flags may be written;
3. chunks and flags go to every peer.

Copy streams never wait on a memory value (cuStreamWaitValue32): on the
H200s such a wait blocked work on the caller's stream that it depended on.
"""
from __future__ import annotations

import torch

from ..kernels.chunks import ChunkLayout


def peers_in_send_order(rank: int, world: int) -> list[int]:
    return [(rank + i) % world for i in range(1, world)]


def push_rows(ctx, streams, layout: ChunkLayout, src: torch.Tensor, ws, flags, dim: int = 0):
    """Enqueue the push of ``src`` (this rank's block of ``layout.m_local`` rows along ``dim``) to every peer."""
    push_chunks(ctx, streams, layout, [(src, ws)], flags, dim)


def push_chunks(ctx, streams, layout: ChunkLayout, pairs, flags, dim: int = 0):
    """Enqueue, for every peer, each chunk of every (source, symmetric workspace) pair, then that chunk's flag.

    Sources hold this rank's ``layout.m_local`` rows along ``dim``; the
    workspaces hold ``W * m_local`` rows along ``dim``. Returns at once.
    """
    r = ctx.rank
    peers = peers_in_send_order(r, ctx.world_size)
    first = streams[0]
    first.wait_stream(ctx.current_stream())
    ctx.barrier(first)
    for s in streams[1:]:
        s.wait_stream(first)
    for i, d in enumerate(peers):
        s = streams[i % len(streams)]
        for j in range(layout.chunks_per_rank):
            ctx.jitter(s)
            rows, mine = layout.rows(r, j), layout.local_rows(j)
            for src, ws in pairs:
                s.copy(ws.peer(d).narrow(dim, rows.start, rows.stop - rows.start),
                       src.narrow(dim, mine.start, mine.stop - mine.start))
            c = layout.chunk_id(r, j)
            s.write_value(flags.peer(d)[c:c + 1], 1)


def join(ctx, streams) -> None:
    """The caller's stream waits for every producer stream."""
    cur = ctx.current_stream()
    for s in streams:
        cur.wait_stream(s)
