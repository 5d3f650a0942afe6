"""AllGather + GEMM: ``all_gather(a) @ w`` with the gather hidden behind the GEMM.

Copy engines push this rank's rows into every peer's workspace chunk by
chunk, or (``mode="pull"``) each rank reads its peers' rows from their
workspaces (producers.allgather); one persistent Triton GEMM computes tiles of the
local rows first and then the remote ones in the order they arrive, each tile
waiting only for the chunks it reads (kernels.gemm, GATHER=True).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..context import op_id
from ..kernels.chunks import ChunkLayout
from ..producers.allgather import follow_caller, join, peers_in_send_order, pull_rows, push_rows
from .common import (FP8, GemmConfig, OverlapOp, agree_across_ranks, check_operands, fp8_matmul, launch_gemm,
                     with_overrides)

OP = op_id("ag_gemm")

#: Below this many bytes per rank shard the transfer is too short to hide anything
#: and the handshake is pure cost: ``fallback="auto"`` uses NCCL + torch.matmul instead.
FALLBACK_SHARD_BYTES = 1 << 20


class AllGatherGEMM(OverlapOp):
    """Reusable AllGather-GEMM bound to a Context: holds its workspace, flags and config.

    ``op(a, w, bias=None, return_gathered=False)``: ``a`` is this rank's row
    shard [M/W, K]; ``w`` is [K, N_local], any 2-D strided view; returns
    [M, N_local] with rank 0's rows first (and the gathered [M, K] when asked).

    fp8: ``a`` and ``w`` float8_e4m3fn (compute capability 8.9 or later, or the host backend) with
    ``scale_a`` and ``scale_b``, one-element float32 tensors: the result is
    ``(all_gather(a) @ w) * scale_a * scale_b (+ bias)`` in ``out_dtype`` (bf16 by default, or fp16; bias in
    that dtype), as ``torch._scaled_mm`` with per-tensor scales. ``scale_a`` is one scale for the whole
    gathered A, so every rank must pass the same value (e.g. from an amax all-reduced over the group); it is
    read on the device when the GEMM runs, so a replayed call follows its current value. The gather moves
    one byte per element.

    ``fallback``: "auto" (NCCL all_gather + torch.matmul when the shard is under
    FALLBACK_SHARD_BYTES, when W == 1, or in eager mode when the GEMM is too short
    to pay for the host's cost of an overlapped call: common.eager_host_bound),
    "never", or "always".
    ``max_m``: largest gathered M accepted (None: the workspace grows as needed).
    ``replay``: an eager call that repeats an earlier one's tensors and arguments replays a CUDA graph of it
    (ops.replay: one graph launch instead of the host's 0.2-0.7 ms of enqueueing); False: always enqueued anew.
    """

    KIND = "ag_gemm"
    #: An eager overlapped call costs the host 0.2-0.5 ms at W = 2 (bench.py's host_enqueue_us, 2xH200: barrier,
    #: copies, flags, the GEMM launch), 0.55-0.7 ms at W = 4, and an idle GPU waits for it. Eager, overlap vs
    #: NCCL + cuBLAS on 2xH200: 0.59-0.79x at 6.9e10 FLOPs, 0.74-0.85x at 1.2e11, 1.09-1.14x at 2.7e11;
    #: at W = 4 0.44-0.92x up to 4.8e11. So below 2e11 FLOPs per peer (about 280 µs of cuBLAS on an H200)
    #: fallback="auto" takes NCCL + cuBLAS in eager mode; captured in a CUDA graph it always overlaps.
    EAGER_MIN_FLOP_PER_PEER = 2e11

    def __init__(self, ctx, config: GemmConfig | None = None, *, fallback: str = "auto", max_m: int | None = None,
                 name: str = "ag_gemm", replay: bool = True):
        super().__init__(ctx, config, fallback, max_m, name, replay)
        self._warm: dict = {}  # layouts called once (producers first), after which gemm_first may apply

    # -------------------------------------------------------------- checks
    def _check(self, a, w, bias, scales, out_dtype) -> torch.dtype:
        ctx = self.ctx
        dtype = check_operands("ag_gemm", ctx, a, w, bias, *scales, out_dtype, fp8=True)
        m = a.shape[0] * ctx.world_size
        if self.max_m is not None and m > self.max_m:
            raise ValueError(f"ag_gemm: gathered M = {m} exceeds this op's max_m = {self.max_m}")
        agree_across_ranks("ag_gemm", ctx, (tuple(a.shape), str(a.dtype)), self._agreed)
        return dtype

    def _use_fallback(self, a, w, shape_key) -> bool:
        if self.fallback != "auto":
            return self.fallback == "always"
        ctx = self.ctx
        flop = 2 * a.shape[0] * ctx.world_size * a.shape[1] * w.shape[1]
        if a.dtype == FP8:
            flop /= 2  # fp8 tensor cores do twice bf16's FLOPs per second: the rule is about time
        return (ctx.world_size == 1 or a.numel() * a.element_size() < FALLBACK_SHARD_BYTES
                or self.eager_fallback(shape_key, flop))

    # ----------------------------------------------------------------- run
    def __call__(self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                 return_gathered: bool = False, out: torch.Tensor | None = None, scale_a: torch.Tensor | None = None,
                 scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, **overrides):
        scales = () if scale_a is None and scale_b is None else (scale_a, scale_b)
        # a repeat of a captured call, unchecked
        replayed, out = self._replayed(a, w, bias, out, overrides, scales, out_dtype)
        if replayed:
            return self._returned(a, out, return_gathered)
        return self._call(a, w, bias, return_gathered, out, overrides, (scale_a, scale_b), out_dtype)

    def _out_rows(self, m: int) -> int:
        return m * self.ctx.world_size

    @torch.no_grad()  # not differentiable itself (nn wraps it in autograd Functions); workspaces are reset in place
    def _call(self, a, w, bias, return_gathered, out, overrides, scales, out_dtype):
        ctx = self.ctx
        ctx._check_open()
        dtype = self._check(a, w, bias, scales, out_dtype)
        scales = scales if a.dtype == FP8 else ()
        want = (a.shape[0] * ctx.world_size, w.shape[1])
        if out is not None and (tuple(out.shape) != want or out.dtype != dtype or out.device != a.device):
            raise ValueError(f"ag_gemm: out must be {dtype} {want} on {a.device}, got {out.dtype} {tuple(out.shape)}")
        a = a.contiguous()
        out = torch.empty(want, dtype=dtype, device=a.device) if out is None else out
        shape_key, key = self._keys(a, w, bias, out, overrides, scales)
        if not self.replays.will_replay(key, shape_key) and self._use_fallback(a, w, shape_key):
            self.replays.saw(key, shape_key)
            self.last_path = "fallback"
            gathered = torch.empty((want[0], a.shape[1]), dtype=a.dtype, device=a.device) if return_gathered else None
            return self._fallback(a, w, bias, gathered, out, scales)
        self.last_path = "overlap"
        self.replays.run(key, shape_key, lambda: self._overlap(a, w, bias, out, overrides, scales))
        return self._returned(a, out, return_gathered)

    def _returned(self, a, out, return_gathered):
        """``out``, or ``(out, gathered)``: the gathered input is copied outside the replayed part (a fresh tensor
        per call, which autograd keeps, would make every key new). Stream order keeps the workspace as it is
        until these copies have read it: peers write into it again only after the next call's barrier, which
        follows this stream."""
        if not return_gathered:
            return out
        ctx, m_local = self.ctx, a.shape[0]
        gathered = torch.empty((m_local * ctx.world_size, a.shape[1]), dtype=a.dtype, device=a.device)
        with torch.no_grad():
            gathered.copy_(self._workspace(a).local)
            gathered[ctx.rank * m_local:(ctx.rank + 1) * m_local].copy_(a)
        return out, gathered

    def _overlap(self, a, w, bias, out, overrides, scales=()) -> None:
        """Enqueue one overlapped call (what ReplayCache captures)."""
        ctx = self.ctx
        shape = (a.shape[0] * ctx.world_size, a.shape[1], w.shape[1])
        cfg = with_overrides(self.config_for(shape, fp8=bool(scales)), **overrides)
        W = ctx.world_size
        m_local, K = a.shape
        N = w.shape[1]
        M = m_local * W
        layout = ChunkLayout(W, m_local, cfg.chunk_rows(m_local, K * a.element_size()))
        ws = self._workspace(a)
        flags = ctx.symmetric(f"{self.name}.flags", (layout.num_chunks,), torch.int32)
        order = self._tile_order(layout, cfg)
        streams = ctx.streams(cfg.streams_for(W))

        gemm_first = cfg.gemm_first and ctx.backend != "host" and self._warm.get((layout, cfg.mode), False)
        follow_caller(ctx, streams)  # the streams wait for the caller's stream as it is now, not for the GEMM
        produce = pull_rows if cfg.mode == "pull" else push_rows
        if not gemm_first:
            produce(ctx, streams, layout, a, ws, flags, follow=False)
        launch_gemm(ctx, cfg, a=a, ws=ws.local, b=w, c=out, bias=bias, M=M, N=N, K=K, m_local=m_local,
                    m_per_chunk=layout.m_per_chunk, chunks_per_rank=layout.chunks_per_rank, tile_order=order,
                    flags=flags.local, op=OP, gather=True, stride_wm=ws.local.stride(0), scales=scales or None,
                    tick=self.exit_counts(), reset_at_exit=True)
        # (the GEMM's last program zeroes the flags: every one was seen; peers set them again only after the next
        # barrier)
        if gemm_first:
            produce(ctx, streams, layout, a, ws, flags, follow=False)
        self._warm[(layout, cfg.mode)] = True
        join(ctx, streams)

    def _workspace(self, a):
        """The symmetric [M, K] workspace the peers' rows land in (every rank's, in rank order)."""
        return self.ctx.symmetric(f"{self.name}.ws", (a.shape[0] * self.ctx.world_size, a.shape[1]), a.dtype)

    def _tile_order(self, layout: ChunkLayout, cfg: GemmConfig) -> torch.Tensor:
        key = (layout, cfg.block_m, cfg.streams_for(layout.world))
        order = self._plans.get(key)
        if order is None:
            W, r = layout.world, self.ctx.rank
            # chunks from peer (r - i) % W arrive on the stream that peer uses for us at its step i
            sources = [(r - i) % W for i in range(1, W)]
            when = layout.stream_schedule(r, cfg.streams_for(W), sources)
            order = torch.tensor(layout.tile_order(cfg.block_m, when), dtype=torch.int32, device=self.ctx.device)
            self._plans[key] = order
        return order

    def _fallback(self, a, w, bias, gathered, out, scales=()):
        ctx = self.ctx
        keep = gathered is not None
        if not keep:
            gathered = torch.empty((a.shape[0] * ctx.world_size, a.shape[1]), dtype=a.dtype, device=a.device)
        if scales:  # fp8 moves as bytes (not every NCCL/Gloo build names the fp8 types); torch._scaled_mm or ours
            dist.all_gather_into_tensor(gathered.view(torch.uint8), a.view(torch.uint8), group=ctx.group)
            shape = (a.shape[0] * ctx.world_size, a.shape[1], w.shape[1])
            fp8_matmul(ctx, self.config_for(shape, fp8=True), gathered, w, *scales, bias, out)
            return (out, gathered) if keep else out
        dist.all_gather_into_tensor(gathered, a, group=ctx.group)
        if bias is None:
            torch.matmul(gathered, w, out=out)
        else:
            torch.addmm(bias, gathered, w, out=out)
        return (out, gathered) if keep else out


def ag_gemm(a: torch.Tensor, w: torch.Tensor, *, ctx, bias: torch.Tensor | None = None, return_gathered: bool = False,
            out: torch.Tensor | None = None, scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, **overrides):
    """Functional form: uses one AllGatherGEMM cached on the Context (fp8: see AllGatherGEMM)."""
    op = ctx.__dict__.setdefault("_ops", {}).get("ag_gemm")
    if op is None:
        op = ctx._ops["ag_gemm"] = AllGatherGEMM(ctx)
    return op(a, w, bias, return_gathered=return_gathered, out=out, scale_a=scale_a, scale_b=scale_b,
              out_dtype=out_dtype, **overrides)


__all__ = ["AllGatherGEMM", "ag_gemm", "peers_in_send_order"]
