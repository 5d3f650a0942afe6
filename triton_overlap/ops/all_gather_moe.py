"""AllGather + grouped MoE GEMM: ``out[t, j] = all_gather(x)[t] @ w[topk_ids[t, j]]``, the gather hidden behind the
experts' GEMM.

Plan: each rank's tokens cut into chunks (ChunkLayout), moved by copy engines with a flag per chunk exactly as
AllGather-GEMM moves its rows (producers.gather, push). Consumer: a persistent grouped GEMM (kernels.grouped_gemm)
over the (token, k) pairs sorted by expert and, within an expert, by the arrival position of the token's chunk,
this rank's own tokens first (ops.moe_routing: small kernels on the device); a tile waits only for the chunks its
rows come from. Tiles run in expert order (an expert's weight read once while it is in L2), those that need a
peer's chunk no earlier than the chunk is expected (MoEGEMMConfig.tile_lag). Fallback: NCCL all_gather + one torch
matmul per expert.

Rows sent sorted (MoEGEMMConfig.send_rows; by default on Hopper for wide weight shards): each rank first copies its
tokens' rows, one per top-k choice, sorted by (expert, pair), into its own block of the workspace, and the copy
engines send that block instead of the tokens: topk times the bytes, but every tile (rows of one expert from one
rank) is consecutive rows, which the Gluon kernel reads by TMA instead of gathering them token by token, and a
peer's rows of an expert arrive in expert order. Tiles run expert by expert, this rank's first, then the peers' in
arrival order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..context.collectives import all_gather_rows
from ..kernels.grouped_gemm import launch_ag_grouped, reads_rows_by_tma, stage_rows
from ..plan import ChunkLayout, GatherSchedule, arrival_times, gather_schedule
from ..producers import pipeline
from ..producers.gather import Gather
from .base import with_overrides
from .moe_config import MoEGEMMConfig, MoEOp, check_moe_operands, check_out, moe_table_shape
from .moe_routing import (MoERouting, Segments, agree_on_routing, arrival_segments, check_routing, count_ids,
                          grouped_matmul, num_slots, sort_by_expert, sort_pairs)

#: fallback="auto" takes NCCL + torch below this many bytes of each rank's token shard
FALLBACK_SHARD_BYTES = 1 << 20


@dataclass(frozen=True, eq=False)
class AllGatherMoESchedule:
    """One call shape's decisions: ``cfg``, the gather's schedule (None for a consumer run alone on rows already
    here, as the benchmark and tuning run it) and its chunk ``layout``, the runs of tokens in the order they are here
    (``segments``: this rank's, then each peer's chunk as it arrives, tagged with its arrival position), the chunk
    at each position on the device (``chunk_at``), the call's header, and ``rank_runs`` (``rank_runs``)."""
    cfg: MoEGEMMConfig
    gather: GatherSchedule | None
    layout: ChunkLayout
    segments: Segments
    chunk_at: torch.Tensor
    call: object = None
    rank_runs: bool = False
    rows: RowsPlan | None = None


@dataclass(frozen=True, eq=False)
class RowsPlan:
    """What a call whose ranks send rows sorted by expert (module doc) keeps per shape: ``by_rank`` (each rank's
    tokens, in rank order: the workspace's blocks), ``by_arrival`` (the same runs in arrival order, this rank's
    first: the sorted layout's), ``src`` int32 [P] (workspace row p: p), ``pos`` int32 [P] (the arrival position of
    each workspace row's chunk, 0 for this rank's) and ``rank_key`` int64 [W] (a rank's place among an expert's
    tiles: this rank first, then the peers as their first chunks arrive)."""
    by_rank: Segments
    by_arrival: Segments
    src: torch.Tensor
    pos: torch.Tensor
    rank_key: torch.Tensor


def rows_plan(layout: ChunkLayout, tokens: int, rank: int, arriving: list, device) -> RowsPlan:
    """The RowsPlan of a rows ``layout`` (each rank's ``layout.m_local`` rows: ``tokens`` tokens times topk) on
    ``rank``, the peers' chunks ``arriving`` in arrival order."""
    W, n = layout.world, layout.chunks_per_rank
    order = [rank] + list(dict.fromkeys(c // n for c in arriving))
    at = {c: i for i, c in enumerate(arriving, start=1)}
    chunk_pos = [0 if c // n == rank else at[c] for c in range(layout.num_chunks)]
    p = torch.arange(W * layout.m_local, device=device)
    chunk = (p // layout.m_local) * n + (p % layout.m_local) // layout.m_per_chunk
    return RowsPlan(Segments(tuple((r * tokens, tokens, 0) for r in range(W)), torch.device(device)),
                    Segments(tuple((r * tokens, tokens, i) for i, r in enumerate(order)), torch.device(device)),
                    p.to(torch.int32), torch.tensor(chunk_pos, dtype=torch.int32, device=device)[chunk],
                    torch.tensor([order.index(r) for r in range(W)], dtype=torch.int64, device=device))


def rank_runs(layout: ChunkLayout, arriving: list) -> bool:
    """Whether the peers' chunks (ids ``arriving``, in arrival order) come rank by rank, each rank's in order. Then
    in the expert-sorted layout (rows by expert, then arrival) each rank's rows of an expert are consecutive and in
    token order, so moe_gemm_rs's tiles, a destination's rows of one expert, are runs of consecutive rows that it
    reads by TMA (MoERouting.rank_runs). True with one chunk a rank, with one peer, and within a host with one copy
    stream (the default); several streams interleave their peers' chunks, and so does the path between hosts the
    chunks of two or more ranks on other hosts."""
    n = layout.chunks_per_rank
    return all(c == arriving[i - i % n] + i % n and arriving[i - i % n] % n == 0 for i, c in enumerate(arriving))


def consumer_schedule(cfg: MoEGEMMConfig, rows: int, device, topk: int | None = None) -> AllGatherMoESchedule:
    """The schedule of the grouped GEMM alone on ``rows`` tokens already here: a world of one, one chunk, no waits;
    ``topk``: as where rows are sent sorted by expert (``topk`` a token)."""
    layout = ChunkLayout(1, rows * (topk or 1), rows * (topk or 1))
    plan = None if topk is None else rows_plan(layout, rows, 0, [], device)
    return AllGatherMoESchedule(cfg, None, layout, arrival_segments(layout, 0, [], device) if plan is None
                                else plan.by_arrival, torch.zeros(1, dtype=torch.int32, device=device),
                                rank_runs=True, rows=plan)


class AllGatherMoEGEMM(MoEOp):
    """Reusable AllGather + grouped MoE GEMM bound to a Context.

    ``op(x, w, topk_ids, *, sorted_output=False, out=None, **overrides)``: ``x`` is this rank's tokens [T/W, K]
    (float16 or bfloat16); ``w`` the experts' column shards [E, K, N_local], any strided view (e.g.
    ``w_nk.transpose(1, 2)``); ``topk_ids`` [T, topk] int32 or int64 expert ids of every token (rank 0's tokens
    first), the same tensor on every rank. Returns [T, topk, N_local], ``out[t, j] = x_all[t] @ w[topk_ids[t, j]]``,
    accumulated in float32 and rounded once to x's dtype; no tokens (T = 0) returns an empty result. With
    ``sorted_output=True`` returns ``(y, routing)`` instead: ``y`` [T * topk, N_local] in this rank's expert-sorted
    layout and ``routing`` (ops.moe_routing.MoERouting) its permutation and expert offsets, which ``moe_gemm_rs``
    takes as they are (no scatter back to token order).
    ``return_gathered=True`` appends the gathered tokens [T, K] to what is returned (a fresh tensor, copied from the
    workspace after the call: what an MoE layer's backward needs for the experts' weight gradients, without a second
    all_gather). ``overrides`` set MoEGEMMConfig fields for this call.

    Checks before anything is launched (ValueError, the Context stays usable): shapes and dtypes, the ranks'
    agreement on them, and, with ``check_routing`` (the default), every id in [0, E) and the same ``topk_ids`` on
    every rank (a digest of it read back to the host and compared across ranks: one device-to-host copy and one
    host exchange per call; ``check_routing=False`` skips both for a caller who guarantees them, where an id out of
    range is undefined behaviour). Routing itself (sort, counts, tile table) runs on the device with no host
    synchronisation: the table has a fixed number of slots (ceil(T * topk / block_m) + min(E, T * topk)).

    ``fallback="auto"`` takes NCCL all_gather + torch when W = 1 or the shard is under FALLBACK_SHARD_BYTES.
    ``config``: MoEGEMMConfig; None: the tuned table's entry for ``moe_table_shape(T, K, N_local, E, topk)``
    (ops.moe_config), else the defaults.
    """

    KIND = "ag_moe_gemm"

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, *, sorted_output: bool = False,
                 return_gathered: bool = False, out: torch.Tensor | None = None, **overrides):
        ctx = self.ctx
        ctx.ensure_usable()
        args = (sorted_output, self.check_overrides(overrides), self.user_config)
        if self.replays.active and all(isinstance(t, torch.Tensor) for t in (x, w, topk_ids)) and x.dim() == 2 \
                and w.dim() == 3 and topk_ids.dim() == 2:  # a repeat of a captured call replays, unchecked
            T, topk, N = x.shape[0] * ctx.world_size, topk_ids.shape[1], w.shape[2]
            out = torch.empty((T * topk, N) if sorted_output else (T, topk, N), dtype=x.dtype,
                              device=x.device) if out is None else out
            if self.replayed(self.replay_key(args, x, w, topk_ids, out)):
                self.last_path = "overlap"
                routing, first = self.replayed_outputs()
                gathered = self._gathered(x, topk, first) if return_gathered else None
                return _result(out, routing, gathered, sorted_output, return_gathered)
        check_moe_operands(self.KIND, ctx, x, w, "x", (2,))
        W = ctx.world_size
        T, E, N = x.shape[0] * W, w.shape[0], w.shape[2]
        check_routing(self.KIND, ctx, topk_ids, T, E)
        topk = topk_ids.shape[1]
        shape = (T * topk, N) if sorted_output else (T, topk, N)
        check_out(self.KIND, out, shape, x.dtype, x.device)
        self.last_table_shape = moe_table_shape(T, x.shape[1], N, E, topk)
        x = x.contiguous()
        out = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
        direct = _rows_view(out)  # the kernel stores rows of N one row stride apart: else through a tensor that is
        rows = out.view(T * topk, N) if direct else torch.empty((T * topk, N), dtype=x.dtype, device=x.device)
        fallback = T == 0 or self._use_fallback(x)
        sent = by_tma = False  # what goes on the wire (rows sorted by expert or tokens: the ranks agree on it)
        if not fallback:
            cfg = with_overrides(self.config_for(self.last_table_shape), overrides)
            by_tma = reads_rows_by_tma(ctx, cfg, x, w, rows)  # whether the Gluon kernel would read sorted rows by TMA
            sent = cfg.sends_rows(N, by_tma)
        self.agree((tuple(x.shape), str(x.dtype), E, topk, "rows" if sent else "tokens"))
        if self.check_routing:
            agree_on_routing(self.KIND, ctx, topk_ids, E)
        if T == 0:  # no rank has a token (the ranks agreed on x's shape): nothing to move or multiply
            self.last_path = "fallback"
            routing = MoERouting(topk_ids.new_empty(0, dtype=torch.int64), topk_ids.new_empty(0, dtype=torch.int32),
                                 topk_ids.new_zeros(E + 1, dtype=torch.int32), E, topk, True)
            return _result(out, routing, x.new_empty(x.shape), sorted_output, return_gathered)
        if fallback:
            self.last_path = "fallback"
            routing, gathered = self._fallback(x, w, topk_ids, rows, sorted_output)
        else:
            self.last_path = "overlap"
            key = self.replay_key(args, x, w, topk_ids, out) if direct else None
            shape_key = (tuple(x.shape), x.dtype, tuple(w.shape), tuple(w.stride()), tuple(topk_ids.shape),
                         topk_ids.dtype, args)
            routing, first = self.run_replayed(
                key, shape_key, lambda: self._overlap(x, w, topk_ids, rows, sorted_output, overrides, sent, by_tma))
            gathered = self._gathered(x, topk, first) if return_gathered else None
        if not direct:
            out.copy_(rows.view(shape))
        return _result(out, routing, gathered, sorted_output, return_gathered)

    def _gathered(self, x, topk: int, first: torch.Tensor | None) -> torch.Tensor:
        """Every rank's tokens as the call just made left them in this rank's workspace, with this rank's own (which
        the producers do not copy here) in their place; where rows were sent sorted (``first``: each token's first
        row in the rows' workspace, as _overlap_rows made it), those rows. Stream order keeps the workspace as it is
        until the copy has read it: peers write into it again only after the next call's barrier, which follows this
        stream."""
        ctx, m_local = self.ctx, x.shape[0]
        if first is not None:
            ws = ctx.symmetric(f"{self.name}.rows", (ctx.world_size * m_local * topk, x.shape[1]), x.dtype)
            return ws.local.index_select(0, first)
        ws = ctx.symmetric(f"{self.name}.ws", (ctx.world_size * m_local, x.shape[1]), x.dtype)
        gathered = ws.local.clone()
        gathered[ctx.rank * m_local:(ctx.rank + 1) * m_local].copy_(x)
        return gathered

    def _use_fallback(self, x) -> bool:
        if not self.overlap_possible():
            return True
        if self.fallback != "auto":
            return self.fallback == "always"
        return self.ctx.world_size == 1 or x.numel() * x.element_size() < FALLBACK_SHARD_BYTES

    # --------------------------------------------------------------------------- plan, consumer, fallback
    def schedule(self, x, overrides, table_shape: tuple | None = None, topk: int | None = None) -> AllGatherMoESchedule:
        """The config, the gather's schedule (push: copy engines write this rank's chunks into every peer's
        workspace and raise their flags; the pipeline zeroes this rank's flags after the join), the chunks' arrival
        positions and the call's header, made once per shape and configuration. ``table_shape``: where the config
        is looked up (moe_table_shape); None: the last call's (for a caller inspecting the call it just made).
        ``topk``: the ranks send rows sorted by expert (RowsPlan), ``topk`` a token; None: they send the tokens."""
        ctx = self.ctx
        m_local, K = x.shape
        cfg = with_overrides(self.config_for(table_shape or self.last_table_shape), overrides)
        key = (m_local, K, x.dtype, cfg, topk)
        found = self.state.setdefault("schedules", {}).get(key)
        if found is None:
            rows = m_local * (topk or 1)
            layout, arriving = self._chunks(cfg, rows, K * x.element_size())
            gather = gather_schedule(layout, ctx.rank, ctx.topology.hosts, mode="push", num_streams=cfg.num_streams,
                                     reset_by="producer", hold_for_link=ctx.holds_for_link)
            own = layout.chunk_id(ctx.rank, 0)
            sent = "push" if topk is None else f"push rows of {topk}"
            call = self.call_header((m_local, K, x.dtype, layout.m_per_chunk, sent), (m_local, K))
            plan = None if topk is None else rows_plan(layout, m_local, ctx.rank, arriving, ctx.device)
            found = self.state["schedules"][key] = AllGatherMoESchedule(
                cfg, gather, layout, arrival_segments(layout, ctx.rank, arriving, ctx.device) if plan is None
                else plan.by_arrival, torch.tensor([own] + arriving, dtype=torch.int32, device=ctx.device), call,
                plan is not None or rank_runs(layout, arriving), plan)
        return found

    def _chunks(self, cfg: MoEGEMMConfig, m_local: int, row_bytes: int) -> tuple:
        """(the ChunkLayout of ``m_local`` rows of ``row_bytes`` per rank under ``cfg``, the peers' chunk ids in the
        order they reach this rank)."""
        layout = ChunkLayout(self.ctx.world_size, m_local, cfg.chunk_rows(m_local, row_bytes))
        when = arrival_times(layout, self.ctx.rank, self.ctx.topology.hosts, cfg.num_streams)
        return layout, sorted(when, key=lambda c: (when[c], c))

    def keeps_rank_runs(self, m_local: int, k: int, n: int, experts: int, topk: int, dtype) -> bool:
        """Whether a call of this op on x [m_local, k] and w [experts, k, n] without overrides returns a sorted
        layout with ``rank_runs`` (what its MoERouting would say), from the shapes alone: for a caller that holds
        the layout's tensors but not the MoERouting (ops.custom_ops.moe_rs). True for no tokens (an empty layout)."""
        if m_local == 0:
            return True
        cfg = self.config_for(moe_table_shape(m_local * self.ctx.world_size, k, n, experts, topk))
        key = ("rank_runs", m_local, k, dtype, cfg)
        found = self.state.get(key)
        if found is None:
            elsize = torch.empty((), dtype=dtype).element_size()
            found = self.state[key] = rank_runs(*self._chunks(cfg, m_local, k * elsize))
        return found

    def _overlap(self, x, w, topk_ids, rows, sorted_output, overrides, sent: bool, by_tma: bool) -> tuple:
        """Enqueue one overlapped call: schedule, then run (the routing tables are made on the caller's stream
        while the copies go); ``sent``: the ranks send rows sorted by expert (MoEGEMMConfig.sends_rows), which the
        grouped GEMM reads by TMA where ``by_tma`` (kernels.grouped_gemm.reads_rows_by_tma). Returns (the MoERouting
        where ``sorted_output``, else None; where rows were sent, each token's first row in their workspace, else
        None)."""
        ctx = self.ctx
        if sent:
            return self._overlap_rows(x, w, topk_ids, rows, sorted_output, overrides, by_tma)
        sched = self.schedule(x, overrides)
        layout, cfg = sched.layout, sched.cfg
        ws = ctx.symmetric(f"{self.name}.ws", (layout.world * layout.m_local, x.shape[1]), x.dtype)
        flags = ctx.symmetric(f"{self.name}.flags", (layout.num_chunks,), torch.int32)
        self.state["buffers"] = {"workspace": ws.local}
        producer = Gather(ctx, sched.gather, [(x, ws)], flags, call=sched.call)
        made = {}

        def consumer():
            routing, routes, table = self.route(sched, topk_ids, w.shape[0], sorted_output,
                                                (ctx.world_size, w.shape[2], x.element_size()))
            made["routing"] = routing
            self.last_gemm = launch_ag_grouped(ctx, cfg, x, ws.local, w, rows, routes, table, flags.local, layout,
                                               op=self.op)

        pipeline.run(ctx, producer, consumer)
        return made["routing"], None

    def _overlap_rows(self, x, w, topk_ids, rows, sorted_output, overrides, contig: bool) -> tuple:
        """One overlapped call whose ranks send rows sorted by expert (module doc): the routing and this rank's
        block of rows on the caller's stream first (the copies send that block), then the call; ``contig``: the
        grouped GEMM reads each tile's rows by TMA."""
        ctx = self.ctx
        sched = self.schedule(x, overrides, topk=topk_ids.shape[1])
        layout, cfg = sched.layout, sched.cfg
        blocks = layout.world * layout.m_local
        ws = ctx.symmetric(f"{self.name}.rows", (blocks, x.shape[1]), x.dtype)
        flags = ctx.symmetric(f"{self.name}.rows_flags", (layout.num_chunks,), torch.int32)
        self.state["buffers"] = {"rows": ws.local}
        own = ws.local.narrow(0, ctx.rank * layout.m_local, layout.m_local)
        with pipeline.guarded(ctx, self.KIND):
            routing, routes, table, tokens, first = self.route_rows(sched, topk_ids, w.shape[0], sorted_output)
            stage_rows(ctx, x, ws.local, tokens, sched.rows.pos, x.shape[0], ctx.rank)
        producer = Gather(ctx, sched.gather, [(own, ws)], flags, call=sched.call)

        def consumer():
            self.last_gemm = launch_ag_grouped(ctx, cfg, own, ws.local, w, rows, routes, table, flags.local, layout,
                                               op=self.op, contig=contig)

        pipeline.run(ctx, producer, consumer)
        return routing, first

    @staticmethod
    def route_rows(sched: AllGatherMoESchedule, topk_ids, num_experts: int, sorted_output: bool):
        """route's counterpart where rows are sent sorted: the pairs sorted by (rank, expert, pair), the workspace's
        order, cut into tiles of one rank's rows of one expert, the tiles then ordered by (expert, the rank's place:
        RowsPlan.rank_key), empty slots last; each row's output row (its pair, or its row in the layout sorted by
        (expert, arrival position of its rank, pair) where ``sorted_output``). Returns (MoERouting where
        ``sorted_output``, (src, dst, pos, chunk_at), table, each workspace row's token, each token's first row in
        the workspace (int32))."""
        layout, cfg, plan = sched.layout, sched.cfg, sched.rows
        topk = topk_ids.shape[1]
        slots = num_slots(layout.m_local, num_experts, cfg.block_m)
        r = sort_by_expert(topk_ids, plan.by_rank, num_experts, cfg.block_m, slots, per_segment=True, src_div=topk,
                           dst=1)
        table = r["table"]
        key = table[:, 0].to(torch.int64) * layout.world + plan.rank_key[table[:, 1] // layout.m_local]
        key = torch.where(table[:, 2] > table[:, 1], key, layout.world * num_experts)
        table = table[torch.argsort(key, stable=True)]
        routing, dst = None, r["dst"]
        if sorted_output:
            e = sort_by_expert(topk_ids, plan.by_arrival, num_experts, cfg.block_m, 0, per_segment=False)
            routing = MoERouting(e["order"], e["position"], e["offsets"].view(-1), num_experts, topk, True)
            dst = e["position"][r["order"]]
        first = r["position"].view(-1, topk)[:, 0]
        return routing, (plan.src, dst, plan.pos, sched.chunk_at), table, r["src"], first

    @staticmethod
    def route(sched: AllGatherMoESchedule, topk_ids, num_experts: int, sorted_output: bool,
              gemm: tuple | None = None):
        """The consumer's routing, by kernels.routing on the caller's stream: pairs sorted by (expert, arrival
        position of the token's chunk, pair); the tile table (``block_m`` rows of one expert a tile) in expert order,
        each tile held back until the tiles before its last chunk's expected arrival have run (MoEGEMMConfig.tile_lag
        for ``gemm`` = (world size, w's columns, bytes a value); ``gemm`` None: by arrival, tile_lag unused), empty
        slots last; and (src: each row's token, dst: its output row, pos: its arrival position, chunk_at) for the
        kernel. Returns (MoERouting where ``sorted_output``, those, table)."""
        layout, cfg = sched.layout, sched.cfg
        T, topk = topk_ids.shape
        slots = num_slots(T * topk, num_experts, cfg.block_m)
        chunks = len(sched.segments.runs) - 1  # the peers' chunks, tagged 1, 2, ... in arrival order
        r = sort_by_expert(topk_ids, sched.segments, num_experts, cfg.block_m, slots, per_segment=False,
                           src_div=topk, dst=2 if sorted_output else 1, by_tag=layout.num_chunks + 1,
                           lag=-1 if gemm is None else cfg.lag_tiles(slots, chunks, gemm[0], topk, *gemm[1:]),
                           lanes=chunks)
        routes = (r["src"], r["dst"], r["tag"], sched.chunk_at)
        if not sorted_output:
            return None, routes, r["table"]
        return (MoERouting(r["order"], r["position"], r["offsets"].view(-1), num_experts, topk, sched.rank_runs),
                routes, r["table"])

    def _fallback(self, x, w, topk_ids, rows, sorted_output) -> tuple[MoERouting | None, torch.Tensor]:
        """NCCL all_gather, then one torch matmul per expert: (the routing where sorted, the gathered tokens)."""
        ctx = self.ctx
        gathered = torch.empty((x.shape[0] * ctx.world_size, x.shape[1]), dtype=x.dtype, device=x.device)
        all_gather_rows(gathered, x, group=ctx.group)
        T, topk = topk_ids.shape
        experts = topk_ids.reshape(-1).to(torch.int64)
        if not sorted_output:
            rows.copy_(grouped_matmul(gathered.repeat_interleave(topk, dim=0), experts, w))
            return None, gathered
        order, position = sort_pairs(experts, w.shape[0], None, 1)
        rows.copy_(grouped_matmul(gathered[order // topk], experts[order], w))
        counts = count_ids(experts, w.shape[0])
        offsets = torch.zeros(w.shape[0] + 1, dtype=torch.int32, device=x.device)
        offsets[1:] = counts.cumsum(0)
        return MoERouting(order, position, offsets, w.shape[0], topk, True), gathered


def _result(out, routing, gathered, sorted_output: bool, return_gathered: bool):
    res = (out, routing) if sorted_output else (out,)
    res += (gathered,) if return_gathered else ()
    return res if len(res) > 1 else out


def _rows_view(out: torch.Tensor) -> bool:
    """Whether ``out`` ([T, topk, N] or [P, N]) is rows of N elements one row stride apart, unit column stride."""
    if out.stride(-1) != 1:
        return False
    return out.dim() == 2 or out.stride(0) == out.stride(1) * out.shape[1] or out.shape[0] == 1


def ag_moe_gemm(x: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, *, ctx, sorted_output: bool = False,
                return_gathered: bool = False, out: torch.Tensor | None = None, **overrides):
    """Functional form of AllGatherMoEGEMM: one op per Context, kept by the Context."""
    return AllGatherMoEGEMM.shared(ctx)(x, w, topk_ids, sorted_output=sorted_output,
                                        return_gathered=return_gathered, out=out, **overrides)


__all__ = ["AllGatherMoEGEMM", "AllGatherMoESchedule", "ag_moe_gemm", "consumer_schedule", "rank_runs"]
