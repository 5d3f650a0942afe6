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

from ..kernels.chunks import ChunkLayout


def peers_in_send_order(rank: int, world: int) -> list[int]:
    return [(rank + i) % world for i in range(1, world)]


def plan_push(ctx, n_streams: int, layout: ChunkLayout, row_bytes: int, ws, flags) -> list[list[tuple]]:
    """Per stream, the copies of one call as raw numbers: (dst address, offset in the source, bytes, flag address).

    Built once per shape, so a call only adds the source's address and issues the copies.
    """
    r = ctx.rank
    work: list[list[tuple]] = [[] for _ in range(n_streams)]
    for i, d in enumerate(peers_in_send_order(r, ctx.world_size)):
        dst, flag = ws.peer(d).data_ptr(), flags.peer(d).data_ptr()
        for j in range(layout.chunks_per_rank):
            rows, mine = layout.rows(r, j), layout.local_rows(j)
            work[i % n_streams].append((dst + rows.start * row_bytes, mine.start * row_bytes,
                                        (mine.stop - mine.start) * row_bytes, flag + 4 * layout.chunk_id(r, j)))
    return work


def depend_on_caller(ctx, streams) -> None:
    """The producers start after what the caller's stream holds now (inputs, our previous consumer, flag reset)."""
    streams[0].wait_stream(ctx.current_stream())


def push(ctx, streams, work: list[list[tuple]], src_ptr: int) -> None:
    """Enqueue the barrier, then every chunk and its flag. Returns at once."""
    first = streams[0]
    ctx.barrier(first)
    for s in streams[1:]:
        s.wait_stream(first)
    for s, items in zip(streams, work):
        for dst, offset, nbytes, flag in items:
            ctx.jitter(s)
            s.copy_bytes(dst, src_ptr + offset, nbytes)
            s.write_value_at(flag, 1)


def join(ctx, streams) -> None:
    """The caller's stream waits for every producer stream."""
    cur = ctx.current_stream()
    for s in streams:
        cur.wait_stream(s)
