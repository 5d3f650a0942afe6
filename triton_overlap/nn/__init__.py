"""torch.nn layers built on the overlapped ops, with autograd: sequence-parallel linear layers, a tensor-parallel
MLP, a tensor-parallel mixture of experts, and a transformer block with context-parallel attention."""
from .block import ParallelTransformerBlock
from .linear import ColumnParallelLinear, RowParallelLinear
from .mlp import TPMLP
from .moe import TPMoE
from .parallel import ColwiseParallel, GatherSequence, RowwiseParallel, ShardSequence

__all__ = ["ColumnParallelLinear", "ColwiseParallel", "GatherSequence", "ParallelTransformerBlock", "RowParallelLinear",
           "RowwiseParallel", "ShardSequence", "TPMLP", "TPMoE"]
