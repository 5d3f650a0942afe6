"""Expert-parallel MoE dispatch and combine (normal mode): each token's row travels to the ranks that own its top-k
experts, and the experts' outputs come back to the token's rank, weighted and summed.

Rank r owns experts [r·E/W, (r+1)·E/W). ``ep_dispatch`` sends each token once to each rank that owns any of its
choices (a token routed to two experts of one rank is sent once and expanded there) and returns the rows this rank
received, grouped by local expert; ``ep_combine`` takes the experts' outputs in that order and returns, on each
token's own rank, ``out[t] = Σ_j topk_weights[t, j] · y_row(t, j)``.

Plan of a dispatch (the overlapped path):

1. **route** (kernels.ep_routing on the device, this rank's tokens only): the owner of each choice, the unique
   (token, owner) pairs, and this rank's *record*: [T_local, smallest id, largest id, unique tokens per owner (W),
   (token, choice) pairs per expert (E)].
2. **counts** (producers.exchange.AllToAll, behind the call's barrier, which compares the ranks' call headers): copy
   engines write the record into slot r of every peer's symmetric counts table and raise that peer's count flag for
   r. The caller's stream waits for every source's count flag (kernels.arrivals, bounded), then copies the table
   (and the error word) to the host behind an event, which the host waits for after step 3 is enqueued: the call's
   one host synchronisation, on the counts alone (the host needs them to size the output). Every rank then holds
   every rank's record, so all take the same decisions with no further exchange: ids out of range on any rank raise
   ValueError on every rank, naming it (no row has moved, so the Context stays usable).
3. **rows, stored by the pack kernel** (once the receive buffers exist): ep_pack reads the counts table on the
   device and stores each (token, owner) row with its metadata (source rank, token, each of the k choices' row in
   the owner's expert-sorted layout, -1 for another owner's, the k weights) straight into the owner's symmetric
   receive buffers, at this source's block (the prefix of the counts of the sources before it); then stream writes
   raise this rank's flag in every owner (one flag per source, raised even where the block is empty). Copy engines
   would need the counts on the host before the first row could move, so the host's read would sit on the
   critical path; the kernel's stores need none. Where any rank's ids are out of range or any owner would receive
   more rows than the buffers hold, every rank's kernel stores nothing (each decides from the same table) and the
   host, once it has the counts, packs into a staging tensor and copy engines move each owner's block (the path of
   a first call, and of a call that grows the buffers on every rank together: symmetric allocation is
   collective). ``op.last_exchange`` says which ("stores" or "copies").
4. **expand**: the caller's stream waits for every source's flag (bounded, naming the source that did not come),
   then one kernel copies each received row to the layout rows its metadata names (no sort). The per-source flags
   exist so that an experts' grouped GEMM can start on a source's rows as soon as they land:
   ``kernels.grouped_gemm.ag_grouped_gemm`` waits on per-chunk flags, and a source's block here is such a chunk (one
   chunk per rank, flag value 1, chunk id = source rank), while the counts table already gives, before any row
   lands, where each (expert, source) run of rows will sit. With ``expert_weight`` that GEMM runs between the rows'
   exchange and the expansion, reading the rows in the receive buffers (ops.ep_experts).

Plan of a combine: behind its own barrier (header: the width, dtype and the dispatch it combines), the owner sums,
for each token it received, ``weight · y`` over the token's choices among its experts in float32, rounds that
partial once to y's dtype and stores it straight into the source's symmetric combine buffer, at the place the
source's block for this owner had in its send order (kernels.row_sums: one launch for every source, whose tiles
alternate between sources so that the local sums run while the peers' cross the link); a stream write after it
then raises the source's flag for this owner; the source waits for every owner's flag and sums the (at most W)
partials of each token in float32, rounding once. Both sums walk their terms in a fixed order (choice j, then owner
rank: kernels.row_sums), so a combine returns the same bits on every call and on both paths. Two roundings to the
16-bit dtype in all: ‖out − ref‖ / ‖ref‖ stays within about two units of its rounding (2^-8 for bf16, 2^-11 for
fp16) on top of whatever rounding y carries.

Host synchronisations: one per dispatch (the counts), none in a combine. A dispatch makes one barrier, two waits on
the caller's stream and two exchanges (three of each where the copy engines move the rows, and growing buffers
synchronise the device); a combine one barrier, one wait, one exchange of flags. Every wait is bounded
by the Context's timeout and a fault poisons the Context until ``reset()`` (docs/protocol.md); no path here is
captured in a CUDA graph (the dispatch reads the counts back to the host). On a group that spans hosts (of one
size), the blocks for ranks on other hosts travel through the Context's Link in the same steps (ops.ep_hosts),
and the rows always take the copy-engine path of step 3 (the pushing pack stores into the owners' memory).

Fallback: ``torch.distributed.all_to_all_single`` on the Context's group (NCCL on GPUs, gloo on the host backend)
for the records, the rows and metadata, and the partials, with the same layouts, so both paths return the same
tensors.

Why one op class with ``dispatch`` and ``combine`` rather than two: the pair shares one configuration (copy streams,
fallback rule), one prefix for its symmetric buffers, and the dispatch count that ties a combine to the dispatch it
undoes (the combine's header carries it, so ranks that combine different dispatches meet a mismatch at the barrier
instead of summing the wrong partials).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..kernels.arrivals import launch_wait_sources
from ..producers import exchange, pipeline
from ..producers.exchange import AllToAll, deal
from ..producers.pipeline import guarded
from .base import OverlapOp, agree_across_ranks
from .moe_config import MoEGEMMConfig
from .moe_routing import grouped_mm
from .checks import FP8
from .ep_combine import combine_overlapped, projected_whole, staged_combine
from .ep_experts import check_expert_weight, projection
from .ep_hosts import counts_remote, remote_ranks, rows_remote
from .ep_routing import (EPHandle, Sent, Traffic, capacity, check_combine, check_dispatch, combine_by_group,
                         counts_by_group, expand, meta_width, pack, route_tokens, rows_by_group)


@dataclass(frozen=True)
class ExpertParallelConfig:
    """``num_streams``: copy streams for the exchanges (None: one per peer, so that every link carries data at
    once; unmeasured on GPUs, where AllGather-GEMM's sweep favoured one stream beside its GEMM).
    ``experts_gemm``: how a dispatch with ``expert_weight`` computes ``d.projected`` (ops.ep_experts): "after"
    (``torch._grouped_mm`` once every row is in; the default: on 2 H200s the per-source GEMM below made the
    EPMoE forward 0.86-0.92x as fast on Qwen3-30B-A3B, docs/decisions.md, Expert-parallel MoE) or "overlap" (a
    grouped GEMM started on each source's rows as they land: the warp-specialized kernel on Hopper where it can
    run, else the Triton one; within one host only, "after" across hosts: ops.ep_hosts).
    ``combine_stages``: the launches of a combine's down projection (``combine(..., expert_weight=w)``), each
    followed by the partials of the tokens it completes (ops.ep_combine; 1: the projection, then every partial)."""

    num_streams: int | None = None
    experts_gemm: str = "after"
    combine_stages: int = 1

    def __post_init__(self):
        if self.experts_gemm not in ("overlap", "after"):
            raise ValueError(f"ExpertParallelConfig.experts_gemm must be 'overlap' or 'after', got "
                             f"{self.experts_gemm!r}")
        if not isinstance(self.combine_stages, int) or self.combine_stages < 1:
            raise ValueError(f"ExpertParallelConfig.combine_stages must be an int >= 1, got {self.combine_stages!r}")


@dataclass(frozen=True, eq=False)
class ExchangeSchedule:
    """One shape's decisions for a dispatch or a combine: each copy stream's peers on this rank's host in order
    (producers.exchange.deal), the call's header, compared across ranks at the call's barrier (Context.call), and
    the ranks on other hosts, whose blocks travel through the Link (ops.ep_hosts; None on one host, where alone the
    pushing pack and the per-source GEMM run: they store into the owners' memory)."""

    copy_streams: tuple
    call: object
    remote: tuple | None = None


class ExpertParallel(OverlapOp):
    """Expert-parallel dispatch and combine bound to a Context (normal mode; the module's docstring has the plan).

    ``op.dispatch(x, topk_ids, topk_weights, *, num_experts, scales=None)``: ``x`` [T_local, H] this rank's tokens
    (float16, bfloat16, or float8_e4m3fn with ``scales`` float32 [T_local, G], per-token groups such as G = H / 128,
    which travel with their rows into ``d.scales``; T_local may differ between ranks and may be 0), ``topk_ids``
    [T_local, topk] int32 or int64 in [0, E), ``topk_weights`` [T_local, topk] float32. Returns an EPHandle.
    ``expert_weight``: None, or this rank's experts' first weight [E/W, H, N] (x's 16-bit dtype): ``d.projected`` is
    then ``d.tokens`` @ it per expert, on the overlapped path by a grouped GEMM that starts on each source's rows as
    they land where ``config.experts_gemm`` is "overlap" (ops.ep_experts; ``op.last_gemm`` names what ran it).
    ``op.combine(y, d, *, out=None, expert_weight=None)``: ``y`` [R, N] (float16 or bfloat16) the experts'
    outputs in ``d.tokens``' order; returns [T_local, N] in y's dtype. ``expert_weight``: None, or this rank's
    experts' down projection [E/W, K, N] (y's dtype): ``y`` [R, K] is then its input, and the op returns
    ``(out, parts)``, ``parts`` the projection's rows in consecutive pieces (``torch.cat(parts)`` is each row @
    w[its local expert]), computed in at most ``config.combine_stages`` launches whose partials leave as each ends
    (ops.ep_combine).

    Checked before anything is launched (ValueError, the Context stays usable): E divisible by W, shapes, dtypes,
    devices, and the ranks' agreement on H, dtype, E, topk and G (combine: on N and dtype). Ids out of range raise
    ValueError on every rank once the counts are in (module docstring, step 2), before any row moves.

    ``fallback``: "auto" (torch.distributed.all_to_all_single where W = 1, or where the group spans hosts of
    different sizes; between hosts of one size the Link carries the remote blocks: ops.ep_hosts), "never",
    "always". ``config``: ExpertParallelConfig. ``name``: the prefix of the op's symmetric buffers.
    """

    KIND = "expert_parallel"
    ACROSS_HOSTS = True

    def __init__(self, ctx, config: ExpertParallelConfig | None = None, *, fallback: str = "auto",
                 name: str | None = None):
        super().__init__(ctx, config, fallback=fallback, name=name, replay=False)
        self.cfg = config if config is not None else ExpertParallelConfig()
        self.dispatch_op, self.combine_op = ctx.op_id("ep_dispatch"), ctx.op_id("ep_combine")
        self.last_exchange = None  # how the last overlapped dispatch moved its rows: "stores" or "copies"
        self.gemm_cfg = MoEGEMMConfig.defaults(ctx)  # the overlapped experts' GEMM's tiles (ops.ep_experts)
        self.last_gemm = None  # what computed the last d.projected: a kernel's name, or "torch"
        # what a wait that times out names: the counts or the rows of a dispatch, the partials of a combine
        self.wait_ops = {what: ctx.op_id(f"{kind} {what}") for kind, what in
                         (("ep_dispatch", "counts"), ("ep_dispatch", "rows"), ("ep_combine", "partials"))}

    def default_config(self, shape, variant: str = ""):
        return ExpertParallelConfig()

    # ------------------------------------------------------------------------------------------------ dispatch
    @torch.no_grad()
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 num_experts: int, scales: torch.Tensor | None = None,
                 expert_weight: torch.Tensor | None = None) -> EPHandle:
        ctx = self.ctx
        ctx.ensure_usable()
        check_dispatch(ctx, x, topk_ids, topk_weights, num_experts, scales)
        check_expert_weight(ctx, x, expert_weight, num_experts)
        W, r, k = ctx.world_size, ctx.rank, topk_ids.shape[1]
        G = 0 if scales is None else scales.shape[1]
        w = expert_weight
        fallback = self._use_fallback()
        sched = None if fallback else self.schedule("dispatch", x.shape[1], x.dtype, num_experts, (k, G))
        # the per-source GEMM and the owners' gather indexes it reads (ops.ep_experts): within one host only
        gathers = w is not None and self.cfg.experts_gemm == "overlap" and sched is not None and sched.remote is None
        self._agree("ep_dispatch", ("dispatch", x.shape[1], str(x.dtype), num_experts, k, G,
                                    0 if w is None else w.shape[2], gathers))
        ticket = None if fallback else self.state.get("ticket")
        if ticket is None and not fallback:  # (the count's, kernels.ep_routing.launch_count: this op's own)
            ticket = self.state["ticket"] = torch.zeros(1, dtype=torch.int32, device=ctx.device)
        route = route_tokens(topk_ids, num_experts, W, ticket)
        self.last_path = "fallback" if fallback else "overlap"
        sent = target = None
        settled = False  # whether the stream already waits for the push flags (and resets them)
        if fallback:
            table, table_dev = counts_by_group(ctx, route.record)
        else:
            table_dev, read_table = self._counts(route.record, sched)
            target = None if sched.remote else self._push_target(
                x.shape[1], torch.uint8 if x.dtype == FP8 else x.dtype, meta_width(k, G), k if gathers else 0)
            if target is not None:  # the rows move while the host reads the counts
                sent = pack(x, route, topk_weights, r, table_dev, 0, scales, push=target[:4], gather=target[4])
                self._raise_push_flags(mine=gathers)
                if not gathers:  # no GEMM waits on them source by source: the stream waits now, and the host's
                    self._settle_push_flags()  # work after the counts' read is only the expansion
                    settled = True
            table = read_table()
        traffic = Traffic.read(table, W, num_experts)
        bad = traffic.out_of_range()
        pushed = sent is not None and not bad and traffic.most_received() <= target[2]  # (the kernel's own test)
        if sent is not None and not pushed and not settled:  # nothing was stored, but the flags were raised
            self._settle_push_flags()
        if bad:
            raise ValueError(f"ep_dispatch: topk_ids must lie in [0, {num_experts}) (E = {num_experts} experts): "
                             + ", ".join(f"rank {s} has ids from {lo} to {hi}" for s, lo, hi in bad))
        with nullcontext() if fallback else guarded(ctx, "ep_dispatch"):  # (flags raised: an error faults the Context)
            self.last_exchange = None if fallback else "stores"
            project, projected = projection(self, traffic, x, w if gathers else None, table_dev)
            if pushed:
                U = sum(traffic.received(r))
                self.state["buffers"].update(rows=target[0].local, meta=target[1].local,
                                             **({"gather": target[4].local} if gathers else {}))
                if project is not None:  # each source's rows as its flag lands
                    project(target[0].local, target[4].local,
                            ctx.symmetric(f"{self.name}.push_flags", (W,), torch.int32).local)
                if not settled:
                    self._settle_push_flags()
                expanded = expand(target[0].local[:U], target[1].local[:U], traffic.expanded(r), sent, k,
                                  x.dtype)
            else:
                # (by what every rank agreed on: the index is allocated on every rank together)
                gather = self._gather_buffer(traffic, x.shape[1], x.dtype, k) if gathers else None
                sent = pack(x, route, topk_weights, r, table_dev, sum(traffic.rows[r]), scales, gather=gather)
                if fallback:
                    rows, meta = rows_by_group(ctx, sent, traffic)
                    expanded = expand(rows, meta, traffic.expanded(r), sent, k, x.dtype)
                else:
                    self.last_exchange = "copies"
                    expanded = self._rows(sent, traffic, sched, x.dtype, k, project, gather)
        seq = self.state.get("dispatches", 0)
        self.state["dispatches"] = seq + 1
        tokens, counts, offsets, source, token, weights, slots, slot_weights, row_scales = expanded
        if w is not None and projected is None:  # after the rows are in, by torch
            self.last_gemm = "torch"
            projected = grouped_mm(tokens, w, offsets)
        return EPHandle(tokens, counts, offsets, source, token, weights, received=traffic.received(r),
                        sent=traffic.rows[r], traffic=traffic, slots=slots, slot_weights=slot_weights,
                        positions=sent.positions, rank=r, num_tokens=x.shape[0], seq=seq, scales=row_scales,
                        projected=projected)

    def _gather_buffer(self, traffic: Traffic, width: int, dtype, k: int):
        """The symmetric gather index (int32) for the copy-engine path, before ep_pack writes it: as long as the
        receive buffer's capacity times k (the stores path's test in _push_target), and every layout."""
        cap = self._receive("rows", traffic.most_received(), width, dtype).local.shape[0]
        most = max(traffic.expanded(d) for d in range(traffic.world))
        return self._receive("gather", max(cap * k, most), 1, torch.int32)

    def _counts(self, record: torch.Tensor, sched: ExchangeSchedule) -> tuple:
        """Step 2: every rank's record into every rank's counts table, behind the call's barrier, and its copy to
        the host started. Returns (the table on the device, a function that waits for the copy and returns the
        table as lists: the call's one host synchronisation, which waits for the counts alone)."""
        ctx, W, r = self.ctx, self.ctx.world_size, self.ctx.rank
        table = ctx.symmetric(f"{self.name}.counts", (W, record.numel()), torch.int32)
        flags = ctx.symmetric(f"{self.name}.count_flags", (W,), torch.int32)
        self.state.setdefault("buffers", {})["counts"] = table.local
        blocks = {d: [(table.peer(d)[r], record)] for d in ctx.local_ranks if d != r}

        def consumer():
            table.local[r].copy_(record)
            launch_wait_sources(ctx, flags.local, self.wait_ops["counts"])

        pipeline.run(ctx, AllToAll(sched.copy_streams, blocks, flags, call=sched.call,
                                   remote=counts_remote(sched.remote, table, record), what="ep_dispatch counts",
                                   op=self.wait_ops["counts"], holds_for_link=ctx.holds_for_link), consumer)
        if table.local.device.type == "cpu":  # (launches are synchronous: the table is in)
            host, done = table.local, None
        else:  # the table and the error word to the host behind the wait, and an event there
            host = self.state.get("counts_host")
            if host is None or host.shape != table.local.shape:
                host = self.state["counts_host"] = torch.empty(table.local.shape, dtype=torch.int32, pin_memory=True)
            ctx.mirror_errors()
            host.copy_(table.local, non_blocking=True)
            done = torch.cuda.Event()
            done.record(ctx.current_stream().torch_stream)

        def read() -> list:
            # a wait that gave up left the table as it was: never read past a fault
            if done is None:
                ctx.check()
            else:  # (not ctx.check(), which would wait for the rows as well)
                done.synchronize()
                ctx.ensure_usable()
            return host.tolist()

        return table.local, read

    def _push_target(self, width: int, dtype, meta_words: int, k: int = 0):
        """The receive buffers as they are and the error word (rows, meta, capacity in rows, ctx.err, gather index or
        None), for ep_pack to store into before the host has the counts; None before their first allocation (the
        copy-engine path allocates them), or where ``k`` (the top-k, for a gather index: 0 for none) times the
        capacity would not fit the gather index. The capacity is the same on every rank (symmetric buffers grow
        together), so is every rank's choice. (Within one host only: the stores go into the owners' memory.)"""
        ctx = self.ctx
        rows_name, meta_name, gather_name = f"{self.name}.rows", f"{self.name}.meta", f"{self.name}.gather"
        size = torch.empty((), dtype=dtype).element_size()
        cap = min(ctx.symmetric_nbytes(rows_name) // (width * size),
                  ctx.symmetric_nbytes(meta_name) // (meta_words * 4))
        if cap < 1 or ctx.symmetric_nbytes(gather_name) // 4 < cap * k:
            return None
        gather = ctx.symmetric(gather_name, (cap * k, 1), torch.int32) if k else None
        return (ctx.symmetric(rows_name, (cap, width), dtype), ctx.symmetric(meta_name, (cap, meta_words), torch.int32),
                cap, ctx.err, gather)

    def _raise_push_flags(self, mine: bool = False) -> None:
        """After the pushing ep_pack: this rank's flag in every owner (exchange.raise_flags: on the caller's stream,
        after the kernel's stores), and with ``mine`` in its own (the overlapped GEMM waits for its own rows too).
        Raised even where the kernel stored nothing (bad ids or overflow: every rank's kernel alike; a fault: the
        Context refuses the next call), so the flags are consumed either way (_settle_push_flags)."""
        ctx = self.ctx
        flags = ctx.symmetric(f"{self.name}.push_flags", (ctx.world_size,), torch.int32)
        exchange.raise_flags(ctx, flags)
        if mine:
            ctx.current_stream().write_value(flags.local[ctx.rank:ctx.rank + 1], 1)

    def _settle_push_flags(self) -> None:
        """The caller's stream waits for every source's push flag, then the flags are reset."""
        ctx = self.ctx
        flags = ctx.symmetric(f"{self.name}.push_flags", (ctx.world_size,), torch.int32)
        launch_wait_sources(ctx, flags.local, self.wait_ops["rows"])
        flags.local.zero_()

    def _rows(self, sent: Sent, traffic: Traffic, sched: ExchangeSchedule, dtype, k: int, project=None,
              gather=None) -> tuple:
        """Steps 3 and 4: each owner's block into its receive buffers with this rank's flag there (no barrier: the
        call's opened with the counts), then, once every source's flag is up, the received rows in expert order.
        ``project``: ops.ep_experts.projection's, launched between the two on the rows as they land."""
        ctx, W, r = self.ctx, self.ctx.world_size, self.ctx.rank
        most = traffic.most_received()
        rows = self._receive("rows", most, sent.rows.shape[1], sent.rows.dtype)  # (fp8 rows: their bytes)
        meta = self._receive("meta", most, sent.meta.shape[1], torch.int32)
        flags = ctx.symmetric(f"{self.name}.row_flags", (W,), torch.int32)
        self.state["buffers"].update(rows=rows.local, meta=meta.local)
        if gather is not None:
            self.state["buffers"]["gather"] = gather.local
        blocks = {}
        for d in ctx.local_ranks:
            n = traffic.rows[r][d]
            if d != r and n:
                a, b = traffic.send_offset(r, d), traffic.recv_offset(r, d)
                blocks[d] = [(rows.peer(d)[b:b + n], sent.rows[a:a + n]), (meta.peer(d)[b:b + n], sent.meta[a:a + n])]
        U = sum(traffic.received(r))
        made = {}

        def consumer():
            n = traffic.rows[r][r]
            if n:  # this rank's own tokens for its own experts: a local copy, no flag
                a, b = traffic.send_offset(r, r), traffic.recv_offset(r, r)
                rows.local[b:b + n].copy_(sent.rows[a:a + n])
                meta.local[b:b + n].copy_(sent.meta[a:a + n])
            if project is not None:
                ctx.current_stream().write_value(flags.local[r:r + 1], 1)  # (its own rows are in)
                project(rows.local, gather.local, flags.local)
            launch_wait_sources(ctx, flags.local, self.wait_ops["rows"])
            made["expanded"] = expand(rows.local[:U], meta.local[:U], traffic.expanded(r), sent, k, dtype)

        pipeline.run(ctx, AllToAll(sched.copy_streams, blocks, flags, what="ep_dispatch rows", op=self.wait_ops["rows"],
                                   remote=rows_remote(sched.remote, r, traffic, sent, rows, meta),
                                   holds_for_link=ctx.holds_for_link), consumer)
        return made["expanded"]

    # ------------------------------------------------------------------------------------------------- combine
    @torch.no_grad()
    def combine(self, y: torch.Tensor, d: EPHandle, *, out: torch.Tensor | None = None,
                expert_weight: torch.Tensor | None = None):
        ctx, w = self.ctx, expert_weight
        ctx.ensure_usable()
        check_combine(ctx, y, d, out, w)
        N, stages = y.shape[1] if w is None else w.shape[2], self.cfg.combine_stages
        self._agree("ep_combine", ("combine", N, str(y.dtype)) + (() if w is None else (y.shape[1], stages)))
        out = torch.empty((d.num_tokens, N), dtype=y.dtype, device=y.device) if out is None else out
        fallback, y = self._use_fallback(), y.contiguous()
        self.last_path = "fallback" if fallback else "overlap"
        if w is not None and not fallback and ctx.num_hosts == 1:
            return out, staged_combine(self, y, w, d, out, stages)
        parts = None if w is None else projected_whole(y, w, d)
        y = y if parts is None else parts[0] if parts else y.new_empty((0, N))
        if fallback:
            combine_by_group(ctx, y, d, out)
        else:
            combine_overlapped(self, y, d, out)
        return out if w is None else (out, parts)

    # ------------------------------------------------------------------------------------- plan and buffers
    def schedule(self, kind: str, width: int, dtype, num_experts: int, extra) -> ExchangeSchedule:
        """The copy streams and the header of a ``kind`` ("dispatch" or "combine") call, made once per shape:
        ``width`` (H, or the combine's N), ``dtype``, E and ``extra`` (the dispatch's topk and number of scales;
        the combine's dispatch number mod 64)."""
        key = (kind, width, dtype, num_experts, extra, self.cfg)
        found = self.state.setdefault("schedules", {}).get(key)
        if found is None:
            ctx = self.ctx
            op = self.dispatch_op if kind == "dispatch" else self.combine_op
            descriptor = (kind, width, dtype, num_experts, extra)
            found = self.state["schedules"][key] = ExchangeSchedule(
                deal(ctx.rank, ctx.world_size, self.cfg.num_streams, ctx.local_ranks),
                ctx.call(op, descriptor, (width, num_experts)), remote_ranks(ctx))
        return found

    def _receive(self, what: str, rows: int, width: int, dtype) -> object:
        """The symmetric receive buffer ``what`` as [capacity, width] of ``dtype``, for ``rows`` rows (the most any
        rank needs in this call, so every rank asks for the same). The buffer keeps its capacity while it is large
        enough (one view shape per width, no collective); else it grows on every rank to ``capacity(rows)``."""
        name = f"{self.name}.{what}"
        have = self.ctx.symmetric_nbytes(name) // (width * torch.empty((), dtype=dtype).element_size())
        cap = have if have >= max(rows, 1) else capacity(rows)
        return self.ctx.symmetric(name, (cap, width), dtype)

    def _agree(self, op: str, key: tuple) -> None:
        agree_across_ranks(op, self.ctx, key, self.state.setdefault("agreed", set()))

    def _use_fallback(self) -> bool:
        if not self.overlap_possible():
            return True
        if self.fallback != "auto":
            return self.fallback == "always"
        return self.ctx.world_size == 1


__all__ = ["EPHandle", "ExpertParallel", "ExpertParallelConfig", "Traffic"]
