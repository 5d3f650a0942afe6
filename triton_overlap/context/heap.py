"""Symmetric memory: buffers of the same size on every rank of a group, each rank's mapped by the ranks of its host.

A ``SymmetricHeap`` keeps a Context's allocations by name. A name is agreed on and allocated by every rank together
(a collective), grown the same way, and viewed at any shape and dtype that fits without a collective. Every
allocation or release bumps ``generation``: what holds addresses (captured CUDA graphs, ops.replay) drops them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Allocation:
    """One name's memory on this rank: ``local`` and the mapped ``peers`` (uint8 tensors, None at this rank and at
    ranks on other hosts), ``ptrs`` every rank's base address (int64 [W], 0 where not mapped)."""
    nbytes: int
    local: torch.Tensor
    handle: Any
    peers: list
    ptrs: torch.Tensor


@dataclass
class SymmetricTensor:
    """A tensor of the same shape and dtype on every rank, each rank's mapped by all.

    ``local`` is this rank's; ``peer(r)`` views rank r's (``peer(rank) is local``), for the ranks on this rank's
    host; ``ptrs`` is a device int64 array of every rank's base address, for kernels (0 for ranks on other hosts).
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    rank: int
    _alloc: Allocation = field(repr=False)
    _views: list = field(repr=False, default_factory=list)

    def __post_init__(self):
        nbytes = _nbytes(self.shape, self.dtype)
        self._views = []
        for r, raw in enumerate(self._alloc.peers):
            raw = self._alloc.local if r == self.rank else raw
            self._views.append(None if raw is None else raw[:nbytes].view(self.dtype).view(self.shape))

    @property
    def local(self) -> torch.Tensor:
        return self._views[self.rank]

    def peer(self, rank: int) -> torch.Tensor:
        view = self._views[rank]
        if view is None:
            raise ValueError(f"symmetric buffer {self.name!r}: rank {rank} is on another host, its memory is not "
                             f"mapped here")
        return view

    @property
    def ptrs(self) -> torch.Tensor:
        return self._alloc.ptrs


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


class SymmetricHeap:
    """A Context's symmetric buffers by name. ``backend`` allocates and maps them; ``mapped``: the ranks whose
    memory this rank maps (its host's); ``exchange(obj, what)``: every rank's ``obj``, bounded (the Context's)."""

    def __init__(self, backend, rank: int, mapped: set, device: torch.device, exchange):
        self._backend, self.rank, self._mapped, self._device = backend, rank, mapped, device
        self._exchange = exchange
        self._allocs: dict[str, Allocation] = {}
        self._views: dict[tuple, SymmetricTensor] = {}  # (name, shape, dtype) -> view agreed on, current buffers
        #: bumped whenever a buffer is allocated or freed (and by the Context's reset and close)
        self.generation = 0

    def nbytes(self, name: str) -> int:
        """The size in bytes of every rank's buffer ``name`` (0 before its first allocation)."""
        alloc = self._allocs.get(name)
        return 0 if alloc is None else alloc.nbytes

    def tensor(self, name: str, shape, dtype: torch.dtype) -> SymmetricTensor:
        """A view of buffer ``name``, allocated or grown first where it is too small (Context.symmetric)."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)))
        cached = self._views.get((name, shape, dtype))
        if cached is not None:
            return cached  # ops ask every call
        if any(s < 0 for s in shape):
            raise ValueError(f"symmetric({name!r}): negative size in {shape}")
        nbytes = _nbytes(shape, dtype)
        alloc = self._allocs.get(name)
        if alloc is not None and alloc.nbytes >= nbytes:
            view = self._views[(name, shape, dtype)] = SymmetricTensor(name, shape, dtype, self.rank, alloc)
            return view
        mine = (name, shape, str(dtype))
        everyone = self._exchange(mine, f"symmetric buffer {name!r}")
        if any(o != mine for o in everyone):
            raise ValueError(f"symmetric({name!r}): ranks asked for different buffers: "
                             + ", ".join(f"rank {r}: {o[1]} {o[2]}" for r, o in enumerate(everyone)))
        if alloc is None or alloc.nbytes < nbytes:
            if alloc is not None:
                self._free(alloc, name)
                self._views = {k: v for k, v in self._views.items() if k[0] != name}  # views of the old buffer
            alloc = self._allocate(max(nbytes, 16), name)
            self._allocs[name] = alloc
        view = self._views[(name, shape, dtype)] = SymmetricTensor(name, shape, dtype, self.rank, alloc)
        return view

    def _allocate(self, nbytes: int, name: str) -> Allocation:
        b = self._backend
        local, handle = b.alloc(nbytes)
        try:
            handles = self._exchange(handle, f"allocating {name!r}")
            peers = [b.open(h, nbytes) if r != self.rank and r in self._mapped else None
                     for r, h in enumerate(handles)]  # ranks on other hosts: not mapped (None)
            self._exchange(None, f"allocating {name!r}, mapped")  # every rank has mapped every buffer it can
        except BaseException:
            b.release(local, handle, [])
            raise
        b.after_exchange(handle)
        ptrs = torch.tensor([local.data_ptr() if r == self.rank else 0 if p is None else p.data_ptr()
                             for r, p in enumerate(peers)], dtype=torch.int64, device=self._device)
        self.generation += 1
        return Allocation(nbytes, local, handle, peers, ptrs)

    def _free(self, alloc: Allocation, name: str) -> None:
        self._backend.synchronize()
        self._exchange(None, f"growing {name!r}")  # no peer still reads or writes it
        self.generation += 1
        self._backend.release(alloc.local, alloc.handle, alloc.peers)

    def zero(self, keep: str) -> None:
        """Zero this rank's memory of every buffer but ``keep``."""
        for name, alloc in self._allocs.items():
            if name != keep:
                alloc.local.zero_()

    def release_all(self) -> None:
        """Unmap and free every buffer (the Context's close)."""
        for alloc in self._allocs.values():
            self._backend.release(alloc.local, alloc.handle, alloc.peers)
        self._allocs.clear()
        self._views.clear()
        self.generation += 1
