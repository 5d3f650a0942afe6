"""Gluon as the Gluon kernels use it (kernels.gemm_warp_specialized, kernels.gemm_gather_hopper,
kernels.grouped_gemm_hopper, kernels.attention_hopper, kernels.attention_bwd_hopper), on every Triton this package
supports: the names that differ between Triton 3.6 (the GPU machines') and newer ones, resolved once here, and
Gluon's shared layouts, built once per block and dtype.

Importing this module needs Gluon; ``kernels.capability.gluon_available`` says whether this Triton has it."""
from __future__ import annotations

import functools

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

#: A TMA load into shared memory: ``tma.async_load`` in newer Gluon, ``async_copy_global_to_shared`` in Triton 3.6.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
#: A TMA store from shared memory: ``tma.async_store`` in newer Gluon, ``async_copy_shared_to_global`` in Triton 3.6.
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
#: A cp.async load of a tensor of pointers into shared memory (masked elements read zeros): ``async_copy.async_load``
#: in newer Gluon, ``async_copy.async_copy_global_to_shared`` in Triton 3.6.
cp_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
#: A barrier of the calling partition's warps: ``gl.thread_barrier`` in Triton 3.6, ``gl.barrier`` in newer Gluon.
barrier = getattr(gl, "thread_barrier", None) or gl.barrier

if hasattr(tma, "async_atomic_add"):
    tma_atomic_add = tma.async_atomic_add
else:  # Triton 3.6: its Gluon builder has the TMA reduction, its language not yet the function
    from triton._C.libtriton import ir as _ir
    from triton.language.core import builtin as _builtin

    @_builtin
    def tma_atomic_add(tensor_desc, coord, src, _semantic=None):
        """Add shared memory block ``src`` into the block of ``tensor_desc`` at ``coord`` (TMA, element-wise atomic)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


def shared_layout(block, dtype):
    """Gluon's default shared layout for a ``block`` of ``dtype`` (a Gluon dtype), built once per pair: launches
    build their descriptors anew every call, and the layout is most of a descriptor's host cost."""
    return _default_layout(tuple(block), dtype)


@functools.lru_cache(maxsize=None)
def _default_layout(block: tuple, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def tma_descriptor(t, shape, stride: int, block, gdt):
    """A Gluon TMA descriptor over 2-D ``t`` (rows ``stride`` elements apart, unit column stride) in ``block``
    blocks of Gluon dtype ``gdt``, in its default shared layout."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, shape, [stride, 1], block, shared_layout(block, gdt))


def b_descriptor(w, b_layout: str, gdt, block_k: int, block_n: int):
    """A GEMM's B: ``w`` [K, N] in [block_k, block_n] blocks ("kn"), or its transpose [N, K] (``linear.weight.t()``)
    in [block_n, block_k] blocks ("nk")."""
    K, N = w.shape
    if b_layout == "kn":
        return tma_descriptor(w, [K, N], w.stride(0), [block_k, block_n], gdt)
    return tma_descriptor(w.t(), [N, K], w.stride(1), [block_n, block_k], gdt)
