"""The host side of the GEMM kernels' launches: their tiles (GemmTiles), where a scattering GEMM's tiles go
(ScatterTarget), and how each operand is read or written: through a tensor descriptor (TMA) where one can describe
it, else through pointers (``desc_layout``, ``describable``), and AllGather's A as planes of one descriptor
(``gather_a``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .capability import supports_tma


@dataclass(frozen=True)
class GemmTiles:
    """The persistent GEMM's tile shape and pipeline.

    ``tma``: load A and B through tensor descriptors (TMA) rather than pointers, on NVIDIA compute capability 9.0
    and later and on the host backend (never on AMD). None: descriptors where B is passed transposed
    (``linear.weight.t()``), pointers for B stored [K, N]; True: descriptors for both; False: never. Operands a
    descriptor cannot describe (``desc_layout``) use pointers whatever this says.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    num_xcds: int = 1
    tma: bool | None = None


@dataclass(frozen=True)
class ScatterTarget:
    """SCATTER: where the GEMM's tiles go. Row ``r`` of the output belongs to rank ``r // m_local``; a tile goes to
    its owner's slot for this rank (``ptrs[owner]``, int64 [W] base addresses) and then bumps the owner's counter of
    each chunk it covers (``counter_ptrs[owner]``).

    ``local``: every address is on this GPU (GEMM-RS's copy variant: a staging buffer and local counters), so a tile
    publishes with a device-scope release. ``free_sm``: leave one SM free, for a barrier kernel beside this GEMM
    that some of its tiles wait for. ``claim`` and ``defer_release``: kernels.gemm's CLAIM (0: round-robin tiles
    with one start count per program; 1: tiles through an atomic counter, which the host backend always takes) and
    DEFER_RELEASE (None: deferred where the counters are a peer's, not where they are local).
    ``reduce_into`` (REDUCE_OWN): the output [M / W, N]; tiles of this rank's rows wait for every peer's count to
    reach ``expected`` and add the peers' partials from ``c`` (this rank's receive slots [W, m_local, N]);
    ``split_m``: how many m-tiles of the order hold peers' rows."""

    ptrs: torch.Tensor
    counter_ptrs: torch.Tensor
    local: bool = False
    free_sm: bool = False
    claim: int = 0
    defer_release: bool | None = None
    reduce_into: torch.Tensor | None = None
    expected: torch.Tensor | None = None
    split_m: int = 0


def aligned(t: torch.Tensor, *strides: int) -> bool:
    e = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * e % 16 == 0 for s in strides)


def pair_gap(a, ws) -> int | None:
    """Elements from the lower of ``a``'s and ``ws``'s addresses to the higher, when one descriptor can span both."""
    e = a.element_size()
    gap = abs(ws.data_ptr() - a.data_ptr())
    return gap // e if gap % 16 == 0 and gap < (1 << 40) and a.stride(0) == ws.stride(0) else None


def gather_a(a, ws, M: int, rank: int, in_place: bool = True):
    """AllGather's A for one 3-D descriptor [planes, M, K], so a GEMM's one K loop reads this rank's rows and its
    peers' by plane index (the kernels' ``own_plane``, ``ws_plane`` and ``own_shift``): the shard and the workspace
    as two planes, the lower in memory plane 0 and the other ``pair_gap`` elements past it (only the shard plane's
    first M_LOCAL rows are real; no tile reads others there: whole tiles of rows per rank); the shard alone when
    ``ws`` is ``a`` (one rank); else, where one descriptor cannot span the two, the workspace alone, after copying
    the shard into its own rows on the current stream (peers write only their own rows; in pull mode the producer
    puts the same bytes there), and so too with ``in_place`` False (the descriptor then depends on the workspace's
    address alone, not on the gap between the two: ops.replay rebinds such a call to another shard). Returns
    (base tensor, shape, strides, (own_plane, ws_plane, own_shift))."""
    m_local, K = a.shape
    if ws.data_ptr() == a.data_ptr():
        return a, [1, M, K], [M * a.stride(0), a.stride(0), 1], (0, 0, 0)
    gap = pair_gap(a, ws) if in_place else None
    if gap is None:
        ws.narrow(0, rank * m_local, m_local).copy_(a)
        return ws, [1, M, K], [M * ws.stride(0), ws.stride(0), 1], (0, 0, 0)
    lo, planes = (a, (0, 1)) if a.data_ptr() < ws.data_ptr() else (ws, (1, 0))
    return lo, [2, M, K], [gap, a.stride(0), 1], (*planes, rank * m_local)


def desc_layout(backend: str, tiles: GemmTiles, a, ws, b, m_local: int, gather: bool) -> str | None:
    """How B is described for the DESC path: "kn" ([K, N] rows; only with ``tiles.tma`` True), "nk" (B's
    transpose, [N, K] rows: ``linear.weight.t()``), or None: pointers. Descriptors need 16-byte aligned bases and
    row strides, unit stride in the last dimension, and with GATHER whole tiles of each rank's rows."""
    if tiles.tma is False or not supports_tma(backend, a.device, tiles.block_m, tiles.block_n, tiles.block_k):
        return None
    if a.stride(1) != 1 or not aligned(a, a.stride(0)):
        return None
    if gather and (m_local % tiles.block_m != 0 or ws.stride(1) != 1 or not aligned(ws, ws.stride(0))):
        return None
    if b.stride(0) == 1 and b.stride(1) != 1 and aligned(b, b.stride(1)):
        return "nk"
    if tiles.tma and b.stride(1) == 1 and aligned(b, b.stride(0)):
        return "kn"
    return None


def describable(backend: str, tiles: GemmTiles, c) -> bool:
    """Whether C's tiles can be stored through a descriptor (TMA): NVIDIA sm_90+ or the host backend, unit column
    stride, 16-byte aligned base and row stride, tiles of at most 256 in each dimension (and half tiles, the store's
    unit, at least 16 columns wide)."""
    return (tiles.block_n >= 32 and supports_tma(backend, c.device, tiles.block_m, tiles.block_n)
            and c.stride(1) == 1 and aligned(c, c.stride(0)))
