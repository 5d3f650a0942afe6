"""The user-facing operations: each pairs a copy-engine producer with a Triton consumer (producers.pipeline)."""
from .all_gather_gemm import AllGatherGEMM, ag_gemm
from .config import AllGatherGEMMConfig, AttentionConfig, GEMMReduceScatterConfig
from .context_parallel_attention import ContextParallelAttention, cp_attention
from .gemm_reduce_scatter import GEMMReduceScatter, gemm_rs

__all__ = ["AllGatherGEMM", "AllGatherGEMMConfig", "AttentionConfig", "ContextParallelAttention",
           "GEMMReduceScatter", "GEMMReduceScatterConfig", "ag_gemm", "cp_attention", "gemm_rs"]
