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


def _host_of(rank: int, hosts) -> tuple:
    """The ranks on ``rank``'s host (``hosts``: the group's hosts, each a tuple of ranks; Topology.hosts)."""
    return next(tuple(h) for h in hosts if rank in h)


def _streams(peers: list[int], num_streams: int | None) -> tuple:
    """``peers`` dealt out to copy streams in turn: ``num_streams`` of them (None: one per peer), at most one per
    peer; each stream serves its peers one after another."""
    if not peers:
        return ()
    n = max(1, min(num_streams or len(peers), len(peers)))
    return tuple(tuple(peers[s::n]) for s in range(n))


def _arrivals(layout: ChunkLayout, streams: tuple) -> dict[int, tuple[int, int]]:
    """When each chunk of each peer moves, for peers dealt out to ``streams`` as ``_streams`` does: {chunk id:
    (position in its stream, stream)}; a stream moves its peers chunk by chunk, and streams run at once."""
    when: dict[int, tuple[int, int]] = {}
    for s, peers in enumerate(streams):
        for i, peer in enumerate(peers):
            for j in range(layout.chunks_per_rank):
                when[layout.chunk_id(peer, j)] = (i * layout.chunks_per_rank + j, s)
    return when


def arrival_times(layout: ChunkLayout, rank: int, hosts, num_streams: int | None = None) -> dict[int, tuple]:
    """When each peer's chunk reaches ``rank`` in an all-gather of ``layout`` (``hosts``: the group's hosts, each a
    tuple of ranks; ``num_streams``: copy streams, None: one per peer): {chunk id: a sortable time}. The host's peers'
    chunks come by copy engine on the streams they are dealt to (push and pull alike), then the other hosts' ranks'
    chunk by chunk. This rank's own chunks are not in it (they are here from the start)."""
    local = _host_of(rank, hosts)
    arriving = arrival_order(rank, layout.world)
    when = _arrivals(layout, _streams([p for p in arriving if p in local], num_streams))
    start = max((t for t, _ in when.values()), default=-1) + 1
    for i, p in enumerate(q for q in arriving if q not in local):
        for j in range(layout.chunks_per_rank):
            when[layout.chunk_id(p, j)] = (start + j, i)
    return when


@dataclass(frozen=True)
class GatherSchedule:
    """Every decision of one all-gather call, made once per shape and configuration: producers execute it, the
    consumer's launcher takes its tile order.

    ``copy_streams``: per copy stream within the host, the peers it serves in order (push: the peers this rank's
    rows go to; pull: the peers whose rows it reads). ``counterparts``: the ranks at this rank's local index on the
    other hosts, exchanged with on one more stream (empty within one host). ``tile_order``: the consumer's m-tiles,
    own rows first, then in the order their chunks arrive (empty where the consumer orders its own work).
    ``reset_by``: who zeroes this rank's flags after the call: "consumer" (its last program) or "producer"
    (the pipeline's closing step). ``hold_consumer``: the consumer starts once the exchanges between hosts are done
    (where NCCL carries them: its kernels need SMs that the consumer's waiting programs could hold)."""

    layout: ChunkLayout
    rank: int
    local: tuple
    mode: str
    copy_streams: tuple
    counterparts: tuple
    tile_order: tuple
    reset_by: str
    hold_consumer: bool = False

    @property
    def num_streams(self) -> int:
        """Producer streams: the copy streams, and one for the exchanges between hosts."""
        return len(self.copy_streams) + int(bool(self.counterparts))


def gather_schedule(layout: ChunkLayout, rank: int, hosts, *, mode: str = "push", num_streams: int | None = None,
                    block_m: int | None = None, reset_by: str = "consumer",
                    hold_for_link: bool = False) -> GatherSchedule:
    """The schedule of an all-gather of ``layout`` on ``rank`` (``hosts``: the group's hosts, each a tuple of
    ranks). Push: peer ``send_order(rank)[i]`` is served on stream ``i % n``; pull reads peers in the order push
    would deliver them. Every rank runs the same schedule shifted by its rank, so the chunks reaching this rank
    follow ``arrival_order`` on the same deal of streams, whatever the mode: the tile order (``block_m``: the
    consumer's m-tile; None: no tile order) takes this rank's own tiles first, then the host's peers' as they
    arrive, then the other hosts' ranks' chunk by chunk (they come through the network, or forwarded after it).
    ``hold_for_link``: the exchanges between hosts go where a waiting consumer could starve them
    (Context.holds_for_link)."""
    if mode not in ("push", "pull"):
        raise ValueError(f"gather mode must be 'push' or 'pull', got {mode!r}")
    if reset_by not in ("consumer", "producer"):
        raise ValueError(f"gather flags are reset by 'consumer' or 'producer', got {reset_by!r}")
    W = layout.world
    local = _host_of(rank, hosts)
    counterparts = tuple(h[local.index(rank)] for h in hosts if tuple(h) != local)
    if counterparts and mode == "pull":
        raise ValueError("gather: pull mode reads peers' memory, which other hosts' ranks are not: use push")
    order = send_order if mode == "push" else arrival_order
    copy_streams = _streams([d for d in order(rank, W) if d in local], num_streams)
    tiles: tuple = ()
    if block_m is not None:
        tiles = tuple(layout.tile_order(block_m, arrival_times(layout, rank, hosts, num_streams)))
    return GatherSchedule(layout, rank, local, mode, copy_streams, counterparts, tiles, reset_by,
                          hold_for_link and bool(counterparts))


@dataclass(frozen=True)
class ScatterSchedule:
    """Every decision of one reduce-scatter call whose partial rows a GEMM produces (GEMM-RS), made once per shape
    and configuration.

    ``copy_streams`` (copy variant): per copy stream, the (owner, chunk) pairs it moves in order; a peer's chunks
    take turns among the streams where there are more streams than peers. ``remote``: the owners on other hosts,
    whose chunks (or the host's sums of them) go through the process group on one more stream (empty within one
    host). ``tile_order``: the
    GEMM's m-tiles, other hosts' owners' rows first (they take the network), then this host's peers' in send order
    and chunk by chunk, this rank's own last; ``peer_tiles``: how many of its first m-tiles hold peers' rows (with
    whole tiles of rows per rank). ``counts[owner][j]``: the count chunk ``j`` of each owner's rows
    reaches once every tile over it is stored (ChunkLayout.tile_stores). ``reduce_after_join``: across hosts, the
    partials are summed by a reduction kernel after the exchanges between hosts, unless the GEMM sums them itself
    (and leaves the exchanges an SM): a reduction waiting on every SM would starve the exchanges' own kernels
    (NCCL's, the guarded exchange's check of the sender's error word). ``reset_by``: who zeroes this rank's
    counters after the call: "consumer" (the GEMM's last program, where it sums the partials itself) or
    "reduction" (the reduction kernel's stream, after it).

    With the partials summed within the host first (``counterparts`` not empty: the ranks at this rank's local
    index on the other hosts, in host order), an owner on another host gets one partial per host: its chunks go
    by copy engine to ``forwarder(owner)``, the rank of this host at the owner's local index (this rank's own
    partials for its counterparts stay here), which sums the host's partials and sends the sum to the owner.
    ``copy_streams`` then also move the chunks of owners on other hosts, and ``sources`` (the ranks whose
    receive slots this rank's reduction sums: every rank, or with the sums, this host's ranks and the
    counterparts) have fewer ranks than the group."""

    layout: ChunkLayout
    rank: int
    local: tuple
    copy: bool
    copy_streams: tuple
    remote: tuple
    tile_order: tuple
    peer_tiles: int
    counts: tuple
    reset_by: str
    reduce_after_join: bool = False
    hosts: tuple = ()
    counterparts: tuple = ()
    sources: tuple = ()

    @property
    def num_streams(self) -> int:
        """Producer streams: the copy streams, and one for the exchanges between hosts."""
        return len(self.copy_streams) + int(bool(self.remote))

    def forwarder(self, owner: int) -> int:
        return forwarder(self.local, self.hosts, owner)

    def other_host(self, owner: int) -> int:
        return other_host(self.local, self.hosts, owner)


def sums_within_host(hosts, reduce_in_host: bool) -> bool:
    """Whether partials for an owner on another host are summed within the host before they cross: asked for
    (``reduce_in_host``), on several hosts of one size, several ranks each."""
    sizes = {len(h) for h in hosts}
    return bool(reduce_in_host) and len(hosts) > 1 and len(sizes) == 1 and sizes != {1}


def forwarder(local: tuple, hosts, owner: int) -> int:
    """The rank of host ``local`` that sums the host's partials for ``owner`` (on another host of ``hosts``) and
    sends the sum: the one at ``owner``'s local index."""
    return local[_host_of(owner, hosts).index(owner)]


def other_host(local: tuple, hosts, owner: int) -> int:
    """The position of ``owner``'s host among ``hosts`` other than ``local`` (a forwarder's slots for it)."""
    return [tuple(h) for h in hosts if tuple(h) != tuple(local)].index(_host_of(owner, hosts))


def scatter_schedule(layout: ChunkLayout, rank: int, hosts, *, copy: bool, num_streams: int | None = None,
                     block_m: int, n_tiles: int, fused: bool, hold_for_link: bool = False,
                     reduce_in_host: bool = False) -> ScatterSchedule:
    """The schedule of a GEMM-RS call of ``layout`` on ``rank`` (``hosts``: the group's hosts, each a tuple of
    ranks). ``copy``: copy engines move the peers' chunks (else the GEMM stores them into the peers itself); across
    hosts always. ``num_streams``: copy streams (None: one per peer), at most one per chunk sent. ``block_m`` and
    ``n_tiles``: the GEMM's m-tile and its tiles across the columns. ``fused``: the GEMM sums the partials (not
    with ``hold_for_link`` across hosts, Context.holds_for_link, nor with the partials summed within the host:
    there a reduction kernel runs after the join). ``reduce_in_host``: across hosts of several ranks each, sum
    the host's partials for an owner on another host before they cross (ScatterSchedule)."""
    W, cpr = layout.world, layout.chunks_per_rank
    hosts = tuple(tuple(h) for h in hosts)
    local = _host_of(rank, hosts)
    remote = tuple(p for p in range(W) if p not in local)
    peers = [d for d in send_order(rank, W) if d in local]
    index = local.index(rank)
    in_host = sums_within_host(hosts, reduce_in_host)
    counterparts = tuple(h[index] for h in hosts if h != local) if in_host else ()
    forwarded = [d for d in send_order(rank, W) if d in remote and d not in counterparts] if in_host else []
    copy = copy or bool(remote)
    streams: tuple = ()
    moved = forwarded + peers
    if copy and moved:  # (None: a stream per peer of the host, which every moved chunk goes to)
        n = max(1, min(num_streams or len(peers), len(moved) * cpr))
        per: list[list] = [[] for _ in range(n)]
        for i, d in enumerate(moved):
            for j in range(cpr):
                per[(i + len(moved) * j) % n].append((d, j))
        streams = tuple(tuple(p) for p in per)
    ordered = [p for p in send_order(rank, W) if p not in local] + peers
    when = {layout.chunk_id(p, j): (i, j) for i, p in enumerate(ordered) for j in range(cpr)}
    tiles = tuple(layout.tile_order(block_m, when, last=True))
    counts = tuple(tuple(c) for c in layout.tile_stores(block_m, n_tiles))
    late = bool(remote) and (hold_for_link or in_host or not fused)
    if late and fused:
        raise ValueError("scatter_schedule: partials summed after the exchanges between hosts cannot be fused")
    sources = tuple(sorted(local + counterparts)) if in_host else tuple(range(W))
    return ScatterSchedule(layout, rank, local, copy, streams, remote, tiles, (W - 1) * layout.m_local // block_m,
                           counts, "consumer" if fused else "reduction", late, hosts, counterparts, sources)
