"""triton_overlap: Triton kernels that hide tensor- and context-parallel communication behind computation.

Copy engines move the data and raise a flag per chunk; persistent Triton kernels wait on those flags tile by tile.
For decode-sized messages, a one-kernel AllReduce (and GEMM + AllReduce) over the same Context.
"""
from . import zigzag
from .context import Context, ContextError, SymmetricTensor
from .ops import (AllGatherGEMM, AllGatherGEMMConfig, AllGatherMoEGEMM, AllReduce, AllReduceRMSNorm, AttentionConfig,
                  ContextParallelAttention, EPHandle, ExpertParallel, ExpertParallelConfig, ExpertParallelLowLatency,
                  GEMMAllReduce, GEMMAllReduceConfig, GEMMReduceScatter, GEMMReduceScatterConfig, LowLatencyHandle,
                  MoEGEMMConfig, MoEGEMMReduceScatter, MoERouting, ag_gemm, ag_moe_gemm, all_reduce, all_reduce_rmsnorm,
                  cp_attention, ep_combine, ep_dispatch, gemm_ar, gemm_rs, moe_gemm_rs)

__all__ = ["AllGatherGEMM", "AllGatherGEMMConfig", "AllGatherMoEGEMM", "AllReduce", "AllReduceRMSNorm",
           "AttentionConfig", "Context", "ContextError", "ContextParallelAttention", "EPHandle", "ExpertParallel",
           "ExpertParallelConfig", "ExpertParallelLowLatency", "GEMMAllReduce", "GEMMAllReduceConfig",
           "GEMMReduceScatter", "GEMMReduceScatterConfig", "LowLatencyHandle", "MoEGEMMConfig", "MoEGEMMReduceScatter",
           "MoERouting", "SymmetricTensor", "ag_gemm", "ag_moe_gemm", "all_reduce", "all_reduce_rmsnorm",
           "cp_attention", "ep_combine", "ep_dispatch", "gemm_ar", "gemm_rs", "moe_gemm_rs", "zigzag"]
__version__ = "0.1.0"
