"""Context-parallel sequence layout (zigzag load balancing).

The global sequence is cut into 2W equal chunks; rank r holds chunks r and
2W-1-r, concatenated. Under a causal mask every rank then has the same amount
of work: an early chunk (few keys before it) paired with a late one.
"""
from __future__ import annotations

import torch


def _chunks(length: int, world: int) -> int:
    if length % (2 * world):
        raise ValueError(f"sequence length {length} is not divisible by 2 * world size = {2 * world}")
    return length // (2 * world)


def shard(x: torch.Tensor, ctx, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag shard of the full sequence ``x`` (length S along ``dim``): chunks r and 2W-1-r."""
    return shard_for(x, ctx.rank, ctx.world_size, dim)


def shard_for(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` in a world of ``world`` (no Context needed)."""
    c = _chunks(x.shape[dim], world)
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * world - 1 - rank) * c, c)], dim=dim).contiguous()


def unshard(x: torch.Tensor, ctx, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's zigzag shard ``x`` (a collective: all ranks call it)."""
    parts = [torch.empty_like(x) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=ctx.group)
    return unshard_parts(parts, dim)


def unshard_parts(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from the list of every rank's zigzag shard, in rank order."""
    W = len(parts)
    c = _chunks(parts[0].shape[dim] * W, W)
    pieces = [None] * (2 * W)
    for r, p in enumerate(parts):
        pieces[r] = p.narrow(dim, 0, c)
        pieces[2 * W - 1 - r] = p.narrow(dim, c, c)
    return torch.cat(pieces, dim=dim)


def positions(rank: int, world: int, s_local: int, device=None) -> torch.Tensor:
    """Global positions of a rank's local sequence indices 0 .. s_local-1."""
    c = s_local // 2
    i = torch.arange(s_local, device=device)
    return torch.where(i < c, rank * c + i, (2 * world - 1 - rank) * c + i - c)
