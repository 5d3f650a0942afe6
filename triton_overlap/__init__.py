"""triton_overlap: Triton kernels that hide tensor- and context-parallel communication behind computation."""
from . import ops
from .context import Context, SymmetricTensor
from .ops.ag_gemm import AllGatherGEMM, ag_gemm
from .ops.common import GemmConfig
from .ops.gemm_rs import GEMMReduceScatter, gemm_rs
from .ops.cp_attention import ContextParallelAttention, cp_attention
from . import cp, library

__all__ = ["Context", "SymmetricTensor", "AllGatherGEMM", "ag_gemm", "GemmConfig", "GEMMReduceScatter", "gemm_rs", "ContextParallelAttention", "cp_attention", "cp", "library",
           "ops"]
__version__ = "0.1.0"
