"""What the GPU and the installed Triton can do, asked on the host: a CUDA device's compute capability, whether
tiles can be loaded and stored through tensor descriptors (TMA), whether a Context runs on Hopper (compute
capability 9.0, the only GPU the Gluon kernels are written for), and whether this Triton has Gluon as those kernels
use it. None of the answers changes while a process runs, so each is asked once."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def capability(index: int | None) -> tuple:
    """The compute capability (major, minor) of CUDA device ``index``."""
    return torch.cuda.get_device_capability(index)


def supports_tma(backend: str, device, *block: int) -> bool:
    """Whether this backend and GPU take tensor descriptors with tile sides ``block``: NVIDIA compute capability
    9.0 and later or the host backend (never AMD), no side over 256."""
    if backend == "hip" or max(block) > 256:
        return False
    return backend != "cuda" or capability(device.index)[0] >= 9


@functools.lru_cache(maxsize=None)
def is_sm90(index: int | None) -> bool:
    """Whether CUDA device ``index`` has compute capability 9.0 (H100, H200: wgmma, TMA, warp specialization)."""
    return capability(index) == (9, 0)


def is_hopper(ctx) -> bool:
    """Whether ``ctx`` runs where the Gluon kernels can: the cuda backend on a GPU of compute capability 9.0."""
    return ctx.backend == "cuda" and is_sm90(ctx.device.index)


@functools.lru_cache(maxsize=1)
def gluon_available() -> bool:
    """Whether this Triton has Gluon with Hopper's wgmma and warp specialization as the Gluon kernels use them."""
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except Exception:  # noqa: BLE001 - an older or newer Triton without the names used here
        return False
    return True
