"""Copy-engine all-gather producers: push (below) and pull (pull_rows).

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


def push_rows(ctx, streams, layout: ChunkLayout, src: torch.Tensor, ws, flags, dim: int = 0, follow: bool = True):
    """Enqueue the push of ``src`` (this rank's block of ``layout.m_local`` rows along ``dim``) to every peer."""
    push_chunks(ctx, streams, layout, [(src, ws)], flags, dim, follow)


def follow_caller(ctx, streams) -> None:
    """Step 1 of the protocol: the producer streams wait for the caller's stream as it is now (the first
    stream directly; the others through it, when they wait for the barrier that push_chunks puts there)."""
    streams[0].wait_stream(ctx.current_stream())


def push_chunks(ctx, streams, layout: ChunkLayout, pairs, flags, dim: int = 0, follow: bool = True,
                gate: bool = False):
    """Enqueue, for every peer, each chunk of every (source, symmetric workspace) pair, then that chunk's flag.

    Sources hold this rank's ``layout.m_local`` rows along ``dim``; the
    workspaces hold ``W * m_local`` rows along ``dim``. Returns at once.
    ``follow=False``: the caller already ran ``follow_caller`` (e.g. before
    launching the consumer, so the streams do not wait for it).
    ``gate=True``: the caller's stream also waits for the barrier. A consumer
    that may fill every SM with programs waiting for chunks needs it: the
    barrier kernel must find an SM, on every rank, or no chunk is ever sent.
    (The persistent GEMM leaves an SM free instead and starts sooner.)
    """
    open_push(ctx, streams, follow, gate)
    enqueue_chunks(ctx, streams, layout, pairs, flags, dim)


def open_push(ctx, streams, follow: bool = True, gate: bool = False) -> None:
    """Steps 1 and 2 of the protocol (see push_chunks): after it, a consumer may be launched before the
    copies are enqueued (``enqueue_chunks``), so the GPU does not wait for the host to enqueue them."""
    if follow:
        follow_caller(ctx, streams)
    first = streams[0]
    ctx.barrier(first)
    if gate:
        ctx.current_stream().wait_stream(first)
    for s in streams[1:]:
        s.wait_stream(first)


def enqueue_chunks(ctx, streams, layout: ChunkLayout, pairs, flags, dim: int = 0) -> None:
    """Step 3: every chunk of every (source, workspace) pair to every peer, each followed by its flag."""
    first = streams[0]
    if first.raw and ctx.producer_jitter_s == 0:
        plan = _raw_plan(ctx, streams, layout, pairs, flags, dim)
        bases = [src.data_ptr() for src, _ in pairs]
        for s, steps in plan:
            for pieces, flag_ptr in steps:
                for p, base in zip(pieces, bases):
                    s.copy_raw(p, base)
                s.write_value_ptr(flag_ptr, 1)
        return
    for i, d in enumerate(peers_in_send_order(ctx.rank, ctx.world_size)):
        s = streams[i % len(streams)]
        for j in range(layout.chunks_per_rank):
            ctx.jitter(s)
            for src, ws in pairs:
                s.copy(*_chunk_views(layout, ctx.rank, j, d, src, ws, dim))
            c = layout.chunk_id(ctx.rank, j)
            s.write_value(flags.peer(d)[c:c + 1], 1)


def pull_rows(ctx, streams, layout: ChunkLayout, src: torch.Tensor, ws, flags, dim: int = 0, follow: bool = True):
    """Pull mode: every peer's rows are read from its workspace into ours, chunk by chunk, and our own flag
    for each chunk is raised after it, on the same stream. Peers' rows are fetched in the order push mode
    delivers them (peer ``(r - i) % W`` at step i, on stream ``(i - 1) % n_streams``), so the consumer's
    tile order is the same.

    Protocol: (1) the streams follow the caller; (2) barrier: every peer has finished reading our
    workspace's own rows in its previous call (its consumer, which waited for those reads, is done);
    (3) our shard is copied into our workspace's own rows (the only rows a peer reads); (4) barrier: every
    rank's own rows are in place; (5) the reads and flags. Flags are only ever written by their owner."""
    if follow:
        follow_caller(ctx, streams)
    first = streams[0]
    r, W = ctx.rank, ctx.world_size
    ctx.barrier(first)
    first.copy(ws.local.narrow(dim, r * layout.m_local, layout.m_local), src)
    ctx.barrier(first)
    for s in streams[1:]:
        s.wait_stream(first)
    for i in range(1, W):
        d = (r - i) % W
        s = streams[(i - 1) % len(streams)]
        for j in range(layout.chunks_per_rank):
            ctx.jitter(s)
            rows = layout.rows(d, j)
            s.copy(ws.local.narrow(dim, rows.start, rows.stop - rows.start),
                   ws.peer(d).narrow(dim, rows.start, rows.stop - rows.start))
            c = layout.chunk_id(d, j)
            s.write_value(flags.local[c:c + 1], 1)


def _chunk_views(layout, r, j, d, src, ws, dim):
    rows, mine = layout.rows(r, j), layout.local_rows(j)
    return (ws.peer(d).narrow(dim, rows.start, rows.stop - rows.start),
            src.narrow(dim, mine.start, mine.stop - mine.start))


def _raw_plan(ctx, streams, layout, pairs, flags, dim):
    """Per (stream, [(pieces per pair, flag address)]): the copies of one call with the sources' addresses
    taken out, cached per shape and workspace, so a call only adds each source's base address."""
    from ..context.cuda import memcpy_plan

    W = ctx.world_size
    addrs = lambda t: tuple(t.peer(d).data_ptr() for d in range(W))  # noqa: E731 - a grown buffer moves
    key = (layout, dim, len(streams), addrs(flags),
           tuple((tuple(src.shape), tuple(src.stride()), src.dtype, addrs(ws)) for src, ws in pairs))
    cache = ctx.__dict__.setdefault("_copy_plans", {})
    plan = cache.get(key)
    if plan is None:
        per_stream = {}
        for i, d in enumerate(peers_in_send_order(ctx.rank, ctx.world_size)):
            s = streams[i % len(streams)]
            steps = per_stream.setdefault(id(s), (s, []))[1]
            for j in range(layout.chunks_per_rank):
                pieces = []
                for src, ws in pairs:
                    dst, part = _chunk_views(layout, ctx.rank, j, d, src, ws, dim)
                    base = src.data_ptr()
                    pieces.append([(dp_, dpitch, sp_ - base, spitch, w, h)
                                   for dp_, dpitch, sp_, spitch, w, h in memcpy_plan(dst, part)])
                c = layout.chunk_id(ctx.rank, j)
                steps.append((pieces, flags.peer(d)[c:c + 1].data_ptr()))
        plan = cache[key] = list(per_stream.values())
    return plan


def join(ctx, streams) -> None:
    """The caller's stream waits for every producer stream."""
    cur = ctx.current_stream()
    for s in streams:
        cur.wait_stream(s)
