"""What the GEMM ops share: configuration, input checks, kernel launch."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..kernels.chunks import cdiv
from ..kernels.gemm import persistent_gemm
from ..kernels.launch import launch
from .replay import ReplayCache, call_key

DTYPES = (torch.float16, torch.bfloat16)
#: fp8 inputs (AllGather-GEMM and the plain GEMM): e4m3 with per-tensor float32 scales, output bf16 or fp16
FP8 = torch.float8_e4m3fn


def eager_host_bound(backend: str, world: int, flop: float, min_flop_per_peer: float,
                     capturing: bool | None = None) -> bool:
    """Whether an eager call of ``flop`` GEMM FLOPs is too short to pay for the host's cost of an overlapped
    call: under ``min_flop_per_peer x (W - 1)`` FLOPs, never on the host backend, never while a CUDA graph is
    being captured (``capturing=None``: ask torch). Each op's EAGER_MIN_FLOP_PER_PEER says why its figure."""
    if backend == "host" or world < 2 or flop >= min_flop_per_peer * (world - 1):
        return False
    if capturing is None:
        capturing = torch.cuda.is_current_stream_capturing()
    return not capturing


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and chunking of an overlapped GEMM.

    ``m_per_chunk=None`` picks about ``chunks_per_rank`` chunks per rank, each a
    multiple of ``block_m``; ``num_streams=None`` uses one stream per peer (AllGather-GEMM takes at most that
    many; GEMM-RS's copy variant up to one per chunk sent, GEMMReduceScatter.copy_streams).
    ``min_chunk_bytes`` (with ``m_per_chunk=None``): fewer
    chunks where the shard is small, so that each carries at least this
    many bytes (at least one chunk). Each chunk costs its copy and its flag
    write, about 8 µs of a graph's critical path on 2xH200 (1 -> 8 chunks
    per rank: +60 µs on 2048x4096x4096), while more chunks only let remote
    tiles start sooner. The GPU default, 16 MiB, is from
    ``benchmarks/results/diag_small-H200x2.log`` (1 or 2 chunks per rank
    beat 4 by 17-53 µs on three of four small shapes, bf16 and fp8) and
    the chunking sweeps (2 beat 4 on 8192x4096x4096 and 16384x8192x14336).
    GEMM-ReduceScatter applies it to each chunk of partial output sent to a
    peer (since the fourteenth session): 2xH200, graphs, ``diag_rs.py``,
    2048x4096x4096 (8 MiB per peer) 1 or 2 chunks 110.4 / 109.7 µs against
    123.0 for 4; 8192x4096x4096 (32 MiB) 2 chunks 394.5 against 393.4 for
    4 (and 453.9 for 1); 64 MiB and up keep 4.
    ``gemm_first`` (AllGather-GEMM): launch the consumer before enqueueing the
    copies, so the GPU computes on the local shard while the host enqueues
    them (the first call of a shape still goes producers first, so every
    kernel the producers use is loaded before a persistent kernel spins).
    ``mode`` (AllGather-GEMM): "push" (each rank writes its rows into its
    peers' workspaces and raises their flags) or "pull" (each rank reads its
    peers' rows from their workspaces and raises its own flags; costs a
    local copy of the shard and a second barrier per call).
    ``scatter`` (GEMM-ReduceScatter): "store" (the GEMM stores peers' tiles
    straight into their receive slots over NVLink), "copy" (the GEMM stores
    them locally; copy engines move each chunk once the GEMM's counter for it
    is complete, waiting with a stream wait-value), or "auto" (copy on GPUs
    when the partial output is at least ``gemm_rs.COPY_SCATTER_BYTES``, or
    ``COPY_SCATTER_FUSED_BYTES`` with the reduction fused).
    ``fuse_reduce`` (GEMM-ReduceScatter): True: the GEMM's tiles of this
    rank's own rows, computed last, add the peers' partials in their epilogue
    and store the output (kernels.gemm REDUCE_OWN), when each rank's rows are
    a whole number of ``block_m`` tiles; False, or rows that are not: every
    partial goes to memory and a separate kernel sums them; None (default):
    True (measured faster on every shape once the tiles went round-robin,
    ``claim=0``; see ``gemm_rs``).
    ``claim`` (GEMM-ReduceScatter with ``fuse_reduce``): how the GEMM's
    programs take tiles so that no own-row tile's wait can block a peer tile
    (kernels.gemm CLAIM): 1, one by one in order through an atomic counter;
    0, round-robin, each program counting itself in once and waiting, before
    its first own-row tile, for every program to have started. The host
    backend always uses 1. None: ``CLAIM_DEFAULT``.
    ``defer_release`` (GEMM-ReduceScatter): a tile's chunk counters are bumped
    after the next tile's K loop, when its stores have landed, instead of
    right after them (the release would wait for them). None: in the store
    variant (counters and stores over NVLink; 2xH200, graphs: 3-14% faster on
    the three large shapes, equal on 2048 x 4096 x 4096), not in the copy
    variant (local counters: within 1% on the large shapes, 33% slower on
    2048 x 4096 x 4096, where each program has two tiles and the deferred
    count holds a chunk's copy back by a whole tile).
    ``tma_store`` (AllGather-GEMM and the plain GEMM): store C tiles through a
    tensor descriptor (a TMA store) instead of pointers, where C can be
    described (as for ``tma``: NVIDIA, compute capability 9.0 and later, or
    the host backend; unit column stride, 16-byte aligned base and rows).
    None: ``TMA_STORE_DEFAULT``.
    ``ws`` (GEMM-ReduceScatter, copy variant with the reduction fused): the
    warp-specialized Gluon GEMM (kernels.gemm_ws: the K loop in two
    warpgroups, the epilogue in a partition of its own reading each finished
    tile from shared memory, so it runs beside the next tile's K loop)
    instead of kernels.gemm, with its own tiles (``gemm_rs.WS_TILES``).
    NVIDIA compute capability 9.0 only, A and B describable
    (``desc_layout``), round-robin tiles (``claim`` not 1), counters bumped
    at once (``defer_release`` not True). None: ``gemm_rs.WS_DEFAULT`` (on:
    measured faster, see there). True where it
    cannot run runs kernels.gemm.
    ``tma``: load A and B tiles through tensor descriptors (TMA) rather than
    pointers, on NVIDIA GPUs of compute capability 9.0 and later and on the
    host backend (never on AMD). None (default): when B is stored [N, K] and
    passed transposed (``linear.weight.t()``), where descriptors measured
    faster on every benchmark shape (H200: 0.97-1.00 of cuBLAS vs 0.85-0.88 on
    the three largest, ``benchmarks/results/diag_tma-H200.log``); for B stored
    [K, N] pointers, which were within 3% either way (graph-timed tile sweep,
    ``tune_tiles_tma-H200.log``: descriptors 0.4-3.0% faster on 9 of 11
    shapes, 6.3% slower on one). True: descriptors for either layout (the
    tuned entries set it per shape where it won). False: never. A call whose operands a descriptor cannot describe (see
    ``desc_layout``) uses pointers either way.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    m_per_chunk: int | None = None
    chunks_per_rank: int = 4
    num_streams: int | None = None
    num_xcds: int = 1
    gemm_first: bool = False
    mode: str = "push"
    scatter: str = "auto"
    fuse_reduce: bool | None = None
    tma: bool | None = None
    min_chunk_bytes: int = 0
    claim: int | None = None
    defer_release: bool | None = None
    tma_store: bool | None = None
    ws: bool | None = None

    def __post_init__(self):
        if self.mode not in ("push", "pull"):
            raise ValueError(f"GemmConfig.mode must be 'push' or 'pull', got {self.mode!r}")
        if self.claim not in (None, 0, 1):
            raise ValueError(f"GemmConfig.claim must be None, 0 or 1, got {self.claim!r}")
        if self.scatter not in ("store", "copy", "auto"):
            raise ValueError(f"GemmConfig.scatter must be 'store', 'copy' or 'auto', got {self.scatter!r}")

    def chunk_rows(self, m_local: int, row_bytes: int = 0) -> int:
        """Rows per chunk for ``m_local`` rows per rank of ``row_bytes`` each (0: ignore min_chunk_bytes)."""
        if self.m_per_chunk is not None:
            return max(1, min(self.m_per_chunk, m_local))
        chunks = self.chunks_per_rank
        if self.min_chunk_bytes and row_bytes:
            chunks = max(1, min(chunks, m_local * row_bytes // self.min_chunk_bytes))
        rows = cdiv(cdiv(m_local, chunks), self.block_m) * self.block_m
        return max(1, min(rows, m_local))

    def streams_for(self, world: int) -> int:
        return max(1, min(self.num_streams or (world - 1), max(world - 1, 1)))


class OverlapOp:
    """What every overlapped op holds: its Context, config, fallback rule, shape checks done, plans."""

    KIND = "?"  # the op's key in tuned tables
    #: eager_host_bound's threshold for this op (set by each op from its measurements)
    EAGER_MIN_FLOP_PER_PEER = 0.0

    def __init__(self, ctx, config: GemmConfig | None, fallback: str, max_m: int | None, name: str,
                 replay: bool = True):
        if fallback not in ("auto", "never", "always"):
            raise ValueError(f"fallback must be 'auto', 'never' or 'always', got {fallback!r}")
        self.ctx = ctx
        self.user_config = config  # when given, used for every shape
        self.config = config or default_config(ctx)
        self.fallback = fallback
        self.max_m = max_m
        self.name = name
        self._agreed: set = set()  # shape keys every rank has been seen to agree on
        self._plans: dict = {}  # per-shape state built on first use
        self.last_path = None  # "overlap" or "fallback", for tests and curious users
        self._tuned: dict = {}
        self._ran_overlap: set = set()  # shapes whose overlap path has run (workspaces allocated, kernels built)
        self.replays = ReplayCache(ctx, enabled=replay)  # eager calls that repeat replay a captured graph

    def exit_counts(self) -> torch.Tensor:
        """Two int32s for the GEMM's RESET_AT_EXIT (a tile counter and the count of programs out; zero between
        calls, the GEMM's last program resets them)."""
        t = self._plans.get("tick")
        if t is None:
            t = self._plans["tick"] = torch.zeros(2, dtype=torch.int32, device=self.ctx.device)
        return t

    def _out_rows(self, m: int) -> int | None:
        """Rows of the output for ``a`` of ``m`` rows (None: not a valid call; the checks will say why)."""
        raise NotImplementedError

    def _replayed(self, a, w, bias, out, overrides, scales=(), out_dtype=None):
        """ops.replay's unchecked path: ``(True, out)`` when a graph held for this call's key was replayed (``out``
        allocated here when None), else ``(False, out)`` with nothing enqueued, for the checked path."""
        if not (self.replays.active and isinstance(a, torch.Tensor) and isinstance(w, torch.Tensor)
                and a.dim() == w.dim() == 2):
            return False, out
        if out is None:
            rows = self._out_rows(a.shape[0])
            if rows is None:
                return False, out
            out = torch.empty((rows, w.shape[1]), dtype=result_dtype(a.dtype, out_dtype), device=a.device)
        if not self.replays.hit(call_key(overrides, a, w, bias, out, *scales)):
            return False, out
        self.last_path = "overlap"
        return True, out

    @staticmethod
    def _keys(a, w, bias, out, overrides, scales=()) -> tuple:
        """(shape key, call key). The shape key is what decides which kernels a call builds and which plans it
        needs, addresses aside: shapes, dtype, B's strides (pointer or descriptor loads), bias or not, overrides;
        it keys the eager rule's first-call exception and the replay cache's "ran eagerly" set. The call key
        (replay.call_key) adds every tensor's address and layout (fp8's scales included: a graph reads them
        where they were). Overrides are sorted once for both."""
        ov = tuple(sorted(overrides.items())) if overrides else ()
        return ((tuple(a.shape), w.shape[1], a.dtype, tuple(w.stride()), bias is None, out.dtype, ov),
                call_key(ov, a, w, bias, out, *scales))

    def eager_fallback(self, key, flop: float) -> bool:
        """The eager rule (eager_host_bound) for a call of ``flop`` FLOPs. The first call of each shape ``key``
        takes the overlap path anyway: it allocates the workspaces and builds the kernels, which cannot
        happen inside a CUDA-graph capture, so a later capture of this shape finds them ready. So does the first
        call of a shape after a workspace allocation dropped the replay cache's graphs (ReplayCache.unprepared).
        Every rank takes the same branch: allocations are collective, so generations change on all alike."""
        if key not in self._ran_overlap or self.replays.unprepared(key):
            self._ran_overlap.add(key)
            return False
        return eager_host_bound(self.ctx.backend, self.ctx.world_size, flop, self.EAGER_MIN_FLOP_PER_PEER)

    def config_for(self, shape, fp8: bool = False) -> GemmConfig:
        """The user's config if one was given, else the tuned one for this GPU, world size, shape and dtype
        class (triton_overlap.tuning; fp8 entries under ``KIND + "_fp8"``), else the defaults."""
        if self.user_config is not None:
            return self.user_config
        key = (tuple(shape), fp8)
        cfg = self._tuned.get(key)
        if cfg is None:
            from ..tuning import gpu_key, lookup

            found = lookup(self.KIND + ("_fp8" if fp8 else ""), gpu_key(self.ctx), self.ctx.world_size, key[0])
            base = fp8_config(self.ctx, self.config) if fp8 else self.config
            # an entry may name only some fields (tune.py --tiles-only: the tiles); the rest stay the op's own
            cfg = self._tuned[key] = replace(base, **found) if found else base
        return cfg


def fp8_config(ctx, cfg: GemmConfig) -> GemmConfig:
    """Untuned fp8 tiles on GPUs: 128-deep K steps (128 bytes, as 64 are for 16-bit types) and 3 stages, which
    keep a 128 x 256 tile's pipeline inside an H100/H200's shared memory."""
    return cfg if ctx.backend == "host" else replace(cfg, block_k=128, num_stages=3)


def default_config(ctx) -> GemmConfig:
    """Defaults: H100/H200-class tiles on GPUs; small tiles for the interpreter."""
    if ctx.backend == "host":
        return GemmConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_warps=1, num_stages=1, chunks_per_rank=3)
    if ctx.backend == "hip":
        return GemmConfig(block_m=256, block_n=256, block_k=64, num_warps=8, num_stages=2, num_xcds=8)
    # gemm_first: faster eager on all six AG shapes on 2xH200; 4 stages: 0.66 vs 0.84 ms on one RS shape (tutorial 06)
    return GemmConfig(gemm_first=True, num_stages=4, min_chunk_bytes=16 << 20)


def with_overrides(cfg: GemmConfig, **kw) -> GemmConfig:
    kw = {k: v for k, v in kw.items() if v is not None}
    return replace(cfg, **kw) if kw else cfg  # dataclasses.replace costs tens of µs per call


def check_operands(op: str, ctx, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                   scale_a=None, scale_b=None, out_dtype=None, fp8: bool = False) -> torch.dtype:
    """Shape/dtype/device checks that need no communication; raise ValueError before any launch. Returns the
    output dtype: ``a``'s, or for fp8 operands (ops that accept them: ``fp8=True``) ``out_dtype`` (default
    bf16), with ``scale_a`` and ``scale_b`` float32 one-element tensors on the device."""
    allowed = DTYPES + ((FP8,) if fp8 else ())
    for name, t in (("a", a), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype not in allowed:
            kinds = "float16, bfloat16 or float8_e4m3fn" if fp8 else "float16 or bfloat16"
            raise ValueError(f"{op}: {name} must be {kinds}, got {t.dtype}")
        if t.device != ctx.device:
            raise ValueError(f"{op}: {name} is on {t.device}, the Context is on {ctx.device}")
    if a.dtype != w.dtype:
        raise ValueError(f"{op}: a and w have different dtypes ({a.dtype} vs {w.dtype})")
    if a.shape[1] != w.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ: a is {tuple(a.shape)}, w is {tuple(w.shape)}")
    if a.shape[0] == 0 or a.shape[1] == 0 or w.shape[1] == 0:
        raise ValueError(f"{op}: empty operand: a {tuple(a.shape)}, w {tuple(w.shape)}")
    out = check_scales(op, ctx, a.dtype, scale_a, scale_b, out_dtype)
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != w.shape[1]:
            raise ValueError(f"{op}: bias must have shape ({w.shape[1]},), got {tuple(bias.shape)}")
        if bias.dtype != out or bias.device != a.device:
            raise ValueError(f"{op}: bias must be {out} on {a.device}, got {bias.dtype} on {bias.device}")
    return out


def result_dtype(dtype, out_dtype) -> torch.dtype:
    """The output dtype of operands of ``dtype`` given the caller's ``out_dtype`` (None: the operands' own, bf16
    for fp8); check_scales says which combinations are valid."""
    return out_dtype or (torch.bfloat16 if dtype == FP8 else dtype)


def check_scales(op: str, ctx, dtype, scale_a, scale_b, out_dtype) -> torch.dtype:
    """fp8's extra arguments (see check_operands); the output dtype."""
    if dtype != FP8:
        if scale_a is not None or scale_b is not None:
            raise ValueError(f"{op}: scale_a and scale_b are for float8_e4m3fn operands, got {dtype}")
        if out_dtype is not None and out_dtype != dtype:
            raise ValueError(f"{op}: out_dtype must be the operands' dtype ({dtype}) for {dtype} operands")
        return dtype
    if ctx.backend == "hip":
        raise ValueError(f"{op}: float8_e4m3fn is not supported on AMD here (MI300 uses e4m3fnuz; not built)")
    if ctx.backend == "cuda" and _capability(ctx.device.index) < (8, 9):
        raise ValueError(f"{op}: float8_e4m3fn needs compute capability 8.9 or later, "
                         f"this GPU has {_capability(ctx.device.index)}")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32 or s.device != ctx.device:
            got = f"{s.dtype} {tuple(s.shape)} on {s.device}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"{op}: float8_e4m3fn operands need {name}, a one-element float32 tensor on "
                             f"{ctx.device} (per-tensor scale), got {got}")
    out = result_dtype(dtype, out_dtype)
    if out not in DTYPES:
        raise ValueError(f"{op}: out_dtype must be float16 or bfloat16, got {out_dtype}")
    return out


def agree_across_ranks(op: str, ctx, key: tuple, seen: set) -> None:
    """Check once per distinct ``key`` that every rank passes the same key (a collective). ``seen`` is cleared
    past 256 keys (keys that change every call, such as packed documents' boundaries, would grow it without
    end; agreeing again is correct, and every rank clears at the same call)."""
    if key in seen:
        return
    if len(seen) >= 256:
        seen.clear()
    everyone = ctx._gather(key)
    if any(k != key for k in everyone):
        raise ValueError(f"{op}: ranks disagree on shapes/dtypes: "
                         + ", ".join(f"rank {r}: {k}" for r, k in enumerate(everyone)))
    seen.add(key)


def plain_gemm(ctx, cfg: GemmConfig, a, w, out, bias=None, scales=None):
    """A launcher of our persistent GEMM alone, ``out = a @ w (+ bias)``: no waits, no communication (the
    "consumer alone" of the benchmarks, what tune.py --tiles-only times, fp8's fallback matmul)."""
    M, K = a.shape
    order = torch.arange(cdiv(M, cfg.block_m), dtype=torch.int32, device=a.device)
    ready = torch.zeros(1, dtype=torch.int32, device=a.device)
    return lambda: launch_gemm(ctx, cfg, a=a, ws=None, b=w, c=out, bias=bias, M=M, N=w.shape[1], K=K, m_local=M,
                               m_per_chunk=M, chunks_per_rank=1, tile_order=order, flags=ready, op=0, gather=False,
                               scales=scales)


def fp8_matmul(ctx, cfg: GemmConfig, a, w, scale_a, scale_b, bias, out) -> None:
    """``out = (a @ w) * scale_a * scale_b (+ bias)`` for fp8 ``a`` and ``w`` (the fallbacks' matmul):
    ``torch._scaled_mm`` where it takes the layout (``w`` column-major as ``weight.t()`` is, K and N multiples
    of 16, ``out`` contiguous), else our persistent GEMM."""
    if (w.stride(0) == 1 and a.stride(1) == 1 and a.shape[1] % 16 == 0 and w.shape[1] % 16 == 0
            and out.is_contiguous()):
        torch._scaled_mm(a, w, scale_a, scale_b, bias=bias, out_dtype=out.dtype, out=out)
    else:
        plain_gemm(ctx, cfg, a, w, out, bias, (scale_a, scale_b))()


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple:
    return torch.cuda.get_device_capability(index)


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    e = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * e % 16 == 0 for s in strides)


def _pair_gap(a, ws) -> int | None:
    """Elements from the lower of ``a``'s and ``ws``'s addresses to the higher, when one descriptor can span both."""
    e = a.element_size()
    gap = abs(ws.data_ptr() - a.data_ptr())
    return gap // e if gap % 16 == 0 and gap < (1 << 40) and a.stride(0) == ws.stride(0) else None


def _pair_desc(a, ws, M, K, bm, bk):
    """AllGather's A as one 3-D descriptor [2, M, K] whose planes are this rank's shard and the workspace (plane 1
    lies ``gap`` elements past plane 0, whichever of the two comes first in memory), so the kernel's one K loop
    reads either by plane index. Only a shard plane's first M_LOCAL rows are real; the kernel reads no others
    there (whole tiles of rows per rank). Returns the descriptor and (shard's plane, workspace's plane)."""
    gap = _pair_gap(a, ws)
    lo, planes = (a, (0, 1)) if a.data_ptr() <= ws.data_ptr() else (ws, (1, 0))
    return TensorDescriptor(lo, [2, M, K], [gap, a.stride(0), 1], [1, bm, bk]), planes


def _tma_target(ctx, device, *block: int) -> bool:
    """Whether this backend and GPU take tensor descriptors with tile sides ``block``: NVIDIA compute capability
    9.0 and later or the host backend (never AMD), no side over 256."""
    if ctx.backend == "hip" or max(block) > 256:
        return False
    return ctx.backend != "cuda" or _capability(device.index)[0] >= 9


def desc_layout(ctx, cfg: GemmConfig, a, ws, b, m_local: int, gather: bool) -> str | None:
    """How B is described for kernels.gemm's DESC path: "kn" ([K, N] rows; only with ``cfg.tma`` True), "nk"
    (B's transpose, [N, K] rows: ``linear.weight.t()``), or None: pointers (GemmConfig.tma says when).
    Descriptors need 16-byte aligned bases and row strides, unit stride in the last dimension, and with
    GATHER whole tiles of each rank's rows."""
    if cfg.tma is False or not _tma_target(ctx, a.device, cfg.block_m, cfg.block_n, cfg.block_k):
        return None
    if a.stride(1) != 1 or not _aligned(a, a.stride(0)):
        return None
    if gather and (m_local % cfg.block_m != 0 or ws.stride(1) != 1 or _pair_gap(a, ws) is None):
        return None
    if b.stride(0) == 1 and b.stride(1) != 1 and _aligned(b, b.stride(1)):
        return "nk"
    if cfg.tma and b.stride(1) == 1 and _aligned(b, b.stride(0)):
        return "kn"
    return None


#: The default of GemmConfig's (and launch_gemm's) ``claim`` off the host backend. Eleventh session, 2xH200,
#: graphs (scripts/diag_rs.py): round-robin (0) made the fused GEMM-RS call 1-3% faster on the three large shapes
#: and 19% on 2048 x 4096 x 4096 (copy variant: 154 -> 125 us).
CLAIM_DEFAULT = 0


#: GemmConfig.tma_store's default.
TMA_STORE_DEFAULT = True


def _describable(ctx, cfg: GemmConfig, c) -> bool:
    """Whether C's tiles can be stored through a descriptor (TMA): NVIDIA sm_90+ or the host backend, unit column
    stride, 16-byte aligned base and row stride, tiles of at most 256 in each dimension (and half tiles, the store's
    unit, at least 16 columns wide)."""
    return (cfg.block_n >= 32 and _tma_target(ctx, c.device, cfg.block_m, cfg.block_n)
            and c.stride(1) == 1 and _aligned(c, c.stride(0)))


def _first(*values):
    return next(v for v in values if v is not None)


def launch_gemm(ctx, cfg: GemmConfig, *, a, ws, b, c, bias, M, N, K, m_local, m_per_chunk, chunks_per_rank,
                tile_order, flags, op, gather, stride_wm=0, scatter_ptrs=None, counter_ptrs=None, reduce_into=None,
                expected=None, tick=None, split_m=0, scales=None, free_sm=None, local_counters=False,
                split_epilogue=None, claim=None, defer_release=None, reset_at_exit=False):
    """One persistent GEMM (kernels.gemm). ``reduce_into``: GEMM-RS with the reduction in the GEMM (REDUCE_OWN):
    the output [M/W, N] (unit column stride; m_local a multiple of block_m), with ``expected`` (counts per
    chunk), ``tick`` (an int32 that is zero at launch and must be reset after it) and ``split_m`` (how many
    m-tiles of ``tile_order`` come before this rank's own). ``scales``: fp8's (scale_a, scale_b) (SCALED).
    ``free_sm`` (default: ``gather``): leave one SM (CU) free, for a barrier kernel that runs beside this GEMM
    and that some of its tiles wait for, on this rank or a peer (else both ranks could wait on each other).
    ``local_counters``: every scatter address and counter is on this GPU (GEMM-RS's copy variant), so a tile
    publishes its stores with a device-scope release instead of a system-scope one. ``split_epilogue`` (default:
    with ``reduce_into``): the own-row tiles' reduction runs on two column halves in turn, which on sm_90a
    (Triton 3.6, 128x256 tiles, unit strides) takes ptxas's spill stores from 8 bytes to none (scripts/compile_check.py).
    ``claim`` (with ``reduce_into``; kernels.gemm CLAIM): 1, tiles handed out one by one through ``tick``; 0,
    round-robin with one start count per program. Always 1 on the host backend, whose interpreter runs
    programs one after another. ``defer_release`` (scatter; DEFER_RELEASE): bump a tile's counters after the
    next tile's K loop. Both default to ``cfg``'s, and where that is None: CLAIM_DEFAULT, and deferred where the
    counters are a peer's (system-scope release over NVLink), not where they are local. ``reset_at_exit`` (with
    ``reduce_into`` or ``gather``; kernels.gemm RESET_AT_EXIT): the GEMM's last program zeroes ``flags`` (this
    rank's flags or counters) and ``tick``, which then holds two int32s (the tile counter and the exit count), both
    zero at launch."""
    num_tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    units = ctx.num_compute_units()
    if (gather if free_sm is None else free_sm) and ctx.backend != "host":
        units -= 1
    programs = max(1, min(units, num_tiles))
    a_desc = b_desc = None
    planes = (0, 0)
    b_layout = desc_layout(ctx, cfg, a, ws, b, m_local, gather)
    if b_layout is not None:
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        if gather:
            a_desc, planes = _pair_desc(a, ws, M, K, bm, bk)
        else:
            a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [bm, bk])
        if b_layout == "kn":
            b_desc = TensorDescriptor(b, [K, N], [b.stride(0), 1], [bk, bn])
        else:
            b_desc = TensorDescriptor(b.t(), [N, K], [b.stride(1), 1], [bn, bk])
    c_desc = None
    if scatter_ptrs is None and _first(cfg.tma_store, TMA_STORE_DEFAULT) and _describable(ctx, cfg, c):
        # the kernel stores each tile in two column halves (half the shared memory)
        c_desc = TensorDescriptor(c, [M, N], [c.stride(0), 1], [cfg.block_m, cfg.block_n // 2])
    launch(persistent_gemm, (programs,), (
        a, ws if ws is not None else a, b, c, bias if bias is not None else c,
        M, N, K, m_local, m_per_chunk, chunks_per_rank,
        a.stride(0), stride_wm, b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        tile_order, flags, ctx.err, ctx.budget, ctx.rank, op,
        scatter_ptrs if scatter_ptrs is not None else flags, counter_ptrs if counter_ptrs is not None else flags,
        reduce_into if reduce_into is not None else c, reduce_into.stride(0) if reduce_into is not None else 0,
        expected if expected is not None else flags, tick if tick is not None else flags, ctx.world_size, split_m,
        a_desc, planes[0], planes[1], b_desc, *(scales if scales is not None else (flags, flags)), c_desc,
    ), dict(
        HAS_BIAS=bias is not None, GATHER=gather, SCATTER=scatter_ptrs is not None, REDUCE_OWN=reduce_into is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_PROGRAMS=programs, NUM_XCDS=cfg.num_xcds, EVEN_K=(K % cfg.block_k == 0), CLOCK=ctx.clock,
        DOT_F32=ctx.backend == "host",
        # every row of a receive slot starts 16-element aligned (cudaMalloc'd base, N % 16 == 0)
        ALIGN_C=scatter_ptrs is not None and N % 16 == 0 and (
            reduce_into is None or (reduce_into.data_ptr() % 16 == 0 and reduce_into.stride(0) * c.element_size() % 16 == 0)),
        DESC=b_layout is not None, B_KMAJOR=b_layout == "nk", SCALED=scales is not None,
        WHOLE_TILES=scatter_ptrs is not None and m_local % cfg.block_m == 0, LOCAL_COUNTERS=local_counters,
        SPLIT_EPILOGUE=(reduce_into is not None if split_epilogue is None else split_epilogue) and cfg.block_n >= 32,
        CLAIM=1 if ctx.backend == "host" else _first(claim, cfg.claim, CLAIM_DEFAULT),
        DEFER_RELEASE=scatter_ptrs is not None and bool(_first(defer_release, cfg.defer_release, not local_counters)),
        DESC_C=c_desc is not None, RESET_AT_EXIT=(reduce_into is not None or gather) and reset_at_exit,
    ), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    ctx.after_launch()
