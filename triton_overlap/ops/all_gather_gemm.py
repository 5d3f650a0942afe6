"""AllGather + GEMM: ``all_gather(a) @ w`` with the gather hidden behind the GEMM.

Plan: each rank's rows cut into chunks (ChunkLayout), the GEMM's m-tiles ordered local rows first, then the others
in the order their chunks arrive. Producer: copy engines push this rank's rows into every peer's workspace, or each
rank pulls its peers' rows (producers.gather). Consumer: one persistent GEMM, each tile waiting only for the chunks
it reads; its last program resets the flags. Fallback: NCCL all_gather + torch.matmul.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..context.collectives import all_gather_rows
from ..kernels import gemm_gather_hopper as gather_hopper
from ..kernels.gemm import launch_gemm, plain_gemm
from ..kernels.gemm_operands import pair_gap
from ..plan import ChunkLayout, GatherSchedule, gather_schedule
from ..producers import pipeline
from ..producers.gather import Gather
from .base import OverlapOp, call_key, with_overrides, with_tiles
from .checks import FP8, check_operands, result_dtype
from .config import AllGatherGEMMConfig

#: fallback="auto" takes NCCL + torch.matmul below this many bytes per rank's shard
FALLBACK_SHARD_BYTES = 1 << 20


@dataclass(frozen=True, eq=False)
class AllGatherGEMMSchedule:
    """One AllGather-GEMM call's decisions (AllGatherGEMM.schedule): ``cfg`` with the consumer's own tiles,
    ``gemm`` the consumer ("gemm_gather_hopper" or "gemm") and ``b_layout`` B's descriptor layout for the Gluon
    GEMM (None: kernels.gemm), ``gather`` the producer's schedule, ``order`` its tile order on the device, ``call``
    the header the call's barrier compares."""
    cfg: AllGatherGEMMConfig
    gemm: str
    b_layout: str | None
    gather: GatherSchedule
    order: torch.Tensor
    call: object


def _placement(layout, a, ws) -> tuple:
    """What the in-place launch of a call of ``layout`` is specialised on: whether the shard ``a`` lies below the
    workspace ``ws``, and whether one descriptor can span the two (gemm_operands.pair_gap)."""
    return layout, a.data_ptr() < ws.data_ptr(), pair_gap(a, ws) is None


class AllGatherGEMM(OverlapOp):
    """Reusable AllGather-GEMM bound to a Context: holds its workspace, flags and config.

    ``op(a, w, bias=None, *, return_gathered=False, out=None, **overrides)``: ``a`` is this rank's row shard
    [M/W, K]; ``w`` is [K, N_local], any 2-D strided view; returns [M, N_local] with rank 0's rows first (and the
    gathered [M, K] when asked). ``overrides`` set AllGatherGEMMConfig fields for this call.

    fp8: ``a`` and ``w`` float8_e4m3fn (compute capability 8.9 or later, or the host backend) with ``scale_a`` and
    ``scale_b``, one-element float32 tensors: the result is ``(all_gather(a) @ w) * scale_a * scale_b (+ bias)`` in
    ``out_dtype`` (bf16 by default, or fp16; bias in that dtype), as ``torch._scaled_mm`` with per-tensor scales.
    ``scale_a`` is one scale for the whole gathered A, so every rank must pass the same value; it is read on the
    device when the GEMM runs, so a replayed call follows its current value. The gather moves one byte per element.

    ``fallback="auto"`` takes NCCL all_gather + torch.matmul when the shard is under FALLBACK_SHARD_BYTES, when
    W = 1, and, where the op does not replay (ops.base.OverlapOp.eager_fallback), for an eager call whose GEMM is
    too short to pay for the host's cost of an overlapped one. On a group that spans hosts, other hosts' rows come
    through the process group (producers.link), in push mode.
    ``max_m``: the largest gathered M accepted (None: the workspace grows as needed). ``last_gemm``: the GEMM the
    last overlapped call ran, "gemm_gather_hopper" or "gemm".
    """

    KIND = "ag_gemm"
    CONFIG = AllGatherGEMMConfig
    ACROSS_HOSTS = True
    EAGER_MIN_FLOP_PER_PEER = 2e11
    REBIND = True

    def __init__(self, ctx, config: AllGatherGEMMConfig | None = None, *, fallback: str = "auto",
                 max_m: int | None = None, name: str | None = None, replay: bool = True):
        super().__init__(ctx, config, fallback=fallback, name=name, replay=replay)
        self.replays.ready = self._rebind_ready
        self.max_m = max_m
        self.last_gemm = None

    def default_config(self, shape, variant=""):
        base = AllGatherGEMMConfig.defaults(self.ctx)
        return base.for_fp8(self.ctx) if variant == "_fp8" else base

    # --------------------------------------------------------------------------------------------- call
    def __call__(self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                 return_gathered: bool = False, out: torch.Tensor | None = None, scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, **overrides):
        self.ctx.ensure_usable()
        ov = self.check_overrides(overrides)
        self.tick()
        scales = () if scale_a is None and scale_b is None else (scale_a, scale_b)
        if self.replays.active and isinstance(a, torch.Tensor) and isinstance(w, torch.Tensor) and a.dim() == 2 \
                and w.dim() == 2:  # a repeat of a captured call replays, unchecked
            out = torch.empty((a.shape[0] * self.ctx.world_size, w.shape[1]), dtype=result_dtype(a.dtype, out_dtype),
                              device=a.device) if out is None else out
            if self.replayed(call_key(ov, a, w, bias, out, *scales)):
                self.last_path = "overlap"
                return self._returned(a, out, return_gathered)
        return self._call(a, w, bias, return_gathered, out, overrides, ov, (scale_a, scale_b), out_dtype)

    @torch.no_grad()  # not differentiable itself (nn wraps it in autograd Functions); workspaces are reset in place
    def _call(self, a, w, bias, return_gathered, out, overrides, ov, scales, out_dtype):
        ctx = self.ctx
        dtype = check_operands(self.KIND, ctx, a, w, bias, *scales, out_dtype, fp8=True)
        W = ctx.world_size
        want = (a.shape[0] * W, w.shape[1])
        if self.max_m is not None and want[0] > self.max_m:
            raise ValueError(f"ag_gemm: gathered M = {want[0]} exceeds this op's max_m = {self.max_m}")
        if out is not None and (tuple(out.shape) != want or out.dtype != dtype or out.device != a.device):
            raise ValueError(f"ag_gemm: out must be {dtype} {want} on {a.device}, got {out.dtype} {tuple(out.shape)}")
        self.agree((tuple(a.shape), str(a.dtype)))
        scales = scales if a.dtype == FP8 else ()
        a = a.contiguous()
        out = torch.empty(want, dtype=dtype, device=a.device) if out is None else out
        shape_key = (tuple(a.shape), w.shape[1], a.dtype, tuple(w.stride()), bias is None, out.dtype, ov)
        key = call_key(ov, a, w, bias, out, *scales)
        self.seen(key)
        if self._use_fallback(a, w, shape_key):
            self.replays.saw(key, shape_key)
            self.last_path = "fallback"
            return self._fallback(a, w, bias, out, scales, return_gathered)
        self.last_path = "overlap"
        layout = self.replays.layout(key) if self.replays.rebind and self.replays.on() else None
        self.enqueue(key, shape_key, lambda: self._overlap(a, w, bias, out, overrides, scales, layout),
                     capturable=None if layout is None else lambda: self._placement_built(layout, a))
        return self._returned(a, out, return_gathered)

    def _use_fallback(self, a, w, shape_key) -> bool:
        if not self.overlap_possible():
            return True
        if self.fallback != "auto":
            return self.fallback == "always"
        W = self.ctx.world_size
        flop = 2 * a.shape[0] * W * a.shape[1] * w.shape[1]
        if a.dtype == FP8:
            flop /= 2  # fp8 tensor cores do twice bf16's FLOPs per second: the rule is about time
        return W == 1 or a.numel() * a.element_size() < FALLBACK_SHARD_BYTES or self.eager_fallback(shape_key, flop)

    def _returned(self, a, out, return_gathered):
        """``out``, or ``(out, gathered)``: the gathered input is copied outside the replayed part (a fresh tensor per
        call, which autograd keeps, would make every key new). Stream order keeps the workspace as it is until these
        copies have read it: peers write into it again only after the next call's barrier, which follows this
        stream."""
        if not return_gathered:
            return out
        ctx, m_local = self.ctx, a.shape[0]
        gathered = torch.empty((m_local * ctx.world_size, a.shape[1]), dtype=a.dtype, device=a.device)
        with torch.no_grad():
            gathered.copy_(self._workspace(a).local)
            gathered[ctx.rank * m_local:(ctx.rank + 1) * m_local].copy_(a)
        return out, gathered

    # --------------------------------------------------------------------------- plan, consumer, fallback
    def _overlap(self, a, w, bias, out, overrides, scales=(), layout=None) -> None:
        """Enqueue one overlapped call (what ReplayCache captures): schedule, then run. ``layout``: the call's
        layout key where its graphs may be rebound (``_reads_shard_in_place``), else None."""
        ctx = self.ctx
        ws = self._workspace(a)
        sched = self.schedule(a, ws, w, out, overrides, bool(scales))
        self.last_gemm = sched.gemm
        flags = ctx.symmetric(f"{self.name}.flags", (sched.gather.layout.num_chunks,), torch.int32)
        self.state["buffers"] = {"workspace": ws.local}
        producer = Gather(ctx, sched.gather, [(a, ws)], flags, call=sched.call)
        chunks, order, cfg = sched.gather.layout, sched.order, sched.cfg

        in_place = self._reads_shard_in_place(layout, a, ws.local)

        def consumer():  # its last program zeroes the flags (sched.gather.reset_by): every one was seen, peers set
            # them again only after the next barrier
            if sched.b_layout is not None:
                gather_hopper.launch_ag_gemm(ctx, sched.b_layout, a, ws.local, w, out, bias, chunks, order,
                                             flags.local, self._exit_counts(), op=self.op, in_place=in_place)
                return
            launch_gemm(ctx, cfg, a, w, out, order=order, flags=flags.local, layout=chunks, bias=bias,
                        scales=scales or None, workspace=ws.local, exit_counts=self._exit_counts(), op=self.op,
                        tma_store=cfg.tma_store, in_place=in_place)

        # (a launch's first use builds its kernel: the copies go first, so that the peers do not wait for the build)
        first = cfg.consumer_first and self.warm((chunks, sched.gather.mode, in_place))
        pipeline.run(ctx, producer, consumer, consumer_first=first)

    def _reads_shard_in_place(self, layout, a, ws) -> bool:
        """Whether the GEMM reads this rank's shard ``a`` where the caller holds it. Not in a graph that ops.replay
        may rebind to other tensors: where the shard and the workspace ``ws`` are read through one descriptor, its
        stride is the distance between them, so the shard is copied into the workspace instead
        (gemm_operands.gather_a). That launch is another specialisation of the kernel, built by an eager call
        before a layout's graph is captured: a layout's second eager overlapped call takes it (its first builds
        the in-place one), and ``_rebind_ready`` holds the layout's captures until then. The in-place launch is
        specialised on where the shard lies (below or above the workspace, within one descriptor's reach or not),
        so a capture reads in place only where an eager call built that launch, else it copies (where that
        launch is built). ``layout`` None (no rebinding): in place, nothing recorded."""
        if layout is None:
            return True
        if self.replays.rebinding:
            return False
        placed = _placement(layout, a, ws)
        built, copied = self.state.setdefault("in place", set()), self.state.setdefault("copied shard", set())
        if self.replays.capturing or torch.cuda.is_current_stream_capturing():
            return placed in built or layout not in copied
        ran = self.state.setdefault("ran in place", set())
        if layout in copied or layout not in ran:
            ran.add(layout)
            built.add(placed)
            return True
        copied.add(layout)
        return False

    def _placement_built(self, layout, a) -> bool:
        """Whether a capture of this call by its exact key finds its launch built (``_reads_shard_in_place``): the
        in-place one for where ``a`` lies against the workspace, or the layout's copying one. Neither (the layout's
        eager overlapped runs, if any, had the shard elsewhere; its calls since then went to NCCL): the call runs
        eagerly, and builds one."""
        placed = _placement(layout, a, self._workspace(a).local)
        return placed in self.state.get("in place", ()) or layout in self.state.get("copied shard", ())

    def _rebind_ready(self, layout) -> bool:
        """Whether a call of ``layout`` can be captured for rebinding: the launch that copies its shard is built
        (``_reads_shard_in_place``)."""
        return layout in self.state.get("copied shard", ())

    def schedule(self, a, ws, w, out, overrides, fp8: bool) -> "AllGatherGEMMSchedule":
        """Every decision of a call of these operands, made once per shape, configuration and consumer: the config,
        the consumer GEMM and B's descriptor layout (which depend on the operands' alignment, so they are found
        first), the gather's schedule (chunks, streams, tile order) and the call's header."""
        ctx = self.ctx
        m_local, K = a.shape
        cfg = with_overrides(self.config_for((m_local * ctx.world_size, K, w.shape[1]), "_fp8" if fp8 else ""),
                             overrides)
        mode = "push" if ctx.num_hosts > 1 else cfg.mode  # (other hosts' memory cannot be read: they send)
        b_layout = gather_hopper.layout_for(ctx, a, ws.local, w, out, m_local) if wants_gluon(cfg, mode) else None
        key = (m_local, K, a.dtype, cfg, mode, b_layout)
        found = self.state.setdefault("schedules", {}).get(key)
        if found is None:
            if b_layout is not None:  # the Gluon GEMM's own tiles, and so its own tile order
                cfg = with_tiles(cfg, gather_hopper.TILES)
            layout = ChunkLayout(ctx.world_size, m_local, cfg.chunk_rows(m_local, K * a.element_size()))
            gather = gather_schedule(layout, ctx.rank, ctx.topology.hosts, mode=mode, num_streams=cfg.num_streams,
                                     block_m=cfg.block_m, hold_for_link=ctx.holds_for_link)
            call = self.call_header((m_local, K, a.dtype, layout.m_per_chunk, mode), (m_local, K))
            found = self.state["schedules"][key] = AllGatherGEMMSchedule(
                cfg, "gemm_gather_hopper" if b_layout is not None else "gemm", b_layout, gather,
                torch.tensor(gather.tile_order, dtype=torch.int32, device=ctx.device), call)
        return found

    def _workspace(self, a):
        """The symmetric [M, K] workspace the peers' rows land in (every rank's, in rank order)."""
        return self.ctx.symmetric(f"{self.name}.ws", (a.shape[0] * self.ctx.world_size, a.shape[1]), a.dtype)

    def _exit_counts(self) -> torch.Tensor:
        """Two int32s for the GEMM's RESET_AT_EXIT, zero between calls (the GEMM's last program resets them)."""
        return self.ctx.cached(("exit counts", self.name), lambda: torch.zeros(2, dtype=torch.int32,
                                                                               device=self.ctx.device))

    def _fallback(self, a, w, bias, out, scales, return_gathered):
        ctx = self.ctx
        gathered = torch.empty((a.shape[0] * ctx.world_size, a.shape[1]), dtype=a.dtype, device=a.device)
        if scales:  # fp8 moves as bytes (not every NCCL/Gloo build names the fp8 types); torch._scaled_mm or ours
            all_gather_rows(gathered.view(torch.uint8), a.view(torch.uint8), group=ctx.group)
            shape = (a.shape[0] * ctx.world_size, a.shape[1], w.shape[1])
            fp8_matmul(ctx, self.config_for(shape, "_fp8"), gathered, w, *scales, bias, out)
        else:
            all_gather_rows(gathered, a, group=ctx.group)
            if bias is None:
                torch.matmul(gathered, w, out=out)
            else:
                torch.addmm(bias, gathered, w, out=out)
        return (out, gathered) if return_gathered else out


def wants_gluon(cfg: AllGatherGEMMConfig, mode: str | None = None) -> bool:
    """Whether ``cfg`` lets a call take the Gluon GEMM (where the call can run on it). ``mode``: the gather's mode
    for the call (None: ``cfg.mode``); "auto" takes it with push only (docs/decisions.md says why)."""
    mode = cfg.mode if mode is None else mode
    want = cfg.gemm == "gluon" or (cfg.gemm == "auto" and mode == "push")
    return want and cfg.tma is not False and cfg.tma_store is not False


def fp8_matmul(ctx, cfg, a, w, scale_a, scale_b, bias, out) -> None:
    """``out = (a @ w) * scale_a * scale_b (+ bias)`` for fp8 ``a`` and ``w``: ``torch._scaled_mm`` where it takes
    the layout (``w`` column-major as ``weight.t()`` is, K and N multiples of 16, ``out`` contiguous), else our
    persistent GEMM."""
    if (w.stride(0) == 1 and a.stride(1) == 1 and a.shape[1] % 16 == 0 and w.shape[1] % 16 == 0
            and out.is_contiguous()):
        torch._scaled_mm(a, w, scale_a, scale_b, bias=bias, out_dtype=out.dtype, out=out)
    else:
        plain_gemm(ctx, cfg, a, w, out, bias, (scale_a, scale_b), tma_store=cfg.tma_store)()


def ag_gemm(a: torch.Tensor, w: torch.Tensor, *, ctx, bias: torch.Tensor | None = None, return_gathered: bool = False,
            out: torch.Tensor | None = None, scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, **overrides):
    """Functional form of AllGatherGEMM: one op per Context, kept by the Context."""
    return AllGatherGEMM.shared(ctx)(a, w, bias, return_gathered=return_gathered, out=out, scale_a=scale_a,
                                     scale_b=scale_b, out_dtype=out_dtype, **overrides)


__all__ = ["AllGatherGEMM", "ag_gemm", "fp8_matmul", "wants_gluon"]
