"""A parallel style for the sparse-MoE block of a Hugging Face model (transformers 5), for
``torch.distributed.tensor.parallel.parallelize_module``: the block becomes tensor parallel in place and computes
as ``TPMoE`` does, or with ``expert_parallel=True`` spreads its whole experts over the ranks and computes as
``EPMoE`` does, inside the sequence-parallel region of ``nn.parallel``'s plan; without sequence parallelism
(decode) each rank computes its share of the experts for every token and one AllReduce sums them.

Transformers 5 stores a block's experts as two fused parameters, ``experts.gate_up_proj`` [E, 2 * hidden, dim]
(every expert's gate rows, then its up rows) and ``experts.down_proj`` [E, dim, hidden], and its router
(``gate``) as a weight [E, dim] with the top-k rule beside it (``nn.routers`` matches the rule); Qwen2-MoE's,
Qwen3-Next's and Qwen3.5-MoE's blocks add a shared expert (an MLP every token passes through) and its sigmoid gate,
DeepSeek-V3's and GLM-4.5's an ungated one (``shared_experts``). The style keeps the module objects (but, tensor
parallel, the shared expert's, whose weights move into the experts') and swaps the classes of the block and of its
router for subclasses with the parallel forwards, as ``nn.parallel`` does for linear layers.
"""
from __future__ import annotations

import ast
import inspect
import textwrap

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from ..ops import custom_ops
from .moe import (SWIGLU, Activation, add_shared_routes, fold_shared, gather_routes, moe_ops, routed_bias,
                  shard_experts, shared_gate, shared_weights, swiglu_experts)
from .parallel import FALLBACKS, check_mesh, replicated_local, replicated_parameter, styled_class, summed_grad
from .ep_moe import ep_op, ep_swiglu, partial_experts
from .linear import all_reduce_op
from .precision import compute_operands
from .routers import logit_bias, router_rule
from .state_dict import Piece, record, selection

#: a shared expert's child name beside the router and the experts -> the name of its sigmoid gate (None: ungated,
#: added to every token with weight 1: DeepSeek-V3's and GLM-4.5's ``shared_experts``)
SHARED = {"shared_expert": "shared_expert_gate", "shared_experts": None}

#: the experts' layout flags of transformers' ``use_experts_implementation``, as the style requires them: SwiGLU
#: experts (gate rows, then up rows), and GPT-OSS's (gate and up rows interleaved, biases, a clamped activation)
_EXPERT_FLAGS = {"has_bias": False, "has_gate": True, "is_concatenated": True, "has_post_expert_norm": False}
_CLAMPED_FLAGS = {**_EXPERT_FLAGS, "has_bias": True, "is_concatenated": False}
#: their parameters' names, in order
_EXPERT_PARAMS = {False: ["gate_up_proj", "down_proj"],
                  True: ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]}


class MoEParallel(ParallelStyle):
    """A Hugging Face sparse-MoE block (``gate`` + ``experts``: Mixtral's ``MixtralSparseMoeBlock``, Qwen3-MoE's
    ``Qwen3MoeSparseMoeBlock``, OLMoE's; with a shared expert: Qwen2-MoE's, Qwen3-Next's, Qwen3.5-MoE's, and
    DeepSeek-V3's and GLM-4.5's ``shared_experts``), tensor parallel: every rank keeps every expert, with its
    ``hidden/W`` slice of each expert's width, and the tokens of all ranks meet at each rank's experts. The router
    may be of any class whose rule is one ``nn.routers`` computes (softmax top-k; DeepSeek-V3's sigmoid top-k with
    a correction bias and groups; MiniMax-M2's, whose block holds the correction bias and passes it to the router;
    DeepSeek-V2's softmax top-k with groups and a scale; Ernie 4.5's softmax top-k with a correction bias; GPT-OSS's
    softmax over its k largest logits, the logits with a trainable bias), named ``gate`` or ``router`` (Granite-MoE's,
    GPT-OSS's): the style matches it by running both on a probe when applied.

    GPT-OSS's block (``GptOssMLP``) adds biases to its experts (``gate_up_proj_bias``, ``down_proj_bias``), stores
    each expert's gate and up rows interleaved and clamps its SwiGLU (``nn.moe.Activation``, matched on a probe);
    its biases are sharded as the weights they add to (tensor parallel, the down bias, which each rank's partial
    sum would add again, is a replicated DTensor added once per routed token after the reduction; without sequence
    parallelism, a W-th of it in each rank's share), its router's bias is replicated as its weight, and the block
    returns (output, this rank's tokens' top-k weights), as it does.

    Applied, the block holds rank r's shard in the ops' [E, K, N] layout: ``experts.gate_up_proj``
    [E, dim, 2 * hidden/W] (r's columns of each expert's gate, then of its up projection) and
    ``experts.down_proj`` [E, hidden/W, dim] (r's rows of its down projection), dtype and ``requires_grad`` kept;
    the experts' own forward is no longer called. ``gate.weight`` becomes a replicated DTensor. Every rank must hold
    the same full weights when the style is applied (the same checkpoint or seed), as for torch's
    ``SequenceParallel``.

    Shared expert (``shared_expert``, gated by ``sigmoid(shared_expert_gate(x))``, or ``shared_experts``, ungated:
    weight 1): an MLP of width ``m * hidden``,
    cut into m experts of the routed experts' width appended to the experts' parameters (``experts.gate_up_proj``
    [E + m, ...], ``nn.moe.fold_shared``); every token is routed to them too, with the gate's weight. It so runs in
    the routed experts' grouped GEMMs and adds no communication. The shared expert's module is removed from the
    block (its weights live in the experts'); ``shared_expert_gate.weight`` becomes a replicated DTensor, as the
    router's.

    Forward: the input is this rank's sequence shard (a DTensor ``Shard(d)``, or the plain local ``[B, S/W, dim]``,
    taken as ``Shard(1)``); the block is token-wise, so the shard may lie on any dim but the last and no row is
    permuted. The router's rule runs on this rank's tokens (``nn.routers``: in float32), one
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
    from them is that of this rank's tokens, as under data parallelism it is that of the rank's batch (without
    sequence parallelism: every token's, the same on every rank, its gradient counted once).

    ``fallback`` is passed to the MoE ops ("auto": NCCL + torch for small shards; "never"; "always").

    ``expert_parallel=True``: the block's experts are spread over the ranks instead (rank r keeps experts
    ``[r·E/W, (r+1)·E/W)`` whole, ``experts.gate_up_proj`` [E/W, dim, 2 * hidden] and ``experts.down_proj``
    [E/W, hidden, dim]; E divisible by W), and this rank's tokens go to the ranks that own their choices and back
    (``nn.ep_moe.ep_swiglu``: ``ExpertParallel``'s dispatch and combine, the rows moved into the owners'
    symmetric memory with a flag per source, as ``EPMoE`` runs them), the attention staying tensor + sequence
    parallel around it. A shared expert is not spread: every rank computes it on its own tokens with the full
    weights, which become replicated DTensors (their gradients left partial, as the router's). The dispatch reads
    its counts back to the host, so the routed part runs outside ``torch.compile``'s graphs. The experts'
    gradients are complete on their owner.

    ``sequence_parallel=False`` (decode, as the linear styles' flag): the input is the whole activation, the same
    on every rank (a plain tensor or a replicated DTensor), and so is the output, a plain tensor. Every rank routes
    every token (the same choices on every rank: the same rows and router), computes its share of the experts
    (``nn.ep_moe.partial_experts``: its slice of every expert's width, or with ``expert_parallel`` its whole
    experts, a shared expert's slice of width among them), and one AllReduce (``ops.all_reduce``, graph-safe) sums
    the shares: no token moves, and where ``torch._grouped_mm`` takes the operands (bfloat16, widths multiples of
    8, compute capability 9.0 or newer) nothing reads back to the host, so a decode step holding the block can be
    captured in a CUDA graph (one eager call first) and traced by ``torch.compile``. The same weights' layouts as
    above. Backward works too (tensor parallel without sequence parallelism): the input's gradient is summed over
    the ranks, the router's and the shared expert's replicated weights' left partial. Mixtral's router jitter in
    training is refused there (each rank would draw other noise, hence other choices).
    """

    def __init__(self, ctx, *, fallback: str = "auto", expert_parallel: bool = False, sequence_parallel: bool = True):
        if fallback not in FALLBACKS:
            raise ValueError(f"MoEParallel: fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.ctx, self.fallback, self.expert_parallel = ctx, fallback, bool(expert_parallel)
        self.sequence_parallel = bool(sequence_parallel)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        ctx = self.ctx
        W = ctx.world_size
        check_mesh(self, device_mesh)
        if hasattr(module, "tp_style"):
            raise ValueError(f"MoEParallel: {type(module).__name__} is parallelized already")
        gate, experts, rule, shared, shared_gate = check_block(module, W, self.expert_parallel)
        module.tp_router, module.tp_router_bias = router_name(module), _block_bias(module, gate) is not None
        module.tp_act, module.tp_pair = experts_activation(experts)[0], _returns_pair(module)
        w1, w3, w2 = _full_experts(experts)
        biases = _full_biases(experts)
        layouts = _layouts(module, experts, shared, W, self.expert_parallel)  # (for nn.state_dict, before changes)
        module.tp_experts, module.tp_shared = w1.shape[0], 0
        replicated = [gate]  # the modules whose weights every rank keeps whole, as replicated DTensors
        if self.expert_parallel:  # this rank's whole experts; a shared expert stays, computed on its own tokens
            local = w1.shape[0] // W
            mine = slice(ctx.rank * local, (ctx.rank + 1) * local)
            w13, w2 = shard_experts(w1[mine], w3[mine], w2[mine], 0, 1)  # whole experts: one "shard"
            if biases is not None:
                biases = _shard_biases(*(b[mine] for b in biases), 0, 1)
            if shared is not None:
                mlp = getattr(module, shared)
                replicated += [getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
            module.tp_shared_name, module.tp_first = shared, ctx.rank * local
            if self.sequence_parallel:
                module.tp_ep_op = ep_op(ctx, self.fallback)
            forward, last_path, ops = _ep_block_forward, _ep_last_path, _ep_ops
        else:  # this rank's columns of every expert, a shared expert's among them
            if shared is not None:
                full = shared_weights(getattr(module, shared), "MoEParallel")
                w1, w3, w2, module.tp_shared = fold_shared(w1, w3, w2, full, "MoEParallel")
                delattr(module, shared)
            w13, w2 = shard_experts(w1, w3, w2, ctx.rank, W)
            if biases is not None:
                biases = _shard_biases(*biases, ctx.rank, W)
            module.tp_shared_gate = SHARED[shared] if shared_gate is not None else None  # (a name, not a child)
            if self.sequence_parallel:
                module.tp_handles = moe_ops(ctx, self.fallback)
            forward, last_path, ops = _block_forward, _last_path, _block_ops
        if not self.sequence_parallel:  # every rank's share of every token, summed by one AllReduce
            module.tp_all_reduce = all_reduce_op(ctx, self.fallback)
            forward, last_path, ops = _replicated_block_forward, _ar_last_path, _ar_ops
        if shared_gate is not None:
            replicated.append(shared_gate)
        with torch.no_grad():
            experts.gate_up_proj = nn.Parameter(w13, requires_grad=experts.gate_up_proj.requires_grad)
            experts.down_proj = nn.Parameter(w2, requires_grad=experts.down_proj.requires_grad)
            for m in replicated:
                m.weight = replicated_parameter(m.weight, device_mesh)
            if logit_bias(gate) is not None:  # (GPT-OSS's router)
                gate.bias = replicated_parameter(gate.bias, device_mesh)
            if biases is not None:  # this rank's gate/up biases; the down biases replicated (tensor parallel)
                b13, b2 = biases
                experts.gate_up_proj_bias = nn.Parameter(b13, requires_grad=experts.gate_up_proj_bias.requires_grad)
                b2.requires_grad_(experts.down_proj_bias.requires_grad)
                experts.down_proj_bias = nn.Parameter(b2, requires_grad=b2.requires_grad) if self.expert_parallel \
                    else replicated_parameter(b2, device_mesh)
        for name, pieces in layouts.items():
            record(module, name, pieces, ctx)
        gate.tp_rule = rule
        gate.tp_replicated_world = 0 if self.sequence_parallel else W
        gate.__class__ = styled_class(type(gate), _router_forward, "MoEParallel")
        module.tp_style, module.tp_mesh = self, device_mesh
        module.__class__ = styled_class(type(module), forward, "MoEParallel", last_path, ops)
        return module


def check_block(block, world: int | None = None, expert_parallel: bool = False):
    """(gate, experts, its router's rule, the shared expert's child name or None, its gate or None) of a block this
    style computes exactly, or TypeError naming what differs: beside the router and the experts at most a shared
    expert of ``SHARED`` (with its gate where it has one), a router whose rule ``nn.routers.router_rule`` finds
    (one trainable weight; a correction bias besides, of the router or the block; or GPT-OSS's bias of the logits),
    fused SwiGLU experts without biases or GPT-OSS's (biases, gate and up interleaved, the clamped SwiGLU), a shared
    expert computing
    ``down(silu(gate(x)) * up(x))`` without biases; with ``world``, ValueError where the experts' hidden width
    (with ``expert_parallel``, their number) is not divisible by it; ValueError where the shared expert's width is
    not a multiple of the experts' (tensor parallel: it joins them)."""
    children = dict(block.named_children())
    shared = next((n for n in SHARED if n in children), None)
    router = router_name(block)
    allowed = {router, "experts"} | ({shared, SHARED[shared]} - {None} if shared else set())
    if not {router, "experts"} <= set(children) <= allowed or list(block.parameters(recurse=False)) or \
            (shared and SHARED[shared] and SHARED[shared] not in children):
        extra = sorted(set(children) - allowed) + [n for n, _ in block.named_parameters(recurse=False)]
        missing = sorted(allowed - set(children))
        why = (f" without {missing}" if missing else "") + (f", with {extra} beside them" if extra else "")
        raise TypeError(f"MoEParallel applies to a sparse-MoE block of a router ('gate' or 'router') and 'experts', "
                        f"and a shared expert of {sorted(SHARED)} with its gate where it has one; "
                        f"{type(block).__name__} has {sorted(children)}{why}")
    gate, experts = children[router], children["experts"]
    biased = experts_activation(experts)[1]
    if biased and shared:
        raise TypeError(f"MoEParallel: experts with biases ({type(experts).__name__}) beside a shared expert are "
                        f"not supported")
    num, hidden = _full_experts(experts)[0].shape[:2]
    biases = _full_biases(experts)
    if biased and (biases[0].shape != (num, hidden) or biases[2].shape != (num, gate.weight.shape[1])):
        raise TypeError(f"MoEParallel: experts' biases gate_up_proj_bias {tuple(experts.gate_up_proj_bias.shape)} "
                        f"and down_proj_bias {tuple(experts.down_proj_bias.shape)} are not [E, 2 * hidden] and "
                        f"[E, dim]")
    if world is not None and expert_parallel and num % world:
        raise ValueError(f"MoEParallel(expert_parallel=True): the {num} experts are not divisible by the world "
                         f"size {world} (rank r owns experts [r*E/W, (r+1)*E/W))")
    if world is not None and not expert_parallel and hidden % world:
        raise ValueError(f"MoEParallel: the experts' hidden width {hidden} is not divisible by the world size {world}")
    shared_gate = children.get(SHARED[shared]) if shared else None
    if shared:
        _check_shared(children[shared], shared_gate, None if expert_parallel else hidden, gate.weight.shape[1])
    return gate, experts, router_rule(gate, "MoEParallel", _block_bias(block, gate)), shared, shared_gate


def experts_activation(experts) -> tuple[Activation, bool]:
    """(their activation, whether they have biases) of experts this style computes, else TypeError: SwiGLU experts
    without biases in transformers 5's fused layout (gate rows, then up rows; ``act_fn`` silu), or GPT-OSS's (gate
    and up rows interleaved, biases, ``_apply_gate`` the clamped ``Activation`` of the experts' ``alpha`` and
    ``limit``, checked on a probe that crosses the limit)."""
    name = type(experts).__name__
    params = [n for n, _ in experts.named_parameters()]
    biased = params == _EXPERT_PARAMS[True]
    if params != _EXPERT_PARAMS[biased]:
        raise TypeError(f"MoEParallel: experts {name} must hold exactly gate_up_proj and down_proj (transformers 5's "
                        f"fused layout), or those and their biases (GPT-OSS's); it has {params}")
    flags = {k: getattr(experts, k, v) for k, v in _EXPERT_FLAGS.items()}
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if not biased:
        probe = torch.linspace(-4, 4, 17)
        if flags == _EXPERT_FLAGS and (apply_gate is None or apply_gate.__name__ == "_default_apply_gate") and \
                torch.allclose(experts.act_fn(probe), nn.functional.silu(probe)):
            return SWIGLU, False
    else:
        alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
        if flags == _CLAMPED_FLAGS and apply_gate is not None and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, limit)):
            act = Activation(float(alpha), float(limit))
            interleaved = torch.linspace(-2.5 * limit, 2.5 * limit, 40, dtype=torch.float64).view(2, 20)
            try:
                got = apply_gate(experts, interleaved)
            except Exception:  # noqa: BLE001 - a gate the probe cannot run is not this one
                got = None
            want = act(torch.cat([interleaved[:, ::2], interleaved[:, 1::2]], dim=-1))
            if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got.double(), want):
                return act, True
    raise TypeError(f"MoEParallel: experts {name} are neither SwiGLU experts silu(x @ gate) * (x @ up) @ down with "
                    f"concatenated gate/up and no biases, nor GPT-OSS's (interleaved gate/up, biases, its clamped "
                    f"activation) ({flags})")


def _returns_pair(block) -> bool:
    """Whether the block's own forward returns a pair (GPT-OSS's: the output and the router's top-k scores), as
    its source says: every ``return`` in it returns two values."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(block).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    returns = [n for n in ast.walk(tree) if isinstance(n, ast.Return)]
    return bool(returns) and all(isinstance(r.value, ast.Tuple) and len(r.value.elts) == 2 for r in returns)


def _block_bias(block, gate) -> torch.Tensor | None:
    """The block's ``e_score_correction_bias`` where its router's forward takes it after the rows (MiniMax-M2's),
    else None."""
    params = list(inspect.signature(type(gate).forward).parameters.values())[1:]
    takes = len(params) >= 2 and params[1].default is inspect.Parameter.empty
    bias = getattr(block, "e_score_correction_bias", None)
    return bias if takes and isinstance(bias, torch.Tensor) else None


def router_name(block) -> str:
    """The name of a block's router child: ``gate`` (most models), else ``router`` (Granite-MoE's, Jamba's, Aria's)."""
    return "router" if "router" in dict(block.named_children()) and not hasattr(block, "gate") else "gate"


def _route(block, rows):
    """The block's router on ``rows`` [T, dim], passed the block's correction bias where it takes it."""
    gate = getattr(block, block.tp_router)
    return gate(rows, block.e_score_correction_bias) if block.tp_router_bias else gate(rows)


def _check_shared(mlp, gate, hidden: int | None, dim: int) -> None:
    """TypeError unless ``mlp`` holds exactly gate_proj, up_proj and down_proj linears without biases and computes
    ``down(silu(gate(x)) * up(x))`` (checked on a probe), and ``gate`` (if any) is ``nn.Linear(dim, 1)`` without
    bias; ValueError where its width is not a multiple of ``hidden`` (None: any width)."""
    names = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    if sorted(n for n, _ in mlp.named_parameters()) != sorted(names) or \
            not all(type(getattr(mlp, n.split(".")[0], None)) is nn.Linear for n in names):
        raise TypeError(f"MoEParallel: shared expert {type(mlp).__name__} must hold exactly gate_proj, up_proj and "
                        f"down_proj nn.Linear layers without biases")
    if gate is not None and (type(gate) is not nn.Linear or gate.bias is not None or gate.out_features != 1):
        raise TypeError(f"MoEParallel: the shared expert's gate must be nn.Linear({dim}, 1, bias=False)")
    w1, w3, w2 = (mlp.get_parameter(n).detach() for n in names)
    if hidden is not None and w1.shape[0] % hidden:
        raise ValueError(f"MoEParallel: the shared expert's width {w1.shape[0]} is not a multiple of the experts' "
                         f"width {hidden}")
    probe = torch.linspace(-1, 1, 3 * dim, dtype=w1.dtype, device=w1.device).view(3, dim)
    with torch.no_grad(), torch.autocast(w1.device.type, enabled=False):
        got, want = mlp(probe), (nn.functional.silu(probe @ w1.t()) * (probe @ w3.t())) @ w2.t()
    if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-6):
        raise TypeError(f"MoEParallel: shared expert {type(mlp).__name__} does not compute "
                        f"down(silu(gate(x)) * up(x))")


def _full_experts(experts):
    """(w1, w3, w2): gate and up [E, hidden, dim], down [E, dim, hidden], views of the experts' fused parameters
    (stored [E, 2 * hidden, dim] / [E, dim, hidden], or transposed where the experts say ``is_transposed``; gate and
    up rows interleaved where they say ``is_concatenated = False``, GPT-OSS's)."""
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    if getattr(experts, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    E, two_hidden, dim = gate_up.shape
    if two_hidden % 2 or tuple(down.shape) != (E, dim, two_hidden // 2):
        raise TypeError(f"MoEParallel: experts' gate_up_proj {tuple(gate_up.shape)} and down_proj "
                        f"{tuple(down.shape)} are not [E, 2 * hidden, dim] and [E, dim, hidden]")
    hidden = two_hidden // 2
    if not getattr(experts, "is_concatenated", True):
        return gate_up[:, 0::2], gate_up[:, 1::2], down
    return gate_up[:, :hidden], gate_up[:, hidden:], down


def _layouts(block, experts, shared, world: int, expert_parallel: bool) -> dict:
    """How the style builds the experts' tensors from the unmodified block's, as ``nn.state_dict.record`` takes them
    (name relative to the block -> pieces): what ``_full_experts``, ``fold_shared`` (tensor parallel with a shared
    expert: its parts after the routed experts), ``shard_experts`` and ``_shard_biases`` do, for every rank."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    turned = (("transpose", 1, 2),) if getattr(experts, "is_transposed", False) else ()
    E, hidden = down.shape[0], _full_experts(experts)[0].shape[1]
    interleaved = not getattr(experts, "is_concatenated", True)
    n = hidden if expert_parallel else hidden // world
    mine = [slice(q * (E // world), (q + 1) * (E // world)) if expert_parallel else slice(0, E)
            for q in range(world)]

    def columns(q):  # rank q's gate then up rows of the unmodified [E, 2 * hidden, dim] (``shard_experts``' order)
        cols = torch.arange(n) + (0 if expert_parallel else q * n)
        return torch.cat([2 * cols, 2 * cols + 1]) if interleaved else torch.cat([cols, hidden + cols])

    # gate and up rows: rank q's of every expert (tensor parallel), or every one of its experts in order
    rows = () if expert_parallel and not interleaved else (selection(1, [columns(q) for q in range(world)]),)
    hidden_cols = [slice(q * n, (q + 1) * n) for q in range(world)]  # down's columns (tensor parallel)
    owned = (selection(0, mine),) if expert_parallel else ()  # the experts (expert parallel)
    down_cols = () if expert_parallel else (selection(2, hidden_cols),)
    last = (("transpose", 1, 2),)  # (the ops' [E, K, N] layout)
    m = 0 if expert_parallel or shared is None else getattr(block, shared).get_submodule(
        _shared_names(getattr(block, shared))[0]).weight.shape[0] // hidden
    routed = ((0, 0, E),) if m else ()
    pieces = {"experts.gate_up_proj": [Piece("experts.gate_up_proj", tuple(gate_up.shape),
                                             turned + owned + rows + last, routed)],
              "experts.down_proj": [Piece("experts.down_proj", tuple(down.shape), turned + owned + down_cols + last,
                                          routed)]}
    if m:  # the shared expert's hidden units as m experts of width hidden, after the routed ones
        g, u, d = (f"{shared}.{name}.weight" for name in _shared_names(getattr(block, shared)))
        H, dim = m * hidden, down.shape[2] if turned else down.shape[1]
        split = (("view", (m, hidden, dim)), selection(1, hidden_cols)) + last
        pieces["experts.gate_up_proj"] += [Piece(name, (H, dim), split, ((0, E, E + m), part))
                                           for name, part in ((g, (2, 0, n)), (u, (2, n, 2 * n)))]
        pieces["experts.down_proj"].append(Piece(d, (dim, H), (("view", (dim, m, hidden)), ("transpose", 0, 1),
                                                               selection(2, hidden_cols)) + last, ((0, E, E + m),)))
    bias = getattr(experts, "gate_up_proj_bias", None)
    if isinstance(bias, torch.Tensor):
        pieces["experts.gate_up_proj_bias"] = [Piece("experts.gate_up_proj_bias", tuple(bias.shape), owned + rows)]
        if expert_parallel:  # (tensor parallel: the down biases are replicated DTensors, whole)
            b2 = experts.down_proj_bias
            pieces["experts.down_proj_bias"] = [Piece("experts.down_proj_bias", tuple(b2.shape), owned)]
    return {name: p for name, p in pieces.items() if any(piece.ops for piece in p)}


def _shared_names(mlp) -> tuple:
    """A shared expert's gate, up and down layers' names (``shared_weights`` reads them)."""
    return ("gate_proj", "up_proj", "down_proj") if hasattr(mlp, "gate_proj") else ("w1", "w3", "w2")


def _full_biases(experts):
    """(gate, up [E, hidden], down [E, dim]) biases of experts that have them (GPT-OSS's, gate and up interleaved as
    their weights), views; None for experts without."""
    b13 = getattr(experts, "gate_up_proj_bias", None)
    if not isinstance(b13, torch.Tensor):
        return None
    b13, b2 = b13.detach(), experts.down_proj_bias.detach()
    if not getattr(experts, "is_concatenated", True):
        return b13[:, 0::2], b13[:, 1::2], b2
    return *b13.chunk(2, dim=1), b2


def _shard_biases(b1, b3, b2, rank: int, world_size: int):
    """Rank ``rank``'s share of the experts' biases (gate ``b1``, up ``b3`` [E, hidden], down ``b2`` [E, dim]) as
    ``shard_experts`` shares their weights: (gate/up [E, 2 * hidden/W], its hidden columns of gate then of up, new;
    ``b2`` whole, new), the down bias added once per token whatever the share."""
    n = b1.shape[1] // world_size
    cols = slice(rank * n, (rank + 1) * n)
    return torch.cat([b1[:, cols], b3[:, cols]], dim=1).contiguous(), b2.clone()


def _biases(block):
    """(gate/up, down) biases of the block's experts as the style keeps them, or (None, None)."""
    experts = block.experts
    return getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None)


def _output(block, y, weights):
    """The block's output: ``y``, or (``y``, this rank's top-k weights) where its own forward returns a pair."""
    return (y, weights) if block.tp_pair else y


def _last_path(block) -> str | None:
    """The path the block's MoE ops took on their latest call (shared by every block with the same Context and
    fallback rule): ``"overlap"``, ``"fallback"``, or None before any call."""
    return _block_ops(block)[0].last_path


def _block_ops(block) -> tuple:
    """The AllGatherMoEGEMM and the MoEGEMMReduceScatter the block's forward and backward call (shared by every
    block with the same Context and fallback rule)."""
    return tuple(custom_ops.op_of(h) for h in block.tp_handles)


def _router_forward(gate, rows, bias=None):
    """The router on this rank's rows [T/W, dim] (``bias``: the block's correction bias, where the block holds
    it): (logits float32 [T/W, E], top-k weights float32, ids), the replicated weight's gradient left partial (this
    rank's tokens' part; DTensor sums it where read). Without
    sequence parallelism every rank routes every token: the top-k weights scale this rank's share of the experts,
    so their gradient is a partial sum as before, but the logits (which an auxiliary loss reads, the same on every
    rank) pass their gradient divided by W, which the ranks' sum makes whole again."""
    own = logit_bias(gate)  # (GPT-OSS's router: a bias of the logits, replicated as the weight)
    extra = {} if own is None else {"logit_bias": replicated_local(own)}
    logits, weights, ids = gate.tp_rule(gate, rows, replicated_local(gate.weight), bias, **extra)
    world = getattr(gate, "tp_replicated_world", 0)
    return (_ScaleGrad.apply(logits, 1.0 / world) if world else logits), weights, ids


class _ScaleGrad(torch.autograd.Function):
    """``x`` forward; its gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _local_tokens(block, hidden_states):
    """(this rank's tokens as a plain tensor, router jitter applied in training, the output's placements)."""
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
    return x, placements


def _block_forward(block, hidden_states):
    W = block.tp_style.ctx.world_size
    x, placements = _local_tokens(block, hidden_states)
    experts = block.experts
    x, w13, w2 = compute_operands("MoEParallel", x, experts.gate_up_proj, experts.down_proj)
    rows = x.reshape(-1, x.shape[-1])
    _, weights, ids = _route(block, rows)
    mine = weights, ids
    if block.tp_shared:
        name = block.tp_shared_gate
        gate = None if name is None else replicated_local(getattr(block, name).weight)
        weights, ids = add_shared_routes(rows, weights, ids, block.tp_experts, block.tp_shared, gate)
    ids, weights = gather_routes(weights, ids, block.tp_handles[0], W)
    b13, b2 = _biases(block)
    y = swiglu_experts(rows, w13, w2, ids, weights, block.tp_handles, W, block.tp_act, b13)
    if b2 is not None:  # (each token's down biases once, on its own rank)
        y = y + routed_bias(*mine, replicated_local(b2)).to(y.dtype)
    return _output(block, DTensor.from_local(y.view(x.shape), block.tp_mesh, placements, run_check=False), mine[0])


def _ep_block_forward(block, hidden_states):
    x, placements = _local_tokens(block, hidden_states)
    experts = block.experts
    x, w13, w2 = compute_operands("MoEParallel", x, experts.gate_up_proj, experts.down_proj)
    rows = x.reshape(-1, x.shape[-1])
    _, weights, ids = _route(block, rows)
    b13, b2 = _biases(block)
    y = _routed(rows, ids, weights, w13, w2, block.tp_ep_op, block.tp_experts, block.tp_act,
                None if b13 is None else (b13, b2))
    if block.tp_shared_name is not None:
        y = y + _shared_local(block, rows)
    return _output(block, DTensor.from_local(y.view(x.shape), block.tp_mesh, placements, run_check=False), weights)


@torch.compiler.disable  # the dispatch reads its counts back to the host: no graph can hold it
def _routed(rows, ids, weights, w13, w2, op, num_experts, act=SWIGLU, biases=None):
    return ep_swiglu(rows, ids, weights, w13, w2, op, num_experts, act=act, biases=biases)


def _shared_local(block, rows, part: int = 0, parts: int = 1):
    """The shared expert on ``rows`` with its (replicated) weights, gated by its sigmoid gate where the block has
    one; the weights' gradients left partial. ``part`` of ``parts``: that slice of its width only (the slices'
    outputs sum to the whole; any width)."""
    name = block.tp_shared_name
    mlp, gate = getattr(block, name), (getattr(block, SHARED[name]) if SHARED[name] else None)
    w1, w3, w2 = (replicated_local(getattr(mlp, n).weight) for n in ("gate_proj", "up_proj", "down_proj"))
    lo, hi = w1.shape[0] * part // parts, w1.shape[0] * (part + 1) // parts
    w1, w3, w2 = (w.to(rows.dtype) for w in (w1[lo:hi], w3[lo:hi], w2[:, lo:hi]))
    out = nn.functional.linear(nn.functional.silu(rows @ w1.t()) * (rows @ w3.t()), w2)
    return out if gate is None else out * shared_gate(rows, replicated_local(gate.weight)).to(out.dtype)


def _replicated_block_forward(block, hidden_states):
    """sequence_parallel=False: every token on every rank; this rank's share of the experts, summed over the ranks
    by one AllReduce (the class docstring)."""
    style, x = block.tp_style, hidden_states
    if isinstance(x, DTensor):
        if not all(isinstance(p, Replicate) for p in x.placements):
            raise ValueError(f"MoEParallel(sequence_parallel=False): input DTensor placed {x.placements}; expected "
                             f"Replicate()")
        x = x.to_local()
    if block.training and getattr(block, "jitter_noise", 0.0) > 0:
        raise ValueError("MoEParallel(sequence_parallel=False): Mixtral's router jitter in training would draw other "
                         "noise on each rank, hence other choices; set router_jitter_noise = 0 or run sequence "
                         "parallel")
    experts = block.experts
    x, w13, w2 = compute_operands("MoEParallel", x, experts.gate_up_proj, experts.down_proj)
    x = summed_grad(x, block.tp_mesh)  # (each rank's input gradient is a partial sum)
    rows = x.reshape(-1, x.shape[-1])
    _, weights, ids = _route(block, rows)
    mine, (b13, b2) = weights, _biases(block)
    if style.expert_parallel:  # (this rank's whole experts, their down biases among them)
        y = partial_experts(rows, ids, weights, w13, w2, block.tp_first, block.tp_act,
                            None if b13 is None else (b13, b2))
        if block.tp_shared_name is not None:
            y = y + _shared_local(block, rows, style.ctx.rank, style.ctx.world_size)
    else:
        if block.tp_shared:
            name = block.tp_shared_gate
            gate = None if name is None else replicated_local(getattr(block, name).weight)
            weights, ids = add_shared_routes(rows, weights, ids, block.tp_experts, block.tp_shared, gate)
        # (the replicated down biases: a W-th in each rank's share, so that the sum holds them once and each rank's
        # gradient is a W-th of the whole, as DTensor's partial gradient sums them)
        biases = None if b13 is None else (b13, replicated_local(b2) / style.ctx.world_size)
        y = partial_experts(rows, ids, weights, w13, w2, act=block.tp_act, biases=biases)
    return _output(block, custom_ops.all_reduce(y.to(x.dtype), block.tp_all_reduce).view(x.shape), mine)


def _ar_last_path(block) -> str | None:
    """The path the block's AllReduce took on its latest call (shared by every such block with the same Context and
    fallback rule): ``"overlap"`` (its kernels), ``"fallback"`` (the process group), or None before any call."""
    return _ar_ops(block)[0].last_path


def _ar_ops(block) -> tuple:
    """The AllReduce that sums the block's shares over the ranks."""
    return (custom_ops.op_of(block.tp_all_reduce),)


def _ep_last_path(block) -> str | None:
    """The path the block's ExpertParallel op took on its latest call (shared by every block with the same Context
    and fallback rule): ``"overlap"``, ``"fallback"``, or None before any call."""
    return block.tp_ep_op.last_path


def _ep_ops(block) -> tuple:
    """The ExpertParallel op the block's dispatches and combines run on."""
    return (block.tp_ep_op,)


__all__ = ["MoEParallel", "SHARED"]
