"""CUDA backend, on cuda-python (``cuda.bindings``).

* Memory: cudaMalloc, shared with cudaIpcGetMemHandle / cudaIpcOpenMemHandle
  (lazy peer access); handles travel over torch.distributed.
* Copies: cudaMemcpyAsync / cudaMemcpy2DAsync device to device, which run on
  the copy engines and take no SMs.
* Flags: cuStreamWriteValue32 on the same stream as the data, so a flag lands
  after its chunk.
* Streams are torch streams of high priority, so ordering with the caller's
  stream uses torch's events and everything can be captured in a CUDA graph.
"""
from __future__ import annotations

import contextlib
import ctypes
import random

import torch

from .backend import Backend, Stream
from .wire import wire_exchange

_IPC_HANDLE_BYTES = 64


def _rt():
    try:
        from cuda.bindings import runtime
    except ImportError:  # cuda-python < 12.6 spelled it cuda.cudart
        from cuda import cudart as runtime  # type: ignore
    return runtime


def _drv():
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # type: ignore
    return driver


def driver():
    """cuda-python's driver API module."""
    return _drv()


def runtime_available() -> bool:
    """Whether cuda-python is installed."""
    try:
        _rt(), _drv()
    except ImportError:
        return False
    return True


def check(result, what: str):
    """cuda-python returns (err, *values); raise on a non-zero error and return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class _DeviceArray:
    """Exposes a raw device pointer to torch through __cuda_array_interface__ (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (int(ptr), False),
            "version": 2,
        }


def wrap_pointer(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_DeviceArray(ptr, nbytes), device=device)


def rows_view(t: torch.Tensor):
    """Describe ``t`` as ``height`` rows of ``width`` bytes ``pitch`` bytes apart, or None."""
    es = t.element_size()
    if t.is_contiguous():
        return 1, t.numel() * es, t.numel() * es
    # collapse the trailing dims that are contiguous into one row
    inner = 1
    d = t.dim() - 1
    while d >= 0 and (t.size(d) == 1 or t.stride(d) == inner):
        inner *= t.size(d)
        d -= 1
    outer = t.shape[: d + 1]
    if len([s for s in outer if s != 1]) > 1:
        return None
    height = max(1, max(outer, default=1))
    pitch = next((t.stride(i) for i in range(d + 1) if t.size(i) != 1), inner) * es
    return height, inner * es, pitch


def memcpy_plan(dst: torch.Tensor, src: torch.Tensor):
    """Split a copy between two equal-shaped views into 2-D pieces (dst_ptr, dpitch, src_ptr, spitch, width, height)."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy: shape/dtype differ: {tuple(dst.shape)} {dst.dtype} vs {tuple(src.shape)} {src.dtype}")
    dv, sv = rows_view(dst), rows_view(src)
    if dv is not None and sv is not None and dv[:2] == sv[:2]:
        h, w, dp = dv
        return [(dst.data_ptr(), dp, src.data_ptr(), sv[2], w, h)]
    if dst.dim() <= 1:
        raise ValueError("copy: views are not expressible as 2-D copies")
    plan = []
    for i in range(dst.size(0)):
        plan += memcpy_plan(dst[i], src[i])
    return plan


class CudaStream(Stream):
    def __init__(self, stream: torch.cuda.Stream):
        self.torch_stream = stream
        self.handle = stream.cuda_stream
        self.event = None  # recorded when another stream waits for this one (wait_stream)
        rt, drv = _rt(), _drv()
        self._memcpy, self._memcpy2d = rt.cudaMemcpyAsync, rt.cudaMemcpy2DAsync
        self._names = ("cudaMemcpyAsync", "cudaMemcpy2DAsync")
        self._d2d = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._default = rt.cudaMemcpyKind.cudaMemcpyDefault  # by the pointers (unified addressing)
        self._write32 = drv.cuStreamWriteValue32
        self._write_flags = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self._wait32 = drv.cuStreamWaitValue32
        self._wait_flags = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ  # (int32)(*addr - value) >= 0

    def call(self, fn):
        with torch.cuda.stream(self.torch_stream):
            fn()

    def _copy2d(self, dptr, dp, sptr, sp, w, h):
        if h == 1:
            check(self._memcpy(dptr, sptr, w, self._d2d, self.handle), self._names[0])
        else:
            check(self._memcpy2d(dptr, dp, sptr, sp, w, h, self._d2d, self.handle), self._names[1])

    def copy(self, dst, src):
        for dptr, dp, sptr, sp, w, h in memcpy_plan(dst, src):
            self._copy2d(dptr, dp, sptr, sp, w, h)

    def plan_copy(self, dst, src, base):
        """The 2-D pieces (dst_ptr, dpitch, src offset from ``base``'s address, spitch, width, height)."""
        at = base.data_ptr()
        return [(dp, dpitch, sp - at, spitch, w, h) for dp, dpitch, sp, spitch, w, h in memcpy_plan(dst, src)]

    def copy_planned(self, plan, base):
        at = base.data_ptr()
        for dptr, dp, soff, sp, w, h in plan:
            self._copy2d(dptr, dp, at + soff, sp, w, h)

    def copy_to_host(self, dst: torch.Tensor, src: torch.Tensor):
        """Copy contiguous device tensor ``src`` into pinned host tensor ``dst`` (no host synchronisation)."""
        check(self._memcpy(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), self._default,
                           self.handle), self._names[0])

    def copy_from_host(self, dst: torch.Tensor, src: torch.Tensor):
        """Copy pinned host tensor ``src`` into contiguous device tensor ``dst`` (a peer's, too)."""
        self.copy_to_host(dst, src)  # the kind follows the pointers (cudaMemcpyDefault)

    def write_value(self, flag, value):
        check(self._write32(self.handle, flag.data_ptr(), value & 0xFFFFFFFF, self._write_flags), "stream write-value")

    def wait_value(self, flag, value, what=""):
        check(self._wait32(self.handle, flag.data_ptr(), value & 0xFFFFFFFF, self._wait_flags),
              f"stream wait-value {what}")

    def wait_stream(self, other):
        # one reusable event per stream: a wait takes the event's state when it is enqueued, so recording it
        # again later does not move an earlier wait (torch's Stream.wait_stream makes a new event every time)
        if other.event is None:
            other.event = torch.cuda.Event()
        other.event.record(other.torch_stream)
        self.torch_stream.wait_event(other.event)

    def synchronize(self):
        self.torch_stream.synchronize()

    def exchange(self, wire, sends, recvs, tag, what, on_timeout=None):
        """NCCL (RCCL): one group of isend/irecv issued on this stream, which then waits for them on the device (a
        peer that never sends shows as the consumer's bounded wait for its chunk; the process group's watchdog
        handles the stuck exchange). Without NCCL (several ranks sharing one GPU over gloo): through host memory and
        the store, blocking the calling thread until this stream's earlier work is done and every receive has
        arrived: a check of the protocol, not a fast path."""
        import torch.distributed as dist

        if wire.nccl:
            with torch.cuda.stream(self.torch_stream):
                ops, landing = [], []
                for t, peer in sends:
                    ops.append(dist.P2POp(dist.isend, t.contiguous(), wire.global_ranks[peer], wire.group, tag))
                for t, peer in recvs:
                    buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                    landing.append((t, buf))
                    ops.append(dist.P2POp(dist.irecv, buf, wire.global_ranks[peer], wire.group, tag))
                for work in dist.batch_isend_irecv(ops):
                    work.wait()  # this stream waits for NCCL's
                for t, buf in landing:
                    if buf is not t:
                        self.copy(t, buf)
            return
        with torch.cuda.stream(self.torch_stream):  # (not the caller's stream: a consumer may be spinning there)
            staged = [(t.to("cpu"), peer) for t, peer in sends]
        self.synchronize()
        bufs = [(torch.empty(t.shape, dtype=t.dtype), t, peer) for t, peer in recvs]
        wire_exchange(wire, staged, [(b, p) for b, _, p in bufs], tag, what, on_timeout)
        with torch.cuda.stream(self.torch_stream):
            for b, t, _ in bufs:
                t.copy_(b)  # from pageable memory: staged by the driver before the call returns

    #: testing aid: the jitter is a local copy of up to this many bytes, at roughly this many bytes per second
    JITTER_BYTES, JITTER_RATE = 64 << 20, 2e11

    def jitter(self, max_s):
        """Delay by a local copy-engine copy of random length. Not a sleep kernel: that needs an SM, and a
        persistent kernel spinning on every SM (a reduction waiting for this very copy) would starve it."""
        scratch = getattr(self, "_scratch", None)
        if scratch is None:
            scratch = self._scratch = torch.empty(2 * self.JITTER_BYTES, dtype=torch.uint8,
                                                  device=self.torch_stream.device)
            scratch.record_stream(self.torch_stream)
        n = min(self.JITTER_BYTES, int(random.uniform(0.0, max_s) * self.JITTER_RATE))
        if n:
            self._copy2d(scratch.data_ptr(), n, scratch.data_ptr() + self.JITTER_BYTES, n, n, 1)


class CudaBackend(Backend):
    name = "cuda"
    clock = 1

    stream_class = CudaStream

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self._index = torch.cuda.current_device()
        self._device = torch.device("cuda", self._index)
        self._units = torch.cuda.get_device_properties(self._device).multi_processor_count
        self._wrapped: dict = {}  # torch stream id -> our wrapper, so a call does not build wrappers anew

    @property
    def device(self):
        return self._device

    def alloc(self, nbytes):
        rt = _rt()
        ptr = int(check(rt.cudaMalloc(max(nbytes, 1)), "cudaMalloc"))
        check(rt.cudaMemset(ptr, 0, max(nbytes, 1)), "cudaMemset")
        check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")  # zeroed before a peer can map it and store into it
        handle = check(rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
        raw = ctypes.string_at(int(handle.getPtr()), _IPC_HANDLE_BYTES)
        return wrap_pointer(ptr, nbytes, self._device), (raw, ptr)

    def open(self, handle, nbytes):
        rt = _rt()
        raw, _ = handle
        h = rt.cudaIpcMemHandle_t()
        ctypes.memmove(int(h.getPtr()), raw, _IPC_HANDLE_BYTES)
        ptr = int(check(rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))
        return wrap_pointer(ptr, nbytes, self._device)

    def release(self, local, handle, peers):
        rt = _rt()
        torch.cuda.synchronize(self._device)
        for p in peers:
            if p is not None:
                check(rt.cudaIpcCloseMemHandle(p.data_ptr()), "cudaIpcCloseMemHandle")
        check(rt.cudaFree(handle[1]), "cudaFree")

    def new_stream(self):
        return self.stream_class(torch.cuda.Stream(device=self._device, priority=-1))

    def current_stream(self):
        ts = torch.cuda.current_stream(self._index)  # an int index: torch's cheap path
        s = self._wrapped.get(ts.stream_id)
        if s is None:
            s = self._wrapped[ts.stream_id] = self.stream_class(ts)
        return s

    @contextlib.contextmanager
    def use_stream(self, stream):
        # torch.cuda.stream() does the same plus device bookkeeping that costs tens of µs per call here
        prev = torch.cuda.current_stream(self._index)
        torch.cuda.set_stream(stream.torch_stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(prev)

    def num_compute_units(self):
        return self._units

    def synchronize(self):
        torch.cuda.synchronize(self._device)

    def error_mirror(self, err):
        self._mirror = torch.zeros(err.shape, dtype=err.dtype, pin_memory=True)
        return self._mirror.numpy()

    def mirror_errors(self, stream, err, mirror):
        stream.copy_to_host(self._mirror, err)

    def relay_error(self, peer_err, word):
        """Through the copy engines on a stream of its own: the peer's code is read first, then the word's other
        nonzero slots are written (the peer's own slots, its current call and headers, stay), then its code."""
        if getattr(self, "_relay", None) is None:
            self._relay = self.new_stream()
        stream = self._relay
        peek = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        stream.copy_to_host(peek, peer_err[:1])
        stream.synchronize()
        if int(peek[0]) != 0:
            return
        staged = torch.tensor(word, dtype=torch.int32).pin_memory()
        for i, v in enumerate(word[1:], 1):
            if v:
                stream.copy_from_host(peer_err[i:i + 1], staged[i:i + 1])
        stream.copy_from_host(peer_err[:1], staged[:1])
        stream.synchronize()
