"""GEMM + ReduceScatter: rows ``rank*M/W ... (rank+1)*M/W`` of ``sum over ranks of a @ w``.

One persistent Triton GEMM computes this rank's partial product, tiles of
peers' rows first in send order and its own rows last, and stores every tile
straight into its owner's receive slot (NVLink stores for peers), bumping the
owner's per-chunk counter after each tile (kernels.gemm, SCATTER=True). Each
owner's reduction kernel waits per chunk and sums the W partials in float32
(kernels.reduce).

Protocol per call, on the caller's stream only: barrier (every owner has
finished its previous reduction and reset its counters, so its receive slots
may be written) -> GEMM -> reduction -> counters reset. With the reduction
fused into the GEMM, the GEMM's last program to finish resets the counters
(kernels.gemm RESET_AT_EXIT); after it only the copy variant's local counts
are reset, once the copy streams are joined. Every value is a constant or
lives in device memory, so the op can be captured in a CUDA graph. On H100/H200
with the reduction fused the GEMM is kernels.gemm_ws, and its store variant
has no barrier kernel: each rank's GEMM announces its start to every peer,
and a program waits for an owner's start before its first tile for it
(kernels.gemm_ws PEER_STORES).

``GemmConfig(scatter="copy")``: the copy-engine variant. The GEMM stores
peers' tiles into a local staging buffer and bumps local per-chunk counters;
on a stream pool, each peer chunk's copy waits for its counter to be complete
(a stream wait-value, enqueued after the GEMM is), moves the chunk into the
owner's receive slot and then writes the owner's counter to its final count,
so the owner's reduction is the same. The stream waits depend only on this
rank's GEMM, which waits on nothing. Here only the copies write into peers'
memory, so the barrier runs on the first copy stream and the GEMM does not
wait for it. ``scatter="auto"`` (the default) picks
it on GPUs from ``COPY_SCATTER_BYTES`` of partial output on (``COPY_SCATTER_FUSED_BYTES`` where the reduction is
fused into the GEMM).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist

from ..context import op_id
from ..kernels.chunks import ChunkLayout, cdiv
from ..kernels.launch import launch
from ..kernels.reduce import reduce_partials
from ..producers.allgather import join
from .common import (GemmConfig, OverlapOp, _capability, agree_across_ranks, check_operands, desc_layout, launch_gemm,
                     with_overrides)

OP = op_id("gemm_rs")


@functools.lru_cache(maxsize=1)
def _gluon_available() -> bool:
    """Whether this Triton has Gluon with Hopper's wgmma and warp specialization (kernels.gemm_ws imports)."""
    try:
        from ..kernels import gemm_ws  # noqa: F401
    except Exception:  # an older or newer Triton without the names it uses
        return False
    return True

#: Below this many bytes of partial output per rank the scatter is too short to hide anything:
#: ``fallback="auto"`` uses torch.matmul + NCCL reduce_scatter_tensor instead.
FALLBACK_PARTIAL_BYTES = 1 << 20

#: ``scatter="auto"``: from this many bytes of partial output (M x N) on, the copy-engine scatter; from
#: COPY_SCATTER_FUSED_BYTES on where the reduction runs in the GEMM (``fuse_reduce``). Measured on H200
#: (bench.py gemm_rs, CUDA graphs, two runs each at W = 2 and W = 4, tenth session): copy was 4-27% faster on every
#: issue shape of M x N x 2 bytes >= 64 MiB; on the 16 MiB one (2048 x 4096), with a separate reduction kernel, it
#: was 7-25% slower in three runs and 28% faster in one. Eleventh session (scripts/diag_rs.py, graphs, 2xH200, the
#: GEMM's tiles round-robin, CLAIM=0): on 2048 x 4096 x 4096 copy + fused 124.5 us, store + fused 129.4, copy +
#: separate kernel 169.4, store + separate kernel 133.6 (benchmarks/results/diag_rs-H200x2.log).
COPY_SCATTER_BYTES = 32 << 20
COPY_SCATTER_FUSED_BYTES = 16 << 20

#: The reduction runs in the GEMM's own-row tiles (``fuse_reduce=None``) wherever each rank's rows are whole
#: tiles. Eleventh session, 2xH200, graphs (scripts/diag_rs.py): fused against a separate reduction kernel, copy /
#: store variant: 8192 x 4096 x 4096 394 / 444 against 440 / 489 us, 8192 x 1792 x 8192 395 / 458 against 483 /
#: 548, 8192^3 1519 / 1620 against 1615 / 1714, 2048 x 4096 x 4096 125 / 129 against 169 / 134. (Before the
#: round-robin tiles, CLAIM=0, fused was 5-20% slower on the 16 MiB shape, and was used from 32 MiB on.)


#: The warp-specialized GEMM's tiles and pipeline (kernels.gemm_ws; GemmConfig.ws): kernels.gemm's 128 x 256 tile,
#: its float32 accumulator over two warpgroups (128 registers a thread), 3 stages of 128 x 64 + 64 x 256 bf16
#: (144 KiB) and the tile buffer the epilogue reads (128 x 256 of the output dtype, 64 KiB).
WS_TILES = dict(block_m=128, block_n=256, block_k=64, num_stages=3)
#: The epilogue partition's warps and the registers (setmaxnreg) a thread of it may use; the kernel-wide cap that
#: 12 warps leave (ptxas, Triton 3.6, sm_90a: 168 registers, no spills).
WS_EPILOGUE_WARPS = 4
WS_EPILOGUE_REGS = 152
WS_SUB_M = 32
WS_MAXNREG = 168
#: GemmConfig.ws=None: whether the warp-specialized GEMM is used where it can run (H100/H200, the copy variant with
#: the reduction fused). On: 2xH200, graphs, scripts/diag_rs.py --quick (seventeenth session, last call,
#: benchmarks/results/diag_rs-H200x2.log): whole calls 110.7 / 380.4 / 353.6 us against kernels.gemm's 111.4 /
#: 396.1 / 394.9 on 2048x4096x4096 / 8192x4096x4096 / 8192x1792x8192 (bound 95.7 / 358.5 / 331.3); the GEMM
#: alone 103.1 / 369.0 / 338.8 against 105.8 / 385.0 / 383.6. (The sixteenth session's version, two pipelines of
#: 128 x 128 tiles, was 1.10-1.14x slower than kernels.gemm.)
WS_DEFAULT = True
#: Whether gemm_ws brings a program's last own-row tile's first peer partial into its tile buffer by one TMA load
#: (where the receive slots' rows are 16-byte aligned) rather than by its epilogue warps' loads.
WS_PRELOAD_TMA = True


class GEMMReduceScatter(OverlapOp):
    """Reusable GEMM-ReduceScatter bound to a Context.

    ``op(a, w, bias=None)``: ``a`` is [M, K_local] (this rank's slice of the
    contraction dimension), ``w`` is [K_local, N], any 2-D strided view;
    returns [M/W, N]. Bias is added once. fp16/bf16 in, partials summed in fp32.

    ``fallback``: "auto" (torch.matmul + NCCL reduce_scatter_tensor when each rank's
    share of the output is under FALLBACK_PARTIAL_BYTES, when W == 1, or in eager
    mode when the GEMM is too short to pay for the host's cost of an overlapped
    call: common.eager_host_bound), "never", or "always".
    ``replay``: as for AllGatherGEMM (ops.replay).
    """

    KIND = "gemm_rs"
    #: Copy variant: the GEMM waits for the barrier too (before the tenth session it did; only
    #: scripts/diag_rs.py sets it, to compare).
    gate_gemm = False
    #: An eager overlapped call costs the host 0.27-0.7 ms at W = 2 (bench.py's host_enqueue_us, 2xH200; the
    #: copy scatter's waits and copies are most of it), about 1.1 ms at W = 4, and an idle GPU waits for it.
    #: Eager, overlap vs NCCL + cuBLAS on 2xH200: 0.62-0.83x at 6.9e10 FLOPs, 0.91-1.02x at 2.4e11, 0.84-0.95x
    #: at 2.7e11, 1.00x at 1.1e12. So below 3e11 FLOPs per peer fallback="auto" takes NCCL + cuBLAS in eager
    #: mode; captured in a CUDA graph it always overlaps.
    EAGER_MIN_FLOP_PER_PEER = 3e11

    def __init__(self, ctx, config: GemmConfig | None = None, *, fallback: str = "auto", max_m: int | None = None,
                 name: str = "gemm_rs", replay: bool = True):
        super().__init__(ctx, config, fallback, max_m, name, replay)
        self.last_gemm = None  # the last overlapped call's GEMM: "gemm_ws" (warp-specialized) or "gemm"

    def _check(self, a, w, bias, out):
        ctx = self.ctx
        check_operands("gemm_rs", ctx, a, w, bias)
        M, W = a.shape[0], ctx.world_size
        if M % W:
            raise ValueError(f"gemm_rs: M = {M} rows is not divisible by the world size {W}")
        if self.max_m is not None and M > self.max_m:
            raise ValueError(f"gemm_rs: M = {M} exceeds this op's max_m = {self.max_m}")
        want = (M // W, w.shape[1])
        if out is not None and (tuple(out.shape) != want or out.dtype != a.dtype or out.device != a.device):
            raise ValueError(f"gemm_rs: out must be {a.dtype} {want} on {a.device}, got {out.dtype} {tuple(out.shape)}")
        agree_across_ranks("gemm_rs", ctx, (tuple(a.shape), w.shape[1], str(a.dtype)), self._agreed)

    def _use_fallback(self, a, w, shape_key) -> bool:
        if self.fallback != "auto":
            return self.fallback == "always"
        ctx = self.ctx
        partial = a.shape[0] // ctx.world_size * w.shape[1] * a.element_size()
        return (ctx.world_size == 1 or partial < FALLBACK_PARTIAL_BYTES
                or self.eager_fallback(shape_key, 2 * a.shape[0] * a.shape[1] * w.shape[1]))

    def __call__(self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None, **overrides):
        replayed, out = self._replayed(a, w, bias, out, overrides)  # a repeat of a captured call, unchecked
        return out if replayed else self._call(a, w, bias, out, overrides)

    def _out_rows(self, m: int) -> int | None:
        W = self.ctx.world_size
        return m // W if m % W == 0 else None

    @torch.no_grad()  # not differentiable itself (nn wraps it in autograd Functions); workspaces are reset in place
    def _call(self, a, w, bias, out, overrides):
        ctx = self.ctx
        ctx._check_open()
        self._check(a, w, bias, out)
        a = a.contiguous()
        if out is None:
            out = torch.empty((a.shape[0] // ctx.world_size, w.shape[1]), dtype=a.dtype, device=a.device)
        shape_key, key = self._keys(a, w, bias, out, overrides)
        if not self.replays.will_replay(key, shape_key) and self._use_fallback(a, w, shape_key):
            self.replays.saw(key, shape_key)
            self.last_path = "fallback"
            return self._fallback(a, w, bias, out)
        self.last_path = "overlap"
        if out.stride(1) != 1:  # the kernels store unit-stride rows: go through a contiguous tensor
            res = self._overlap_into(torch.empty(out.shape, dtype=out.dtype, device=out.device), a, w, bias, overrides)
            return out.copy_(res)
        return self._overlap_into(out, a, w, bias, overrides, key, shape_key)

    def _overlap_into(self, out, a, w, bias, overrides, key=None, shape_key=None):
        self.replays.run(key, shape_key, lambda: self._overlap(a, w, bias, out, overrides))
        return out

    def _overlap(self, a, w, bias, out, overrides) -> None:
        """Enqueue one overlapped call (what ReplayCache captures)."""
        ctx = self.ctx
        cfg = with_overrides(self.config_for((a.shape[0], a.shape[1], w.shape[1])), **overrides)
        W, r = ctx.world_size, ctx.rank
        M, K = a.shape
        N = w.shape[1]
        m_local = M // W
        copy = self.scatter_mode(M, N, a.element_size(), cfg) == "copy"
        fuse = self.fuses(M, cfg)
        b_layout = self.ws_layout(a, w, cfg) if fuse else None
        self.last_gemm = "gemm_ws" if b_layout is not None else "gemm"
        if b_layout is not None:  # the warp-specialized GEMM, with its own tiles (and so its own plan)
            cfg = replace(cfg, **WS_TILES)
        layout, order, expected = self._plan(m_local, N, cfg, a.element_size())
        recv = ctx.symmetric(f"{self.name}.recv", (W, m_local, N), a.dtype)
        counters = ctx.symmetric(f"{self.name}.counters", (layout.num_chunks,), torch.int32)
        starts = None  # gemm_ws's store variant: its start counts (PEER_STORES)

        if copy:
            # Only the copies write into peers' memory: they alone wait for the barrier (owners have reduced the
            # previous call and reset their counters), on the first copy stream, and the GEMM starts at once.
            # The GEMM then leaves an SM free (launch_gemm's free_sm): its own-row tiles wait for peers' copies,
            # which wait for this barrier, whose kernel must find an SM on every rank.
            streams = ctx.streams(self.copy_streams(cfg, layout))
            cur = ctx.current_stream()
            streams[0].wait_stream(cur)  # the caller's stream as it is now (inputs ready), not the GEMM to come
            if self.gate_gemm:
                ctx.barrier()
                streams[0].wait_stream(cur)
            else:
                ctx.barrier(streams[0])
            for s in streams[1:]:
                s.wait_stream(streams[0])
            staging, done, scatter_ptrs, counter_ptrs = self._staging(recv, counters, layout, a.dtype)
        else:  # the GEMM stores into peers' receive slots once their owners have reduced and reset: kernels.gemm
            # after a barrier, kernels.gemm_ws after each owner's start count (PEER_STORES) says its call has started
            if b_layout is None:
                ctx.barrier()
            else:
                starts = ctx.symmetric(f"{self.name}.starts", (W,), torch.int32)
            scatter_ptrs, counter_ptrs = recv.ptrs, counters.ptrs
        tick = self.exit_counts() if fuse else None
        # On the host backend a launch returns when the kernel has finished, and a fused GEMM waits for the peers'
        # copies: there the copies (whose streams wait for our counters in worker threads) are enqueued first.
        copies_first = copy and fuse and ctx.backend == "host"
        if copies_first:
            self._copy_chunks(streams, layout, staging, done, recv, counters, self._counts(layout, N, cfg))
        if b_layout is not None:
            self._launch_ws(cfg, b_layout, a, w, recv.local.view(W * m_local, N), out, bias, layout, order, expected,
                            counters.local, scatter_ptrs, counter_ptrs, tick, starts=starts)
        else:
            launch_gemm(ctx, cfg, a=a, ws=None, b=w, c=recv.local.view(W * m_local, N), bias=bias if fuse else None,
                        M=M, N=N, K=K, m_local=m_local, m_per_chunk=layout.m_per_chunk,
                        chunks_per_rank=layout.chunks_per_rank, tile_order=order, flags=counters.local, op=OP,
                        gather=False, scatter_ptrs=scatter_ptrs, counter_ptrs=counter_ptrs,
                        reduce_into=out if fuse else None, expected=expected, tick=tick,
                        split_m=(W - 1) * m_local // cfg.block_m, free_sm=copy and fuse and not self.gate_gemm,
                        local_counters=copy, reset_at_exit=fuse)
        if copy and not copies_first:
            self._copy_chunks(streams, layout, staging, done, recv, counters, self._counts(layout, N, cfg))
        if not fuse:
            block_m, block_n = (32, 32) if ctx.backend == "host" else (64, 128)
            programs = max(1, min(ctx.num_compute_units(), cdiv(m_local, block_m) * cdiv(N, block_n)))
            launch(reduce_partials, (programs,), (
                recv.local, out, bias if bias is not None else out, counters.local, expected, ctx.err, ctx.budget, r, W,
                OP, m_local, N, layout.m_per_chunk, layout.chunks_per_rank, out.stride(0),
            ), dict(HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, NUM_PROGRAMS=programs,
                    CLOCK=ctx.clock), num_warps=4)
            ctx.after_launch()
            counters.local.zero_()  # every count was seen; peers add again only after the next barrier
        # (fused: the GEMM's last program has zeroed the counters and the tick, RESET_AT_EXIT)
        if copy:
            join(ctx, streams)  # (the copies have zeroed the local counts they waited for)

    def ws_layout(self, a, w, cfg: GemmConfig) -> str | None:
        """Whether this call (reduction fused; copy or store variant) takes the warp-specialized GEMM
        (GemmConfig.ws): None if not, else how B is described ("kn" or "nk", as desc_layout says)."""
        ctx = self.ctx
        want = WS_DEFAULT if cfg.ws is None else cfg.ws
        if (not want or ctx.backend != "cuda" or cfg.claim == 1 or cfg.defer_release or self.gate_gemm
                or (a.shape[0] // ctx.world_size) % WS_TILES["block_m"] or _capability(a.device.index) != (9, 0)
                or not _gluon_available()):
            return None
        return desc_layout(ctx, replace(cfg, tma=True, **WS_TILES), a, None, w, a.shape[0] // ctx.world_size, False)

    def ws_programs(self, cfg: GemmConfig, m: int, n: int, peer_stores: bool = False) -> int:
        """kernels.gemm_ws's grid for ``m`` x ``n`` in ``cfg``'s tiles: a program per SM, at most one per tile.
        The copy variant leaves an SM for the barrier on its copy stream; the store variant (``peer_stores``,
        PEER_STORES) launches no barrier kernel."""
        spare = 0 if peer_stores else 1
        return max(1, min(self.ctx.num_compute_units() - spare, cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)))

    def _launch_ws(self, cfg, b_layout, a, w, c, out, bias, layout, order, expected, counters, scatter_ptrs,
                   counter_ptrs, tick, reset=True, trace=None, starts=None):
        """The fused GEMM as kernels.gemm_ws (arguments as launch_gemm's; ``reset``: RESET_AT_EXIT, off only for
        scripts/diag_rs.py's GEMM alone, whose flags stay set; ``trace``: int64 [programs, gemm_ws.TRACE_SLOTS] for
        the kernel's timestamps, scripts/diag_rs_trace.py). ``starts``: the store variant's symmetric start counts
        (int32 [W], PEER_STORES: peers' tiles go straight into their receive slots once their calls have started);
        None: the copy variant (into the staging buffer, local counters)."""
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from ..kernels.gemm_ws import rs_gemm_ws

        ctx = self.ctx
        W = ctx.world_size
        (M, K), N = a.shape, w.shape[1]
        m_local = M // W
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        gdt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16

        def desc(t, shape, stride, block):
            return TensorDescriptor(t, shape, [stride, 1], block, gl.NVMMASharedLayout.get_default_for(block, gdt))

        a_desc = desc(a, [M, K], a.stride(0), [bm, bk])
        if b_layout == "kn":
            b_desc = desc(w, [K, N], w.stride(0), [bk, bn])
        else:  # B's transpose [N, K] (linear.weight.t())
            b_desc = desc(w.t(), [N, K], w.stride(1), [bn, bk])
        if starts is not None and not reset:
            raise ValueError("gemm_rs: the store variant's start counts are taken off at exit (RESET_AT_EXIT)")
        programs = self.ws_programs(cfg, M, N, peer_stores=starts is not None)
        align = N % 16 == 0 and out.data_ptr() % 16 == 0 and out.stride(0) * out.element_size() % 16 == 0
        preload_tma = WS_PRELOAD_TMA and c.data_ptr() % 16 == 0 and c.stride(0) * c.element_size() % 16 == 0
        c_desc = desc(c, [W * m_local, N], c.stride(0), [bm, bn]) if preload_tma else b_desc
        launch(rs_gemm_ws, (programs,), (
            a_desc, b_desc, c_desc, c, out, bias if bias is not None else out, scatter_ptrs, counter_ptrs, counters,
            expected, tick, ctx.err, order, tick if trace is None else trace,
            tick if starts is None else starts.ptrs, ctx.budget, ctx.rank, OP, W,
            (W - 1) * m_local // bm, M, N, K, m_local, layout.m_per_chunk, layout.chunks_per_rank, c.stride(0),
            out.stride(0),
        ), dict(BLOCK_N=bn, GROUP_M=cfg.group_m, NUM_PROGRAMS=programs, NUM_STAGES=cfg.num_stages,
                B_KMAJOR=b_layout == "nk", HAS_BIAS=bias is not None, CLOCK=ctx.clock, ALIGN_C=align,
                EPILOGUE_WARPS=WS_EPILOGUE_WARPS, EPILOGUE_REGS=WS_EPILOGUE_REGS, SUB_M=WS_SUB_M,
                PRELOAD_TMA=preload_tma, RESET_AT_EXIT=reset, TRACE=trace is not None, PEER_STORES=starts is not None),
               num_warps=8, maxnreg=WS_MAXNREG)
        ctx.after_launch()

    def fuses(self, m: int, cfg: GemmConfig) -> bool:
        """Whether the reduction runs in the GEMM for ``m`` rows in all: ``cfg.fuse_reduce`` (None: yes), where every
        rank's rows are whole ``block_m`` tiles (own-row tiles hold our rows only)."""
        return cfg.fuse_reduce is not False and (m // self.ctx.world_size) % cfg.block_m == 0

    def scatter_mode(self, m: int, n: int, elsize: int, cfg: GemmConfig) -> str:
        """"store" or "copy": ``cfg``'s choice, or for "auto" the rule above (the host backend stores)."""
        mode = cfg.scatter
        if mode == "auto":
            size = m * n * elsize
            big = size >= COPY_SCATTER_BYTES or (size >= COPY_SCATTER_FUSED_BYTES and self.fuses(m, cfg))
            mode = "copy" if big and self.ctx.backend != "host" else "store"
        return mode

    def _staging(self, recv, counters, layout, dtype):
        """Copy variant: the local staging buffer [W, m_local, N] and counters [W * chunks_per_rank], and the
        GEMM's store and counter address tables: peers' tiles land in staging[owner] (the kernel adds row
        ``rank * m_local``, so each base is moved back by that much) and bump done[owner * chunks + j];
        our own rows go to our receive slot and counters, as in the store variant."""
        ctx = self.ctx
        W, r = ctx.world_size, ctx.rank
        m_local, N = recv.local.shape[1], recv.local.shape[2]
        key = ("staging", m_local, N, dtype, layout.chunks_per_rank, recv.local.data_ptr(), counters.local.data_ptr())
        got = self._plans.get(key)
        if got is None:
            staging = torch.empty((W, m_local, N), dtype=dtype, device=ctx.device)
            done = torch.zeros(W * layout.chunks_per_rank, dtype=torch.int32, device=ctx.device)
            shift = r * m_local * N * staging.element_size()
            cpr4 = layout.chunks_per_rank * done.element_size()
            ptrs = [recv.local.data_ptr() if o == r else staging[o].data_ptr() - shift for o in range(W)]
            cptrs = [counters.local.data_ptr() if o == r else done.data_ptr() + (o - r) * cpr4 for o in range(W)]
            got = self._plans[key] = (staging, done, torch.tensor(ptrs, dtype=torch.int64, device=ctx.device),
                                      torch.tensor(cptrs, dtype=torch.int64, device=ctx.device))
        return got

    def _counts(self, layout, n, cfg):
        """[owner][j]: how many tile stores the GEMM makes into chunk j of each owner's rows (the m-tiles over
        the chunk, times the n-tiles)."""
        key = ("counts", layout, n, cfg.block_m, cfg.block_n)
        counts = self._plans.get(key)
        if counts is None:
            counts = [[0] * layout.chunks_per_rank for _ in range(layout.world)]
            for t in range(cdiv(layout.world * layout.m_local, cfg.block_m)):
                for c in layout.tile_chunks(t, cfg.block_m):
                    counts[c // layout.chunks_per_rank][c % layout.chunks_per_rank] += cdiv(n, cfg.block_n)
            self._plans[key] = counts
        return counts

    @staticmethod
    def copy_streams(cfg: GemmConfig, layout) -> int:
        """Copy variant: how many copy streams, ``cfg.num_streams`` (None: one per peer), at most one per chunk
        sent. Peer i's chunk j goes on stream ((i - 1) + (W - 1) * j) % n: with more streams than peers, a peer's
        chunks take turns among them and copy side by side, on more copy engines."""
        sends = (layout.world - 1) * layout.chunks_per_rank
        return max(1, min(cfg.num_streams or (layout.world - 1), sends))

    @staticmethod
    def copy_stream(streams, world: int, i: int, j: int):
        """The stream that copies chunk ``j`` to the ``i``-th peer in send order (copy_streams)."""
        return streams[((i - 1) + (world - 1) * j) % len(streams)]

    def _copy_chunks(self, streams, layout, staging, done, recv, counters, counts, mark=None):
        """Per peer (send order r+1, r+2, ...; streams as copy_streams says), per chunk: wait for the GEMM's
        count, copy the chunk into the owner's slot for this rank, write the owner's counter, then zero the count
        for the next call (the GEMM made its last bump of the chunk before the wait passed; zeroed on the copy
        stream, after the copy, so no memset waits for the GEMM at the end of the call). ``mark(stream)``, if
        given, is called after each chunk's wait, copy and counter write (scripts/diag_rs_trace.py's events)."""
        ctx = self.ctx
        W, r, cpr = ctx.world_size, ctx.rank, layout.chunks_per_rank
        for i in range(1, W):
            d = (r + i) % W
            for j in range(cpr):
                s = self.copy_stream(streams, W, i, j)
                rows = layout.local_rows(j)
                count = done[d * cpr + j:d * cpr + j + 1]
                s.wait_value(count, counts[d][j], f"rank {r} gemm_rs chunk {j} for rank {d}")
                if mark is not None:
                    mark(s)
                ctx.jitter(s)
                s.copy(recv.peer(d)[r, rows], staging[d, rows])
                if mark is not None:
                    mark(s)
                s.write_value(counters.peer(d)[r * cpr + j:r * cpr + j + 1], counts[d][j])
                if mark is not None:
                    mark(s)
                s.write_value(count, 0)

    def _plan(self, m_local: int, n: int, cfg: GemmConfig, elsize: int):
        """Chunk layout, GEMM tile order and the count each chunk's counter reaches, per shape. Each chunk of
        partial output carries at least ``cfg.min_chunk_bytes`` where it can (GemmConfig.chunk_rows)."""
        rows = cfg.chunk_rows(m_local, n * elsize)
        key = (m_local, n, cfg.block_m, cfg.block_n, rows)
        plan = self._plans.get(key)
        if plan is None:
            ctx = self.ctx
            W, r = ctx.world_size, ctx.rank
            layout = ChunkLayout(W, m_local, rows)
            # peers' rows in send order (r+1, r+2, ...), chunk by chunk; our own rows last
            when = {layout.chunk_id((r + i) % W, j): (i, j) for i in range(1, W) for j in range(layout.chunks_per_rank)}
            order = torch.tensor(layout.tile_order(cfg.block_m, when, last=True), dtype=torch.int32, device=ctx.device)
            # stores each of our chunks gets from one source (every source tiles the rows the same way)
            expected = torch.tensor(self._counts(layout, n, cfg)[r], dtype=torch.int32, device=ctx.device)
            plan = self._plans[key] = (layout, order, expected)
        return plan

    def _fallback(self, a, w, bias, out):
        ctx = self.ctx
        full = a @ w
        direct = out.is_contiguous()  # NCCL writes straight into the caller's tensor
        res = out if direct else torch.empty(out.shape, dtype=a.dtype, device=a.device)
        dist.reduce_scatter_tensor(res, full, group=ctx.group)
        if bias is not None:
            res += bias
        return out if direct else out.copy_(res)


def gemm_rs(a: torch.Tensor, w: torch.Tensor, *, ctx, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None, **overrides):
    """Functional form: uses one GEMMReduceScatter cached on the Context."""
    op = ctx.__dict__.setdefault("_ops", {}).get("gemm_rs")
    if op is None:
        op = ctx._ops["gemm_rs"] = GEMMReduceScatter(ctx)
    return op(a, w, bias, out=out, **overrides)


__all__ = ["GEMMReduceScatter", "gemm_rs"]
