"""torch.nn layers built on the overlapped ops, with autograd: sequence-parallel linear layers, a tensor-parallel
MLP, and a transformer block with context-parallel attention."""
from .block import ParallelTransformerBlock
from .linear import ColumnParallelLinear, RowParallelLinear
from .mlp import TPMLP

__all__ = ["ColumnParallelLinear", "ParallelTransformerBlock", "RowParallelLinear", "TPMLP"]
