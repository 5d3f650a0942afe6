"""User-facing operations: each pairs a copy-engine producer with a Triton consumer."""
from .ag_gemm import AllGatherGEMM, ag_gemm
from .common import GemmConfig
from .gemm_rs import GEMMReduceScatter, gemm_rs
from .cp_attention import ContextParallelAttention, cp_attention

__all__ = ["AllGatherGEMM", "ag_gemm", "GemmConfig", "GEMMReduceScatter", "gemm_rs", "ContextParallelAttention", "cp_attention"]
