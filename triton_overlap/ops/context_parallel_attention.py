"""Context-parallel attention, forward and backward: K/V gathered by copy engines, consumed chunk by chunk.

Every rank holds its zigzag shard of q, k and v (triton_overlap.zigzag). Plan: each rank's K/V cut into chunks
(never mixing the two zigzag halves). Producer: copy engines push this rank's K and V, chunk by chunk, into every
peer's workspaces with one flag per chunk (producers.gather), at Hkv heads, never expanded for GQA/MQA. Consumer:
one flash-attention kernel folds its own K/V in first and each peer's chunk as soon as its flag is up
(kernels.attention); in backward, a dQ kernel and a dK/dV kernel whose float32 partials go straight to their
owners, who sum them (kernels.attention_bwd). There is no fallback: with W = 1 nothing is gathered.
"""
from __future__ import annotations

import math

import torch

from ..kernels.attention import Blocks, launch_fwd, persistent_fwd
from ..kernels.attention_bwd import backward_scratch, launch_bwd, launch_reduce_dkdv
from ..kernels.capability import is_hopper
from ..kernels.reduce import launch_sum_forwarded
from ..kernels.signal import WHAT_PARTIALS
from ..plan import ChunkLayout, GatherSchedule, forwarder, gather_schedule, other_host, sums_within_host
from ..producers import pipeline
from ..producers.gather import Gather
from ..producers.link import link
from ..producers.scatter import Forwarding
from ..zigzag import as_ints, int_vector, local_cu_seqlens
from .attention_on_gathered import all_ready, documents, slot_base
from .base import OverlapOp, call_key
from .checks import DTYPES
from .config import AttentionConfig
from .replay import ReplayCache

HEAD_DIMS = (64, 128)


class ContextParallelAttention(OverlapOp):
    """Reusable context-parallel attention bound to a Context, with autograd.

    ``op(q, k, v, causal=True, softmax_scale=None) -> (out, lse)``: q is [B, S_local, Hq, D], k and v
    [B, S_local, Hkv, D] in the zigzag layout; out is like q, lse is [B, Hq, S_local] float32 (natural log).
    ``chunks_per_rank`` sets how finely each rank's K/V is cut for the flags (even; 2 by default) with the tuned or
    default tiles; ``config`` (AttentionConfig) sets it and the kernels' tiles instead (a ``chunks_per_rank`` that
    differs from the config's raises ValueError).

    ``keep_kv``: backward reads the K/V gathered in forward, kept between the passes (2 x [B, W * S_local, Hkv, D]
    per call that autograd holds), instead of gathering them again with the copy engines (the default: the gather
    overlaps the backward kernels). ``replay``: as for every op (ops.base.OverlapOp), for the forward and the
    backward alike.

    Packed documents: ``op(q, k, v, cu_seqlens=...)`` with B = 1 and ``cu_seqlens`` the documents' boundaries in
    the full sequence (flash-attn's convention; a list, or a 1-D integer tensor, read on the host: pass a list to
    keep a CUDA tensor's synchronisation out of the call), each document a multiple of 2W long and sharded on its
    own (``triton_overlap.zigzag.shard(x, ctx, cu_seqlens=...)``). A query attends to its own document's keys only
    (causally by position within the document when ``causal``).
    """

    KIND = "cp_attention"
    ACROSS_HOSTS = True

    def __init__(self, ctx, *, chunks_per_rank: int | None = None, config: AttentionConfig | None = None,
                 keep_kv: bool = False, name: str | None = None, replay: bool = True):
        if config is not None and chunks_per_rank not in (None, config.chunks_per_rank):
            raise ValueError(f"ContextParallelAttention: chunks_per_rank={chunks_per_rank} differs from the config's "
                             f"{config.chunks_per_rank}: the config's field decides, pass one or the other")
        if chunks_per_rank is None:
            chunks_per_rank = 2 if config is None else config.chunks_per_rank
        if chunks_per_rank < 2 or chunks_per_rank % 2:
            raise ValueError(f"chunks_per_rank must be an even number >= 2, got {chunks_per_rank}")
        super().__init__(ctx, config, fallback="never", name=name, replay=replay)
        self.overlap_possible()  # ValueError on hosts of different sizes: there is no other path
        self.chunks_per_rank = chunks_per_rank
        self.keep_kv = keep_kv
        self.backward_replays = ReplayCache(ctx, enabled=self.replays.enabled)  # (the forward's: self.replays)
        ctx.on_close(self.backward_replays.clear)
        from . import custom_ops

        self._handle = custom_ops.handle(self)

    def default_config(self, shape, variant=""):
        return AttentionConfig.defaults(self.ctx, shape[3], self.chunks_per_rank, is_hopper(self.ctx),
                                        seq_len=shape[0], causal=bool(shape[4]))

    def from_table(self, found, base):
        fwd, dq, dkdv = (Blocks(**found[k]) for k in ("fwd", "dq", "dkdv"))
        return AttentionConfig(chunks_per_rank=base.chunks_per_rank, fwd=fwd, dq=dq, dkdv=dkdv,
                               consumer_first=base.consumer_first, num_streams=base.num_streams)

    def shape_key(self, q, k, causal) -> tuple:
        """What the tuned table keys attention by: (S in all, Hq, Hkv, D, causal)."""
        return q.shape[1] * self.ctx.world_size, q.shape[2], k.shape[2], q.shape[3], int(causal)

    # --------------------------------------------------------------------------------------------- call
    def __call__(self, q, k, v, *, causal: bool = True, softmax_scale: float | None = None, cu_seqlens=None,
                 out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """(out, lse); differentiable in q, k, v when grad is enabled and any of them requires it (then without
        ``out=`` and ``lse=``)."""
        if not torch.compiler.is_compiling():  # (traced, the custom op checks when it runs)
            self.ctx.ensure_usable()
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
        if out is None and lse is None and (grad or torch.compiler.is_compiling()):
            # through the custom op: autograd, and torch.compile traces it (the boundaries go in as a tensor, read
            # inside the op, so a compiled graph holds no guard on their values). Otherwise the op is called
            # directly, without the dispatcher's round trip.
            from . import custom_ops

            return custom_ops.cp_attention(q, k, v, self._handle, causal, scale, self.keep_kv and grad,
                                           _as_tensor(cu_seqlens))[:2]
        if grad:
            raise ValueError("cp_attention: out= and lse= are for calls without autograd")
        return self.forward(q, k, v, causal, scale, out, lse, cu=_as_tuple(cu_seqlens))

    def forward(self, q, k, v, causal, scale, out=None, lse=None, keep: bool = False, cu=()):
        """(out, lse), and with ``keep`` also copies of the gathered K/V workspaces for ``backward``. ``cu``: the
        packed documents' global boundaries (a tuple; empty: one sequence per batch row)."""
        self.ctx.ensure_usable()
        cu = tuple(cu)
        if self.replays.active and not keep and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
            if lse is None:
                lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
            if self.replayed(call_key((bool(causal), float(scale), cu), q, k, v, out, lse)):
                self.last_path = "overlap"
                return out, lse
        return self._checked_forward(q, k, v, causal, scale, out, lse, keep, cu)

    def _check(self, q, k, v, cu):
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
        if B == 0 or S == 0 or Hq == 0 or k.numel() == 0:
            raise ValueError(f"cp_attention: empty input: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
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
        self.agree((tuple(q.shape), tuple(k.shape), str(q.dtype), docs))
        return local_cu

    @torch.no_grad()  # workspaces are reset in place; autograd goes through custom_ops.cp_attention
    def _checked_forward(self, q, k, v, causal, scale, out, lse, keep, cu=()):
        ctx = self.ctx
        local_cu = self._check(q, k, v, cu)
        B, S, Hq, D = q.shape
        if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
            raise ValueError(f"cp_attention: out must be {q.dtype} {tuple(q.shape)} on {q.device}")
        if lse is not None and (tuple(lse.shape) != (B, Hq, S) or lse.dtype != torch.float32 or lse.device != q.device):
            raise ValueError(f"cp_attention: lse must be float32 {(B, Hq, S)} on {q.device}")
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device) if lse is None else lse
        self.last_path = "overlap"
        if keep:  # the gathered K/V for backward (this rank's own rows are read from k and v, not from here)
            kw, vw = self._forward(q, k, v, out, lse, causal, scale, local_cu)
            return out, lse, kw.clone(), vw.clone()
        # the shape key leaves the boundaries out (new ones every batch would grow the cache's record of prepared
        # shapes); the call key has them, so a capture follows an eager call with the same ones
        shape_key = (tuple(q.shape), tuple(k.shape), q.dtype, bool(causal), float(scale), bool(cu))
        key = call_key((bool(causal), float(scale), cu), q, k, v, out, lse)
        if local_cu is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            # the tables, built here if need be, outside any capture the replay cache may start below
            documents(ctx, local_cu, self.config_for(self.shape_key(q, k, causal)).fwd.block_m)
        self.enqueue(key, shape_key, lambda: self._forward(q, k, v, out, lse, causal, scale, local_cu))
        return out, lse

    # --------------------------------------------------------------------------- plan, consumers
    def schedule(self, k, cfg) -> GatherSchedule:
        """The gather's schedule for K/V of this shape and config, made once: each rank's K/V rows in
        ``chunks_per_rank`` chunks, K and V pushed together on ``cfg.num_streams`` streams, and the flags reset by
        the producer after the call (the kernels wait for every one and leave them)."""
        key = (k.shape[1], self.chunks_per_rank, cfg.num_streams)
        schedules = self.state.setdefault("schedules", {})
        if key not in schedules:
            ctx, S = self.ctx, k.shape[1]
            layout = ChunkLayout(ctx.world_size, S, S // self.chunks_per_rank)
            schedules[key] = gather_schedule(layout, ctx.rank, ctx.topology.hosts, num_streams=cfg.num_streams,
                                             reset_by="producer", hold_for_link=ctx.holds_for_link)
        return schedules[key]

    def _kv(self, k, sched: GatherSchedule):
        """The symmetric K and V workspaces and the flags of ``sched``'s chunks."""
        ctx = self.ctx
        B, S, Hkv, D = k.shape
        W = ctx.world_size
        kws = ctx.symmetric(f"{self.name}.k", (B, W * S, Hkv, D), k.dtype)
        vws = ctx.symmetric(f"{self.name}.v", (B, W * S, Hkv, D), k.dtype)
        flags = ctx.symmetric(f"{self.name}.flags", (sched.layout.num_chunks,), torch.int32)
        self.state.setdefault("buffers", {}).update(k=kws.local, v=vws.local)
        return kws, vws, flags

    def _gather(self, sched, k, v, kws, vws, flags, call) -> Gather:
        """The producer: K and V moved together, chunk by chunk, as ``sched`` says."""
        return Gather(self.ctx, sched, [(k, kws), (v, vws)], flags, dim=1, call=call)

    def _header(self, step: str, k, local_cu, kept: bool = False, in_host: bool = False):
        """The call's header: what every rank's K/V, chunking and documents must agree on (and, backward, whether
        the partials are summed within the host before they cross hosts)."""
        B, S, Hkv, D = k.shape
        docs = hash(tuple(local_cu)) if local_cu is not None else 0
        return self.call_header((step, B, S, Hkv, D, k.dtype, self.chunks_per_rank, docs, kept, in_host),
                                (B, S, Hkv, D))

    def _forward(self, q, k, v, out, lse, causal, scale, local_cu=None):
        """Enqueue one forward (what ReplayCache captures); returns the gathered K and V ([B, W * S_local, Hkv, D]).
        On one rank there is nothing to gather and no peer to meet: the kernel alone, on k and v."""
        ctx = self.ctx
        cfg = self.config_for(self.shape_key(q, k, causal))
        docs = documents(ctx, local_cu, cfg.fwd.block_m)
        # the Hopper forward's tile counter: this op's, as its workspaces are (its calls never overlap)
        tiles = self.state.get("tile counter")
        if tiles is None:
            tiles = self.state["tile counter"] = torch.zeros(2, dtype=torch.int32, device=ctx.device)
        sched = self.schedule(k, cfg)
        layout = sched.layout
        if ctx.world_size == 1:
            kw, vw, flags, producer = k, v, all_ready(ctx, layout.num_chunks), None
        else:
            kws, vws, symmetric_flags = self._kv(k, sched)
            kw, vw, flags = kws.local, vws.local, symmetric_flags.local
            producer = self._gather(sched, k, v, kws, vws, symmetric_flags, self._header("forward", k, local_cu))

        def consumer():
            launch_fwd(ctx, q, k, v, kw, vw, out, lse, flags, layout.m_per_chunk, layout.chunks_per_rank, scale,
                       causal, cfg.fwd, docs=docs, op=self.op, tiles=tiles)

        # attention programs waiting for chunks can fill every SM: the barrier kernel runs first (gate); where ranks
        # share the GPU, copies run on SMs too, and a grid that is not persistent starts after them (after_copies)
        first = cfg.consumer_first and self.warm((tuple(k.shape), k.dtype, kw.data_ptr(), vw.data_ptr()))
        hold = ctx.ranks_on_device > 1 and not persistent_fwd(ctx, q, k, v, kw, vw, docs, cfg.fwd, out)
        pipeline.run(ctx, producer, consumer, consumer_first=first, gate=True, after_copies=hold)
        return kw, vw

    @torch.no_grad()
    def backward(self, q, k, v, out, lse, dout, causal, scale, kept_k=None, kept_v=None, cu=()):
        """dq, dk, dv for this rank's shards. K/V come from ``kept_k``/``kept_v`` (the gathered workspaces that
        ``forward(keep=True)`` returned) or, when those are None, are gathered again by the copy engines. Partial
        dK/dV go straight to their owners, who sum them in float32 (across hosts of several ranks, those for an
        owner on another host summed within the host first: ``_send_partials``). ``cu`` as in forward (checked
        there).
        Replayed like the forward (``replay``): a call whose tensors, scratch included, sit where an earlier one's
        did replays the graph captured of it (``backward_replays``)."""
        ctx = self.ctx
        ctx.ensure_usable()
        q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))  # (no copies inside a captured call)
        local_cu = local_cu_seqlens(cu or None, ctx.world_size)
        W = ctx.world_size
        B, S, Hq, D = q.shape
        Hkv = k.shape[2]
        cfg = self.config_for(self.shape_key(q, k, causal))
        sched = self.schedule(k, cfg)
        layout = sched.layout
        recv = ctx.symmetric(f"{self.name}.dkv", (W, 2, B, S, Hkv, D), torch.float32)
        counters = ctx.symmetric(f"{self.name}.dkv_count", (W,), torch.int32)
        self.state.setdefault("buffers", {})["dK/dV receive slots"] = recv.local
        docs_dkdv = documents(ctx, local_cu, cfg.dkdv.block_n)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kept = kept_k is not None
        forward = self._forwarding(recv, cfg, sched)
        call = self._header("backward", k, local_cu, kept=kept, in_host=forward is not None)
        if W == 1:  # one rank: nothing to gather and no peer to meet or store into; the kernels alone
            kw, vw, ready, producer = k, v, all_ready(ctx, layout.num_chunks), None
        elif kept:  # no gather: every chunk is ready; the barrier orders our dK/dV stores into peers
            kw, vw, ready, producer = kept_k, kept_v, all_ready(ctx, layout.num_chunks), pipeline.BarrierOnly(call)
        else:
            kws, vws, flags = self._kv(k, sched)
            kw, vw, ready = kws.local, vws.local, flags.local
            producer = self._gather(sched, k, v, kws, vws, flags, call)
        scratch = backward_scratch(ctx, q, k, v, kw, vw, dq, ready, cfg.dkdv, W, docs_dkdv)

        recv_ptrs, counter_ptrs, staged, sources = recv.ptrs, counters.ptrs, None, None
        if sched.counterparts:  # other hosts' owners: partials staged here (or summed within the host), then sent
            recv_ptrs, counter_ptrs, staged = self._staging(recv, counters, forward, sched)  # (_send_partials)
        if forward is not None:
            sources = tuple(sorted(sched.local + sched.counterparts))
            self.state["buffers"]["dK/dV forwarding slots"] = forward.slots.local

        def consumer():
            # the tables again: a capture of this call pins them (DocumentTables), as it reads them at every replay
            docs = documents(ctx, local_cu, cfg.dq.block_m), documents(ctx, local_cu, cfg.dkdv.block_n)
            expected = launch_bwd(ctx, q, k, v, kw, vw, dout, out, lse, dq, recv_ptrs, counter_ptrs, ready,
                                  layout.m_per_chunk, layout.chunks_per_rank, scale, causal, cfg.dq, cfg.dkdv,
                                  docs_dq=docs[0], docs_dkdv=docs[1], op=self.op, scratch=scratch)
            if staged is not None:
                self._send_partials(recv, counters, staged, expected, forward, sched)
            launch_reduce_dkdv(ctx, recv.local, dk, dv, counters.local, expected, op=self.op, sources=sources)
            counters.local.zero_()  # every count was seen; peers add again only after the next call's barrier

        key = call_key((bool(causal), float(scale), tuple(cu)), q, k, v, out, lse, dout, kept_k, kept_v, dq, dk, dv,
                       *scratch.tensors())
        shape_key = (tuple(q.shape), tuple(k.shape), q.dtype, bool(causal), float(scale), bool(cu), kept)
        # copies first, always: backward launches several kernels, and building one while another spins for chunks
        # not yet enqueued can wait for the spinning kernel
        # (where ranks share the GPU, after them: the backward's grids are not persistent; pipeline.run)
        self.backward_replays.run(key, shape_key, lambda: pipeline.run(ctx, producer, consumer, gate=True,
                                                                       after_copies=ctx.ranks_on_device > 1))
        return dq, dk, dv

    def _forwarding(self, recv, cfg, sched) -> Forwarding | None:
        """The buffers where this host's dK/dV partials for the owners at this rank's local index on the other
        hosts are summed before they cross (producers.scatter.Forwarding, one chunk: the whole slot), where the group
        spans hosts of several ranks and ``cfg.reduce_in_host``; else None."""
        ctx = self.ctx
        if not sums_within_host(ctx.topology.hosts, cfg.reduce_in_host):
            return None
        K, L = len(sched.counterparts), len(sched.local)
        W, two, B, S, Hkv, D = recv.local.shape
        slots = ctx.symmetric(f"{self.name}.dkv_forward", (K, L, two * B * S * Hkv, D), torch.float32)
        counters = ctx.symmetric(f"{self.name}.dkv_forward_count", (K, L, 1), torch.int32)
        dests, names = ctx.cached(("dkdv forwarding", sched.counterparts, sched.local), lambda: (
            torch.tensor(sched.counterparts, dtype=torch.int32, device=ctx.device),
            torch.tensor(sched.local, dtype=torch.int32, device=ctx.device)))
        return Forwarding(slots, counters, None, dests, names)  # (expected: per call, _send_partials)

    def _staging(self, recv, counters, forward: Forwarding | None, sched):
        """Address tables for the dK/dV kernel on a group that spans hosts: owners on this host as always, owners on
        other hosts aimed at a local buffer (their slots of it; counters bumped locally, never waited for), or with
        ``forward``, at the forwarding slot for this rank of the host's rank at the owner's local index (the
        counterparts' at this rank's own)."""
        ctx = self.ctx

        def make():
            W, r = ctx.world_size, ctx.rank
            staged = torch.empty(recv.local.shape, dtype=recv.local.dtype, device=ctx.device)
            bumps = torch.zeros(W, dtype=torch.int32, device=ctx.device)
            local = set(ctx.local_ranks)
            ptrs = [p if o in local else slot_base(staged, o, r) for o, p in enumerate(recv.ptrs.tolist())]
            cptrs = [p if o in local else bumps.data_ptr() + (o - r) * bumps.element_size()
                     for o, p in enumerate(counters.ptrs.tolist())]
            if forward is not None:
                hosts, i = ctx.topology.hosts, sched.local.index(r)
                slot = recv.local[0].numel() * recv.local.element_size()
                for o in (o for o in range(W) if o not in local):
                    f, k = forwarder(sched.local, hosts, o), other_host(sched.local, hosts, o)
                    ptrs[o] = forward.slots.peer(f)[k, i].data_ptr() - r * slot
                    cptrs[o] = forward.counters.peer(f)[k, i].data_ptr() - r * bumps.element_size()
            return (torch.tensor(ptrs, dtype=torch.int64, device=ctx.device),
                    torch.tensor(cptrs, dtype=torch.int64, device=ctx.device), staged, bumps)

        key = ("dkdv staging", self.name, recv.local.data_ptr(), tuple(recv.local.shape), counters.local.data_ptr(),
               None if forward is None else (forward.slots.local.data_ptr(), tuple(forward.slots.local.shape),
                                             forward.counters.local.data_ptr()))
        got = ctx.cached(key, make)
        return got[0], got[1], got[2]

    def _send_partials(self, recv, counters, staged, expected: int, forward: Forwarding | None, sched) -> None:
        """After the dK/dV kernel, on a producer stream: this rank's partials to each owner on another host (with
        ``forward``: the sum of this host's partials for each counterpart, a bounded wait for each of the host's
        ranks), theirs for this rank into its receive slots, and this rank's counter for each such source set to
        its final count. The caller's stream then waits for it, so the reduction that follows finds every count
        complete."""
        ctx = self.ctx
        caller, s = ctx.current_stream(), ctx.streams(1)[0]
        peers = list(sched.counterparts) if forward is not None else list(link(ctx).remote)
        if forward is not None:  # (filled on the caller's stream, before the producer stream waits for it)
            K, L, rows, D = forward.slots.local.shape
            want = ctx.cached(("dkdv forwarding expected", K, expected), lambda: torch.full(
                (K, 1), expected, dtype=torch.int32, device=ctx.device))
        s.wait_stream(caller)
        what = "dK/dV partials"
        if forward is not None:
            W = staged.shape[0]
            with ctx.use_stream(s):
                launch_sum_forwarded(ctx, forward.slots.local, forward.counters.local, want, staged.view(W, rows, D),
                                     forward.dests, forward.names, ChunkLayout(W, rows, rows), 0, op=self.op,
                                     what=int(WHAT_PARTIALS))
            what = "dK/dV partials (this host's sums)"
        link(ctx).exchange(s, [(staged[o], o) for o in peers], [(recv.local[o], o) for o in peers],
                           f"cp_attention {what} with ranks {peers}", self.op,
                           {o: int(WHAT_PARTIALS) for o in peers}, guarded=True)
        for o in peers:
            s.write_value(counters.local[o:o + 1], expected)
        if forward is not None:
            forward.zero(s, 0)
        caller.wait_stream(s)


def cp_attention(q, k, v, *, ctx, causal: bool = True, softmax_scale: float | None = None, cu_seqlens=None,
                 out=None, lse=None):
    """Functional form of ContextParallelAttention: one op per Context, kept by the Context."""
    return ContextParallelAttention.shared(ctx)(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                cu_seqlens=cu_seqlens, out=out, lse=lse)


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


__all__ = ["AttentionConfig", "Blocks", "ContextParallelAttention", "cp_attention"]
