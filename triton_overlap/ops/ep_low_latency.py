"""Expert-parallel dispatch and combine in low-latency mode, for decode: no host synchronisation, no barrier and
fixed shapes, so a decode step that holds them can be captured in a CUDA graph and replayed.

The normal mode (ops.expert_parallel) reads the counts back to the host once per dispatch, to size its output and to
enqueue copies of the right lengths. Here the sizes are fixed by ``max_tokens_per_rank`` (``cap``): each rank's
receive buffers hold one slot of ``cap`` rows per source (per half: calls alternate between two), so a source stores
its rows for an owner straight into the owner's slot for it, at the token's place among those it sends there,
without knowing what the other sources send. The kernels do every store (kernels.ep_low_latency: the module doc has
the protocol); for decode's few rows a copy engine's start-up would cost more than the stores. One dispatch is three
launches on the caller's stream (four with no tokens, five above 256 on GPUs): the count of the normal mode (this
rank's record, in one launch: kernels.ep_routing.ep_count_record), the send (rows, metadata, the record and the
call's header into every owner, then one flag per owner), and the expansion (waits for every source, compares
headers, checks ids, places each (source, expert) run and copies the rows into expert order). A combine is two: the
owners' weighted partials stored into each source's slot, then the sums.

What a dispatch returns (LowLatencyHandle) has the same fields as the normal mode's handle, in fixed shapes:
``tokens`` [W · cap · topk, H] (the most (token, choice) pairs a rank can receive), whose first ``offsets[-1]`` rows
hold the received pairs in expert order (as the normal mode's; the rows past them are unspecified), ``counts`` and
``offsets`` on the device (``torch._grouped_mm``'s ``offs`` are ``offsets[1:]``). Both modes return the same rows
in the same order, and combines return the same bits.

Faults: every wait is bounded and names the rank, the op and the source; the senders' headers are compared with the
receiver's call (ranks calling with different shapes or out of step fault, naming both; a combine's header names
the dispatch it combines, so ranks combining different dispatches fault too); ids outside [0, E) on any rank fault
every rank's Context, naming that rank (the check needs every rank's ids, which the host never sees here); a
Context faults until ``reset()``. Unlike the normal mode, rows move before the headers are compared (there is no
barrier), and a fault is seen on the device: the outputs of a faulted call are garbage, so call ``ctx.check()``
after a replayed step. Tokens beyond ``cap`` on a rank raise
ValueError on that rank before any launch; its peers raise ValueError too on a shape's first call, else every
rank's Context faults, naming it and its error (docs/protocol.md, Inputs).

Make one eager call of each shape (H, dtype, topk, E, scales; the combine's N) before capturing: it allocates the
symmetric buffers and agrees on the shapes across ranks, which cannot happen inside a capture.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.cached_launch import launch
from ..kernels.ep_low_latency import ll_combine_recv, ll_combine_send, ll_expand, ll_send
from ..kernels.ep_routing import tiles
from ..kernels.routing import pow2
from ..kernels.signal import waiter
from ..plan import cdiv
from .all_reduce import slot_elements
from .base import OverlapOp, agree_across_ranks
from .checks import DTYPES, FP8
from .ep_routing import EPHandle, check_dispatch, route_tokens
from .expert_parallel import ExpertParallel


@dataclass(frozen=True, eq=False)
class LowLatencyHandle:
    """What a low-latency dispatch returns on a rank, and what its combine takes back: ``tokens`` [W · cap · topk,
    H], ``counts`` int32 [E/W], ``offsets`` int32 [E/W + 1], and per layout row ``source``, ``token`` (int32),
    ``weights`` (float32), ``scales`` (float32 [rows, G] for fp8 rows, else None), as in EPHandle; rows past
    ``offsets[-1]`` are unspecified. What combine reads: ``slots`` int32 [W · cap, topk] and ``slot_weights`` per
    received row (source s's row u at s · cap + u), ``positions`` int32 [T_local, W] (d · cap + the token's place
    among this rank's rows for owner d; -1: none), ``received`` int32 [W] (rows from each source) and ``number``
    int32 [1] (the dispatch's call number, which the combine's header carries), all on the device."""

    tokens: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    source: torch.Tensor
    token: torch.Tensor
    weights: torch.Tensor
    scales: torch.Tensor | None
    slots: torch.Tensor
    slot_weights: torch.Tensor
    positions: torch.Tensor
    received: torch.Tensor
    number: torch.Tensor
    rank: int
    world: int
    num_tokens: int
    num_experts: int
    capacity: int

    @property
    def num_rows(self) -> int:
        """The layout's rows (fixed: W · cap · topk); the received pairs are the first ``offsets[-1]``."""
        return self.tokens.shape[0]


@dataclass(frozen=True, eq=False)
class Slots:
    """One exchange's symmetric buffers: ``data`` [2, W, slot] (and ``meta``, ``table`` for a dispatch), ``header``
    [2, W, 4], ``flags`` [W] (one per source, carrying the call number), ``state`` [4] (the calls done, the programs
    out, the senders' ticket, the count kernel's ticket); ``slot`` and friends: elements between consecutive slots."""

    data: object
    meta: object
    table: object
    header: object
    flags: object
    state: object
    slot: int
    meta_slot: int
    table_slot: int


class ExpertParallelLowLatency(OverlapOp):
    """Expert-parallel dispatch and combine for decode, bound to a Context and a ``max_tokens_per_rank`` (the module
    docstring has the protocol). ``op.dispatch(x, topk_ids, topk_weights, *, num_experts, scales=None)`` and
    ``op.combine(y, d, *, out=None)`` take what ExpertParallel's take (T_local <= max_tokens_per_rank on every rank)
    and return a LowLatencyHandle and [T_local, N].

    ``fallback``: "auto" (the kernels wherever the ranks share a host; across hosts, ExpertParallel's process-group
    path), "never", "always" (that path). The process-group path returns an EPHandle, whose shapes depend on the
    routing, and reads counts on the host: it cannot be captured. ``name``: the prefix of the op's buffers.
    """

    KIND = "ep_low_latency"

    def __init__(self, ctx, max_tokens_per_rank: int, *, fallback: str = "auto", name: str | None = None):
        super().__init__(ctx, None, fallback=fallback, name=name, replay=False)
        if isinstance(max_tokens_per_rank, bool) or not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be a positive int, got {max_tokens_per_rank!r}")
        self.capacity = max_tokens_per_rank
        self.dispatch_op, self.combine_op = ctx.op_id("ep_dispatch"), ctx.op_id("ep_combine")
        self._plain = None

    def default_config(self, shape, variant: str = ""):
        return None

    def plain(self) -> ExpertParallel:
        """The process-group path (ExpertParallel with fallback="always")."""
        if self._plain is None:
            self._plain = ExpertParallel(self.ctx, fallback="always", name=f"{self.name}.plain")
        return self._plain

    # ------------------------------------------------------------------------------------------------ dispatch
    @torch.no_grad()
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, num_experts: int,
                 scales: torch.Tensor | None = None):
        ctx = self.ctx
        ctx.ensure_usable()
        check_dispatch(ctx, x, topk_ids, topk_weights, num_experts, scales)
        W, r, cap = ctx.world_size, ctx.rank, self.capacity
        T, H = x.shape
        k, E = topk_ids.shape[1], num_experts
        if T > cap:
            raise ValueError(f"ep_dispatch: rank {r} has {T} tokens, more than max_tokens_per_rank = {cap} (the "
                             f"receive slots' size; make the op with a larger max_tokens_per_rank)")
        G = 0 if scales is None else scales.shape[1]
        descriptor = ("low-latency dispatch", H, str(x.dtype), E, k, G, cap)
        self._agree("ep_dispatch", descriptor)
        if self._use_fallback():
            self.last_path = "fallback"
            return self.plain().dispatch(x, topk_ids, topk_weights, num_experts=E, scales=scales)
        self.last_path = "overlap"
        rows_dtype = torch.uint8 if x.dtype == FP8 else x.dtype
        MW = 2 + 3 * k + G
        bufs = self._slots("dispatch", cap * H, rows_dtype, meta=cap * MW, table=3 + W + E)
        call = self.call_header(descriptor, (H, E), self.dispatch_op)
        route = route_tokens(topk_ids, E, W, bufs.state.local[3:])
        dev, EL, R = x.device, E // W, W * cap * k
        small = torch.empty(W * EL + 2 * EL + 2 + W + 3 * R + 2 * W * cap * k + R * G + max(T, 1) * W,
                            dtype=torch.int32, device=dev)
        place, offsets, counts, received, number, source, token, weights, slots, slot_w, row_scales, positions = (
            torch.split(small, (W * EL, EL + 1, EL, W, 1, R, R, R, W * cap * k, W * cap * k, R * G, max(T, 1) * W)))
        tokens = torch.empty((R, H), dtype=rows_dtype, device=dev)
        xs = x.view(torch.uint8) if x.dtype == FP8 else x
        xs = xs if xs.stride(1) == 1 else xs.contiguous()
        wbits = topk_weights.contiguous().view(torch.int32)
        sbits = None if scales is None else scales.contiguous().view(torch.int32)
        if T == 0:  # (no kernel reads them; real tensors so that no empty one reaches the launcher)
            xs, wbits = xs.new_zeros(1, H), wbits.new_zeros(1, k)
            sbits = None if sbits is None else sbits.new_zeros(1, G)
        ids = route.ids if T else route.ids.new_zeros(1, k)
        bt, bh = tiles()
        w_pad = pow2(W)
        launch(ll_send, (max(cdiv(T, bt), 1), cdiv(H, bh)),
               (xs, ids, wbits, wbits if sbits is None else sbits, route.record,
                route.base if T else small, route.base_e if T else small, positions, bufs.data.ptrs, bufs.meta.ptrs,
                bufs.table.ptrs, bufs.header.ptrs, bufs.flags.ptrs, bufs.state.local, T, H, E, EL, W, r, xs.stride(0),
                G, cap, bufs.slot, bufs.meta_slot, bufs.table_slot, self.dispatch_op, call.fingerprint),
               dict(K=k, K_PAD=pow2(k), BT=bt, W_PAD=w_pad, BLOCK_H=bh, G_PAD=pow2(G) if G else 0,
                    REC_PAD=pow2(3 + W + E)), num_warps=4)
        ctx.after_launch()
        launch(ll_expand, (W * cdiv(cap, bt), cdiv(H, bh)),
               (bufs.table.local, bufs.header.local, bufs.flags.local, bufs.data.local, bufs.meta.local, place,
                offsets, counts, received, number, bufs.state.local, tokens, source, token, weights, slots, slot_w,
                row_scales if G else small, waiter(ctx, self.dispatch_op), E, H, EL, W, cap, R, G, bufs.slot,
                bufs.meta_slot, bufs.table_slot, call.fingerprint),
               dict(K=k, K_PAD=pow2(k), BU=bt, BLOCK_H=bh, G_PAD=pow2(G) if G else 0, W_PAD=w_pad, EL_PAD=pow2(EL),
                    CLOCK=ctx.clock), num_warps=4)
        ctx.after_launch()
        self.state.setdefault("buffers", {}).update(rows=bufs.data.local, meta=bufs.meta.local,
                                                    table=bufs.table.local)
        return LowLatencyHandle(
            tokens.view(x.dtype), counts, offsets, source, token, weights.view(torch.float32),
            row_scales.view(torch.float32).view(R, G) if G else None, slots.view(W * cap, k),
            slot_w.view(torch.float32).view(W * cap, k), positions[:T * W].view(T, W), received, number, r, W, T, E,
            cap)

    # ------------------------------------------------------------------------------------------------- combine
    @torch.no_grad()
    def combine(self, y: torch.Tensor, d, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(d, EPHandle):
            return self.plain().combine(y, d, out=out)
        ctx = self.ctx
        ctx.ensure_usable()
        self._check_combine(y, d, out)
        W, r, cap = ctx.world_size, ctx.rank, d.capacity
        N, T = y.shape[1], d.num_tokens
        descriptor = ("low-latency combine", N, str(y.dtype), d.num_experts, d.slots.shape[1], cap)
        self._agree("ep_combine", descriptor)
        self.last_path = "overlap"
        out = torch.empty((T, N), dtype=y.dtype, device=y.device) if out is None else out
        target = out if out.stride(-1) == 1 else torch.empty((T, N), dtype=y.dtype, device=y.device)
        bufs = self._slots("combine", cap * N, y.dtype)
        call = self.call_header(descriptor, (N,), self.combine_op)
        y = y if y.stride(1) == 1 else y.contiguous()
        bu, bn, warps = (8, 64, 1) if ctx.interpreted else (16, 256, 4)
        w_pad = pow2(W)
        launch(ll_combine_send, (W * cdiv(cap, bu), cdiv(N, bn)),
               (y, d.slots, d.slot_weights, d.received, d.number, bufs.data.ptrs, bufs.header.ptrs, bufs.flags.ptrs,
                bufs.state.local, N, W, r, cap, y.stride(0), bufs.slot, self.combine_op, call.fingerprint),
               dict(K=d.slots.shape[1], K_PAD=pow2(d.slots.shape[1]), BU=bu, BLOCK_N=bn, W_PAD=w_pad),
               num_warps=warps)
        ctx.after_launch()
        positions = d.positions if T else d.received.new_full((1, W), -1)
        launch(ll_combine_recv, (max(cdiv(T, bu), 1), cdiv(N, bn)),
               (bufs.data.local, positions, target, d.number, bufs.header.local, bufs.flags.local, bufs.state.local,
                waiter(ctx, self.combine_op), T, N, W, cap, bufs.slot, target.stride(0), call.fingerprint),
               dict(W_PAD=w_pad, BLOCK_M=bu, BLOCK_N=bn, CLOCK=ctx.clock), num_warps=warps)
        ctx.after_launch()
        self.state.setdefault("buffers", {})["partials"] = bufs.data.local
        if target is not out:
            out.copy_(target)
        return out

    def _check_combine(self, y, d, out) -> None:
        op, ctx = "ep_combine", self.ctx
        if not isinstance(d, LowLatencyHandle):
            raise ValueError(f"{op}: d must be the handle ep_dispatch returned, got {type(d).__name__}")
        if d.rank != ctx.rank or d.world != ctx.world_size:
            raise ValueError(f"{op}: d was made by rank {d.rank} of {d.world}, this is rank {ctx.rank} of "
                             f"{ctx.world_size}")
        if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != d.num_rows or y.shape[1] == 0:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"{op}: y must be a [R, N] tensor with R = {d.num_rows} (d.tokens' rows, of which the "
                             f"first offsets[-1] are read) and N >= 1, got {got}")
        if y.dtype not in DTYPES or y.device != ctx.device:
            raise ValueError(f"{op}: y must be float16 or bfloat16 on {ctx.device}, got {y.dtype} on {y.device}")
        shape = (d.num_tokens, y.shape[1])
        if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape
                                or out.dtype != y.dtype or out.device != y.device):
            got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"{op}: out must be {y.dtype} {shape} on {y.device}, got {got}")

    # ---------------------------------------------------------------------------------------------- buffers
    def _slots(self, kind: str, n: int, dtype, meta: int = 0, table: int = 0) -> Slots:
        """``kind``'s buffers for slots of ``n`` elements of ``dtype`` (and ``meta``, ``table`` int32 elements):
        each slot the whole buffer's share while the buffer is large enough, else grown on every rank (as the
        AllReduce's slots, so the halves of consecutive calls never overlap whatever their shapes)."""
        ctx, W, p = self.ctx, self.ctx.world_size, f"{self.name}.{kind}"

        def grown(what, count, dt):
            if not count:
                return None, 0
            slot = slot_elements(ctx, f"{p}.{what}", count, dt)
            return ctx.symmetric(f"{p}.{what}", (2, W, slot), dt), slot

        data, slot = grown("rows", n, dtype)
        meta_buf, meta_slot = grown("meta", meta, torch.int32)
        table_buf, table_slot = grown("table", table, torch.int32)
        return Slots(data, meta_buf, table_buf, ctx.symmetric(f"{p}.header", (2, W, 4), torch.int32),
                     ctx.symmetric(f"{p}.flags", (W,), torch.int32), ctx.symmetric(f"{p}.state", (4,), torch.int32),
                     slot, meta_slot, table_slot)

    def _agree(self, op: str, key: tuple) -> None:
        agree_across_ranks(op, self.ctx, key, self.state.setdefault("agreed", set()))

    def _use_fallback(self) -> bool:
        if not self.overlap_possible():
            return True
        return self.fallback == "always"


__all__ = ["ExpertParallelLowLatency", "LowLatencyHandle"]
