"""Context, symmetric memory, signals, barrier and stream pools; one module per backend."""
from .context import Context
from .errors import Call, ContextError, op_id
from .heap import SymmetricTensor

__all__ = ["Call", "Context", "ContextError", "SymmetricTensor", "op_id"]
