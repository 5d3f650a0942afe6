"""GEMM + ReduceScatter: rows ``rank*M/W ... (rank+1)*M/W`` of ``sum over ranks of a @ w``.

Plan: each rank's rows cut into chunks, the GEMM's m-tiles ordered peers' rows first (in send order) and this
rank's own rows last, and for each chunk the count of tile stores that completes it. Consumer: one persistent GEMM
that hands peers' tiles on as they finish, and whose own-row tiles add the peers' partials in their epilogue
(``fuse_reduce``; else a reduction kernel sums them). Producer, by variant:

* store: the GEMM stores peers' tiles straight into their receive slots over NVLink and bumps their counters. A
  device barrier opens the call (kernels.gemm); the warp-specialized GEMM needs none: each rank's GEMM announces
  its start, and a program waits for an owner's start before its first tile for it (PEER_STORES);
* copy: the GEMM stores peers' tiles locally and copy engines move each chunk once its count is complete
  (producers.scatter).

Fallback: torch.matmul + NCCL reduce-scatter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..context.collectives import reduce_scatter_rows
from ..kernels import gemm_warp_specialized as warp_specialized
from ..kernels.gemm import launch_gemm
from ..kernels.gemm_operands import ScatterTarget
from ..kernels.reduce import launch_reduce
from ..plan import ChunkLayout, ScatterSchedule, cdiv, scatter_schedule, sums_within_host
from ..producers import pipeline
from ..producers.scatter import Scatter, forwarding, staging
from .base import OverlapOp, call_key, with_overrides, with_tiles
from .checks import check_operands
from .config import GEMMReduceScatterConfig

#: fallback="auto" takes torch.matmul + NCCL below this many bytes of each rank's share of the output
FALLBACK_PARTIAL_BYTES = 1 << 20


def fuses(cfg: GEMMReduceScatterConfig, m: int, world: int) -> bool:
    """Whether the reduction runs in the GEMM for ``m`` rows in all: ``cfg.fuse_reduce`` (None: yes), where every
    rank's rows are whole ``block_m`` tiles (own-row tiles then hold one rank's rows only)."""
    return cfg.fuse_reduce is not False and (m // world) % cfg.block_m == 0


def sums_in_host(ctx, cfg) -> bool:
    """Whether a call on ``ctx`` sums the host's partials for an owner on another host before they cross:
    ``cfg.reduce_in_host``, on a group that spans hosts of one size, several ranks each (plan.sums_within_host)."""
    return sums_within_host(ctx.topology.hosts, cfg.reduce_in_host)


def scatter_mode(cfg: GEMMReduceScatterConfig, m: int, n: int, elsize: int, copy_engines: bool, world: int) -> str:
    """"store" or "copy": ``cfg.scatter``, or for "auto" copy where copies run on ``copy_engines`` (GPUs) from
    ``cfg.copy_bytes`` of partial output (``copy_bytes_fused`` with the reduction fused), store below and on the
    host backend."""
    if cfg.scatter != "auto":
        return cfg.scatter
    size = m * n * elsize
    big = size >= cfg.copy_bytes or (size >= cfg.copy_bytes_fused and fuses(cfg, m, world))
    return "copy" if big and copy_engines else "store"


def one_wave(cfg: GEMMReduceScatterConfig, m: int, n: int, world: int, units: int) -> bool:
    """Whether the GEMM's output tiles for ``m`` x ``n`` (each rank's ``m / world`` rows in whole ``block_m`` tiles)
    number no more than ``units`` SMs. Then every tile runs at once, the peers' partials are all complete only when
    the whole GEMM is, and none of the reduce-scatter hides behind it: matmul + NCCL is as fast or faster."""
    return world * cdiv(m // world, cfg.block_m) * cdiv(n, cfg.block_n) <= units


def wants_warp_specialized(cfg: GEMMReduceScatterConfig) -> bool:
    """Whether ``cfg`` lets a fused call take the warp-specialized GEMM (where the call can run on it)."""
    return cfg.gemm != "triton" and cfg.claim != 1 and not cfg.defer_release


@dataclass(frozen=True, eq=False)
class GEMMReduceScatterSchedule:
    """One GEMM-RS call's decisions (GEMMReduceScatter.schedule): ``cfg`` with the GEMM's own tiles, ``fuse``
    whether the GEMM sums the partials itself, ``gemm`` ("gemm_warp_specialized" or "gemm") and ``b_layout`` B's
    descriptor layout for the warp-specialized GEMM (None: kernels.gemm), ``scatter`` the producer's schedule,
    ``order`` its tile order and ``expected`` this rank's counts per chunk on the device, ``call`` the header the
    call's barrier compares."""
    cfg: GEMMReduceScatterConfig
    fuse: bool
    gemm: str
    b_layout: str | None
    scatter: ScatterSchedule
    order: torch.Tensor
    expected: torch.Tensor
    call: object


class GEMMReduceScatter(OverlapOp):
    """Reusable GEMM-ReduceScatter bound to a Context.

    ``op(a, w, bias=None, *, out=None, **overrides)``: ``a`` is [M, K_local] (this rank's slice of the contraction
    dimension), ``w`` is [K_local, N], any 2-D strided view; returns [M/W, N]. The bias is added once; partials
    are summed in float32. ``overrides`` set GEMMReduceScatterConfig fields for this call.

    ``fallback="auto"`` takes torch.matmul + NCCL reduce-scatter when each rank's share of the output is under
    FALLBACK_PARTIAL_BYTES, when W = 1, on GPUs when the GEMM's tiles fit in one wave (``one_wave``), and, where the
    op does not replay (ops.base.OverlapOp.eager_fallback), for an eager call whose GEMM is too short to pay for
    the host's cost of an overlapped one. On a group that spans hosts, the copy variant, with other hosts' owners
    served through the process group (producers.link), the host's partials for each of them summed before they
    cross (``reduce_in_host``, producers.scatter).
    ``max_m``: the largest M accepted. ``last_gemm``: the GEMM the last overlapped call ran,
    "gemm_warp_specialized" or "gemm".
    """

    KIND = "gemm_rs"
    CONFIG = GEMMReduceScatterConfig
    REBIND = True
    ACROSS_HOSTS = True
    EAGER_MIN_FLOP_PER_PEER = 3e11

    def __init__(self, ctx, config: GEMMReduceScatterConfig | None = None, *, fallback: str = "auto",
                 max_m: int | None = None, name: str | None = None, replay: bool = True):
        super().__init__(ctx, config, fallback=fallback, name=name, replay=replay)
        self.max_m = max_m
        self.last_gemm = None

    def default_config(self, shape, variant=""):
        return GEMMReduceScatterConfig.defaults(self.ctx)

    # --------------------------------------------------------------------------------------------- call
    def __call__(self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None, **overrides):
        self.ctx.ensure_usable()
        ov = self.check_overrides(overrides)
        self.tick()
        W = self.ctx.world_size
        if self.replays.active and isinstance(a, torch.Tensor) and isinstance(w, torch.Tensor) and a.dim() == 2 \
                and w.dim() == 2 and a.shape[0] % W == 0:  # a repeat of a captured call replays, unchecked
            out = torch.empty((a.shape[0] // W, w.shape[1]), dtype=a.dtype, device=a.device) if out is None else out
            if self.replayed(call_key(ov, a, w, bias, out)):
                self.last_path = "overlap"
                return out
        return self._call(a, w, bias, out, overrides, ov)

    @torch.no_grad()  # not differentiable itself (nn wraps it in autograd Functions); workspaces are reset in place
    def _call(self, a, w, bias, out, overrides, ov):
        ctx = self.ctx
        check_operands(self.KIND, ctx, a, w, bias)
        M, W = a.shape[0], ctx.world_size
        if M % W:
            raise ValueError(f"gemm_rs: M = {M} rows is not divisible by the world size {W}")
        if self.max_m is not None and M > self.max_m:
            raise ValueError(f"gemm_rs: M = {M} exceeds this op's max_m = {self.max_m}")
        want = (M // W, w.shape[1])
        if out is not None and (tuple(out.shape) != want or out.dtype != a.dtype or out.device != a.device):
            raise ValueError(f"gemm_rs: out must be {a.dtype} {want} on {a.device}, got {out.dtype} {tuple(out.shape)}")
        self.agree((tuple(a.shape), w.shape[1], str(a.dtype)))
        a = a.contiguous()
        out = torch.empty(want, dtype=a.dtype, device=a.device) if out is None else out
        shape_key = (tuple(a.shape), w.shape[1], a.dtype, tuple(w.stride()), bias is None, out.dtype, ov)
        key = call_key(ov, a, w, bias, out)
        self.seen(key)
        if self._use_fallback(a, w, shape_key, overrides):
            self.replays.saw(key, shape_key)
            self.last_path = "fallback"
            return self._fallback(a, w, bias, out)
        self.last_path = "overlap"
        if out.stride(1) != 1:  # the kernels store unit-stride rows: go through a contiguous tensor
            res = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            self.enqueue(None, shape_key, lambda: self._overlap(a, w, bias, res, overrides))
            return out.copy_(res)
        self.enqueue(key, shape_key, lambda: self._overlap(a, w, bias, out, overrides))
        return out

    def _use_fallback(self, a, w, shape_key, overrides) -> bool:
        if not self.overlap_possible():
            return True
        if self.fallback != "auto":
            return self.fallback == "always"
        ctx = self.ctx
        W = ctx.world_size
        (M, K), N = a.shape, w.shape[1]
        partial = M // W * N * a.element_size()
        if W == 1 or partial < FALLBACK_PARTIAL_BYTES:
            return True
        if not ctx.interpreted and one_wave(self._gemm_config(a, w, overrides)[0], M, N, W,
                                              ctx.num_compute_units()):
            return True
        return self.eager_fallback(shape_key, 2 * M * K * N)

    # --------------------------------------------------------------------------- plan, consumer, fallback
    def _gemm_config(self, a, w, overrides):
        """The overlapped call's config (the warp-specialized GEMM's own tiles where it runs), whether the GEMM
        sums the partials itself, and B's layout for the warp-specialized GEMM (None: kernels.gemm runs)."""
        ctx = self.ctx
        (M, K), N = a.shape, w.shape[1]
        cfg = with_overrides(self.config_for((M, K, N)), overrides)
        # across hosts over NCCL (Context.holds_for_link) nothing waits for other hosts' partials while the
        # exchanges run, and the host's partials summed before they cross come from several ranks: a separate
        # reduction, after the join
        fuse = fuses(cfg, M, ctx.world_size) and not ctx.holds_for_link and not sums_in_host(ctx, cfg)
        b_layout = (warp_specialized.layout_for(ctx, a, w, M // ctx.world_size)
                    if fuse and wants_warp_specialized(cfg) else None)
        if b_layout is not None:  # the warp-specialized GEMM's own tiles, and so its own plan
            cfg = with_tiles(cfg, warp_specialized.TILES)
        return cfg, fuse, b_layout

    def _overlap(self, a, w, bias, out, overrides) -> None:
        """Enqueue one overlapped call (what ReplayCache captures): schedule, then run."""
        ctx = self.ctx
        W = ctx.world_size
        M, N = a.shape[0], w.shape[1]
        m_local = M // W
        sched = self.schedule(a, w, overrides)
        cfg, fuse, b_layout, copy = sched.cfg, sched.fuse, sched.b_layout, sched.scatter.copy
        layout, order, expected = sched.scatter.layout, sched.order, sched.expected
        late = sched.scatter.reduce_after_join
        self.last_gemm = sched.gemm
        recv = ctx.symmetric(f"{self.name}.recv", (W, m_local, N), a.dtype)
        counters = ctx.symmetric(f"{self.name}.counters", (layout.num_chunks,), torch.int32)
        # the warp-specialized GEMM's store variant: each rank's start count, instead of a barrier (PEER_STORES)
        starts = ctx.symmetric(f"{self.name}.starts", (W,), torch.int32) if b_layout is not None and not copy else None
        c = recv.local.view(W * m_local, N)
        self.state["buffers"] = {"receive slots": recv.local}
        if copy:  # peers' tiles to a local staging buffer; copy engines move them on
            forward = forwarding(ctx, self.name, sched.scatter, N, a.dtype)
            stage = staging(ctx, recv, counters, layout, forward, sched.scatter)
            self.state["buffers"]["staging"] = stage.partials
            if forward is not None:
                self.state["buffers"]["forwarding slots"] = forward.slots.local
            producer = Scatter(ctx, sched.scatter, stage, recv, counters, call=sched.call, forward=forward)
            ptrs, counter_ptrs = stage.ptrs, stage.counter_ptrs
        else:  # peers' tiles straight into their receive slots, once every owner's previous call is done and every
            # rank makes the same call (the barrier; the warp-specialized GEMM also waits for each owner's start)
            producer = pipeline.BarrierOnly(sched.call)
            ptrs, counter_ptrs = recv.ptrs, counters.ptrs

        resets = sched.scatter.reset_by  # who zeroes this rank's counters: the GEMM's last program, or the reduction

        def reduce():  # a reduction kernel sums the partials; its counters are then reset on this stream
            launch_reduce(ctx, recv.local, out, bias, counters.local, expected, layout, op=self.op,
                          sources=sched.scatter.sources)
            counters.local.zero_()  # every count was seen; peers add again only after the next barrier

        def consumer():
            if b_layout is not None:
                warp_specialized.launch_gemm_rs(ctx, b_layout, a, w, c, out, bias, layout, order, expected,
                                                counters.local, ptrs, counter_ptrs, self._exit_counts(), starts,
                                                op=self.op)
                return
            # the copy variant's GEMM waits (own rows) for copies that wait for a barrier kernel: leave it an SM
            target = ScatterTarget(ptrs, counter_ptrs, local=copy, free_sm=copy and fuse, claim=cfg.claim,
                                   defer_release=cfg.defer_release, reduce_into=out if fuse else None,
                                   expected=expected, split_m=sched.scatter.peer_tiles)
            launch_gemm(ctx, cfg, a, w, c, order=order, flags=counters.local, layout=layout,
                        bias=bias if fuse else None, scatter=target,
                        exit_counts=self._exit_counts() if resets == "consumer" else None, op=self.op)
            if resets == "reduction" and not late:
                reduce()

        # (the copy streams zero the local counts they waited on)
        pipeline.run(ctx, producer, consumer, consumer_first=copy)
        if late:
            reduce()

    def schedule(self, a, w, overrides) -> "GEMMReduceScatterSchedule":
        """Every decision of a call of these operands, made once per shape and configuration: the config and the
        GEMM (_gemm_config), the variant (store or copy: across hosts always copy, the GEMM cannot store into
        another host's memory), the chunk layout (each chunk of partial output at least ``cfg.min_chunk_bytes``
        where it can), the scatter's schedule (copy streams, tile order, counts) and the call's header."""
        ctx = self.ctx
        W = ctx.world_size
        M, N = a.shape[0], w.shape[1]
        cfg, fuse, b_layout = self._gemm_config(a, w, overrides)
        copy = scatter_mode(cfg, M, N, a.element_size(), ctx.copy_engines, W) == "copy"  # (across hosts: always)
        key = (M, N, a.dtype, cfg, fuse, b_layout, copy)
        found = self.state.setdefault("schedules", {}).get(key)
        if found is None:
            m_local = M // W
            layout = ChunkLayout(W, m_local, cfg.chunk_rows(m_local, N * a.element_size()))
            scatter = scatter_schedule(layout, ctx.rank, ctx.topology.hosts, copy=copy, num_streams=cfg.num_streams,
                                       block_m=cfg.block_m, n_tiles=cdiv(N, cfg.block_n), fused=fuse,
                                       hold_for_link=ctx.holds_for_link, reduce_in_host=cfg.reduce_in_host)
            call = self.call_header((M, N, a.dtype, "copy" if scatter.copy else "store", fuse, b_layout is not None,
                                     layout.m_per_chunk, cfg.block_m, cfg.block_n, bool(scatter.counterparts)),
                                    (M, N))
            found = self.state["schedules"][key] = GEMMReduceScatterSchedule(
                cfg, fuse, "gemm_warp_specialized" if b_layout is not None else "gemm", b_layout, scatter,
                torch.tensor(scatter.tile_order, dtype=torch.int32, device=ctx.device),
                torch.tensor(scatter.counts[ctx.rank], dtype=torch.int32, device=ctx.device), call)
        return found

    def _exit_counts(self) -> torch.Tensor:
        """Two int32s for the fused GEMM's tile claims and RESET_AT_EXIT, zero between calls."""
        return self.ctx.cached(("exit counts", self.name), lambda: torch.zeros(2, dtype=torch.int32,
                                                                               device=self.ctx.device))

    def _fallback(self, a, w, bias, out):
        full = a @ w
        direct = out.is_contiguous()  # NCCL writes straight into the caller's tensor
        res = out if direct else torch.empty(out.shape, dtype=a.dtype, device=a.device)
        reduce_scatter_rows(res, full, group=self.ctx.group)
        if bias is not None:
            res += bias
        return out if direct else out.copy_(res)


def gemm_rs(a: torch.Tensor, w: torch.Tensor, *, ctx, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None, **overrides):
    """Functional form of GEMMReduceScatter: one op per Context, kept by the Context."""
    return GEMMReduceScatter.shared(ctx)(a, w, bias, out=out, **overrides)


__all__ = ["GEMMReduceScatter", "fuses", "gemm_rs", "one_wave", "scatter_mode", "sums_in_host",
           "wants_warp_specialized"]
