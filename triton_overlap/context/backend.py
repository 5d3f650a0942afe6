"""The runtime interface every backend implements.

A backend knows how to allocate memory that peers can map, how to open a
peer's allocation, and how to build streams on which copies, flag writes and
flag waits run in order. Everything above it (the Context, symmetric tensors,
producers, ops) is shared by all backends.
"""
from __future__ import annotations

import abc
from typing import Any

import torch

from ..kernels.signal import TICKS_PER_SECOND
from .wire import Wire, wire_exchange  # noqa: F401 - what Stream.exchange takes, and how backends without NCCL send


def each(items, fn) -> None:
    """``fn(item)`` for every item, also after one raises; the first exception is raised once all have run. A join
    of streams that stopped at the first one holding an error would leave the others running, still writing."""
    error = None
    for item in items:
        try:
            fn(item)
        except Exception as e:  # noqa: BLE001 - raised below, once every item has run
            error = error or e
    if error is not None:
        raise error


class Stream(abc.ABC):
    """An in-order queue of copy-engine work on one rank.

    Every method enqueues and returns at once; the work runs later, in the
    order it was enqueued. ``flag`` arguments are one-element int32 tensor
    views (local or a peer's) inside symmetric memory.
    """

    @abc.abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (same shape and dtype) with a copy engine."""

    def plan_copy(self, dst: torch.Tensor, src: torch.Tensor, base: torch.Tensor):
        """Prepare the copy of ``src``, a view of ``base``, into ``dst``, so that a later call can enqueue the same
        copy out of another tensor laid out like ``base`` (``copy_planned``) without building views again.
        Producers keep such plans per shape: a call then costs the host little more than the copies themselves."""
        return dst, tuple(src.shape), tuple(src.stride()), src.storage_offset() - base.storage_offset()

    def copy_planned(self, plan, base: torch.Tensor) -> None:
        """Enqueue a copy prepared by ``plan_copy``, reading from ``base``."""
        dst, size, stride, offset = plan
        self.copy(dst, base.as_strided(size, stride, base.storage_offset() + offset))

    @abc.abstractmethod
    def write_value(self, flag: torch.Tensor, value: int) -> None:
        """Write a 32-bit constant into ``flag`` after all earlier work on this stream."""

    def wait_value(self, flag: torch.Tensor, value: int, what: str = "") -> None:
        """Later work on this stream waits until the int32 in ``flag`` reaches ``value`` (``(int32)(*flag -
        value) >= 0``). On GPUs this is a stream memory wait, which cannot time out: wait only for values that
        this rank's own kernels, which wait on nothing, are sure to write. ``what`` names the wait in errors."""
        raise NotImplementedError(f"{type(self).__name__} has no stream wait-value")

    def call(self, fn) -> None:
        """Have ``fn``'s work follow this stream's earlier work, without blocking the host: on GPUs ``fn`` runs at
        once with this stream current (the kernels it launches join the stream); where the stream is a thread of
        the host (the host backend) that thread runs ``fn`` in turn, so ``fn`` must not run Triton's interpreter,
        which runs one kernel at a time per process."""
        raise NotImplementedError(f"{type(self).__name__} has no calls")

    @abc.abstractmethod
    def wait_stream(self, other: "Stream") -> None:
        """Work enqueued on this stream later runs after all work enqueued on ``other`` so far."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until this stream's work is done (raises errors it recorded)."""

    def jitter(self, max_s: float) -> None:
        """Testing aid: delay this stream by a random time up to ``max_s`` seconds."""

    def exchange(self, wire: "Wire", sends, recvs, tag: int, what: str, on_timeout=None) -> None:
        """Point-to-point between ranks of other hosts after all earlier work on this stream: ``sends`` and
        ``recvs`` are lists of (tensor, group rank); later work on this stream runs after every receive has landed
        (a flag written next is seen only after its data). ``tag`` must be the same for the matching send and
        receive; ``what`` names the exchange in errors. How it travels is the backend's: NCCL on the stream itself,
        otherwise through the ranks' key-value store (``wire_exchange``), waiting at most the wire's timeout and
        then calling ``on_timeout(late group ranks, elapsed_s)`` before a TimeoutError."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point exchange")


class Backend(abc.ABC):
    """A backend, and the facts about it that the layers above read (through the Context) instead of its name."""

    name: str = "?"
    #: the clock the kernels' waits read (kernels.signal CLOCK): 0, the milliseconds a thread of the host backend
    #: writes into the error word; 1, CUDA's %globaltimer (ns); 2, AMD's s_memrealtime (100 MHz)
    clock: int = 0
    #: kernels run in Triton's interpreter on the CPU (float accumulations take float32 dots there)
    interpreted: bool = False
    #: a kernel launch returns only once the kernel has ended (the interpreter runs it on the calling thread)
    synchronous_launches: bool = False
    #: producers' copies run on the device's copy engines (on GPUs), not on threads of the host
    copy_engines: bool = True

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """Allocate ``nbytes`` of zeroed shareable memory; return (uint8 tensor, picklable handle)."""

    @abc.abstractmethod
    def open(self, handle: Any, nbytes: int) -> torch.Tensor:
        """Map a peer's allocation from its handle; return a uint8 tensor over it."""

    @abc.abstractmethod
    def release(self, local: torch.Tensor, handle: Any, peers: list[torch.Tensor | None]) -> None:
        """Unmap peers' allocations and free the local one."""

    def after_exchange(self, handle: Any) -> None:
        """Called once every peer has opened ``handle`` (the host backend unlinks its file here)."""

    @abc.abstractmethod
    def new_stream(self) -> Stream:
        """A new high-priority stream for producers."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream kernels are launched on right now (the caller's compute stream)."""

    def use_stream(self, stream: Stream):
        """Context manager making ``stream`` current for kernel launches."""
        raise NotImplementedError

    @property
    def ticks_per_second(self) -> int:
        """How many times ``clock`` ticks in a second (kernels.signal.TICKS_PER_SECOND)."""
        return TICKS_PER_SECOND[self.clock]

    def timeout_budget(self, timeout_s: float) -> int:
        """``timeout_s`` in ticks of ``clock``, the unit the kernels' wait loops count in (at least one)."""
        return max(1, int(timeout_s * self.ticks_per_second))

    def num_compute_units(self) -> int:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block until all work on this rank's device is done."""

    def error_mirror(self, err: torch.Tensor):
        """Start keeping a host copy of the error word ``err`` that the host reads without synchronising (updated
        by ``mirror_errors``), and return it as an array; None where the host reads ``err`` itself."""
        return None

    def mirror_errors(self, stream: Stream, err: torch.Tensor, mirror) -> None:
        """Enqueue on ``stream`` the update of ``mirror`` (error_mirror's) from ``err``."""

    def relay_error(self, peer_err: torch.Tensor, word: list[int]) -> None:
        """Write ``word`` into a peer's error word ``peer_err`` (its code last), unless the peer has a fault of its
        own, without waiting for this rank's kernels (which may be spinning on that peer)."""
        if int(peer_err[0]) != 0:
            return
        for i, v in enumerate(word[1:], 1):
            if v:  # (the slots left at zero are the peer's own: its clock, its current call)
                peer_err[i] = v
        peer_err[0] = word[0]

    def close(self) -> None:
        """Free backend-wide resources (streams)."""
