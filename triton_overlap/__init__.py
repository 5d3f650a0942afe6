"""triton_overlap: Triton kernels that hide tensor- and context-parallel communication behind computation."""
from . import ops
from .context import Context, SymmetricTensor
from .ops.ag_gemm import AllGatherGEMM, ag_gemm
from .ops.common import GemmConfig

__all__ = ["Context", "SymmetricTensor", "AllGatherGEMM", "ag_gemm", "GemmConfig", "ops"]
__version__ = "0.1.0"
