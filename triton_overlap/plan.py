"""Chunk and tile arithmetic on the host: which rows move in which chunk, in what order, and in what order a
persistent kernel takes its tiles.

The rows of a gathered (or to-be-scattered) ``[M, ...]`` tensor belong to ranks in blocks of ``m_local`` rows;
each rank's block is cut into chunks of ``m_per_chunk`` rows (the last one may be shorter). Chunk ids are global:
``src * chunks_per_rank + j``. A tile may cover several chunks and a chunk several tiles. The device side of the
same arithmetic is ``kernels.chunks``. Nothing here touches a GPU or a process group, so producers and kernel
launchers both import it.
"""
from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def send_order(rank: int, world: int) -> list[int]:
    """The peers a rank sends to, in order: ``rank + 1, rank + 2, ...`` (mod ``world``). At step ``i`` every rank
    sends to a different peer, so every link carries data at once."""
    return [(rank + i) % world for i in range(1, world)]


def arrival_order(rank: int, world: int) -> list[int]:
    """The peers whose chunks reach ``rank`` first to last when every rank sends in ``send_order``."""
    return [(rank - i) % world for i in range(1, world)]


@dataclass(frozen=True)
class ChunkLayout:
    world: int
    m_local: int
    m_per_chunk: int

    def __post_init__(self):
        if self.m_local <= 0 or self.m_per_chunk <= 0:
            raise ValueError(f"chunk layout needs positive sizes, got m_local={self.m_local}, "
                             f"m_per_chunk={self.m_per_chunk}")

    @property
    def chunks_per_rank(self) -> int:
        return cdiv(self.m_local, self.m_per_chunk)

    @property
    def num_chunks(self) -> int:
        return self.world * self.chunks_per_rank

    def local_rows(self, j: int) -> slice:
        """Rows of chunk j inside its owner's own [m_local, ...] block."""
        return slice(j * self.m_per_chunk, min((j + 1) * self.m_per_chunk, self.m_local))

    def rows(self, src: int, j: int) -> slice:
        """Global rows of chunk j of rank src."""
        s = self.local_rows(j)
        return slice(src * self.m_local + s.start, src * self.m_local + s.stop)

    def chunk_id(self, src: int, j: int) -> int:
        return src * self.chunks_per_rank + j

    def chunk_of_row(self, row: int) -> int:
        return (row // self.m_local) * self.chunks_per_rank + (row % self.m_local) // self.m_per_chunk

    def tile_chunks(self, pid_m: int, block_m: int) -> range:
        m = self.world * self.m_local
        lo = pid_m * block_m
        hi = min(lo + block_m, m) - 1
        return range(self.chunk_of_row(lo), self.chunk_of_row(hi) + 1)

    def stream_schedule(self, n_streams: int, peers_in_order: list[int]) -> dict[int, tuple[int, int]]:
        """When each chunk of each peer moves: {chunk id of (peer, j): (position in its stream, stream)}.

        Peer ``peers_in_order[i]`` uses stream ``i % n_streams``; a stream moves its peers one after another,
        chunk by chunk, and streams run at once.
        """
        when: dict[int, tuple[int, int]] = {}
        seq = [0] * n_streams
        for i, peer in enumerate(peers_in_order):
            s = i % n_streams
            for j in range(self.chunks_per_rank):
                when[self.chunk_id(peer, j)] = (seq[s], s)
                seq[s] += 1
        return when

    def tile_order(self, block_m: int, when: dict[int, tuple], last: bool = False) -> list[int]:
        """m-tiles sorted by the latest of their chunks' times (chunks missing from ``when`` come first, or last
        with ``last=True``): the order a consumer (or producer) should take them."""
        m = self.world * self.m_local
        missing = (1 << 30, 0) if last else (-1, 0)
        key = {t: max(when.get(c, missing) for c in self.tile_chunks(t, block_m)) for t in range(cdiv(m, block_m))}
        return sorted(key, key=lambda t: (key[t], t))

    def tile_stores(self, block_m: int, n_tiles: int) -> list[list[int]]:
        """``[owner][j]``: how many tile stores a GEMM over all rows makes into chunk ``j`` of each owner's rows
        (the m-tiles over the chunk, times ``n_tiles`` tiles across the columns): the count a chunk's counter
        reaches once every tile covering it has been stored."""
        counts = [[0] * self.chunks_per_rank for _ in range(self.world)]
        for t in range(cdiv(self.world * self.m_local, block_m)):
            for c in self.tile_chunks(t, block_m):
                counts[c // self.chunks_per_rank][c % self.chunks_per_rank] += n_tiles
        return counts


def gather_tile_order(layout: ChunkLayout, rank: int, n_streams: int, block_m: int, local=None) -> list[int]:
    """AllGather consumer: this rank's own m-tiles first (read in place), then the others in the order their
    chunks arrive (peer ``(rank - i) % W`` sends to us at its step i, on its stream ``(i - 1) % n_streams``).
    ``local``: the ranks on this rank's host, where the group spans hosts: their chunks come first (copy engines),
    then the other hosts' ranks' chunk by chunk (they arrive through the network, or forwarded after it)."""
    peers = arrival_order(rank, layout.world)
    if local is None:
        return layout.tile_order(block_m, layout.stream_schedule(n_streams, peers))
    near = [p for p in peers if p in local]
    when = layout.stream_schedule(n_streams, near) if near else {}
    start = max((t for t, _ in when.values()), default=-1) + 1
    for i, p in enumerate(q for q in peers if q not in local):
        for j in range(layout.chunks_per_rank):
            when[layout.chunk_id(p, j)] = (start + j, i)
    return layout.tile_order(block_m, when)


def scatter_tile_order(layout: ChunkLayout, rank: int, block_m: int, local=None) -> list[int]:
    """ReduceScatter producer: peers' m-tiles first, in send order and chunk by chunk, this rank's own last.
    ``local``: the ranks on this rank's host, where the group spans hosts: the other hosts' owners' tiles come first
    (their partials take the network)."""
    peers = send_order(rank, layout.world)
    if local is not None:
        peers = [p for p in peers if p not in local] + [p for p in peers if p in local]
    when = {layout.chunk_id(p, j): (i, j) for i, p in enumerate(peers) for j in range(layout.chunks_per_rank)}
    return layout.tile_order(block_m, when, last=True)
