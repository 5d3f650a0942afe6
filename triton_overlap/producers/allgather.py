"""Copy-engine all-gather producer (push).

Rank r copies its own rows, chunk by chunk, into the same rows of every peer's
workspace and sets the peer's flag for that chunk after each chunk, on the
same stream, so a flag can only be seen after its data. Peer
``(r + i) % W`` is served at step i, on stream ``(i - 1) % n_streams``, so
several links carry data at once. The local shard is never copied.

Protocol per call, all on streams (no host synchronisation, nothing baked in
that a CUDA-graph replay would get wrong: every value written is a constant
and every flag is reset before it can be set again):

1. each stream waits for the caller's stream (inputs ready, this rank's
   previous consumer finished and its flags reset);
2. ``ack`` of every peer, slot r, := 1: "r may be written to again";
3. wait ``go[d] >= 1`` (set by this rank's consumer kernel once it saw ``ack[d]``
   from d), reset it, then push chunks and flags to d.
"""
from __future__ import annotations

import torch

from ..kernels.chunks import ChunkLayout


def peers_in_send_order(rank: int, world: int) -> list[int]:
    return [(rank + i) % world for i in range(1, world)]


def push_rows(ctx, streams, layout: ChunkLayout, src: torch.Tensor, ws, flags, ack, go: torch.Tensor, what: str):
    """Enqueue the push of ``src`` (this rank's [m_local, ...] rows) to every peer. Returns at once."""
    r = ctx.rank
    peers = peers_in_send_order(r, ctx.world_size)
    cur = ctx.current_stream()
    for s in streams:
        s.wait_stream(cur)
    for i, d in enumerate(peers):
        streams[i % len(streams)].write_value(ack.peer(d)[r:r + 1], 1)
    for i, d in enumerate(peers):
        s = streams[i % len(streams)]
        s.wait_value(go[d:d + 1], 1, f"rank {r}: {what}: go to push to rank {d}")
        s.write_value(go[d:d + 1], 0)
        for j in range(layout.chunks_per_rank):
            ctx.jitter(s)
            c = layout.chunk_id(r, j)
            s.copy(ws.peer(d)[layout.rows(r, j)], src[layout.local_rows(j)])
            s.write_value(flags.peer(d)[c:c + 1], 1)


def join(ctx, streams) -> None:
    """The caller's stream waits for every producer stream."""
    cur = ctx.current_stream()
    for s in streams:
        cur.wait_stream(s)
