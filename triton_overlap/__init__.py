"""triton_overlap: Triton kernels that hide tensor- and context-parallel communication behind computation."""
from .context import Context, SymmetricTensor

__all__ = ["Context", "SymmetricTensor"]
__version__ = "0.1.0"
