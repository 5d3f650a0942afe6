"""Routing for the tensor-parallel MoE ops: checking ``topk_ids``, sorting (token, k) pairs by expert with the grouped
GEMMs' tile tables (on the device, no host synchronisation: the overlapped calls by kernels.routing's kernels,
the fallback's sorted layout by torch), the plain-torch grouped matmul of the ops' fallbacks, and the experts' weight
gradients (an MoE layer's backward).

A pair ``q = t * topk + j`` is token ``t``'s ``j``-th choice, expert ``topk_ids[t, j]``. Each op sorts the pairs by
a key of its own, given as runs of tokens (``Segments``): AllGather-MoE by (expert, arrival position of the token's
chunk, pair), so that a tile of an expert's rows needs as few chunks as possible and rows already here come first;
MoE-ReduceScatter by (destination rank in send order, expert, pair). Each group of sorted rows is cut into tiles of
``block_m`` rows of one expert, in a table of fixed length (kernels.grouped_gemm reads it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.routing import block_size, cut_blocks, sort_segments
from ..plan import ChunkLayout, cdiv

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, eq=False)
class MoERouting:
    """The expert-sorted layout of one rank's (token, k) pairs, as ``ag_moe_gemm(..., sorted_output=True)`` returns
    it beside its [T * topk, N] output: sorted row ``p`` holds pair ``order[p]`` (``t * topk + j``), pair ``q`` sits
    at row ``position[q]``, and expert ``e``'s rows are ``offsets[e]:offsets[e + 1]`` (``torch._grouped_mm``'s
    ``offs`` are ``offsets[1:]``). Within an expert the rows follow the order in which the token chunks reached this
    rank, so the layout differs from rank to rank; ``moe_gemm_rs`` takes it as is. ``rank_runs``: each rank's rows
    of an expert are consecutive rows in token order (ops.all_gather_moe.rank_runs), which lets ``moe_gemm_rs`` read
    them by TMA; False (the default) makes no such claim."""
    order: torch.Tensor
    position: torch.Tensor
    offsets: torch.Tensor
    num_experts: int
    topk: int
    rank_runs: bool = False


@dataclass(frozen=True, eq=False)
class Segments:
    """Runs of whole tokens (first token, tokens, tag) in the order a routing sort keeps them (kernels.routing), with
    the device tables the kernels read, made once per (topk, grouping) and kept here: a schedule holds one."""
    runs: tuple
    device: torch.device
    _tables: dict = field(default_factory=dict, repr=False)

    @property
    def tokens(self) -> int:
        return sum(n for _, n, _ in self.runs)

    def tables(self, topk: int, segs_per_group: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks int32 [NB, 4], groups int32 [G, 3]) on the device: kernels.routing.cut_blocks."""
        key = (topk, segs_per_group, block)
        found = self._tables.get(key)
        if found is None:
            blocks, groups = cut_blocks(list(self.runs), topk, segs_per_group, block)
            found = self._tables[key] = (
                torch.tensor(blocks, dtype=torch.int32, device=self.device).view(-1, 4),
                torch.tensor(groups, dtype=torch.int32, device=self.device).view(-1, 3))
        return found


def arrival_segments(layout: ChunkLayout, rank: int, arriving: list[int], device) -> Segments:
    """AllGather-MoE's runs: this rank's tokens (tag 0), then each chunk of ``arriving`` (chunk ids in arrival order)
    tagged with its arrival position 1, 2, ...: sorted by expert within one group, an expert's rows follow the
    order in which their tokens are here."""
    runs = [(rank * layout.m_local, layout.m_local, 0)]
    for i, c in enumerate(arriving, start=1):
        rows = layout.rows(c // layout.chunks_per_rank, c % layout.chunks_per_rank)
        runs.append((rows.start, rows.stop - rows.start, i))
    return Segments(tuple(runs), torch.device(device))


def destination_segments(m_local: int, dests: list[int], device) -> Segments:
    """MoE-ReduceScatter's runs: each destination's tokens, in the order the kernel computes them."""
    return Segments(tuple((d * m_local, m_local, 0) for d in dests), torch.device(device))


def sort_by_expert(topk_ids: torch.Tensor, segments: Segments, num_experts: int, block_m: int, slots: int, *,
                   per_segment: bool, remap: torch.Tensor | None = None, **kw) -> dict:
    """kernels.routing.sort_segments on ``topk_ids`` (made contiguous) over ``segments``, which must cover every
    token once: one group of every segment (``per_segment=False``: rows by expert, then segment) or a group per
    segment (by segment, then expert). ``remap``: read as a contiguous int32 vector."""
    T, topk = topk_ids.shape
    if segments.tokens != T:
        raise ValueError(f"routing: the segments hold {segments.tokens} tokens, topk_ids {T}")
    block = block_size()
    blocks, groups = segments.tables(topk, 1 if per_segment else len(segments.runs), block)
    if remap is not None:
        remap = remap.reshape(-1).to(torch.int32).contiguous()
    return sort_segments(topk_ids.contiguous(), blocks, groups, num_experts, block_m, slots, block=block,
                         remap=remap, **kw)


def check_routing(op: str, ctx, topk_ids: torch.Tensor, tokens: int, num_experts: int) -> None:
    """``topk_ids`` [tokens, topk], an integer tensor on the Context's device: shape and dtype checks that need
    nothing from the device (ValueError)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise ValueError(f"{op}: topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.shape[1] < 1:
        raise ValueError(f"{op}: topk_ids must be [T, topk] with T = {tokens} tokens (all ranks') and topk >= 1, "
                         f"got {tuple(topk_ids.shape)}")
    if topk_ids.device != ctx.device:
        raise ValueError(f"{op}: topk_ids is on {topk_ids.device}, the Context is on {ctx.device}")
    if num_experts < 1:
        raise ValueError(f"{op}: w must hold at least one expert, got E = {num_experts}")


def routing_digest(topk_ids: torch.Tensor) -> list[int]:
    """[smallest id, largest id, two wrapping hashes of every id and its place], read back to the host at once: the
    one device-to-host copy of a call that checks its routing (ids in range, the same on every rank). No tokens:
    [0, -1, 0, 0] (no id out of range), with no copy."""
    if topk_ids.numel() == 0:
        return [0, -1, 0, 0]
    ids = topk_ids.reshape(-1).to(torch.int64)
    place = torch.arange(ids.numel(), device=ids.device, dtype=torch.int64)
    mix = (ids + 1) * (place * 0x9E3779B1 + 0x7F4A7C15)
    stats = torch.stack([ids.min(), ids.max(), mix.sum(), (mix ^ (mix >> 29)).sum()])
    return [int(v) for v in stats.tolist()]


def agree_on_routing(op: str, ctx, topk_ids: torch.Tensor, num_experts: int) -> None:
    """Every id in [0, num_experts) and the same ``topk_ids`` on every rank (a collective: every rank's digest), else
    ValueError naming the bad ids or the ranks whose routing differs from rank 0's; before anything is launched, so
    the Context stays usable."""
    lo, hi, *digest = routing_digest(topk_ids)
    everyone = ctx.gather_object((lo, hi, tuple(digest)), f"{op}: agreeing on topk_ids")
    bad = [(r, l, h) for r, (l, h, _) in enumerate(everyone) if l < 0 or h >= num_experts]
    if bad:
        raise ValueError(f"{op}: topk_ids must lie in [0, {num_experts}) (E = {num_experts} experts): "
                         + ", ".join(f"rank {r} has ids from {l} to {h}" for r, l, h in bad))
    differ = [r for r, d in enumerate(everyone) if d[2] != everyone[0][2]]
    if differ:
        raise ValueError(f"{op}: ranks disagree on topk_ids (every rank must pass the same routing): ranks "
                         f"{', '.join(map(str, differ))} differ from rank 0")


def sort_pairs(group: torch.Tensor, groups: int, minor: torch.Tensor | None, minor_size: int):
    """Sort pairs by (group, minor, pair index): returns (order int64, position int32), ``order[p]`` the pair at
    sorted row p and ``position`` its inverse. ``group`` int64 [pairs] in [0, groups), ``minor`` int64 [pairs] in
    [0, minor_size) (None: 0). A stable sort keeps the pairs of one key in pair order; the key is int32 where
    groups x minor_size fits, which halves the radix sort's passes against an int64 key."""
    pairs = group.numel()
    key = group * minor_size if minor is None else group * minor_size + minor
    if groups * minor_size < 2 ** 31:
        key = key.to(torch.int32)
    order = torch.sort(key, stable=True).indices
    position = torch.empty(pairs, dtype=torch.int32, device=group.device)
    position[order] = torch.arange(pairs, dtype=torch.int32, device=group.device)
    return order, position


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how many times each of 0..n-1 occurs in ``ids`` (int64), with no host synchronisation (on CUDA,
    ``torch.bincount`` reads the largest id back to the host to size its output)."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def num_slots(rows: int, experts: int, block_m: int) -> int:
    """The tile slots of ``rows`` sorted rows in ``experts`` groups: the most tiles any routing can make."""
    return cdiv(rows, block_m) + min(experts, rows)


def grouped_matmul(rows: torch.Tensor, experts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``rows[i] @ w[experts[i]]`` for every i, by torch: rows sorted by expert, one matmul per expert that has rows
    (the fallbacks' path; reads the counts back to the host)."""
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=w.shape[0]).tolist()
    out = torch.empty((rows.shape[0], w.shape[2]), dtype=rows.dtype, device=rows.device)
    done = []
    for e, part in enumerate(rows[order].split(counts)):
        if counts[e]:
            done.append(part @ w[e])
    out[order] = torch.cat(done)
    return out


def expert_grads(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[E, K, N]: ``a[o_e:o_{e+1}].T @ b[o_e:o_{e+1}]`` for each expert e (``a`` [P, K] and ``b`` [P, N] rows sorted by
    expert, ``offsets`` int32 [E + 1] their bounds): the experts' weight gradients of a grouped GEMM, in ``a``'s
    dtype, zero for experts without rows. ``torch._grouped_mm`` (one launch, no host synchronisation) where it takes
    the operands: bfloat16 with K and N multiples of 8 (its 16-byte strides), on the CPU or a GPU of compute
    capability 9.0 or newer; else one matmul per expert, the counts read back to the host."""
    E, K, N = offsets.numel() - 1, a.shape[1], b.shape[1]
    a, b = a.contiguous(), b.contiguous()
    grouped = (hasattr(torch, "_grouped_mm") and a.dtype == torch.bfloat16 and K % 8 == 0 and N % 8 == 0
               and (not a.is_cuda or torch.cuda.get_device_capability(a.device) >= (9, 0)))
    if grouped and a.shape[0] > 0:
        return torch._grouped_mm(a.t(), b, offs=offsets[1:].contiguous())
    bounds = offsets.tolist()
    out = torch.zeros((E, K, N), dtype=a.dtype, device=a.device)
    for e in range(E):
        if bounds[e + 1] > bounds[e]:
            out[e] = a[bounds[e]:bounds[e + 1]].t() @ b[bounds[e]:bounds[e + 1]]
    return out


def takes_grouped_mm(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``a`` [R, K] @ ``w`` [E, K, N] (expert_grads' rule: bfloat16, K and N
    multiples of 8 for its 16-byte strides, the CPU or a GPU of compute capability 9.0 or newer, rows present)."""
    K, N = w.shape[1], w.shape[2]
    return (hasattr(torch, "_grouped_mm") and a.dtype == torch.bfloat16 and w.dtype == a.dtype and K % 8 == 0
            and N % 8 == 0 and a.shape[0] > 0 and (not a.is_cuda or torch.cuda.get_device_capability(a.device)
                                                    >= (9, 0)))


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bounds: list | None = None) -> torch.Tensor:
    """[R, N]: ``a[o_e:o_{e+1}] @ w[e]`` for each expert e (``a`` [R, K] rows grouped by expert, ``offsets`` int32
    [E + 1] their bounds, ``w`` [E, K, N], or a transposed view of one). One ``torch._grouped_mm`` where it takes
    the operands, else a matmul per expert that has rows (at ``bounds``, the offsets on the host where the caller
    has them, else read back)."""
    a = a.contiguous()
    if takes_grouped_mm(a, w):
        return torch._grouped_mm(a, w, offs=offsets[1:].contiguous())
    out = a.new_empty((a.shape[0], w.shape[2]))
    bounds = offsets.tolist() if bounds is None else bounds
    for e in range(w.shape[0]):
        if bounds[e + 1] > bounds[e]:
            out[bounds[e]:bounds[e + 1]] = a[bounds[e]:bounds[e + 1]] @ w[e]
    return out


__all__ = ["MoERouting", "Segments", "agree_on_routing", "arrival_segments", "check_routing", "count_ids",
           "destination_segments", "expert_grads", "grouped_matmul", "grouped_mm", "num_slots", "routing_digest",
           "sort_by_expert", "sort_pairs", "takes_grouped_mm"]
