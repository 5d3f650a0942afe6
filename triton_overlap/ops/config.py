"""One configuration class per op, holding that op's knobs only.

Each knob says what it does; why a default is what it is (the measurements) is in docs/decisions.md. Every op
reads, in order: the config its caller gave, the tuned table (ops.tuned), the defaults here. A tuned entry may set
some fields only; the rest keep the defaults. Calls can also override fields per call (``op(a, w, m_per_chunk=...)``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..kernels.attention import Blocks
from ..kernels.gemm_operands import GemmTiles
from ..plan import cdiv


#: The GEMM ops' consumer choices (AllGatherGEMMConfig.gemm, GEMMReduceScatterConfig.gemm).
GEMMS = ("auto", "gluon", "triton")


def require(cfg, names: tuple, ok, want: str) -> None:
    """ValueError naming ``cfg``'s class, the field and ``want`` for the first of ``names`` whose value ``ok``
    refuses."""
    for name in names:
        v = getattr(cfg, name)
        if not ok(v):
            raise ValueError(f"{type(cfg).__name__}.{name} must be {want}, got {v!r}")


def power_of_two(least: int):
    return lambda v: isinstance(v, int) and v >= least and not v & (v - 1)


def _positive(v) -> bool:
    return isinstance(v, int) and v >= 1


@dataclass(frozen=True)
class ChunkedGemmConfig(GemmTiles):
    """The GEMM ops' common knobs: the persistent GEMM's tiles (kernels.gemm_operands.GemmTiles) and how each rank's
    rows are cut into chunks, each moved by a copy and announced by a flag.

    ``m_per_chunk``: rows per chunk; None: about ``chunks_per_rank`` chunks of whole ``block_m`` tiles per rank,
    fewer where a chunk would carry under ``min_chunk_bytes`` (at least one). More chunks let the consumer start
    sooner; each costs a copy and a flag write. ``num_streams``: producer streams (None: one per peer).
    """

    m_per_chunk: int | None = None
    chunks_per_rank: int = 4
    min_chunk_bytes: int = 0
    num_streams: int | None = None

    def __post_init__(self):
        """Bad knobs raise ValueError here, before any launch (a tile Triton cannot build would fail inside one)."""
        require(self, ("block_m", "block_n", "block_k"), power_of_two(16), "a power of two >= 16")
        require(self, ("num_warps",), power_of_two(1), "a power of two >= 1")
        require(self, ("group_m", "num_stages", "num_xcds", "chunks_per_rank"), _positive, "an integer >= 1")
        require(self, ("m_per_chunk", "num_streams"), lambda v: v is None or _positive(v), "None or an integer >= 1")
        require(self, ("min_chunk_bytes",), lambda v: v >= 0, ">= 0")

    def chunk_rows(self, m_local: int, row_bytes: int = 0) -> int:
        """Rows per chunk for ``m_local`` rows per rank of ``row_bytes`` each (0: ignore min_chunk_bytes)."""
        if self.m_per_chunk is not None:
            return max(1, min(self.m_per_chunk, m_local))
        chunks = self.chunks_per_rank
        if self.min_chunk_bytes and row_bytes:
            chunks = max(1, min(chunks, m_local * row_bytes // self.min_chunk_bytes))
        rows = cdiv(cdiv(m_local, chunks), self.block_m) * self.block_m
        return max(1, min(rows, m_local))


@dataclass(frozen=True)
class AllGatherGEMMConfig(ChunkedGemmConfig):
    """AllGather-GEMM's knobs (and the common ones, ChunkedGemmConfig).

    ``mode``: "push" (each rank writes its rows into its peers' workspaces and raises their flags) or "pull" (each
    rank reads its peers' rows from their workspaces and raises its own flags; a local copy of the shard and a
    second barrier per call). ``consumer_first``: launch the GEMM before enqueueing the copies, so the GPU computes
    on the local shard while the host enqueues them (not on a shape's first call, which builds the kernels).
    ``tma_store``: store C tiles through a tensor descriptor where C can be described. ``gemm``: the
    consumer GEMM: "gluon", on Hopper with 16-bit operands the GEMM in Gluon (kernels.gemm_gather_hopper: the next
    tile's loads start during this tile's K loop) with its own tiles, where it can run (else kernels.gemm);
    "triton", kernels.gemm; "auto", "gluon" with push and "triton" with pull. The Gluon GEMM never runs with
    ``tma`` or ``tma_store`` False.
    """

    mode: str = "push"
    consumer_first: bool = False
    tma_store: bool = True
    gemm: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in ("push", "pull"):
            raise ValueError(f"AllGatherGEMMConfig.mode must be 'push' or 'pull', got {self.mode!r}")
        if self.gemm not in GEMMS:
            raise ValueError(f"AllGatherGEMMConfig.gemm must be one of {GEMMS}, got {self.gemm!r}")

    @classmethod
    def defaults(cls, ctx) -> "AllGatherGEMMConfig":
        """The defaults on ``ctx``'s backend: interpreter-sized tiles where kernels are interpreted (the host
        backend); AMD CDNA-class tiles on hip; H100/H200-class tiles and one producer stream on cuda."""
        if ctx.interpreted:
            return cls(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=1, num_stages=1, chunks_per_rank=3)
        if ctx.backend == "hip":
            return cls(block_m=256, block_n=256, block_k=64, num_warps=8, num_stages=2, num_xcds=8)
        return cls(consumer_first=True, num_stages=4, min_chunk_bytes=16 << 20, num_streams=1)

    def for_fp8(self, ctx) -> "AllGatherGEMMConfig":
        """Untuned fp8 tiles on ``ctx``'s GPUs: 128-deep K steps (128 bytes, as 64 are for 16-bit types) and 3
        stages, which keep a 128 x 256 tile's pipeline inside an H100/H200's shared memory."""
        return self if ctx.interpreted else replace(self, block_k=128, num_stages=3)


@dataclass(frozen=True)
class GEMMReduceScatterConfig(ChunkedGemmConfig):
    """GEMM-ReduceScatter's knobs (and the common ones, ChunkedGemmConfig).

    ``scatter``: "store" (the GEMM stores peers' tiles straight into their receive slots over NVLink), "copy" (the
    GEMM stores them locally and copy engines move each chunk once the GEMM's counter for it is complete), or
    "auto" (copy on GPUs from ``copy_bytes`` of partial output (M x N), from ``copy_bytes_fused`` where the
    reduction is fused into the GEMM).
    ``fuse_reduce``: the GEMM's tiles of this rank's own rows, computed last, add the peers' partials in their
    epilogue and store the output, where every rank's rows are whole ``block_m`` tiles (None: yes); False: a
    separate kernel sums the partials. ``claim``: how the fused GEMM's programs take tiles so that no own-row wait
    can block a peer tile (kernels.gemm CLAIM): 1, one by one through an atomic counter; 0, round-robin with one
    start count per program (the host backend always takes 1).
    ``defer_release``: bump a tile's chunk counters after the next tile's K loop, when its stores have landed
    (None: where the counters are a peer's, not where they are local). ``gemm``: the GEMM: "gluon" (or "auto"),
    with the reduction fused, on Hopper, the warp-specialized Gluon GEMM (kernels.gemm_warp_specialized: the
    epilogue in a partition of its own, beside the next tile's K loop) with its own tiles, where it can run (else
    kernels.gemm); "triton", kernels.gemm. The Gluon GEMM never runs with ``claim=1`` or deferred counters.
    ``reduce_in_host``: on a group that spans hosts of several ranks each, the partials of an owner on another host
    are summed within this host first and one sum per host crosses to it (a link between hosts then carries 1 / L
    of the partials, for L ranks per host; producers.scatter); False: each rank sends its own partial to each
    owner on another host.
    """

    scatter: str = "auto"
    fuse_reduce: bool | None = None
    claim: int = 0
    defer_release: bool | None = None
    gemm: str = "auto"
    copy_bytes: int = 32 << 20
    copy_bytes_fused: int = 4 << 20
    reduce_in_host: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.gemm not in GEMMS:
            raise ValueError(f"GEMMReduceScatterConfig.gemm must be one of {GEMMS}, got {self.gemm!r}")
        if self.claim not in (0, 1):
            raise ValueError(f"GEMMReduceScatterConfig.claim must be 0 or 1, got {self.claim!r}")
        if self.scatter not in ("store", "copy", "auto"):
            raise ValueError(f"GEMMReduceScatterConfig.scatter must be 'store', 'copy' or 'auto', "
                             f"got {self.scatter!r}")

    @classmethod
    def defaults(cls, ctx) -> "GEMMReduceScatterConfig":
        """As AllGatherGEMMConfig.defaults, with GEMM-RS's own knobs at their defaults."""
        if ctx.interpreted:
            return cls(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=1, num_stages=1, chunks_per_rank=3)
        if ctx.backend == "hip":
            return cls(block_m=256, block_n=256, block_k=64, num_warps=8, num_stages=2, num_xcds=8)
        return cls(num_stages=4, min_chunk_bytes=16 << 20)


@dataclass(frozen=True)
class GEMMAllReduceConfig:
    """The fused GEMM + AllReduce kernel's tiles (kernels.gemm_all_reduce): ``block_m`` x ``block_n`` output tiles,
    ``block_k``-deep steps of the K loop, ``num_warps`` and ``num_stages`` as in any Triton kernel. Every rank must
    use the same tiles (a call's header carries them, so ranks that differ get an error)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4

    @classmethod
    def defaults(cls, ctx, m: int, n: int, units: int) -> "GEMMAllReduceConfig":
        """Interpreter-sized tiles where ``ctx``'s kernels are interpreted (the host backend). On GPUs, up to 64
        rows (decode): 16 rows per tile up to 16 rows, else 64, and 64 columns, or 32 where 64 would leave over
        a tenth of the ``units`` compute units idle over the waves of tiles and 32 fewer, and 128-deep steps (the
        GEMM streams the weight; 256-deep for 16-row tiles, which the kernel computes swapped: ops.gemm_all_reduce's
        SWAP_MAX_ROWS) in 4 stages, fewer stages or shallower steps where a program's shared memory
        (``ctx.shared_memory_per_program()``) cannot hold them; 64 x 128 tiles up to 256 rows, 128 x 128 above
        (docs/decisions.md)."""
        if ctx.interpreted:
            return cls(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
        if m > 256:
            return cls(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
        if m > 64:
            return cls(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
        bm = 16 if m <= 16 else 64  # (32-row tiles measured slower than 64-row ones at 32 rows: docs/decisions.md)
        shared = ctx.shared_memory_per_program()

        def busy(bn):  # the share of compute units busy over the waves of tiles
            tiles = cdiv(m, bm) * cdiv(n, bn)
            return tiles / (cdiv(tiles, units) * units)

        bn = 64 if busy(64) >= 0.9 or busy(64) >= busy(32) else 32
        # the deepest steps in 4 stages whose operands' tiles fit the shared memory (with 4 KiB to spare), then fewer
        # stages, then shallower steps (256-deep first for 16-row tiles)
        for bk, stages in ((256, 4), (128, 4), (128, 3), (64, 4), (64, 3), (64, 2))[bm > 16:]:
            if (bm + bn) * bk * 2 * stages + (4 << 10) <= shared:
                break
        return cls(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=stages)


#: The key blocks (of 128) a query tile reads on average from which the Hopper forward at D = 64 runs three compute
#: warpgroups (AttentionConfig.defaults).
LONG_WALK = 64


@dataclass(frozen=True)
class AttentionConfig:
    """Context-parallel attention's knobs. ``chunks_per_rank``: how finely each rank's K/V is cut for the flags
    (even: the two zigzag halves are never mixed in one chunk). One ``Blocks`` per kernel: forward, backward dQ,
    backward dK/dV. ``consumer_first``: launch the forward kernel before enqueueing the copies (not on a shape's
    first call; the backward always enqueues its copies first). ``num_streams``: the copy streams that push this
    rank's K/V to its peers (peer ``i`` of the send order on stream ``i % num_streams``; None: one per peer).
    ``reduce_in_host``: on a group that spans hosts of several ranks each, the backward's dK/dV partials for an
    owner on another host are summed within this host first, one sum per host crossing (GEMMReduceScatterConfig's
    knob of that name); False: each rank sends its own."""

    chunks_per_rank: int = 2
    fwd: Blocks = field(default_factory=lambda: Blocks(block_m=128, block_n=64, num_warps=8, num_stages=3))
    dq: Blocks = field(default_factory=lambda: Blocks(block_m=128, block_n=64, num_warps=8, num_stages=2))
    dkdv: Blocks = field(default_factory=lambda: Blocks(block_m=64, block_n=128, num_warps=8, num_stages=2))
    consumer_first: bool = True
    num_streams: int | None = None
    reduce_in_host: bool = True

    def __post_init__(self):
        if self.chunks_per_rank < 2 or self.chunks_per_rank % 2:
            raise ValueError(f"chunks_per_rank must be an even number >= 2, got {self.chunks_per_rank}")
        if self.num_streams is not None and self.num_streams < 1:
            raise ValueError(f"num_streams must be at least 1, got {self.num_streams}")

    @classmethod
    def defaults(cls, ctx, head_dim: int, chunks_per_rank: int = 2, hopper: bool = False,
                 seq_len: int | None = None, causal: bool = True) -> "AttentionConfig":
        """The defaults on ``ctx``'s backend. Small tiles for the interpreter (odd sizes still exercise every path);
        on GPUs the tiles docs/decisions.md gives the reasons for: at D = 64 the dK/dV kernel's key blocks are 64
        rows (128 spill at 4 warps). On Hopper (``hopper``: compute capability 9.0) at D = 64 and 128 the forward is
        the warp-specialized kernel (kernels.attention_hopper) on 128-key blocks, and the backward the single
        warp-specialized kernel (kernels.attention_bwd_hopper) where it has programs enough for the GPU. The forward
        runs two compute warpgroups and two K/V stages, except at D = 64 where a query tile reads ``LONG_WALK`` key
        blocks or more on average (``seq_len``, the whole sequence: that many blocks not causal, half as many
        causal): there three warpgroups and three stages, which lose to two on shorter walks. On CUDA one copy
        stream serves every peer in turn (the first peer's chunks, which the kernels read first, land soonest);
        elsewhere a stream per peer."""
        if ctx.interpreted:
            small = Blocks(block_m=16, block_n=16, num_warps=1, num_stages=1)
            return cls(chunks_per_rank=chunks_per_rank, fwd=small, dq=small, dkdv=small)
        if head_dim <= 64:
            ws = hopper and head_dim == 64
            fwd = Blocks(block_m=128, block_n=64, num_warps=8, num_stages=3)
            if ws:
                walk = 0 if seq_len is None else seq_len // 128 // (2 if causal else 1)
                groups = 3 if walk >= LONG_WALK else 2
                fwd = Blocks(block_m=128, block_n=128, num_warps=8, num_stages=groups, warp_specialized=True,
                             warp_groups=groups)
            cfg = cls(chunks_per_rank=chunks_per_rank, fwd=fwd,
                      dq=Blocks(block_m=128, block_n=32, num_warps=4, num_stages=3),
                      dkdv=Blocks(block_m=64, block_n=64, num_warps=4, num_stages=2, warp_specialized=ws))
        elif hopper and head_dim == 128:
            cfg = cls(chunks_per_rank=chunks_per_rank,
                      fwd=Blocks(block_m=128, block_n=128, num_warps=8, num_stages=2, warp_specialized=True),
                      dkdv=Blocks(block_m=64, block_n=128, num_warps=8, num_stages=2, warp_specialized=True))
        else:
            cfg = cls(chunks_per_rank=chunks_per_rank)
        return replace(cfg, num_streams=1) if ctx.backend == "cuda" else cfg
