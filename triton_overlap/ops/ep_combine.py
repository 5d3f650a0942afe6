"""The overlapped paths of an expert-parallel combine (ops.expert_parallel's module docstring has the plan): on the
experts' outputs, and with the experts' down projection in stages, each stage's partials sent as it ends.

``ExpertParallel.combine(h, d, expert_weight=w)`` takes the experts' last activations ``h`` [R, K] (in d.tokens'
order, rows grouped by local expert) instead of their outputs, and computes the outputs itself: ``h_row @ w[its local
expert]``. An owner's partial for a token sums the token's choices over every local expert, so it can leave only
once the last of them is computed. With ``ExpertParallelConfig.combine_stages`` = S, the projection runs as S
``torch._grouped_mm`` launches over consecutive local experts (each cut at the first expert boundary at or past an
even share of the rows: the rows are expert-major, so each launch is a slice and every weight is still read once;
stages without rows are left out, so there may be fewer), and after each, on a side stream, one
launch of the partials of the tokens whose last local row that stage holds (kernels.row_sums'
gather_rows_sum_listed, over the received tokens listed by stage). The partials of a stage cross to their sources
while the next stage's GEMM runs; the flags are raised after the last stage, and the sum on each token's rank is the
unstaged combine's.

What it can gain: with ``k`` choices per owner the share of tokens ready after a fraction ``f`` of the experts is
about ``f^k``, so staging pays where an owner holds few of a token's choices (more ranks: DeepSeek-V3's top-8 over
W = 8 owners gives about 1.5 per owner) and little at W = 2 (docs/decisions.md, Expert-parallel MoE). Hence one
stage by default (the GEMM, then every partial, as before; the barrier on the side stream lets the GEMM start before
the peers arrive).

Within one host only: on a group that spans hosts, and on the fallback, the projection runs whole, then the op's
combine. The stages' outputs are kept as they are (``(out, parts)``: ``torch.cat(parts)`` is the projection, never
materialised) for a backward that needs them (the top-k weights' gradient).
"""
from __future__ import annotations

from itertools import accumulate

import torch

from ..kernels.arrivals import launch_wait_sources
from ..kernels.row_sums import launch_gather_rows_sum_jobs, launch_gather_rows_sum_listed, part_table
from ..producers import exchange, pipeline
from ..producers.link import open_call
from ..producers.pipeline import BarrierOnly, guarded
from .ep_hosts import combine_jobs, partials_between_hosts
from .ep_routing import sum_partials
from .moe_routing import grouped_mm


def stage_cuts(counts: list, stages: int) -> list:
    """(first expert, end expert, first row, end row) of each stage of ``stages`` over experts with ``counts`` rows,
    consecutive, each cut at the first expert boundary at or past the next even share of the rows; stages without
    rows left out."""
    total, cuts, e0, b0, acc = sum(counts), [], 0, 0, 0
    for e, c in enumerate(counts):
        acc += c
        if acc > b0 and (acc * stages >= total * (len(cuts) + 1) or e == len(counts) - 1):
            cuts.append((e0, e + 1, b0, acc))
            e0, b0 = e + 1, acc
    return cuts


def _combine_buffers(op, d, N: int, dtype) -> tuple:
    """(schedule, partials buffer, flags) of a combine of width ``N``; the dispatch's number (mod 64) is in the
    header: ranks combining different dispatches fault at the barrier."""
    ctx = op.ctx
    sched = op.schedule("combine", N, dtype, d.num_experts, d.seq % 64)
    back = op._receive("partials", d.traffic.most_sent(), N, dtype)
    flags = ctx.symmetric(f"{op.name}.partial_flags", (ctx.world_size,), torch.int32)
    op.state.setdefault("buffers", {})["partials"] = back.local
    return sched, back, flags


def _sum_when_flagged(op, d, back, flags, out: torch.Tensor) -> None:
    """On the caller's stream: once every owner's flag is up, the sum of the partials into ``out``; the flags
    cleared (each was waited for, earlier on this stream)."""
    launch_wait_sources(op.ctx, flags.local, op.wait_ops["partials"])
    sum_partials(op.ctx, back.local[:sum(d.sent)], d, out)
    flags.local.zero_()


def combine_overlapped(op, y: torch.Tensor, d, out: torch.Tensor) -> None:
    """The combine of the experts' outputs ``y``: behind the combine's barrier, each source's partials computed
    straight into its combine buffer (at the place its block for this rank had in its send order; one launch for all
    sources, ops.ep_hosts.combine_jobs), then this rank's flag in every source (exchange.raise_flags, after the
    launch; across hosts a launch for the remote sources comes first, and the Link carries their partials and flags
    beside the local launch); once every owner's flag is up, the sum."""
    ctx = op.ctx
    sched, back, flags = _combine_buffers(op, d, y.shape[1], y.dtype)
    jobs = combine_jobs(ctx, sched.remote, op.state, d, back)
    stride = back.local.stride(0)

    def call():
        sending = None
        if jobs.remote is not None:  # the remote sources' first: they cross while the local ones are summed
            launch_gather_rows_sum_jobs(ctx, y, d.slots, d.slot_weights, jobs.ptrs, jobs.remote, jobs.remote_most,
                                        stride)
            sending = partials_between_hosts(ctx, sched.remote, d, back, jobs.staged, flags,
                                             op.wait_ops["partials"])
        launch_gather_rows_sum_jobs(ctx, y, d.slots, d.slot_weights, jobs.ptrs, jobs.local, jobs.local_most, stride)
        exchange.raise_flags(ctx, flags)
        if sending is not None:
            ctx.current_stream().wait_stream(sending)
        _sum_when_flagged(op, d, back, flags, out)

    pipeline.run(ctx, BarrierOnly(sched.call), call)


def projected_whole(h: torch.Tensor, w: torch.Tensor, d) -> tuple:
    """The projection in one launch (the fallback's, and across hosts): a tuple of its one part."""
    return (grouped_mm(h, w, d.offsets),) if h.shape[0] else ()


def partial_places(op, d, back) -> torch.Tensor:
    """int64 [U]: where each received token's partial goes, as an element offset from ``back.local`` (into its
    source's partials buffer, mapped here, at the place its block for this rank had in the source's send order);
    made once per dispatch and buffer."""
    ctx, traffic, r = op.ctx, d.traffic, op.ctx.rank
    key = (back.local.data_ptr(), back.local.shape[1], back.local.dtype)
    cached = op.state.get("partial places")
    if cached is not None and cached[0] is traffic and cached[1] == key:
        return cached[2]
    stride, size, base = back.local.stride(0), back.local.element_size(), back.local.data_ptr()
    counts, adjust = [], []
    for s in range(traffic.world):  # index rows: the sources' blocks in rank order
        buf = back.local if s == r else back.peer(s)
        counts.append(traffic.rows[s][r])
        moved = traffic.send_offset(s, r) - traffic.recv_offset(s, r)  # (its row there less its index row)
        adjust.append((buf.data_ptr() - base) // size + moved * stride)
    U = sum(counts)
    table = torch.tensor([adjust, counts], dtype=torch.int64).to(ctx.device, non_blocking=True)
    places = torch.repeat_interleave(table[0], table[1], output_size=U) + torch.arange(U, device=ctx.device) * stride
    op.state["partial places"] = (traffic, key, places)
    return places


def staged_combine(op, h: torch.Tensor, w: torch.Tensor, d, out: torch.Tensor, stages: int) -> tuple:
    """The overlapped combine with the projection in ``stages`` (module docstring), within one host: returns the
    parts of the projection, in row order. Behind the combine's barrier (on the side stream: the first GEMM does not
    wait for the peers), each stage's partials go straight into their sources' combine buffers; this rank's flag in
    every source after the last; once every owner's flag is up, the sum into ``out``. The received tokens are
    listed by stage (a stable sort of each token's stage, the one holding its last local row) on the device, and
    each stage's launch sums its own tokens only."""
    ctx, traffic, r = op.ctx, d.traffic, op.ctx.rank
    el, U = traffic.experts_per_rank, sum(d.received)
    counts = [sum(traffic.experts[s][r * el + e] for s in range(traffic.world)) for e in range(el)]
    bounds_here = [0, *accumulate(counts)]  # the rows' expert bounds on the host (d.offsets, not read back)
    cuts = stage_cuts(counts, stages)
    sched, back, flags = _combine_buffers(op, d, w.shape[2], h.dtype)
    jobs = combine_jobs(ctx, None, op.state, d, back)
    if len(cuts) > 1:
        places = partial_places(op, d, back)
        bounds = torch.tensor([b0 for _, _, b0, _ in cuts[1:]], dtype=torch.int32).to(ctx.device, non_blocking=True)
        stage_of, listed = torch.sort(torch.bucketize(d.slots.max(dim=1).values, bounds, right=True), stable=True)
        starts = torch.searchsorted(stage_of, torch.arange(len(cuts) + 1, device=ctx.device))
    caller, side = ctx.current_stream(), ctx.streams(1)[0]
    parts, tables = [], []  # (the tables live until the side stream is joined: its launches read them)
    with guarded(ctx, "ep_combine"):
        side.wait_stream(caller)
        try:
            open_call(ctx, side, sched.call)
            for i, (e0, e1, b0, b1) in enumerate(cuts):
                parts.append(grouped_mm(h[b0:b1], w[e0:e1], d.offsets[e0:e1 + 1] - b0,
                                        [b - b0 for b in bounds_here[e0:e1 + 1]]))
                tables.append(part_table(ctx, parts) if i else None)
                side.wait_stream(caller)
                with ctx.use_stream(side):
                    if len(cuts) == 1:
                        launch_gather_rows_sum_jobs(ctx, parts[0], d.slots, d.slot_weights, jobs.ptrs, jobs.local,
                                                    jobs.local_most, back.local.stride(0))
                    else:
                        # a token of stage i has its last local row there: at most b1 - b0 of them
                        launch_gather_rows_sum_listed(ctx, parts[0], d.slots, d.slot_weights, back.local, places,
                                                      listed, starts[i:i + 2], min(U, b1 - b0), tables[-1])
            with ctx.use_stream(side):
                exchange.raise_flags(ctx, flags)
        finally:
            caller.wait_stream(side)
        _sum_when_flagged(op, d, back, flags, out)
    return tuple(parts)


__all__ = ["combine_overlapped", "partial_places", "projected_whole", "stage_cuts", "staged_combine"]
