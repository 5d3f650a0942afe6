"""Context-parallel attention's kernels on K/V already in place, with no communication: the packed documents'
tables the kernels read, the all-up flags for K/V that need no wait, and the forward and backward kernels run as
any rank of a world on gathered K/V (the NCCL baselines, and every rank's share on one GPU)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..kernels.attention import Documents, launch_fwd, segment_table
from ..kernels.attention_bwd import launch_bwd
from ..zigzag import local_cu_seqlens
from .config import AttentionConfig

#: packed documents' tables kept for this many boundary sets (x block sizes), least recently used dropped: training
#: feeds new boundaries every batch. Tables a CUDA graph captured are kept for good (the graph reads them).
SEGMENT_CACHE = 64


class DocumentTables:
    """Packed documents' tables (kernels.attention.segment_table) per boundaries and block size, kept by the
    Context: the SEGMENT_CACHE most recently used, and every one a CUDA graph captured."""

    def __init__(self):
        self.recent: OrderedDict = OrderedDict()
        self.pinned: dict = {}

    def get(self, local_cu, block: int, device) -> Documents:
        key = (tuple(local_cu), block)
        got = self.pinned.get(key) or self.recent.get(key)
        capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
        if got is None:
            if capturing:
                raise RuntimeError("cp_attention: packed documents' tables are built on the first call with these "
                                   "boundaries: run the call once outside CUDA-graph capture first")
            got = segment_table(local_cu, block, device)
        if capturing or key in self.pinned:
            self.pinned[key] = got
            self.recent.pop(key, None)
        else:
            self.recent[key] = got
            self.recent.move_to_end(key)
            while len(self.recent) > SEGMENT_CACHE:
                self.recent.popitem(last=False)
        return got


def documents(ctx, local_cu, block: int) -> Documents | None:
    """The packed documents' tables for shard boundaries ``local_cu`` (None: one sequence per batch row)."""
    if local_cu is None:
        return None
    return ctx.cached("cp documents", DocumentTables).get(local_cu, block, ctx.device)


def all_ready(ctx, n: int) -> torch.Tensor:
    """``n`` flags that are all up, for kernels reading K/V that are already in place."""
    return ctx.cached(("all ready", n), lambda: torch.ones(n, dtype=torch.int32, device=ctx.device))


def forward_on_gathered(ctx, q, k, v, kg, vg, rank, world, causal, scale, cfg: AttentionConfig, out=None, lse=None,
                        cu_seqlens=None):
    """The forward kernel as rank ``rank`` of ``world`` with K/V already gathered (``kg``/``vg``
    [B, world * S, Hkv, D], rank order; this rank's rows are read from ``k``/``v``): no flags, no communication.
    For baselines that gather with NCCL, and for running every rank's share on one GPU. ``cu_seqlens``: packed
    documents' global boundaries, as the op takes them."""
    B, S, Hq, _ = q.shape
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device) if lse is None else lse
    cpr = cfg.chunks_per_rank
    docs = documents(ctx, local_cu_seqlens(cu_seqlens, world), cfg.fwd.block_m)
    launch_fwd(ctx, q, k, v, kg, vg, out, lse, all_ready(ctx, world * cpr), S // cpr, cpr, scale, causal, cfg.fwd,
               rank=rank, world=world, docs=docs)
    return out, lse


def slot_base(parts, owner: int, rank: int) -> int:
    """The address to give the dK/dV kernel as owner ``owner``'s receive buffer so that its stores for slot ``rank``
    (the kernel adds ``rank`` slots) land in ``parts[owner]``, a local buffer."""
    return parts[owner].data_ptr() - rank * parts[0].numel() * parts.element_size()


def backward_on_gathered(ctx, q, k, v, kg, vg, out, lse, dout, rank, world, causal, scale, cfg: AttentionConfig,
                         parts=None, cu_seqlens=None, head_split=None):
    """The backward kernels as rank ``rank`` of ``world`` on gathered K/V (see forward_on_gathered). Returns dq and
    this rank's float32 dK/dV partials for every owner, [world, 2, B, S, Hkv, D] (into ``parts`` when given): the
    sum over ranks of entry o is owner o's (dK, dV), e.g. through a reduce-scatter. The address tables are kept per
    ``parts`` buffer, so a caller that passes the same buffer makes no host-to-device copy per call.
    ``head_split``: as launch_bwd's (None: chosen for the GPU)."""
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    dev = q.device
    cpr = cfg.chunks_per_rank
    keep = parts is not None  # a fresh buffer per call would only fill the cache with one-off addresses
    if parts is None:
        parts = torch.empty((world, 2, B, S, Hkv, D), dtype=torch.float32, device=dev)

    def tables():
        # the kernel stores into owner o's receive slot ``rank``; aim each owner's base so that slot is parts[o]
        recv_ptrs = torch.tensor([slot_base(parts, o, rank) for o in range(world)], dtype=torch.int64, device=dev)
        counters = torch.zeros(world, dtype=torch.int32, device=dev)  # bumped, never waited for
        return recv_ptrs, counters, torch.full((world,), counters.data_ptr(), dtype=torch.int64, device=dev)

    key = ("on gathered", parts.data_ptr(), parts[0].numel(), rank, world)
    recv_ptrs, _, counter_ptrs = ctx.cached(key, tables) if keep else tables()
    local_cu = local_cu_seqlens(cu_seqlens, world)
    dq = torch.empty_like(q)
    launch_bwd(ctx, q, k, v, kg, vg, dout, out, lse, dq, recv_ptrs, counter_ptrs, all_ready(ctx, world * cpr),
               S // cpr, cpr, scale, causal, cfg.dq, cfg.dkdv, rank=rank, world=world,
               docs_dq=documents(ctx, local_cu, cfg.dq.block_m), docs_dkdv=documents(ctx, local_cu, cfg.dkdv.block_n),
               head_split=head_split)
    return dq, parts


__all__ = ["DocumentTables", "all_ready", "backward_on_gathered", "documents", "forward_on_gathered",
           "slot_base"]
