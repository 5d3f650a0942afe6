"""torch.nn layers built on the overlapped ops, with autograd: sequence-parallel linear layers, a tensor-parallel MLP, a
tensor-parallel and an expert-parallel mixture of experts, a transformer block with context-parallel attention, and
parallel styles for parallelize_module (linear layers, the sequence-parallel region's edges, sparse-MoE blocks, latent
attention's down-projections, norms over column layers' whole outputs, Qwen3.5's and Qwen3-Next's linear attention,
Phi-3's fused q/k/v attention, GPT-OSS's attention with sinks), and a Hugging Face model's whole plan from its own
(hf_plan); a parallelized model's weights and gradients in the unmodified model's layout (full_state_dict, full_grads;
sharded_state_dict, sharded_optimizer_state_dict for torch.distributed.checkpoint), its gradient norm (grad_norm,
clip_grad_norm_), its parameters in groups torch's multi-tensor optimizers take (param_groups) and float16 loss scaling
(GradScaler)."""
from .block import ParallelTransformerBlock
from .ep_moe import EPMoE
from .grads import GradScaler, clip_grad_norm_, grad_norm, param_groups
from .linear import ColumnParallelLinear, RowParallelLinear, local_linear
from .mlp import TPMLP
from .moe import TPMoE
from .parallel_attention import FusedQKVParallel, SinkAttentionParallel
from .parallel import (ColwiseParallel, GatherSequence, ReplicatedLatent, RowwiseParallel, ShardSequence,
                       SharedInputColwise, overlap_ops)
from .parallel_linear_attention import GatedDeltaNetParallel
from .parallel_moe import MoEParallel
from .parallel_norm import ColwiseRMSNorm
from .plans import hf_plan
from .state_dict import (full_grads, full_state_dict, load_full_state_dict, load_sharded_optimizer_state_dict,
                         load_sharded_state_dict, sharded_optimizer_state_dict, sharded_state_dict)

__all__ = ["ColumnParallelLinear", "ColwiseParallel", "ColwiseRMSNorm", "EPMoE", "FusedQKVParallel",
           "GatedDeltaNetParallel", "GatherSequence", "GradScaler", "MoEParallel", "ParallelTransformerBlock",
           "ReplicatedLatent", "RowParallelLinear", "RowwiseParallel", "ShardSequence", "SharedInputColwise",
           "SinkAttentionParallel", "TPMLP", "TPMoE", "clip_grad_norm_", "full_grads", "full_state_dict", "grad_norm",
           "hf_plan", "load_full_state_dict", "load_sharded_optimizer_state_dict", "load_sharded_state_dict",
           "local_linear", "overlap_ops", "param_groups", "sharded_optimizer_state_dict", "sharded_state_dict"]
