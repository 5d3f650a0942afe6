"""triton_overlap: Triton kernels that hide tensor- and context-parallel communication behind computation.

Copy engines move the data and raise a flag per chunk; persistent Triton kernels wait on those flags tile by tile.
"""
from . import zigzag
from .context import Context, ContextError, SymmetricTensor
from .ops import (AllGatherGEMM, AllGatherGEMMConfig, AttentionConfig, ContextParallelAttention, GEMMReduceScatter,
                  GEMMReduceScatterConfig, ag_gemm, cp_attention, gemm_rs)

__all__ = ["AllGatherGEMM", "AllGatherGEMMConfig", "AttentionConfig", "Context", "ContextError",
           "ContextParallelAttention", "GEMMReduceScatter", "GEMMReduceScatterConfig", "SymmetricTensor", "ag_gemm",
           "cp_attention", "gemm_rs", "zigzag"]
__version__ = "0.1.0"
