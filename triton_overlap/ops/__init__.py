"""User-facing operations: each pairs a copy-engine producer with a Triton consumer."""
from .ag_gemm import AllGatherGEMM, ag_gemm
from .common import GemmConfig

__all__ = ["AllGatherGEMM", "ag_gemm", "GemmConfig"]
