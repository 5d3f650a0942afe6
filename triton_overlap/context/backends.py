"""Which backend a Context runs on, and making it (the backends themselves: cuda.py, hip.py, host.py)."""
from __future__ import annotations

import torch

from ..kernels.cached_launch import triton_interprets
from .backend import Backend


def pick(name: str) -> str:
    """``name``, or for "auto": host where Triton interprets kernels (TRITON_INTERPRET=1: they cannot run on a GPU
    backend's streams), hip on ROCm torch with a GPU, cuda with a CUDA GPU, host otherwise."""
    if name != "auto":
        return name
    if triton_interprets():
        return "host"
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "hip"
    if torch.cuda.is_available():
        return "cuda"
    return "host"


def make(name: str, rank: int, world_size: int, timeout_s: float, namespace) -> Backend:
    """Backend ``name`` for ``rank`` of ``world_size``; ``namespace()``: a name every rank of the group shares, new
    for each Context (a collective, called on the host backend only)."""
    if name == "host":
        if not triton_interprets():
            raise RuntimeError("the host backend runs kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
                               "before triton is imported (scripts/launch.sh does this on machines without GPUs)")
        from .host import HostBackend

        return HostBackend(rank, world_size, namespace(), timeout_s)
    if name in ("cuda", "hip"):
        built_for = "ROCm" if name == "hip" else "CUDA"
        if not torch.cuda.is_available():
            raise RuntimeError(f"Context(backend={name!r}) needs a GPU and a {built_for} build of torch; this "
                               f"torch ({torch.__version__}) sees none. Without GPUs use backend='host' or 'auto'.")
        if name == "cuda":
            from .cuda import CudaBackend, runtime_available

            if not runtime_available():
                raise RuntimeError("Context(backend='cuda') needs cuda-python: pip install 'triton-overlap[cuda]'")
            return CudaBackend(rank, world_size)
        from .hip import HipBackend, runtime_available

        if not runtime_available():
            raise RuntimeError("Context(backend='hip') needs hip-python: pip install 'triton-overlap[rocm]'")
        return HipBackend(rank, world_size)
    raise ValueError(f"unknown backend {name!r}: use 'cuda', 'hip', 'host' or 'auto'")
