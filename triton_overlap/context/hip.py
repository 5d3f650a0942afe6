"""AMD backend, on hip-python (``from hip import hip``).

NOT RUN: no AMD GPU is available to this project yet. This module is written
against hip-python's documented API and kept thin; everything above it is the
code the CUDA backend runs.

* Memory: hipMalloc, hipIpcGetMemHandle / hipIpcOpenMemHandle.
* Copies: hipMemcpyAsync / hipMemcpy2DAsync with hipMemcpyDeviceToDeviceNoCU,
  so the SDMA engines move the data and no compute unit is taken.
* Flags: hipStreamWriteValue32 on the same stream as the data, so a flag lands
  after its chunk.
* torch on ROCm exposes HIP streams through the torch.cuda API.
"""
from __future__ import annotations

import ctypes

import torch

from .cuda import CudaBackend, CudaStream, check, wrap_pointer

_IPC_HANDLE_BYTES = 64


def _hip():
    from hip import hip

    return hip


def runtime_available() -> bool:
    """Whether hip-python is installed."""
    try:
        _hip()
    except ImportError:
        return False
    return True


class HipStream(CudaStream):
    """Stream ordering and synchronisation as on CUDA (torch events); the runtime calls are HIP's."""

    def __init__(self, stream: torch.cuda.Stream):
        self.torch_stream = stream
        self.handle = stream.cuda_stream
        self.event = None
        hip = _hip()
        self._memcpy, self._memcpy2d = hip.hipMemcpyAsync, hip.hipMemcpy2DAsync
        self._names = ("hipMemcpyAsync", "hipMemcpy2DAsync")
        self._d2d = hip.hipMemcpyKind.hipMemcpyDeviceToDeviceNoCU
        self._default = hip.hipMemcpyKind.hipMemcpyDefault
        self._write32 = hip.hipStreamWriteValue32
        self._write_flags = 0
        # hipStreamWaitValue32(stream, ptr, value, flags, mask): Gte compares (*ptr & mask) >= value
        self._wait32 = lambda stream, ptr, value, flags: hip.hipStreamWaitValue32(stream, ptr, value, flags,
                                                                                  0xFFFFFFFF)
        self._wait_flags = hip.hipStreamWaitValueGte


class HipBackend(CudaBackend):
    """Shares device handling with the CUDA backend; only the runtime calls differ."""

    name = "hip"
    clock = 2
    stream_class = HipStream

    def alloc(self, nbytes):
        hip = _hip()
        ptr = int(check(hip.hipMalloc(max(nbytes, 1)), "hipMalloc"))
        check(hip.hipMemset(ptr, 0, max(nbytes, 1)), "hipMemset")
        check(hip.hipDeviceSynchronize(), "hipDeviceSynchronize")  # zeroed before a peer can map it and store into it
        handle = check(hip.hipIpcGetMemHandle(ptr), "hipIpcGetMemHandle")
        raw = ctypes.string_at(int(handle.getPtr()), _IPC_HANDLE_BYTES)
        return wrap_pointer(ptr, nbytes, self.device), (raw, ptr)

    def open(self, handle, nbytes):
        hip = _hip()
        raw, _ = handle
        h = hip.hipIpcMemHandle_t()
        ctypes.memmove(int(h.getPtr()), raw, _IPC_HANDLE_BYTES)
        ptr = int(check(hip.hipIpcOpenMemHandle(h, hip.hipIpcMemLazyEnablePeerAccess), "hipIpcOpenMemHandle"))
        return wrap_pointer(ptr, nbytes, self.device)

    def release(self, local, handle, peers):
        hip = _hip()
        torch.cuda.synchronize(self.device)
        for p in peers:
            if p is not None:
                check(hip.hipIpcCloseMemHandle(p.data_ptr()), "hipIpcCloseMemHandle")
        check(hip.hipFree(handle[1]), "hipFree")
