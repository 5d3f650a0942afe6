"""NCCL's symmetric-memory kernels behind the process group's all_reduce: the AllReduce benchmarks' strongest NCCL
baseline, where the installed torch and NCCL offer it.

NCCL 2.27 added kernels for buffers that every rank registered as a symmetric window (ncclCommWindowRegister with
NCCL_WIN_COLL_SYMMETRIC), for all_reduce, all_gather and reduce_scatter of floating-point types within one NVLink
domain. torch reaches them through a memory pool of ProcessGroupNCCL's allocator (``backend.mem_allocator``,
ncclMemAlloc) registered with ``backend.register_mem_pool(pool, symm=True)`` (earlier releases took a ``symmetric``
or ``symm_mem`` argument of ``torch.cuda.MemPool`` instead); a collective on a tensor of that pool may then run
NCCL's symmetric kernel. Where it does not apply, NCCL takes its ordinary kernels without a word, and what torch
exposes differs between releases, so every step is detected at run time (``route``), what was done or why it
could not be is said in words (``SymmetricBuffer.describe``), and the kernel NCCL ran is read from a profile
(``nccl_kernels``).
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field

import torch

#: the first NCCL with symmetric kernels
MIN_NCCL = (2, 27)
#: NCCL's environment variables that decide whether windows are registered and which kernels run, quoted in the
#: record where they are set
NCCL_ENV = ("NCCL_WIN_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO")


def nccl_version() -> tuple | None:
    """The NCCL torch was built with, as (major, minor, patch), or None where torch has no NCCL (a CPU build)."""
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - no NCCL in this torch
        return None
    if isinstance(v, int):  # NCCL's code: major * 10000 + minor * 100 + patch (2.9 on)
        return (v // 10000, v // 100 % 100, v % 100)
    return tuple(int(p) for p in v[:3]) if isinstance(v, (tuple, list)) else None


def version_text(v: tuple | None) -> str:
    return "none" if v is None else ".".join(map(str, v))


@dataclass(frozen=True)
class Route:
    """How this torch registers a pool for NCCL's symmetric kernels: the words for the record, the keywords of
    ``torch.cuda.MemPool(allocator, ...)`` and the arguments of ``register_mem_pool(pool, ...)`` after the pool."""
    text: str
    pool_kwargs: dict = field(default_factory=dict)
    register_args: tuple = ()
    register_kwargs: dict = field(default_factory=dict)


def _pybind_params(fn) -> list[str]:
    """The parameters of a pybind11 method as its docstring's first signature writes them
    (``name(self: T, pool: P, symm: bool = False) -> None`` gives ``["self: T", "pool: P", "symm: bool = False"]``);
    [] where it has none."""
    for line in (getattr(fn, "__doc__", None) or "").splitlines():
        if "(" in line and ")" in line and "->" in line:
            inside = line[line.index("(") + 1:line.rindex(")", 0, line.index("->"))]
            return [p.strip() for p in inside.split(",") if p.strip()]
    return []


def _name(param: str) -> str:
    return param.split(":")[0].split("=")[0].strip()


def _params(fn) -> list[str]:
    """The parameters of ``fn``: from its signature, else (pybind11) from its docstring, ``self`` included there."""
    try:
        return [str(p) for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):
        return _pybind_params(fn)


def route(backend, mempool=None, version: tuple | None = None) -> tuple[Route | None, str | None]:
    """``(Route, None)`` where ``backend`` (the process group's CUDA backend), ``mempool`` (torch.cuda.MemPool) and
    NCCL ``version`` can register a pool for NCCL's symmetric kernels, else ``(None, why not)``. Nothing is
    called: the answer comes from the attributes and signatures this torch has."""
    if backend is None:
        return None, "no CUDA backend in the process group"
    name = type(backend).__name__
    if version is None:
        return None, "this torch has no NCCL"
    if tuple(version[:2]) < MIN_NCCL:
        return None, f"NCCL {version_text(version)} has no symmetric kernels (NCCL 2.27 added them)"
    if mempool is None:
        return None, "torch.cuda.MemPool is missing"
    if not hasattr(backend, "mem_allocator"):
        return None, f"{name} has no mem_allocator (the ncclMemAlloc allocator a pool needs)"
    register = getattr(backend, "register_mem_pool", None)
    if register is None:
        return None, f"{name} has no register_mem_pool"
    params = _params(register)
    names = [_name(p) for p in params]
    if "symm" in names:
        return Route(f"a torch.cuda.MemPool of {name}.mem_allocator (ncclMemAlloc), registered with "
                     "register_mem_pool(pool, symm=True) (ncclCommWindowRegister)",
                     register_kwargs={"symm": True}), None
    if names[:1] == ["self"] and len(params) == 3 and "bool" in params[2]:  # (self, pool, flag) without names
        return Route(f"a torch.cuda.MemPool of {name}.mem_allocator (ncclMemAlloc), registered with "
                     f"register_mem_pool(pool, True) (the symmetric flag, unnamed in this torch: {params[2]})",
                     register_args=(True,)), None
    for flag in ("symmetric", "symm_mem"):
        if flag in [_name(p) for p in _params(mempool)]:
            return Route(f"torch.cuda.MemPool({name}.mem_allocator, {flag}=True) (ncclMemAlloc), registered with "
                         "register_mem_pool(pool)", pool_kwargs={flag: True}), None
    return None, (f"{name}.register_mem_pool takes no symmetric flag ({', '.join(names) or 'no signature'}) and "
                  "torch.cuda.MemPool no symmetric argument: this torch registers pools for NCCL's ordinary buffer "
                  "registration only")


def nccl_env() -> str:
    """NCCL's variables of NCCL_ENV that are set, as ``NAME=value``; "none set" else."""
    got = [f"{k}={os.environ[k]}" for k in NCCL_ENV if k in os.environ]
    return ", ".join(got) if got else "none set"


def nccl_kernels(fn) -> list[str]:
    """The names of the NCCL kernels one call of ``fn`` ran on the GPU (torch.profiler): a symmetric one where NCCL
    took it (is_symmetric_kernel), ``ncclDevKernel_*`` where it took its ordinary ones. GPUs only."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if is_nccl_kernel(e.name)})


def is_nccl_kernel(name: str) -> bool:
    """Whether a profiled event's name is an NCCL kernel's (not the host-side ``nccl:all_reduce`` range)."""
    return name.startswith("nccl") and "Kernel" in name


def is_symmetric_kernel(name: str) -> bool:
    """Whether an NCCL kernel is a symmetric one: ``ncclSymDevKernel_*`` (NCCL 2.27), ``ncclSymkDevKernel_*``
    (2.28); the ordinary ones are ``ncclDevKernel_*``."""
    return name.startswith("ncclSym")


class SymmetricBuffer:
    """``numel`` elements of ``dtype`` from a pool registered for NCCL's symmetric kernels with the process group
    ``group`` (collective: every rank opens one of the same size, together), or where that is not possible,
    ``tensor`` None and the reason in ``why_not``. ``view(n)`` is its first ``n`` elements, at the same offset (0)
    on every rank, as the symmetric kernels need. ``close()`` deregisters the pool (collective); the pool itself is
    freed with the last reference to it."""

    def __init__(self, group, numel: int, dtype: torch.dtype, device: torch.device, backend_name: str):
        self.version = nccl_version()
        self.route, self.why_not = None, None
        self.tensor = self.pool = self.backend = None
        if backend_name != "nccl":
            self.why_not = f"the process group is {backend_name}, not NCCL"
            return
        try:
            backend = group._get_backend(device)
            self.route, self.why_not = route(backend, getattr(torch.cuda, "MemPool", None), self.version)
            if self.route is None:
                return
            allocator = backend.mem_allocator
            pool = torch.cuda.MemPool(allocator, **self.route.pool_kwargs)
            with torch.cuda.use_mem_pool(pool):
                tensor = torch.zeros(numel, dtype=dtype, device=device)
            torch.cuda.synchronize()
            backend.register_mem_pool(pool, *self.route.register_args, **self.route.register_kwargs)
            self.tensor, self.pool, self.backend = tensor, pool, backend
        except Exception as e:  # noqa: BLE001 - the reason goes into the record
            self.route, self.why_not = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    def view(self, n: int) -> torch.Tensor | None:
        return None if self.tensor is None else self.tensor[:n]

    def describe(self) -> str:
        """The torch and NCCL, and how the symmetric registration was made, or why it was not."""
        head = f"torch {torch.__version__}, NCCL {version_text(self.version)}, NCCL env: {nccl_env()}"
        if self.tensor is not None:
            return f"{head}; enabled: {self.route.text}"
        return f"{head}; not enabled: {self.why_not}"

    def close(self) -> None:
        if self.backend is not None and self.pool is not None:
            torch.cuda.synchronize()
            try:
                self.backend.deregister_mem_pool(self.pool)
            finally:
                self.backend = None
        self.tensor = None
