"""Launching a Triton kernel again without Triton's per-call binding.

``fn[grid](*args, **kw)`` binds and specialises every argument, builds a cache
key and looks the compiled kernel up on every call: tens of µs of host time
per launch, which an eager call of an overlapped op pays two or three times
before the GPU has its work. ``launch`` makes the first call of a
specialisation through Triton and keeps the CompiledKernel it returns; later
calls with the same specialisation go straight to the compiled kernel's
launcher (``CompiledKernel[grid](*args)``, the form Triton's own run ends in).
The grid is not part of the key (a compiled kernel runs on any grid), so calls
whose row counts vary share one entry.

The specialisation key mirrors what Triton specialises on: each tensor's
dtype and whether its address is 16-byte aligned; each int's value class
(1, a multiple of 16, 32- or 64-bit); each item of a tuple alike; every
constexpr and launch option. In Triton's interpreter (host backend) kernels
are simply called.

Every GPU launch made here asks for FP fusion (a multiply and an add
contracted into one FMA) unless the caller says otherwise: Triton's default up to 3.9, which
the kernels' timings and tolerances were measured with; Triton 3.10 turns the
default off.
"""
from __future__ import annotations

import functools
import os

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

_compiled: dict = {}


def _spec(a):
    """An argument's part of the specialisation key. Plain ints, bools and tuples are told by their exact type
    first: most of a launch's arguments are sizes and strides, and the isinstance chain below costs them a few µs
    a launch."""
    t = type(a)
    if t is int:
        return a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31), a >= 1 << 63
    if t is bool:
        return "b", a
    if t is tuple:  # (a waiter: kernels.signal.waiter) Triton specialises its items one by one
        return tuple(map(_spec, a))
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, TensorDescriptor) or hasattr(a, "block_shape") and hasattr(a, "layout"):  # (or Gluon's)
        return "desc", a.base.dtype, tuple(a.block_shape), a.padding, getattr(a, "layout", None)  # (frozen: hashable)
    if isinstance(a, tuple):
        return tuple(map(_spec, a))
    if isinstance(a, int):  # (bool has no subclasses: every bool was taken above)
        return _spec(int(a))
    return type(a)


@functools.lru_cache(maxsize=1)
def triton_interprets() -> bool:
    """Whether Triton runs kernels in its interpreter (decided when triton is imported, so asked once)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime") and hasattr(knobs.runtime, "interpret"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch(fn, grid: tuple, args: tuple, consts: dict, **options) -> None:
    """``fn[grid](*args, **consts, **options)``: ``args`` are the leading runtime arguments in order, ``consts``
    the constexprs (by name; those left out take their defaults), ``options`` num_warps and the like."""
    if triton_interprets():
        fn[grid](*args, **consts, **options)
        return
    options.setdefault("enable_fp_fusion", True)
    # (the device too: Triton loads a kernel into the device current at its first launch)
    key = (id(fn), torch.cuda.current_device(), tuple(map(_spec, args)), tuple(consts.items()),
           tuple(options.items()))
    hit = _compiled.get(key)
    if hit is None:
        kernel = fn[grid](*args, **consts, **options)
        names = fn.arg_names[len(args):]
        defaults = {n: p.default for n, p in fn.signature.parameters.items()}
        tail = tuple(consts[n] if n in consts else defaults[n] for n in names)
        if kernel is not None and hasattr(kernel, "__getitem__"):
            _compiled[key] = (kernel, tail)
        return
    kernel, tail = hit
    kernel[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)
