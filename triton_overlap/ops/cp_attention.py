"""Context-parallel attention, forward: K/V gathered by copy engines, consumed chunk by chunk.

Every rank holds its zigzag shard of q, k and v (triton_overlap.cp). Copy
engines push this rank's K and V, chunk by chunk, into every peer's
workspaces with one flag per chunk (producers.allgather.push_chunks, the
AllGather-GEMM producer); one flash-attention kernel per call folds its own
K/V in first and each peer's chunk as soon as its flag is up
(kernels.attention). K/V move at Hkv heads, never expanded for GQA/MQA.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..context import op_id
from ..cp import as_ints, int_vector, local_cu_seqlens
from ..kernels.attention import cp_attention_fwd
from ..kernels.attention_bwd import cp_attention_dkdv, cp_attention_dq, reduce_dkdv
from ..kernels.chunks import ChunkLayout, cdiv
from ..kernels.launch import launch
from ..producers.allgather import enqueue_chunks, join, open_push
from .common import DTYPES, agree_across_ranks
from .replay import ReplayCache, call_key

OP = op_id("cp_attention")
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class Blocks:
    """Tile sizes and launch parameters of one attention kernel (``block_m`` query rows, ``block_n`` key rows)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class AttentionConfig:
    """``chunks_per_rank``: how finely each rank's K/V is cut for the flags (even: the two zigzag halves are
    never mixed in one chunk). One ``Blocks`` per kernel: forward, backward dQ, backward dK/dV."""
    chunks_per_rank: int = 2
    fwd: Blocks = field(default_factory=lambda: Blocks(128, 64, 8, 3))
    dq: Blocks = field(default_factory=lambda: Blocks(128, 64, 8, 2))
    dkdv: Blocks = field(default_factory=lambda: Blocks(64, 128, 8, 2))


def default_attention_config(backend: str, head_dim: int, chunks_per_rank: int = 2) -> AttentionConfig:
    if backend == "host":  # small tiles keep the interpreter fast; odd sizes still exercise every path
        small = Blocks(16, 16, 1, 1)
        return AttentionConfig(chunks_per_rank, small, small, small)
    if head_dim <= 64:
        return AttentionConfig(chunks_per_rank, Blocks(128, 64, 4, 3), Blocks(128, 64, 4, 2), Blocks(64, 128, 4, 2))
    return AttentionConfig(chunks_per_rank)


#: packed documents' tables kept for this many boundary sets (x tile sizes x devices), least recently used
#: dropped: training feeds new boundaries every batch. Tables a CUDA graph captured are kept for good in
#: _PINNED (the graph reads them at every replay).
SEGMENT_CACHE = 64
_SEGMENTS: OrderedDict = OrderedDict()
_PINNED: dict = {}


def segments(local_cu, block: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For packed documents with shard boundaries ``local_cu``: the table of (document, first row) of every
    block of ``block`` rows, documents longest first (so that the longest programs start first), the
    boundaries as an int32 tensor, and the number of blocks. Cached per boundaries, block and device (see
    SEGMENT_CACHE)."""
    key = (tuple(local_cu), block, str(device))
    got = _PINNED.get(key) or _SEGMENTS.get(key)
    capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
    if got is None:
        if capturing:
            raise RuntimeError("cp_attention: packed documents' tables are built on the first call with these "
                               "boundaries: run the call once outside CUDA-graph capture first")
        docs = sorted(range(len(local_cu) - 1), key=lambda d: -(local_cu[d + 1] - local_cu[d]))
        rows = [(d, r0) for d in docs for r0 in range(0, local_cu[d + 1] - local_cu[d], block)]
        seg = torch.tensor(rows or [(0, 0)], dtype=torch.int32, device=device)
        got = (seg, torch.tensor(local_cu, dtype=torch.int32, device=device), len(rows))
    if capturing or key in _PINNED:
        _PINNED[key] = got
        _SEGMENTS.pop(key, None)
    else:  # freed tables go back to the caller's stream's pool: reused only after the work queued on it
        _SEGMENTS[key] = got
        _SEGMENTS.move_to_end(key)
        while len(_SEGMENTS) > SEGMENT_CACHE:
            _SEGMENTS.popitem(last=False)
    return got


def _grid0(S, block, local_cu, device):
    """(programs along the sequence, table, boundaries): whole-shard blocks, or the packed documents' blocks."""
    if local_cu is None:
        none = _all_ready(1, device)  # never read (VARLEN off)
        return cdiv(S, block), none, none
    seg, cu, n = segments(local_cu, block, device)
    return n, seg, cu


def launch_fwd(q, k, v, kw, vw, out, lse, flags, err, budget, rank, world, op, m_per_chunk, chunks_per_rank,
               scale, causal, blocks: Blocks, clock: int, dot_f32: bool, local_cu=None):
    """The forward kernel on contiguous q [B, S, Hq, D], k/v [B, S, Hkv, D], workspaces [B, W*S, Hkv, D].
    ``local_cu``: packed documents' boundaries within the shard (B = 1), else None."""
    B, S, Hq, D = q.shape
    assert k.stride(1) == kw.stride(1) == v.stride(1) == vw.stride(1), "k, v and workspaces share a sequence stride"
    n, seg, cu = _grid0(S, blocks.block_m, local_cu, q.device)
    if n == 0:
        return
    launch(cp_attention_fwd, (n, B * Hq), (
        q, k, v, kw, vw, out, lse, flags, err, budget, rank, world, op,
        S, Hq, Hq // k.shape[2], m_per_chunk, chunks_per_rank, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(2), kw.stride(0), kw.stride(2), k.stride(1),
        out.stride(0), out.stride(1), out.stride(2), seg, cu,
    ), dict(CAUSAL=causal, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, HEAD_D=D, CLOCK=clock, DOT_F32=dot_f32,
            VARLEN=local_cu is not None), num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def launch_bwd(q, k, v, kw, vw, dout, lse, delta, dq, recv_ptrs, counter_ptrs, flags, err, budget, rank, world, op,
               m_per_chunk, chunks_per_rank, scale, causal, cfg: AttentionConfig, clock: int, dot_f32: bool,
               local_cu=None):
    """dQ into ``dq``; float32 dK/dV partials into every owner's receive slot [W, 2, B, S, Hkv, D] for this rank,
    each block bumping the owner's counter for this rank. Returns the count each owner waits for per source."""
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    assert k.stride(1) == kw.stride(1) == v.stride(1) == vw.stride(1), "k, v and workspaces share a sequence stride"
    common = (rank, world, op, S)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(2), kw.stride(0), kw.stride(2), k.stride(1))
    meta = dict(CAUSAL=causal, HEAD_D=D, CLOCK=clock, DOT_F32=dot_f32, VARLEN=local_cu is not None)
    b = cfg.dq
    n, seg, cu = _grid0(S, b.block_m, local_cu, q.device)
    if n:
        launch(cp_attention_dq, (n, B * Hq), (
            q, k, v, kw, vw, dout, lse, delta, dq, flags, err, budget, *common, Hq, Hq // Hkv,
            m_per_chunk, chunks_per_rank, scale, *strides, seg, cu), dict(BLOCK_M=b.block_m, BLOCK_N=b.block_n, **meta),
            num_warps=b.num_warps, num_stages=b.num_stages)
    b = cfg.dkdv
    n, seg, cu = _grid0(S, b.block_n, local_cu, q.device)
    if n:
        launch(cp_attention_dkdv, (n, B * Hkv, world), (
            q, k, v, kw, vw, dout, lse, delta, recv_ptrs, counter_ptrs, flags, err, budget,
            *common, Hq, Hkv, Hq // Hkv, m_per_chunk, chunks_per_rank, scale, *strides, seg, cu),
            dict(BLOCK_M=b.block_m, BLOCK_N=b.block_n, **meta), num_warps=b.num_warps, num_stages=b.num_stages)
    return n * B * Hkv


_READY: dict = {}
_TABLES: dict = {}


def _all_ready(n: int, device) -> torch.Tensor:
    """``n`` flags that are all up, for kernels reading K/V that are already in place (one tensor per size)."""
    key = (n, str(device))
    t = _READY.get(key)
    if t is None:
        t = _READY[key] = torch.ones(n, dtype=torch.int32, device=device)
    return t


@contextmanager
def _pushing(ctx, streams, layout, pairs, flags, kernel_first: bool):
    """Barrier, then the body (the consumer's launch) and the copies. ``kernel_first``: the kernel is queued
    before the host spends its time enqueueing the copies. The caller's stream waits for the barrier (gate):
    attention programs waiting for chunks can fill every SM, and the barrier kernel must have run on every
    rank first. On the host backend a launch runs to completion, so the copies always go first there."""
    kernel_first = kernel_first and ctx.backend != "host"
    open_push(ctx, streams, gate=True)
    if not kernel_first:
        enqueue_chunks(ctx, streams, layout, pairs, flags, dim=1)
    yield
    if kernel_first:
        enqueue_chunks(ctx, streams, layout, pairs, flags, dim=1)


class ContextParallelAttention:
    """Reusable context-parallel attention bound to a Context, with autograd.

    ``op(q, k, v, causal=True, softmax_scale=None) -> (out, lse)``: q is
    [B, S_local, Hq, D], k and v [B, S_local, Hkv, D] in the zigzag layout;
    out is like q, lse is [B, Hq, S_local] float32 (natural log).
    ``chunks_per_rank`` sets how finely each rank's K/V is cut for the flags
    (a multiple of 2: the two zigzag halves are never mixed in one chunk);
    ``config`` (an AttentionConfig) overrides it and the kernels' tiles.

    ``keep_kv``: backward reads the K/V gathered in forward, kept between the
    passes (2 x [B, W * S_local, Hkv, D] per call that autograd holds), instead
    of gathering them again with the copy engines (the default: the gather
    overlaps the backward kernels, so keeping saves little time; see README).
    ``replay``: a forward that repeats an earlier one's tensors and arguments replays a CUDA graph of it
    (ops.replay); False: always enqueued anew.

    Packed documents: ``op(q, k, v, cu_seqlens=...)`` with B = 1 and ``cu_seqlens`` the documents'
    boundaries in the full sequence (flash-attn's convention; a list, or a 1-D integer tensor, read on the
    host: pass a list to keep a CUDA tensor's synchronisation out of the call), each document a multiple of
    2W long and sharded on its own (``triton_overlap.cp.shard(x, ctx, cu_seqlens=...)``). A query attends
    to its own document's keys only (causally by position within the document when ``causal``).
    """

    def __init__(self, ctx, *, chunks_per_rank: int = 2, config: AttentionConfig | None = None,
                 keep_kv: bool = False, name: str = "cp_attention", replay: bool = True):
        if config is not None:
            chunks_per_rank = config.chunks_per_rank
        if chunks_per_rank < 2 or chunks_per_rank % 2:
            raise ValueError(f"chunks_per_rank must be an even number >= 2, got {chunks_per_rank}")
        self.ctx = ctx
        self.name = name
        self.chunks_per_rank = chunks_per_rank
        self.keep_kv = keep_kv
        self.kernel_first = True  # see _kernel_first
        self._called: set = set()
        self._config = config
        self._configs: dict = {}
        self._agreed: set = set()
        self.replays = ReplayCache(ctx, enabled=replay)  # eager forwards that repeat replay a captured graph
        from .. import library

        self._handle = library.handle(self)

    def config(self, head_dim: int, shape=None) -> AttentionConfig:
        """The config given at construction, else the tuned one for ``shape`` = (S_global, Hq, Hkv, D, causal)
        on this GPU and world size (triton_overlap.tuning), else the defaults."""
        if self._config is not None:
            return self._config
        if shape in self._configs:
            return self._configs[shape]
        cfg = self._configs[shape] = self._find_config(head_dim, shape)
        return cfg

    def _find_config(self, head_dim, shape):
        if shape is not None and self.ctx.backend != "host":
            from ..tuning import gpu_key, lookup

            found = lookup("cp_attention", gpu_key(self.ctx), self.ctx.world_size, shape)
            if found:
                return AttentionConfig(self.chunks_per_rank, *(Blocks(**found[k]) for k in ("fwd", "dq", "dkdv")))
        return default_attention_config(self.ctx.backend, head_dim, self.chunks_per_rank)

    def _kernel_first(self, kws, vws, k) -> bool:
        """Whether to launch the kernel before enqueueing the copies: not on the first call for a shape and
        workspace (its copies go first, like AllGather-GEMM's first call), and not when ``kernel_first`` is off."""
        key = (tuple(k.shape), k.dtype, kws.local.data_ptr(), vws.local.data_ptr())
        seen = key in self._called
        self._called.add(key)
        return self.kernel_first and seen

    def _shape_key(self, q, k, causal):
        return (q.shape[1] * self.ctx.world_size, q.shape[2], k.shape[2], q.shape[3], int(causal))

    def _check(self, q, k, v, cu=None):
        """Raises ValueError for bad input; returns the packed documents' boundaries within the shard, or None."""
        ctx = self.ctx
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"cp_attention: {name} must be a 4-D tensor [B, S_local, H, D]")
            if t.dtype not in DTYPES:
                raise ValueError(f"cp_attention: {name} must be float16 or bfloat16, got {t.dtype}")
            if t.device != ctx.device:
                raise ValueError(f"cp_attention: {name} is on {t.device}, the Context is on {ctx.device}")
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"cp_attention: q, k, v have different dtypes ({q.dtype}, {k.dtype}, {v.dtype})")
        B, S, Hq, D = q.shape
        if k.shape != v.shape or k.shape[0] != B or k.shape[1] != S or k.shape[3] != D:
            raise ValueError(f"cp_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, S_local, Hkv, D] "
                             f"with q {tuple(q.shape)}")
        if Hq % k.shape[2]:
            raise ValueError(f"cp_attention: Hq = {Hq} is not a multiple of Hkv = {k.shape[2]}")
        if D not in HEAD_DIMS:
            raise ValueError(f"cp_attention: head dim {D} is not supported (use one of {HEAD_DIMS})")
        if S % self.chunks_per_rank:
            raise ValueError(f"cp_attention: S_local = {S} does not split into the zigzag halves and "
                             f"{self.chunks_per_rank} chunks per rank")
        local_cu = None
        if cu:
            if B != 1:
                raise ValueError(f"cp_attention: with cu_seqlens, q must be [1, S_local, Hq, D], got B = {B}")
            try:
                local_cu = local_cu_seqlens(cu, ctx.world_size, S * ctx.world_size)
            except ValueError as e:
                raise ValueError(f"cp_attention: {e}") from None
        docs = (len(cu) - 1, hash(cu)) if cu else None  # documents, and a digest of their boundaries
        agree_across_ranks("cp_attention", ctx, (tuple(q.shape), tuple(k.shape), str(q.dtype), docs), self._agreed)
        return local_cu

    def __call__(self, q, k, v, *, causal: bool = True, softmax_scale: float | None = None, cu_seqlens=None,
                 out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """(out, lse); differentiable in q, k, v when grad is enabled and any of them requires it (out= not allowed then)."""
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
        if out is None and lse is None and (grad or torch.compiler.is_compiling()):
            # through the custom op: autograd, and torch.compile traces it. Otherwise the op is called
            # directly: the dispatcher's round trip costs an eager call about 0.1 ms of host time (H200 host).
            # The boundaries go in as a tensor, read inside the op: a compiled graph then holds no guard on
            # their values (a list would be specialised: a recompile per new list)
            from .. import library

            return library.cp_attention(q, k, v, self._handle, causal, scale, self.keep_kv and grad,
                                        _as_tensor(cu_seqlens))[:2]
        cu = _as_tuple(cu_seqlens)
        if grad:
            raise ValueError("cp_attention: out= and lse= are for calls without autograd")
        return self.forward(q, k, v, causal, scale, out, lse, cu=cu)

    def forward(self, q, k, v, causal, scale, out=None, lse=None, keep: bool = False, cu=()):
        """(out, lse), and with ``keep`` also copies of the gathered K/V workspaces for ``backward``. ``cu``:
        the packed documents' global boundaries (a tuple; empty: one sequence per batch row)."""
        cu = tuple(cu)
        if self.replays.active and not keep and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
            # a forward that repeats a captured one replays it, unchecked (ops.replay: it passed the checks before)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
            if lse is None:
                lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
            if self.replays.hit(call_key((bool(causal), float(scale), cu), q, k, v, out, lse)):
                return out, lse
        return self._checked_forward(q, k, v, causal, scale, out, lse, keep, cu)

    @torch.no_grad()  # workspaces are reset in place; autograd goes through library.cp_attention
    def _checked_forward(self, q, k, v, causal, scale, out, lse, keep, cu=()):
        ctx = self.ctx
        ctx._check_open()
        local_cu = self._check(q, k, v, cu)
        B, S, Hq, D = q.shape
        if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
            raise ValueError(f"cp_attention: out must be {q.dtype} {tuple(q.shape)} on {q.device}")
        if lse is not None and (tuple(lse.shape) != (B, Hq, S) or lse.dtype != torch.float32 or lse.device != q.device):
            raise ValueError(f"cp_attention: lse must be float32 {(B, Hq, S)} on {q.device}")
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device) if lse is None else lse
        if keep:  # the gathered K/V for backward (this rank's own rows are read from k and v, not from here)
            kws, vws = self._forward(q, k, v, out, lse, causal, scale, local_cu)
            return out, lse, kws.local.clone(), vws.local.clone()
        # the shape key leaves the boundaries out (new ones every batch would grow the cache's record of
        # prepared shapes); the call key has them, so a capture follows an eager call with the same ones
        shape_key = (tuple(q.shape), tuple(k.shape), q.dtype, bool(causal), float(scale), bool(cu))
        key = call_key((bool(causal), float(scale), cu), q, k, v, out, lse)
        if local_cu is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            # the tables, built here if need be, outside any capture the replay cache may start below
            segments(local_cu, self.config(D, self._shape_key(q, k, causal)).fwd.block_m, q.device)
        self.replays.run(key, shape_key, lambda: self._forward(q, k, v, out, lse, causal, scale, local_cu))
        return out, lse

    def _forward(self, q, k, v, out, lse, causal, scale, local_cu=None):
        """Enqueue one forward (what ReplayCache captures); returns the K/V workspaces."""
        ctx = self.ctx
        B, S, Hq, D = q.shape
        W, r = ctx.world_size, ctx.rank
        Hkv = k.shape[2]
        layout = ChunkLayout(W, S, S // self.chunks_per_rank)
        kws = ctx.symmetric(f"{self.name}.k", (B, W * S, Hkv, D), k.dtype)
        vws = ctx.symmetric(f"{self.name}.v", (B, W * S, Hkv, D), v.dtype)
        flags = ctx.symmetric(f"{self.name}.flags", (layout.num_chunks,), torch.int32)
        streams = ctx.streams(max(1, min(W - 1, 2)))

        cfg = self.config(D, self._shape_key(q, k, causal))
        with _pushing(ctx, streams, layout, [(k, kws), (v, vws)], flags, self._kernel_first(kws, vws, k)):
            launch_fwd(q, k, v, kws.local, vws.local, out, lse, flags.local, ctx.err, ctx.budget, r, W, OP,
                       layout.m_per_chunk, layout.chunks_per_rank, scale, causal, cfg.fwd, ctx.clock,
                       ctx.backend == "host", local_cu)
            ctx.after_launch()
        join(ctx, streams)
        flags.local.zero_()  # every needed flag was seen; peers set them again only after the next barrier
        return kws, vws

    @torch.no_grad()
    def backward(self, q, k, v, out, lse, dout, causal, scale, kept_k=None, kept_v=None, cu=()):
        """dq, dk, dv for this rank's shards. K/V come from ``kept_k``/``kept_v`` (the gathered workspaces
        that ``forward(keep=True)`` returned) or, when those are None, are gathered again by the copy
        engines. Partial dK/dV go straight to their owners, who sum them in fp32. ``cu`` as in forward
        (checked there)."""
        ctx = self.ctx
        local_cu = local_cu_seqlens(cu or None, ctx.world_size)
        W, r = ctx.world_size, ctx.rank
        B, S, Hq, D = q.shape
        Hkv = k.shape[2]
        layout = ChunkLayout(W, S, S // self.chunks_per_rank)
        recv = ctx.symmetric(f"{self.name}.dkv", (W, 2, B, S, Hkv, D), torch.float32)
        counters = ctx.symmetric(f"{self.name}.dkv_count", (W,), torch.int32)
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [B, Hq, S]
        streams = ctx.streams(max(1, min(W - 1, 2)))
        host = ctx.backend == "host"
        cfg = self.config(D, self._shape_key(q, k, causal))
        dq = torch.empty_like(q)
        launch = lambda kw, vw, ready: launch_bwd(  # noqa: E731
            q, k, v, kw, vw, dout, lse, delta, dq, recv.ptrs, counters.ptrs, ready, ctx.err, ctx.budget, r, W, OP,
            layout.m_per_chunk, layout.chunks_per_rank, scale, causal, cfg, ctx.clock, host, local_cu)
        if kept_k is not None:
            # no gather: every chunk is ready. The barrier still orders this call's dK/dV stores into the
            # peers' receive slots after the peers' previous reductions (which reset their counters).
            ready = _all_ready(layout.num_chunks, q.device)
            ctx.barrier()
            expected = launch(kept_k, kept_v, ready)
            ctx.after_launch()
            streams, flags = [], None
        else:
            kws = ctx.symmetric(f"{self.name}.k", (B, W * S, Hkv, D), k.dtype)
            vws = ctx.symmetric(f"{self.name}.v", (B, W * S, Hkv, D), v.dtype)
            flags = ctx.symmetric(f"{self.name}.flags", (layout.num_chunks,), torch.int32)
            # copies first, always: backward launches two kernels, and loading the second (lazily, on its first
            # launch) while the first spins for chunks not yet enqueued deadlocked on 2xH200
            with _pushing(ctx, streams, layout, [(k, kws), (v, vws)], flags, False):
                expected = launch(kws.local, vws.local, flags.local)
                ctx.after_launch()
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        n = B * S * Hkv * D
        block = 1024 if host else 2048
        reduce_dkdv[(cdiv(n, block),)](recv.local, dk, dv, counters.local, expected, ctx.err,
                                       ctx.budget, r, W, OP, n, BLOCK=block, CLOCK=ctx.clock)
        ctx.after_launch()
        join(ctx, streams)
        if flags is not None:
            flags.local.zero_()  # every flag was waited for by the kernels above
        counters.local.zero_()  # every count was seen; peers add again only after the next call's barrier
        return dq, dk, dv


def forward_on_gathered(ctx, q, k, v, kg, vg, rank, world, causal, scale, cfg: AttentionConfig, out=None, lse=None,
                        cu_seqlens=None):
    """The forward kernel as rank ``rank`` of ``world`` with K/V already gathered (``kg``/``vg``
    [B, world * S, Hkv, D], rank order; this rank's rows are read from ``k``/``v``): no flags, no
    communication. For baselines that gather with NCCL, and for running every rank's share on one GPU.
    ``cu_seqlens``: packed documents' global boundaries, as the op takes them."""
    B, S, Hq, _ = q.shape
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device) if lse is None else lse
    cpr = cfg.chunks_per_rank
    launch_fwd(q, k, v, kg, vg, out, lse, _all_ready(world * cpr, q.device), ctx.err, ctx.budget, rank, world, OP,
               S // cpr, cpr, scale, causal, cfg.fwd, ctx.clock, ctx.backend == "host",
               local_cu_seqlens(cu_seqlens, world))
    return out, lse


def backward_on_gathered(ctx, q, k, v, kg, vg, out, lse, dout, rank, world, causal, scale, cfg: AttentionConfig,
                         parts=None, cu_seqlens=None):
    """The backward kernels as rank ``rank`` of ``world`` on gathered K/V (see forward_on_gathered).
    Returns dq and this rank's float32 dK/dV partials for every owner, [world, 2, B, S, Hkv, D] (into
    ``parts`` when given): the sum over ranks of entry o is owner o's (dK, dV), e.g. through
    reduce_scatter_tensor. The address tables are cached per ``parts`` buffer, so a caller that passes the
    same buffer makes no host-to-device copy per call."""
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    dev = q.device
    cpr = cfg.chunks_per_rank
    cache = parts is not None  # a fresh buffer per call would only fill the cache with one-off addresses
    if parts is None:
        parts = torch.empty((world, 2, B, S, Hkv, D), dtype=torch.float32, device=dev)
    key = (parts.data_ptr(), parts[0].numel(), rank, world, str(dev))
    tables = _TABLES.get(key) if cache else None
    if tables is None:
        # the kernel stores into owner o's receive slot ``rank``; aim each owner's base so that slot is parts[o]
        shift = rank * parts[0].numel() * parts.element_size()
        recv_ptrs = torch.tensor([parts[o].data_ptr() - shift for o in range(world)], dtype=torch.int64, device=dev)
        counters = torch.zeros(world, dtype=torch.int32, device=dev)  # bumped, never waited for
        counter_ptrs = torch.full((world,), counters.data_ptr(), dtype=torch.int64, device=dev)
        tables = (recv_ptrs, counters, counter_ptrs)
        if cache:
            _TABLES[key] = tables
    recv_ptrs, _, counter_ptrs = tables
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    dq = torch.empty_like(q)
    launch_bwd(q, k, v, kg, vg, dout, lse, delta, dq, recv_ptrs, counter_ptrs, _all_ready(world * cpr, dev), ctx.err,
               ctx.budget, rank, world, OP, S // cpr, cpr, scale, causal, cfg, ctx.clock, ctx.backend == "host",
               local_cu_seqlens(cu_seqlens, world))
    return dq, parts


def cp_attention(q, k, v, *, ctx, causal: bool = True, softmax_scale: float | None = None, cu_seqlens=None,
                 out=None, lse=None):
    """Functional form: uses one ContextParallelAttention cached on the Context."""
    op = ctx.__dict__.setdefault("_ops", {}).get("cp_attention")
    if op is None:
        op = ctx._ops["cp_attention"] = ContextParallelAttention(ctx)
    return op(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, out=out, lse=lse)


def _as_tuple(cu_seqlens) -> tuple:
    """``cu_seqlens`` as a tuple of ints (empty for None); checked later, with the other inputs."""
    if cu_seqlens is None:
        return ()
    try:
        return as_ints(cu_seqlens)
    except ValueError as e:
        raise ValueError(f"cp_attention: {e}") from None


def _as_tensor(cu_seqlens) -> torch.Tensor:
    """``cu_seqlens`` as an int64 tensor for the custom op (empty for None; a tensor stays on its device and is
    read inside the op)."""
    if int_vector(cu_seqlens):
        return cu_seqlens.to(torch.int64)
    return torch.tensor(_as_tuple(cu_seqlens), dtype=torch.int64)



__all__ = ["AttentionConfig", "Blocks", "ContextParallelAttention", "backward_on_gathered", "cp_attention",
           "default_attention_config", "forward_on_gathered"]
