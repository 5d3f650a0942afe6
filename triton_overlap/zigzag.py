"""Context-parallel sequence layout (zigzag load balancing).

The global sequence is cut into 2W equal chunks; rank r holds chunks r and
2W-1-r, concatenated. Under a causal mask every rank then has the same amount
of work: an early chunk (few keys before it) paired with a late one.

Packed documents (``cu_seqlens``: the documents' boundaries in the full
sequence, as flash-attn's varlen functions take them, starting at 0 and
ending at the sequence length): every document is cut the same way on its
own, and a rank's shard holds, document after document, its two chunks of
each. Every document's length must then be a multiple of 2W; every rank's
shard has the same document boundaries (``local_cu_seqlens``).
"""
from __future__ import annotations

import torch


def _chunks(length: int, world: int) -> int:
    if length % (2 * world):
        raise ValueError(f"sequence length {length} is not divisible by 2 * world size = {2 * world}")
    return length // (2 * world)


def int_vector(t) -> bool:
    """Whether ``t`` is a tensor ``cu_seqlens`` may be: 1-D, of an integer dtype."""
    return isinstance(t, torch.Tensor) and t.dim() == 1 and not t.dtype.is_floating_point and t.dtype != torch.bool


def as_ints(cu_seqlens) -> tuple[int, ...]:
    """``cu_seqlens`` (a sequence of ints or a 1-D integer tensor, read on the host) as a tuple of ints."""
    if isinstance(cu_seqlens, torch.Tensor):
        if not int_vector(cu_seqlens):
            raise ValueError("cu_seqlens must be a 1-D integer tensor or a sequence of ints")
        cu_seqlens = cu_seqlens.tolist()
    try:
        return tuple(int(c) for c in cu_seqlens)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor or a sequence of ints: {e}") from None


def doc_bounds(cu_seqlens, world: int, length: int | None = None) -> tuple[int, ...]:
    """``cu_seqlens`` (as ``as_ints`` takes it) as a tuple, checked: it starts at 0, never decreases, ends at
    ``length`` when given, and every document is a multiple of 2 * ``world`` long."""
    cu = as_ints(cu_seqlens)
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least one document, got {list(cu)[:8]}")
    for d in range(len(cu) - 1):
        n = cu[d + 1] - cu[d]
        if n < 0:
            raise ValueError(f"cu_seqlens decreases at document {d} ({cu[d]} -> {cu[d + 1]})")
        if n % (2 * world):
            raise ValueError(f"document {d} has {n} tokens, not a multiple of 2 * world size = {2 * world} "
                             "(each document is split into 2W chunks)")
    if length is not None and cu[-1] != length:
        raise ValueError(f"cu_seqlens ends at {cu[-1]}, the sequence has {length} tokens")
    return cu


def local_cu_seqlens(cu_seqlens, world: int, length: int | None = None) -> tuple[int, ...] | None:
    """The document boundaries within every rank's shard (the global ones, checked as ``doc_bounds`` does,
    divided by W); None for None."""
    if cu_seqlens is None:
        return None
    return tuple(c // world for c in doc_bounds(cu_seqlens, world, length))


def _pieces(length: int, rank: int, world: int, cu_seqlens):
    """(start, length) of the pieces of the full sequence that make up ``rank``'s shard, in shard order."""
    if cu_seqlens is None:
        c = _chunks(length, world)
        return [(rank * c, c), ((2 * world - 1 - rank) * c, c)]
    cu = doc_bounds(cu_seqlens, world, length)
    out = []
    for d in range(len(cu) - 1):
        c = (cu[d + 1] - cu[d]) // (2 * world)
        if c:
            out += [(cu[d] + rank * c, c), (cu[d] + (2 * world - 1 - rank) * c, c)]
    return out


def shard(x: torch.Tensor, ctx, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """This rank's zigzag shard of the full sequence ``x`` (length S along ``dim``): chunks r and 2W-1-r (of
    every document, with ``cu_seqlens``)."""
    return shard_for(x, ctx.rank, ctx.world_size, dim, cu_seqlens)


def shard_for(x: torch.Tensor, rank: int, world: int, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` in a world of ``world`` (no Context needed)."""
    pieces = _pieces(x.shape[dim], rank, world, cu_seqlens)
    return torch.cat([x.narrow(dim, s, n) for s, n in pieces], dim=dim).contiguous()


def unshard(x: torch.Tensor, ctx, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """The full sequence from every rank's zigzag shard ``x`` (a collective: all ranks call it)."""
    parts = [torch.empty_like(x) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=ctx.group)
    return unshard_parts(parts, dim, cu_seqlens)


def unshard_parts(parts: list[torch.Tensor], dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """The full sequence from the list of every rank's zigzag shard, in rank order."""
    W = len(parts)
    length = parts[0].shape[dim] * W
    placed = []
    for r, p in enumerate(parts):
        at = 0
        for s, n in _pieces(length, r, W, cu_seqlens):
            placed.append((s, p.narrow(dim, at, n)))
            at += n
    placed.sort(key=lambda t: t[0])
    return torch.cat([t for _, t in placed], dim=dim)


def positions(rank: int, world: int, s_local: int, device=None, cu_seqlens=None) -> torch.Tensor:
    """Global positions of a rank's local sequence indices 0 .. s_local-1 (with ``cu_seqlens``: positions in
    the full packed sequence)."""
    pieces = _pieces(s_local * world, rank, world, cu_seqlens)
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in pieces]) if pieces else \
        torch.zeros(0, dtype=torch.int64, device=device)
