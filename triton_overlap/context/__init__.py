"""Context, symmetric memory, signals, barrier and stream pools; one module per backend."""
from .context import OPS, Context, SymmetricTensor, op_id

__all__ = ["Context", "SymmetricTensor", "OPS", "op_id"]
