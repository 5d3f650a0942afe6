"""The user-facing operations: each overlapped one pairs a copy-engine producer with a Triton consumer
(producers.pipeline); AllReduce and GEMM + AllReduce are one-kernel collectives for decode-sized messages."""
from .all_gather_gemm import AllGatherGEMM, ag_gemm
from .all_reduce import AllReduce, all_reduce
from .config import AllGatherGEMMConfig, AttentionConfig, GEMMAllReduceConfig, GEMMReduceScatterConfig
from .context_parallel_attention import ContextParallelAttention, cp_attention
from .gemm_all_reduce import GEMMAllReduce, gemm_ar
from .gemm_reduce_scatter import GEMMReduceScatter, gemm_rs

__all__ = ["AllGatherGEMM", "AllGatherGEMMConfig", "AllReduce", "AttentionConfig", "ContextParallelAttention",
           "GEMMAllReduce", "GEMMAllReduceConfig", "GEMMReduceScatter", "GEMMReduceScatterConfig", "ag_gemm",
           "all_reduce", "cp_attention", "gemm_ar", "gemm_rs"]
