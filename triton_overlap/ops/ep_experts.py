"""The experts' first grouped GEMM of an expert-parallel dispatch, started on each source's rows as they land.

``ExpertParallel.dispatch(..., expert_weight=w)`` returns, beside the rows, ``d.projected`` = each row @ w[its
local expert] ([R, N], in d.tokens' order). With ``ExpertParallelConfig(experts_gemm="overlap")``, where the op's
overlapped path moves the rows (stored by ep_pack or by copy engine, a flag per source), that product is one
persistent grouped GEMM (kernels.grouped_gemm's ``launch_ag_grouped``: on Hopper the warp-specialized Gluon kernel,
else the Triton one) which reads every row straight from the owner's receive buffer and whose tiles wait only for
the flags of the sources their rows come from; the expansion of the received rows into d.tokens runs after it.
Otherwise (the default, "after") the product is ``torch._grouped_mm`` on d.tokens once every source's rows are in
and expanded: on 2 H200s that was the faster (docs/decisions.md, Expert-parallel MoE), since the rows that a kernel
stores are mostly in before the GEMM could start and the gathering kernel is slower than ``torch._grouped_mm`` on
the expert-sorted rows.

What the GEMM reads, per layout row (the owner's rows by local expert, then source rank, token and choice):

* ``src``: the row's place in the receive buffer, which its sender stores into the owner's symmetric gather index
  (kernels.ep_routing.ep_pack's GATHER) before it raises its flag, so a tile reads it only after its waits;
* ``pos``: its source rank + 1 (every row waits, this rank's own too: its flag is raised on the caller's stream
  before the GEMM), ``chunk_at``: position -> source rank, one chunk per source;
* the tile table (expert, first row, end row), from the counts every rank holds (kernels.ep_experts): tiles of up to
  ``block_m`` rows of one expert, in expert order, so that consecutive programs share an expert's weights (GROUP_M
  tiles a column tile). Ordering tiles by their sources' arrival instead would read each expert's weights once per
  source run, while the rows of a dispatch whose kernel stores them are mostly in before the GEMM starts.

A tile whose wait gives up (a source that never sent) still reads its rows' entries of the gather index and the rows
they name: they hold this call's rows, an earlier call's, or zeros (symmetric buffers are zeroed when allocated, and
ep_pack stores only rows below the receive buffer's capacity, which never shrinks), so every read stays inside the
receive buffer; the Context is faulted, and ``ctx.check()`` and every later call raise until ``reset()``.
"""
from __future__ import annotations

import torch

from ..kernels.ep_experts import launch_gemm_plan
from ..kernels.grouped_gemm import launch_ag_grouped
from ..plan import ChunkLayout
from .ep_routing import Traffic
from .moe_config import MoEGEMMConfig

#: device -> int32 [n] 0, 1, ..., n - 1 (each layout row's output row), sliced per call
_IDENTITY: dict = {}
#: (device, W) -> int32 [W + 1]: chunk_at (``sources``)
_SOURCES: dict = {}


def identity_rows(n: int, device) -> torch.Tensor:
    key = str(device)
    found = _IDENTITY.get(key)
    if found is None or found.numel() < n:
        found = _IDENTITY[key] = torch.arange(max(n, 4096) * 2, dtype=torch.int32, device=device)
    return found[:n]


def experts_plan(traffic: Traffic, rank: int, block_m: int, table: torch.Tensor) -> tuple:
    """(pos int32 [R], chunk_at int32 [W + 1], tiles int32 [tiles, 3], R) for this rank's layout (module doc): sized
    on the host from the counts, written on the device from the counts ``table`` (kernels.ep_experts)."""
    W, EL = traffic.world, traffic.experts_per_rank
    lo = rank * EL
    per = [sum(col) for col in zip(*(traffic.experts[s][lo:lo + EL] for s in range(W)))]
    R, slots = sum(per), sum((n + block_m - 1) // block_m for n in per)
    buf = torch.empty(R + 3 * slots, dtype=torch.int32, device=table.device)
    pos, tiles = buf[:R], buf[R:].view(slots, 3)
    if R:
        launch_gemm_plan(table, pos, tiles, rank, traffic.num_experts, W, block_m)
    return pos, sources(W, table.device), tiles, R


def sources(world: int, device) -> torch.Tensor:
    """chunk_at for the grouped GEMM: position p (source rank + 1) -> chunk p - 1, the source; [0] unused."""
    key = (str(device), world)
    found = _SOURCES.get(key)
    if found is None:
        found = _SOURCES[key] = (torch.arange(world + 1, dtype=torch.int32).clamp_min(1) - 1).to(device)
    return found


def projection(op, traffic: Traffic, x: torch.Tensor, w, table: torch.Tensor):
    """For a dispatch of ExpertParallel ``op`` whose experts' GEMM starts per source (``w`` given: the dispatch
    decided so, on its overlapped path within one host, ``op.cfg.experts_gemm`` "overlap"): (a function of
    (receive buffer, gather index, flags) that launches it on the caller's stream, the [R, N] tensor it writes);
    for ``w`` None, (None, None)."""
    if w is None:
        return None, None
    ctx, R = op.ctx, traffic.expanded(op.ctx.rank)
    out = torch.empty((R, w.shape[2]), dtype=x.dtype, device=x.device)

    def project(rows, gather, flags):
        plan = experts_plan(traffic, ctx.rank, op.gemm_cfg.block_m, table)
        op.last_gemm = launch_experts_gemm(ctx, op.gemm_cfg, rows, gather, w, out, plan, flags, op.wait_ops["rows"])

    return project, out


def check_expert_weight(ctx, x: torch.Tensor, w, num_experts: int) -> None:
    """ValueError, before any launch, unless ``w`` is None or this rank's experts' weight [E/W, H, N] of x's 16-bit
    dtype on the Context's device."""
    if w is None:
        return
    op, EL = "ep_dispatch", num_experts // ctx.world_size
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{op}: expert_weight must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 3 or w.shape[0] != EL or w.shape[1] != x.shape[1] or w.shape[2] < 1:
        raise ValueError(f"{op}: expert_weight must be [E/W, H, N] = [{EL}, {x.shape[1]}, N >= 1] (this rank's "
                         f"experts), got {tuple(w.shape)}")
    if w.dtype != x.dtype or w.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{op}: expert_weight must be float16 or bfloat16 and x's dtype, got {w.dtype} for x of "
                         f"{x.dtype}")
    if w.device != ctx.device:
        raise ValueError(f"{op}: expert_weight is on {w.device}, the Context is on {ctx.device}")


def launch_experts_gemm(ctx, cfg: MoEGEMMConfig, rows: torch.Tensor, gather: torch.Tensor, w: torch.Tensor,
                        out: torch.Tensor, plan: tuple, flags: torch.Tensor, op: int) -> str:
    """``out[p] = rows[gather[p]] @ w[expert of p]`` for the R layout rows, on the caller's stream, each tile after
    the flags of its rows' sources (``flags`` int32 [W], this rank's, one per source). ``rows``: this rank's receive
    buffer [cap, H]; ``gather``: its gather index (int32, at least R); ``plan``: experts_plan's. Returns the
    kernel's name."""
    pos, chunk_at, table, R = plan
    if R == 0 or table.shape[0] == 0:
        return "none"
    routes = (gather[:R], identity_rows(R, rows.device), pos, chunk_at)
    layout = ChunkLayout(ctx.world_size, rows.shape[0], rows.shape[0])  # one chunk per source
    return launch_ag_grouped(ctx, cfg, rows, rows, w, out, routes, table, flags, layout, op)


__all__ = ["check_expert_weight", "experts_plan", "identity_rows", "launch_experts_gemm", "projection", "sources"]
