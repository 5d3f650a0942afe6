"""A parallel style for the sparse-MoE block of a Hugging Face model (transformers 5), for
``torch.distributed.tensor.parallel.parallelize_module``: the block becomes tensor parallel in place and computes
as ``TPMoE`` does, inside the sequence-parallel region of ``nn.parallel``'s plan.

Transformers 5 stores a block's experts as two fused parameters, ``experts.gate_up_proj`` [E, 2 * hidden, dim]
(every expert's gate rows, then its up rows) and ``experts.down_proj`` [E, dim, hidden], and its router
(``gate``) as a weight [E, dim] with the top-k rule beside it. The style keeps the module objects and swaps the
classes of the block and of its router for subclasses with the parallel forwards, as ``nn.parallel`` does for
linear layers.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from ..ops import custom_ops
from .moe import gather_routes, moe_ops, route_local, shard_experts, swiglu_experts
from .parallel import FALLBACKS, check_mesh, styled_class
from .precision import compute_operands

#: routers whose rule is softmax over the experts, top-k, optionally the k weights renormalized to sum 1 (the rule
#: ``route_local`` computes), by class name, with how each says whether it renormalizes; a router of another model
#: with this rule is one entry more
ROUTERS = {"MixtralTopKRouter": lambda gate: True, "Qwen3MoeTopKRouter": lambda gate: bool(gate.norm_topk_prob)}

#: the experts' layout flags of transformers' ``use_experts_implementation``, as the style requires them
_EXPERT_FLAGS = {"has_bias": False, "has_gate": True, "is_concatenated": True, "has_post_expert_norm": False}


class MoEParallel(ParallelStyle):
    """A Hugging Face sparse-MoE block (``gate`` + ``experts``: Mixtral's ``MixtralSparseMoeBlock``, Qwen3-MoE's
    ``Qwen3MoeSparseMoeBlock``; the routers of ``ROUTERS``), tensor parallel: every rank keeps every expert, with
    its ``hidden/W`` slice of each expert's width, and the tokens of all ranks meet at each rank's experts.

    Applied, the block holds rank r's shard in the ops' [E, K, N] layout: ``experts.gate_up_proj``
    [E, dim, 2 * hidden/W] (r's columns of each expert's gate, then of its up projection) and
    ``experts.down_proj`` [E, hidden/W, dim] (r's rows of its down projection), dtype and ``requires_grad`` kept;
    the experts' own forward is no longer called. ``gate.weight`` becomes a replicated DTensor. Every rank must
    hold the same full weights when the style is applied (the same checkpoint or seed), as for torch's
    ``SequenceParallel``.

    Forward: the input is this rank's sequence shard (a DTensor ``Shard(d)``, or the plain local ``[B, S/W, dim]``,
    taken as ``Shard(1)``); the block is token-wise, so the shard may lie on any dim but the last and no row is
    permuted. The router runs on this rank's tokens (``route_local``: logits in float32), one
    all-gather gives every rank every token's top-k ids and weights (``gather_routes``), and ``swiglu_experts``
    computes ``ag_moe`` (the tokens gathered by copy engine behind the gate/up grouped GEMM), ``silu(gate) * up``
    and ``moe_rs`` (down grouped GEMM, top-k combine, reduce-scatter to each token's owner). The output is the
    sequence shard as a DTensor placed as the input (plain input: ``Shard(1)``), as ``RowwiseParallel`` returns,
    a single tensor as these blocks return. Autocast is followed as ``nn.precision`` says; float32 parameters need
    it. Mixtral's router jitter (training, ``router_jitter_noise > 0``) multiplies this rank's tokens.

    Gradients: the experts' are this rank's shards, complete. The router's is computed from this rank's tokens
    only; ``gate.weight`` is a replicated DTensor whose gradient is a ``Partial`` DTensor, summed over the ranks
    where it is read (``full_tensor()``, an optimizer step on the DTensor parameter), as torch's
    ``SequenceParallel`` leaves its norms' weights: no call is needed.

    Router logits: the router module is still called, on this rank's tokens, so its forward hooks (transformers'
    ``output_router_logits`` recorder) see this rank's float32 logits; an auxiliary load-balancing loss computed
    from them is that of this rank's tokens, as under data parallelism it is that of the rank's batch.

    ``fallback`` is passed to the MoE ops ("auto": NCCL + torch for small shards; "never"; "always").
    """

    def __init__(self, ctx, *, fallback: str = "auto"):
        if fallback not in FALLBACKS:
            raise ValueError(f"MoEParallel: fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.ctx, self.fallback = ctx, fallback

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        ctx = self.ctx
        W = ctx.world_size
        check_mesh(self, device_mesh)
        if hasattr(module, "tp_style"):
            raise ValueError(f"MoEParallel: {type(module).__name__} is parallelized already")
        gate, experts, renormalize = check_block(module, W)
        w1, w3, w2 = _full_experts(experts)
        with torch.no_grad():
            w13, w2 = shard_experts(w1, w3, w2, ctx.rank, W)
            experts.gate_up_proj = nn.Parameter(w13, requires_grad=experts.gate_up_proj.requires_grad)
            experts.down_proj = nn.Parameter(w2, requires_grad=experts.down_proj.requires_grad)
            gate.weight = nn.Parameter(DTensor.from_local(gate.weight.detach(), device_mesh, [Replicate()],
                                                          run_check=False), requires_grad=gate.weight.requires_grad)
        gate.tp_renormalize = renormalize
        gate.__class__ = styled_class(type(gate), _router_forward, "MoEParallel")
        module.tp_style, module.tp_mesh, module.tp_handles = self, device_mesh, moe_ops(ctx, self.fallback)
        module.__class__ = styled_class(type(module), _block_forward, "MoEParallel", _last_path)
        return module


def check_block(block, world: int | None = None):
    """(gate, experts, renormalize) of a block this style computes exactly, or TypeError naming what differs:
    nothing beside the router and the experts (no shared expert), a router of ``ROUTERS`` with a weight and no
    bias, and fused SwiGLU experts without biases; with ``world``, ValueError where the experts' hidden width is
    not divisible by it."""
    children = dict(block.named_children())
    if set(children) != {"gate", "experts"} or list(block.parameters(recurse=False)):
        extra = sorted(set(children) - {"gate", "experts"}) + [n for n, _ in block.named_parameters(recurse=False)]
        missing = sorted({"gate", "experts"} - set(children))
        why = (f" without {missing}" if missing else "") + (f", with {extra} beside them" if extra else "") + \
            (" (a shared expert is not supported)" if any("shared" in n for n in extra) else "")
        raise TypeError(f"MoEParallel applies to a sparse-MoE block of a router 'gate' and 'experts' only; "
                        f"{type(block).__name__} has {sorted(children)}{why}")
    gate, experts = children["gate"], children["experts"]
    rule = ROUTERS.get(type(gate).__name__)
    if rule is None or [n for n, _ in gate.named_parameters()] != ["weight"]:
        raise TypeError(f"MoEParallel: router {type(gate).__name__} is not one it reproduces "
                        f"({', '.join(ROUTERS)}: softmax, top-k, a weight without bias)")
    if [n for n, _ in experts.named_parameters()] != ["gate_up_proj", "down_proj"]:
        raise TypeError(f"MoEParallel: experts {type(experts).__name__} must hold exactly gate_up_proj and "
                        f"down_proj (transformers 5's fused layout)")
    flags = {k: getattr(experts, k, v) for k, v in _EXPERT_FLAGS.items()}
    apply_gate = getattr(type(experts), "_apply_gate", None)
    probe = torch.linspace(-4, 4, 17)
    if flags != _EXPERT_FLAGS or (apply_gate is not None and apply_gate.__name__ != "_default_apply_gate") or \
            not torch.allclose(experts.act_fn(probe), nn.functional.silu(probe)):
        raise TypeError(f"MoEParallel: experts {type(experts).__name__} are not SwiGLU experts "
                        f"silu(x @ gate) * (x @ up) @ down with concatenated gate/up and no biases ({flags})")
    hidden = _full_experts(experts)[0].shape[1]
    if world is not None and hidden % world:
        raise ValueError(f"MoEParallel: the experts' hidden width {hidden} is not divisible by the world size {world}")
    return gate, experts, rule(gate)


def _full_experts(experts):
    """(w1, w3, w2): gate and up [E, hidden, dim], down [E, dim, hidden], views of the experts' fused parameters
    (stored [E, 2 * hidden, dim] / [E, dim, hidden], or transposed where the experts say ``is_transposed``)."""
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if getattr(experts, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    E, two_hidden, dim = gate_up.shape
    if two_hidden % 2 or tuple(down.shape) != (E, dim, two_hidden // 2):
        raise TypeError(f"MoEParallel: experts' gate_up_proj {tuple(gate_up.shape)} and down_proj "
                        f"{tuple(down.shape)} are not [E, 2 * hidden, dim] and [E, dim, hidden]")
    hidden = two_hidden // 2
    return gate_up[:, :hidden], gate_up[:, hidden:], down


def _last_path(block) -> str | None:
    """The path the block's MoE ops took on their latest call (shared by every block with the same Context and
    fallback rule): ``"overlap"``, ``"fallback"``, or None before any call."""
    return custom_ops.op_of(block.tp_handles[0]).last_path


def _router_forward(gate, rows):
    """The router on this rank's rows [T/W, dim]: (logits float32 [T/W, E], top-k weights float32, ids), the
    replicated weight's gradient left partial (this rank's tokens' part; DTensor sums it where read)."""
    weight = gate.weight
    if isinstance(weight, DTensor):
        weight = weight.to_local(grad_placements=[Partial()])
    return route_local(rows, weight, gate.top_k, gate.tp_renormalize)


def _block_forward(block, hidden_states):
    style = block.tp_style
    W = style.ctx.world_size
    placements = [Shard(1)]
    x = hidden_states
    if isinstance(x, DTensor):
        p = x.placements[0]
        if not isinstance(p, Shard) or p.dim % x.ndim == x.ndim - 1:
            raise ValueError(f"MoEParallel: input DTensor placed {x.placements}; expected the sequence shard, "
                             f"e.g. Shard(1)")
        placements, x = [Shard(p.dim % x.ndim)], x.to_local()
    jitter = getattr(block, "jitter_noise", 0.0)
    if block.training and jitter > 0:  # Mixtral's router jitter, on this rank's tokens
        x = x * torch.empty_like(x).uniform_(1.0 - jitter, 1.0 + jitter)
    experts = block.experts
    x, w13, w2 = compute_operands("MoEParallel", x, experts.gate_up_proj, experts.down_proj)
    rows = x.reshape(-1, x.shape[-1])
    _, weights, ids = block.gate(rows)
    ids, weights = gather_routes(weights, ids, block.tp_handles[0], W)
    y = swiglu_experts(rows, w13, w2, ids, weights, block.tp_handles, W)
    return DTensor.from_local(y.view(x.shape), block.tp_mesh, placements, run_check=False)


__all__ = ["MoEParallel", "ROUTERS"]
