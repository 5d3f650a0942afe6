"""Context, symmetric memory, signals, barrier and stream pools; one module per backend."""
from .context import OPS, Call, Context, ContextError, SymmetricTensor, op_id

__all__ = ["Call", "Context", "ContextError", "OPS", "SymmetricTensor", "op_id"]
