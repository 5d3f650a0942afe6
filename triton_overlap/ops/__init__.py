"""The user-facing operations: each overlapped one pairs a copy-engine producer with a Triton consumer
(producers.pipeline); AllReduce and GEMM + AllReduce are one-kernel collectives for decode-sized messages."""
from .all_gather_gemm import AllGatherGEMM, ag_gemm
from .all_gather_moe import AllGatherMoEGEMM, ag_moe_gemm
from .all_reduce import AllReduce, all_reduce
from .all_reduce_rmsnorm import AllReduceRMSNorm, all_reduce_rmsnorm
from .config import AllGatherGEMMConfig, AttentionConfig, GEMMAllReduceConfig, GEMMReduceScatterConfig
from .context_parallel_attention import ContextParallelAttention, cp_attention
from .ep_functional import ep_combine, ep_dispatch
from .ep_low_latency import ExpertParallelLowLatency, LowLatencyHandle
from .expert_parallel import EPHandle, ExpertParallel, ExpertParallelConfig
from .gemm_all_reduce import GEMMAllReduce, gemm_ar
from .gemm_reduce_scatter import GEMMReduceScatter, gemm_rs
from .moe_config import MoEGEMMConfig
from .moe_reduce_scatter import MoEGEMMReduceScatter, moe_gemm_rs
from .moe_routing import MoERouting

__all__ = ["AllGatherGEMM", "AllGatherGEMMConfig", "AllGatherMoEGEMM", "AllReduce", "AllReduceRMSNorm",
           "AttentionConfig", "ContextParallelAttention", "EPHandle", "ExpertParallel", "ExpertParallelConfig",
           "ExpertParallelLowLatency", "GEMMAllReduce", "GEMMAllReduceConfig", "GEMMReduceScatter",
           "GEMMReduceScatterConfig", "LowLatencyHandle", "MoEGEMMConfig", "MoEGEMMReduceScatter", "MoERouting",
           "ag_gemm", "ag_moe_gemm", "all_reduce", "all_reduce_rmsnorm", "cp_attention", "ep_combine", "ep_dispatch",
           "gemm_ar", "gemm_rs", "moe_gemm_rs"]
