"""The Context: one per process group, owning symmetric memory, signals, the
error word, the barrier and the producer stream pool. Ops take a Context;
nothing else holds global state."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..kernels.cached_launch import launch, triton_interprets
from ..kernels.signal import ERR_CODE, ERR_INDEX, ERR_OP, ERR_RANK, ERR_SEEN, ERR_WANTED, ERR_WORDS, barrier_kernel
from .backend import Backend, Stream

# Names of the ops that can report a timed-out wait, by the id kernels record.
OPS: dict[int, str] = {}


def op_id(name: str) -> int:
    """The id kernels record for op ``name`` (registered on first use)."""
    for k, v in OPS.items():
        if v == name:
            return k
    k = len(OPS) + 1
    OPS[k] = name
    return k


OP_BARRIER = op_id("barrier")


def _pick_backend(name: str) -> str:
    if name != "auto":
        return name
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "hip"
    if torch.cuda.is_available():
        return "cuda"
    return "host"


@dataclass
class _Allocation:
    nbytes: int
    local: torch.Tensor
    handle: Any
    peers: list  # uint8 tensor per rank (None at our own rank)
    ptrs: torch.Tensor  # int64 [W] base address of every rank's buffer


@dataclass
class SymmetricTensor:
    """A tensor of the same shape and dtype on every rank, each rank's mapped by all.

    ``local`` is this rank's; ``peer(r)`` views rank r's (``peer(rank) is local``);
    ``ptrs`` is a device int64 array of every rank's base address, for kernels.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    rank: int
    _alloc: _Allocation = field(repr=False)
    _views: list = field(repr=False, default_factory=list)

    def __post_init__(self):
        numel = 1
        for s in self.shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=self.dtype).element_size()
        self._views = []
        for r, raw in enumerate(self._alloc.peers):
            raw = self._alloc.local if r == self.rank else raw
            self._views.append(raw[:nbytes].view(self.dtype).view(self.shape))

    @property
    def local(self) -> torch.Tensor:
        return self._views[self.rank]

    def peer(self, rank: int) -> torch.Tensor:
        return self._views[rank]

    @property
    def ptrs(self) -> torch.Tensor:
        return self._alloc.ptrs


class Context:
    """Owns what the overlapped ops share on one process group.

    Args:
        group: an initialised torch.distributed group (None: WORLD).
        backend: "cuda", "hip", "host", or "auto" (hip on ROCm torch, cuda when a
            CUDA GPU is present, host otherwise).
        timeout_s: how long any wait may spin before it gives up with an error.
        producer_jitter_s: testing aid; every producer step is delayed by a
            random time up to this many seconds.
    """

    def __init__(self, group=None, backend: str = "auto", timeout_s: float = 30.0, producer_jitter_s: float = 0.0):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("triton_overlap.Context needs torch.distributed.init_process_group() first")
        self._group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self._group)
        self.world_size = dist.get_world_size(self._group)
        self.timeout_s = float(timeout_s)
        self.producer_jitter_s = float(producer_jitter_s)
        name = _pick_backend(backend)
        self.backend_name = name
        self._backend = self._make_backend(name)
        self.device = self._backend.device
        self.budget = self._backend.timeout_budget(self.timeout_s)
        self.clock = self._backend.clock
        self._allocs: dict[str, _Allocation] = {}
        self._views: dict[tuple, SymmetricTensor] = {}  # (name, shape, dtype) -> view agreed on, current buffers
        #: bumped whenever a symmetric buffer is allocated or freed: what holds addresses (ops.replay) drops them
        self.generation = 0
        self._streams: list[Stream] = []
        self._cache: dict = {}  # what ops keep per Context (plans, op objects, copy plans); freed by close()
        self._on_close: list = []
        self._closed = False
        self.err = torch.zeros(ERR_WORDS, dtype=torch.int32, device=self.device)
        self._barrier_slots = self.symmetric("__barrier", (self.world_size,), torch.int32)
        self._barrier_count = torch.zeros(1, dtype=torch.int32, device=self.device)
        # the barrier kernel is built and loaded now, before any op's persistent kernel can spin: loading a module
        # while a kernel that waits on peers occupies the GPU may wait for that kernel
        self.barrier()
        self.synchronize()

    # ------------------------------------------------------------------ set-up
    def _make_backend(self, name: str) -> Backend:
        if name == "host":
            if not triton_interprets():
                raise RuntimeError("the host backend runs kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
                                   "before triton is imported (scripts/launch.sh does this on machines without GPUs)")
            from .host import HostBackend

            namespace = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
            dist.broadcast_object_list(namespace, src=dist.get_global_rank(self.group, 0), group=self.group)
            return HostBackend(self.rank, self.world_size, namespace[0], self.timeout_s)
        if name in ("cuda", "hip"):
            built_for = "ROCm" if name == "hip" else "CUDA"
            if not torch.cuda.is_available():
                raise RuntimeError(f"Context(backend={name!r}) needs a GPU and a {built_for} build of torch; this "
                                   f"torch ({torch.__version__}) sees none. Without GPUs use backend='host' or 'auto'.")
            if name == "cuda":
                from .cuda import CudaBackend, runtime_available

                if not runtime_available():
                    raise RuntimeError("Context(backend='cuda') needs cuda-python: pip install 'triton-overlap[cuda]'")
                return CudaBackend(self.rank, self.world_size)
            from .hip import HipBackend, runtime_available

            if not runtime_available():
                raise RuntimeError("Context(backend='hip') needs hip-python: pip install 'triton-overlap[rocm]'")
            return HipBackend(self.rank, self.world_size)
        raise ValueError(f"unknown backend {name!r}: use 'cuda', 'hip', 'host' or 'auto'")

    @property
    def backend(self) -> str:
        return self.backend_name

    def gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order (a collective)."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def ensure_open(self) -> None:
        """Raise RuntimeError if this Context is closed."""
        if self._closed:
            raise RuntimeError("this Context is closed")

    # ------------------------------------------------------------- what ops keep
    def cached(self, key, make):
        """The object kept under ``key`` for this Context, made by ``make()`` on first use. Ops keep here what
        they build once and reuse (plans, address tables, the functional forms' op objects); ``close()`` frees
        it all, whoever still holds the ops."""
        self.ensure_open()
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = make()
        return got

    def on_close(self, fn) -> None:
        """Call ``fn()`` when this Context closes (registries that name its ops let go of them)."""
        self._on_close.append(fn)

    @property
    def group(self):
        """The process group (RuntimeError once closed: close() lets go of it)."""
        if self._group is None:
            raise RuntimeError("this Context is closed")
        return self._group

    # ------------------------------------------------------- symmetric memory
    def symmetric(self, name: str, shape, dtype: torch.dtype) -> SymmetricTensor:
        """A symmetric tensor (collective: every rank calls it with the same arguments).

        Asking again for ``name`` reuses its buffer when it is large enough and
        grows it (collectively) when not. Mismatched arguments raise ValueError
        on every rank.
        """
        self.ensure_open()
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)))
        cached = self._views.get((name, shape, dtype))
        if cached is not None:
            return cached  # agreed on before, buffer unchanged since: no collective (ops ask every call)
        if any(s < 0 for s in shape):
            raise ValueError(f"symmetric({name!r}): negative size in {shape}")
        mine = (name, shape, str(dtype))
        everyone = self.gather_object(mine)
        if any(o != mine for o in everyone):
            raise ValueError(f"symmetric({name!r}): ranks asked for different buffers: "
                             + ", ".join(f"rank {r}: {o[1]} {o[2]}" for r, o in enumerate(everyone)))
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        alloc = self._allocs.get(name)
        if alloc is None or alloc.nbytes < nbytes:
            if alloc is not None:
                self._free(alloc)
                self._views = {k: v for k, v in self._views.items() if k[0] != name}  # views of the old buffer
            alloc = self._allocate(max(nbytes, 16))
            self._allocs[name] = alloc
        view = self._views[(name, shape, dtype)] = SymmetricTensor(name, shape, dtype, self.rank, alloc)
        return view

    def _allocate(self, nbytes: int) -> _Allocation:
        b = self._backend
        local, handle = b.alloc(nbytes)
        handles = self.gather_object(handle)
        peers = [None if r == self.rank else b.open(h, nbytes) for r, h in enumerate(handles)]
        dist.barrier(group=self.group)  # every rank has mapped every buffer
        b.after_exchange(handle)
        views = [local if p is None else p for p in peers]
        ptrs = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=self.device)
        self.generation += 1
        return _Allocation(nbytes, local, handle, peers, ptrs)

    def _free(self, alloc: _Allocation) -> None:
        self._backend.synchronize()
        dist.barrier(group=self.group)  # no peer still reads or writes it
        self.generation += 1
        self._backend.release(alloc.local, alloc.handle, alloc.peers)

    # ---------------------------------------------------------------- streams
    def streams(self, n: int) -> list[Stream]:
        """``n`` high-priority producer streams, created once and reused across calls."""
        self.ensure_open()
        while len(self._streams) < n:
            self._streams.append(self._backend.new_stream())
        return self._streams[:n]

    def current_stream(self) -> Stream:
        return self._backend.current_stream()

    def use_stream(self, stream: Stream):
        return self._backend.use_stream(stream)

    def num_compute_units(self) -> int:
        return self._backend.num_compute_units()

    # ----------------------------------------------------------- synchronising
    def barrier(self, stream: Stream | None = None) -> None:
        """A barrier across ranks that runs on ``stream`` (default: current), with no host synchronisation.

        It is a one-program Triton kernel (see kernels.signal.barrier_kernel for
        why it stays correct under CUDA-graph replay). Launch it before, not
        during, a persistent kernel that occupies every SM.
        """
        self.ensure_open()
        stream = stream or self.current_stream()
        block = 1
        while block < self.world_size:
            block *= 2
        with self.use_stream(stream):
            launch(barrier_kernel, (1,), (self._barrier_slots.ptrs, self._barrier_slots.local, self._barrier_count,
                                          self.err, self.budget, self.rank, self.world_size, OP_BARRIER),
                   dict(BLOCK_W=block, CLOCK=self.clock))
        self.after_launch()

    def check(self) -> None:
        """Raise RuntimeError if a wait of this Context timed out (synchronises with the device)."""
        word = self.err.tolist()
        if word[ERR_CODE] != 0:
            self.err.zero_()
            op = OPS.get(word[ERR_OP], f"op#{word[ERR_OP]}")
            index = word[ERR_INDEX]
            what = (f"signal {index}" if index >= 0 else  # -1: kernels.gemm CLAIM=0's start count
                    "its GEMM's programs to start" if index == -1 else  # -2 - o: kernels.gemm_ws PEER_STORES
                    f"rank {-2 - index}'s call to start (before storing into its receive slot)")
            raise RuntimeError(f"triton_overlap: rank {word[ERR_RANK]}: {op} timed out after {self.timeout_s:g} s "
                               f"waiting on {what} (saw {word[ERR_SEEN]}, waited for {word[ERR_WANTED]})")

    def after_launch(self) -> None:
        """Called by ops after each kernel launch: on the host backend kernels are synchronous,
        so a timed-out wait is raised right away; GPU backends leave it to ``check()``."""
        if self._backend.name == "host":
            self.check()

    def synchronize(self) -> None:
        """Wait for all of this rank's device and producer work."""
        for s in self._streams:
            s.synchronize()
        self._backend.synchronize()

    def jitter(self, stream: Stream) -> None:
        if self.producer_jitter_s > 0:
            stream.jitter(self.producer_jitter_s)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Free IPC mappings, buffers and streams. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
            if dist.is_initialized():
                dist.barrier(group=self.group)  # no peer still uses our memory when we free it
        finally:
            for fn in self._on_close:
                fn()
            self._on_close.clear()
            self._cache.clear()
            for alloc in self._allocs.values():
                self._backend.release(alloc.local, alloc.handle, alloc.peers)
            self._allocs.clear()
            self._views.clear()
            self.generation += 1
            self._streams.clear()
            self._backend.close()
            # ops may keep this Context until the interpreter finalises; the process group must not live that long
            # (a gloo group held past destroy_process_group can abort the process at exit: docs/decisions.md)
            self._group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (f"Context(backend={self.backend_name!r}, rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device})")
