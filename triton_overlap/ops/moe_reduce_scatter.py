"""Grouped MoE GEMM + top-k combine + ReduceScatter: this rank's tokens of
``sum over ranks and j of topk_weights[t, j] * h[t, j] @ w[topk_ids[t, j]]``, the reduce-scatter hidden behind the
experts' GEMM.

Plan: the (token, k) pairs sorted by destination (the rank that owns the token, in GEMM-RS's send order, this rank
last), then expert (ops.moe_routing: small kernels on the device); each owner's tokens cut into chunks
(ChunkLayout). Consumer: one persistent kernel (kernels.grouped_gemm.rs_grouped_gemm) that, destination by
destination, runs the grouped GEMM tiles of its pairs and then its top-k combine tiles, which sum each token's k
products in float32 into a partial row and bump the chunk counters (on ag_moe_gemm's sorted layout with
MoERouting.rank_runs, each tile's rows of h are consecutive, and the Gluon kernel on Hopper reads them by TMA);
producer: GEMM-RS's copy variant (producers.scatter), whose copy engines move each chunk of partials to its owner
once its count is complete, while the kernel goes on with the next destination; then GEMM-RS's reduction kernel sums
the partials of this rank's rows as they land (the W ranks', or across hosts, the host's and the other hosts' sums).
Fallback: one torch matmul per expert, the combine in float32 and NCCL reduce-scatter in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..context.collectives import reduce_scatter_rows
from ..kernels.grouped_gemm import launch_rs_grouped
from ..kernels.reduce import launch_reduce
from ..plan import ChunkLayout, ScatterSchedule, cdiv, scatter_schedule, send_order
from ..producers import pipeline
from ..producers.scatter import Scatter, forwarding, staging
from .base import with_overrides
from .moe_config import MoEGEMMConfig, MoEOp, check_moe_operands, check_out, moe_table_shape
from .moe_routing import (MoERouting, Segments, agree_on_routing, check_routing, destination_segments, grouped_matmul,
                          num_slots, sort_by_expert)

#: fallback="auto" takes torch + NCCL below this many bytes of each rank's share of the output
FALLBACK_PARTIAL_BYTES = 1 << 20


@dataclass(frozen=True, eq=False)
class MoEReduceScatterSchedule:
    """One call shape's decisions: ``cfg``; the scatter's schedule, whose ``counts`` are the combine tiles' stores
    per chunk (the same for every owner, whatever the routing); ``dests``: the destinations in the order the kernel
    computes them, on the device, and ``segments`` the destinations' tokens in that order; ``expected`` this
    rank's counts per chunk on the device; the call's header."""
    cfg: MoEGEMMConfig
    scatter: ScatterSchedule
    dests: torch.Tensor
    segments: Segments
    expected: torch.Tensor
    call: object


class MoEGEMMReduceScatter(MoEOp):
    """Reusable grouped MoE GEMM + top-k combine + ReduceScatter bound to a Context.

    ``op(h, w, topk_ids, topk_weights, *, routing=None, out=None, **overrides)``: ``h`` [T, topk, K_local] (this
    rank's slice of the experts' inner dimension for every token and choice), or, with ``routing`` (what
    ``ag_moe_gemm(..., sorted_output=True)`` returned), [T * topk, K_local] rows in that expert-sorted layout; ``w``
    [E, K_local, N], any strided view; ``topk_ids`` [T, topk] int32/int64, the same on every rank; ``topk_weights``
    [T, topk], any float dtype. Returns this rank's tokens [T/W, N] of
    ``sum over ranks and j of topk_weights[t, j] * h[t, j] @ w[topk_ids[t, j]]`` in h's dtype (empty where T = 0).

    Rounding: each product ``h[t, j] @ w[e]`` is accumulated in float32 and rounded once to h's dtype; the top-k
    combine multiplies by the weights (as float32) and sums in float32, rounding each rank's partial row once; the
    sum over ranks is float32, rounded once to the output (across hosts of several ranks, a host's partials for an
    owner on another host are summed in float32 and rounded once more before they cross: producers.scatter). (The
    fallback: products rounded once, combine and reduce-scatter in float32, one rounding at the end.)

    Checks before anything is launched, as AllGatherMoEGEMM's (``check_routing`` likewise). ``routing`` is trusted
    to be this rank's layout of these ``topk_ids``. ``fallback="auto"`` takes the torch path when W = 1 or each
    rank's share of the output is under FALLBACK_PARTIAL_BYTES. ``config``: MoEGEMMConfig; None: the tuned table's
    entry for ``moe_table_shape(T, K_local, N, E, topk)`` (ops.moe_config), else the defaults.
    """

    KIND = "moe_gemm_rs"

    @torch.no_grad()
    def __call__(self, h: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 routing: MoERouting | None = None, out: torch.Tensor | None = None, **overrides):
        ctx = self.ctx
        ctx.ensure_usable()
        op = self.KIND
        args = (self.check_overrides(overrides), self.user_config,
                None if routing is None else (routing.rank_runs, routing.num_experts, routing.topk))
        # routing's tensors in the key: the call reads its positions, the checks the others' sizes and places
        keyed = (None, None, None) if routing is None else (routing.position, routing.order, routing.offsets)
        if self.replays.active and all(isinstance(t, torch.Tensor) for t in (h, w, topk_ids, topk_weights)) \
                and w.dim() == 3 and topk_ids.dim() == 2:  # a repeat of a captured call replays, unchecked
            out = torch.empty((topk_ids.shape[0] // ctx.world_size, w.shape[2]), dtype=h.dtype,
                              device=h.device) if out is None else out
            if self.replayed(self.replay_key(args, h, w, topk_ids, topk_weights, *keyed, out)):
                self.last_path = "overlap"
                return out
        check_moe_operands(op, ctx, h, w, "h", (2,) if routing is not None else (3,))
        W = ctx.world_size
        E, N = w.shape[0], w.shape[2]
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
            raise ValueError(f"{op}: topk_ids must be a [T, topk] tensor")
        T, topk = topk_ids.shape
        if T % W:
            raise ValueError(f"{op}: T = {T} tokens is not divisible by the world size {W}")
        check_routing(op, ctx, topk_ids, T, E)
        rows = (T * topk,) if routing is not None else (T, topk)
        if tuple(h.shape[:-1]) != rows:
            raise ValueError(f"{op}: h must be {list(rows) + ['K']} for topk_ids {tuple(topk_ids.shape)}, got "
                             f"{tuple(h.shape)}")
        if routing is not None and (routing.topk != topk or routing.num_experts != E
                                    or routing.position.numel() != T * topk or routing.order.numel() != T * topk
                                    or routing.offsets.numel() != E + 1):
            raise ValueError(f"{op}: routing is for {routing.position.numel()} pairs, top-{routing.topk} of "
                             f"{routing.num_experts} experts, not these topk_ids and w")
        if routing is not None and any(t.device != h.device or t.is_floating_point()
                                       for t in (routing.order, routing.position, routing.offsets)):
            raise ValueError(f"{op}: routing's tensors must be integer tensors on {h.device} (ag_moe_gemm's "
                             f"sorted_output of this call's tokens)")
        if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (T, topk) \
                or not topk_weights.dtype.is_floating_point or topk_weights.device != ctx.device:
            got = (f"{topk_weights.dtype} {tuple(topk_weights.shape)} on {topk_weights.device}"
                   if isinstance(topk_weights, torch.Tensor) else type(topk_weights).__name__)
            raise ValueError(f"{op}: topk_weights must be a floating [T, topk] = [{T}, {topk}] tensor on "
                             f"{ctx.device}, got {got}")
        want = (T // W, N)
        check_out(op, out, want, h.dtype, h.device)
        self.last_table_shape = moe_table_shape(T, h.shape[-1], N, E, topk)
        self.agree((tuple(h.shape), str(h.dtype), tuple(w.shape), topk))
        if self.check_routing:
            agree_on_routing(op, ctx, topk_ids, E)
        h = h.contiguous()
        out = torch.empty(want, dtype=h.dtype, device=h.device) if out is None else out
        if T == 0:  # no rank has a token (the ranks agreed on h's shape): nothing to multiply or reduce
            self.last_path = "fallback"
            return out
        res = out if out.stride(1) == 1 else torch.empty(want, dtype=h.dtype, device=h.device)
        if self._use_fallback(T // W, N, h.element_size()):
            self.last_path = "fallback"
            self._fallback(h, w, topk_ids, topk_weights, routing, res)
        else:
            self.last_path = "overlap"
            key = self.replay_key(args, h, w, topk_ids, topk_weights, *keyed, out) if res is out else None
            shape_key = (tuple(h.shape), h.dtype, tuple(w.shape), tuple(w.stride()), tuple(topk_ids.shape),
                         topk_ids.dtype, topk_weights.dtype, args)
            self.run_replayed(key, shape_key,
                              lambda: self._overlap(h, w, topk_ids, topk_weights, routing, res, overrides))
        return out if res is out else out.copy_(res)

    def _use_fallback(self, m_local, n, elsize) -> bool:
        if not self.overlap_possible():
            return True
        if self.fallback != "auto":
            return self.fallback == "always"
        return self.ctx.world_size == 1 or m_local * n * elsize < FALLBACK_PARTIAL_BYTES

    # --------------------------------------------------------------------------- plan, consumer, fallback
    def schedule(self, T, N, dtype, overrides, table_shape: tuple | None = None) -> MoEReduceScatterSchedule:
        """The config, the chunk layout of each owner's partial rows, the scatter's schedule (copy engines, the
        reduction kernel after the GEMM resets the counters) with the combine tiles' counts, the order of
        destinations (as GEMM-RS orders its tiles: other hosts' owners, then this host's peers in send order, this
        rank last) and the call's header, made once per shape and configuration. ``table_shape``: where the config
        is looked up (moe_table_shape); None: the last call's (for a caller inspecting the call it just made)."""
        ctx = self.ctx
        W, r = ctx.world_size, ctx.rank
        m_local = T // W
        cfg = with_overrides(self.config_for(table_shape or self.last_table_shape), overrides)
        key = (T, N, dtype, cfg)
        found = self.state.setdefault("schedules", {}).get(key)
        if found is None:
            elsize = torch.empty((), dtype=dtype).element_size()
            layout = ChunkLayout(W, m_local, cfg.chunk_rows(m_local, N * elsize))
            npn = cdiv(N, cfg.block_n)
            counts = tuple(ChunkLayout(1, m_local, layout.m_per_chunk).tile_stores(cfg.block_c, npn)[0])
            scatter = scatter_schedule(layout, r, ctx.topology.hosts, copy=True, num_streams=cfg.num_streams,
                                       block_m=cfg.block_c, n_tiles=npn, fused=False,
                                       hold_for_link=ctx.holds_for_link, reduce_in_host=cfg.reduce_in_host)
            scatter = replace(scatter, counts=(counts,) * W)
            local = ctx.local_ranks
            ahead = [p for p in send_order(r, W) if p not in local] + [p for p in send_order(r, W) if p in local]
            dests = ahead + [r]
            call = self.call_header((T, N, dtype, layout.m_per_chunk, cfg.block_c, cfg.block_n,
                                     bool(scatter.counterparts)), (T, N))
            dev = ctx.device
            found = self.state["schedules"][key] = MoEReduceScatterSchedule(
                cfg, scatter, torch.tensor(dests, dtype=torch.int32, device=dev),
                destination_segments(m_local, dests, dev), torch.tensor(counts, dtype=torch.int32, device=dev), call)
        return found

    def _overlap(self, h, w, topk_ids, topk_weights, routing, out, overrides) -> None:
        ctx = self.ctx
        T, topk = topk_ids.shape
        N = w.shape[2]
        sched = self.schedule(T, N, h.dtype, overrides)
        layout, cfg = sched.scatter.layout, sched.cfg
        W = layout.world
        recv = ctx.symmetric(f"{self.name}.recv", (W, layout.m_local, N), h.dtype)
        counters = ctx.symmetric(f"{self.name}.counters", (layout.num_chunks,), torch.int32)
        forward = forwarding(ctx, self.name, sched.scatter, N, h.dtype)
        stage = staging(ctx, recv, counters, layout, forward, sched.scatter)
        self.state["buffers"] = {"receive slots": recv.local, "staging": stage.partials}
        if forward is not None:
            self.state["buffers"]["forwarding slots"] = forward.slots.local
        producer = Scatter(ctx, sched.scatter, stage, recv, counters, call=sched.call, forward=forward)
        late = sched.scatter.reduce_after_join

        def reduce():  # this rank's rows: the sources' partials summed in float32 as they land; then its counters reset
            launch_reduce(ctx, recv.local, out, None, counters.local, sched.expected, layout, op=self.op,
                          sources=sched.scatter.sources)
            counters.local.zero_()  # every count was seen; peers add again only after the next barrier

        def consumer():
            routes, table = self.route(sched, topk_ids, w.shape[0], routing)
            y = torch.empty((T * topk, N), dtype=h.dtype, device=h.device)
            done = torch.zeros(W + 1, dtype=torch.int32, device=h.device)
            self.last_gemm = launch_rs_grouped(ctx, cfg, cfg.block_c, h.view(-1, h.shape[-1]), w, y, routes,
                              topk_weights.reshape(-1).to(torch.float32).contiguous(), table, sched.dests, done,
                              stage, layout, op=self.op, contig=routing is not None and routing.rank_runs)
            if not late:
                reduce()

        pipeline.run(ctx, producer, consumer, consumer_first=True)
        if late:
            reduce()

    @staticmethod
    def route(sched: MoEReduceScatterSchedule, topk_ids, num_experts: int, routing: MoERouting | None):
        """The kernel's routing, by kernels.routing on the caller's stream: pairs sorted by (destination's place,
        expert, pair); the tile table, a fixed number of slots per destination; (src: each sorted row's row of h,
        pos: each pair's row of Y). Returns (routes, table)."""
        layout, bm = sched.scatter.layout, sched.cfg.block_m
        topk = topk_ids.shape[1]
        r = sort_by_expert(topk_ids, sched.segments, num_experts, bm, num_slots(layout.m_local * topk, num_experts, bm),
                           per_segment=True, remap=None if routing is None else routing.position)
        return (r["src"], r["position"]), r["table"]

    def _fallback(self, h, w, topk_ids, topk_weights, routing, out) -> None:
        T, topk = topk_ids.shape
        experts = topk_ids.reshape(-1).to(torch.int64)
        rows = h.view(-1, h.shape[-1])
        if routing is not None:
            rows = rows[routing.position.to(torch.int64)]  # back to token order
        y = grouped_matmul(rows, experts, w).view(T, topk, -1)
        full = (y.float() * topk_weights.float().unsqueeze(-1)).sum(1)
        part = torch.empty((T // self.ctx.world_size, w.shape[2]), dtype=torch.float32, device=h.device)
        reduce_scatter_rows(part, full, group=self.ctx.group)
        out.copy_(part)


def moe_gemm_rs(h: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, ctx,
                routing: MoERouting | None = None, out: torch.Tensor | None = None, **overrides):
    """Functional form of MoEGEMMReduceScatter: one op per Context, kept by the Context."""
    return MoEGEMMReduceScatter.shared(ctx)(h, w, topk_ids, topk_weights, routing=routing, out=out, **overrides)


__all__ = ["MoEGEMMReduceScatter", "moe_gemm_rs"]
