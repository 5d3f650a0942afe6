"""A whole model's plan for ``parallelize_module`` from the tensor-parallel plan the model already ships: Hugging Face
transformers' causal LMs declare which linear layers are column- and row-wise (``config.base_model_tp_plan``) and
which modules open and close the stack of layers (``config.base_model_pp_plan``); ``hf_plan`` maps both onto this
project's styles, so that ``parallelize_module(model, mesh, hf_plan(model, ctx))`` is the whole change to a model."""
from __future__ import annotations

import copy
import re

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from .parallel import (ColwiseParallel, GatherSequence, ReplicatedLatent, RowwiseParallel, ShardSequence,
                       SharedInputColwise, shard_rows)
from .parallel_attention import SINK_LAYERS, FusedQKVParallel, SinkAttentionParallel, check_fused_qkv, \
    check_sink_attention
from .parallel_moe import MoEParallel, check_block
from .parallel_linear_attention import IN_PROJ, IN_PROJ_BY_HEAD, GatedDeltaNetParallel, check_layer
from .parallel_norm import ColwiseRMSNorm, check_norm

#: a vocabulary-parallel embedding's strategies: these styles keep the embedding whole on every rank
KEPT_WHOLE = ("embedding_rowwise", "embedding_colwise")
#: the strategies that mark a sparse-MoE block's ``experts``: "moe_tp_experts" in ``base_model_tp_plan`` (transformers
#: up to 5.24), "ep_dispatch_experts" in ``base_model_ep_plan`` (from 5.25, where the tp plan no longer names experts)
EXPERTS = ("moe_tp_experts", "ep_dispatch_experts")
#: the strategy that marks multi-head latent attention's kv down-projection (transformers 5.25), and that attention's
#: down-projections as DeepSeek-V2/V3 name them -> (the latent's norm, its up-projection)
MLA_STRATEGY = "mla_kv_a_proj"
MLA = {"kv_a_proj_with_mqa": ("kv_a_layernorm", "kv_b_proj"), "q_a_proj": ("q_a_layernorm", "q_b_proj")}
#: attention whose plan gathers q/k/v to their full width for a norm over all heads (OLMo-2/3, OLMoE, FlexOlmo,
#: MiniMax-M2): "colwise_gather_output" layers of these names -> the whole-width norm that reads each (None: none),
#: and the "rowwise_split_input" output projection beside them
GATHERED = {"q_proj": "q_norm", "k_proj": "k_norm", "v_proj": None}
GATHERED_OUT = "o_proj"
#: the styles that take a whole attention module (its layers inside it are no plan entries of their own)
WHOLE_MODULE = (GatedDeltaNetParallel, FusedQKVParallel, SinkAttentionParallel)
#: an MLP whose plan gathers its fused gate/up layer because the model splits its output in two (GLM-4's):
#: (that layer, the "rowwise_split_input" down-projection)
HALVED = ("gate_up_proj", "down_proj")
#: attention whose plan gathers its fused q/k/v layer because the module slices it at offsets computed from its head
#: counts (Phi-3's, Phi-4's): (that layer, the "rowwise_split_input" output projection)
FUSED_QKV = ("qkv_proj", "o_proj")


def hf_plan(model: nn.Module, ctx, *, fallback: str = "auto", sequence_parallel: bool = True,
            shared_inputs: bool = True, expert_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The plan that makes a Hugging Face transformers model tensor parallel over ``ctx``'s ranks with this
    project's styles, by concrete module name, from the model's own ``config.base_model_tp_plan`` (docs/design.md
    lists the models it has run on). ``ctx`` may be None to inspect a plan (no width is then checked):

    * "colwise" linear layers: ``ColwiseParallel``; those of one module (q/k/v, gate/up) as one
      ``SharedInputColwise`` on that module (``shared_inputs=False``, and models that clamp q/k/v in place,
      ``config.clip_qkv``: a ``ColwiseParallel`` each);
    * "rowwise" linear layers: ``RowwiseParallel``;
    * multi-head latent attention (DeepSeek-V2/V3, Kimi K2: its kv down-projection "mla_kv_a_proj"): the
      down-projections ``ReplicatedLatent`` (sequence parallel: the narrow latent gathered), the up-projections local
      ``ColwiseParallel`` layers over it;
    * a sparse-MoE block (its ``experts`` marked in the model's tp or ep plan, ``EXPERTS``): ``MoEParallel`` on the
      block (``expert_parallel=True``: its experts spread over the ranks, ``MoEParallel``'s docstring);
    * an MLP whose plan gathers its fused ``gate_up_proj`` for the model to split it in two ("colwise_gather_output",
      "rowwise_split_input" on ``down_proj``: GLM-4): ``ColwiseParallel(chunks=2)``, this rank's half of the gate's
      and of the up's columns, and ``RowwiseParallel`` (a probe checks that the down-projection reads each hidden
      column from its own gate and up);
    * attention whose plan gathers q/k/v to the full width for a norm over all heads and splits the output
      projection's input again ("colwise_gather_output" on ``q_proj``/``k_proj``/``v_proj``, "rowwise_split_input"
      on ``o_proj``: OLMo-2/3, OLMoE, FlexOlmo, MiniMax-M2): the projections column- and row-wise as above, each
      rank keeping its heads, and the whole-width ``q_norm``/``k_norm`` ``ColwiseRMSNorm`` (their mean square summed
      over the ranks by one AllReduce);
    * attention whose plan gathers its fused ``qkv_proj`` for the module to slice it at offsets computed from its
      head counts ("colwise_gather_output", ``o_proj`` "rowwise_split_input": Phi-3, Phi-4): ``FusedQKVParallel``
      on the attention, each rank keeping its query and key/value heads, the module's head counts this rank's;
    * attention with a learned sink per query head (a parameter ``sinks``: GPT-OSS, whose plan leaves the attention
      out): ``SinkAttentionParallel`` on the attention, q/k/v column-wise, ``o_proj`` row-wise, each rank keeping
      its heads and their sinks;
    * Qwen3.5's and Qwen3-Next's gated delta-rule linear attention (every projection "colwise_gather_output"):
      ``GatedDeltaNetParallel`` on the layer, each rank keeping its heads;
    * per-head norms ("replicated_with_grad_allreduce": Qwen3's q/k norms, which read this rank's heads of
      ``[B, S, heads, head_dim]``; and those the plan leaves out, GLM-4.5's: a norm of ``head_dim`` elements beside
      a column-wise layer): torch's ``SequenceParallel`` on the heads' dimension, so that their weights' gradients
      are summed over the ranks;
    * the embedding and the LM head (vocabulary-parallel in the model's plan) stay whole on every rank.

    Refused with ValueError, naming the module, before any change to the model: a strategy these styles do not
    reproduce ("colwise_gather_output" and "rowwise_split_input" but on the attention and MLPs above; Hugging Face's
    other local or packed strategies, also on a parameter), a plan with no column or row layer, a sharded width
    (or an attention projection's heads) not divisible by the world size, and a module inside the decoder layers
    with parameters that the plan leaves out (an activation's learned scalars), whose gradient would be this
    rank's part only. A sparse-MoE block that ``MoEParallel`` cannot compute raises its TypeError, as do a norm or
    a linear attention layer that ``ColwiseRMSNorm`` or ``GatedDeltaNetParallel`` cannot.

    The model takes the full token ids ``[B, S]`` on every rank (S divisible by the world size, sequence parallel)
    and returns the full logits on every rank. A model is parallelized once: prefill and decode with different
    plans need two copies of it.

    ``sequence_parallel`` (the default, for training and prefill): the residual stream between the layers is each
    rank's sequence shard: ``ShardSequence`` on the embedding, torch's ``SequenceParallel`` on the norms of each
    decoder layer, ``GatherSequence`` on the final norm (``config.base_model_pp_plan``'s first module, its list of
    layers and its last module; without that plan, the base model's ``embed_tokens``, ``layers`` and ``norm``).
    ``False`` (decode): column layers multiply locally and row layers run GEMM + AllReduce; a sparse-MoE block
    computes this rank's share of its experts for every token, summed by one AllReduce (``MoEParallel``'s
    docstring). ``fallback`` goes to every style that takes one. Every rank must hold
    the same full weights, as for torch's own styles."""
    config = getattr(model, "config", None)
    # (GPT-OSS declares no tp plan before transformers 5.25: its ep plan marks the experts)
    tp = getattr(config, "base_model_tp_plan", None) or {}
    if not tp and not expert_keys(config):
        raise ValueError(f"hf_plan: {type(model).__name__} has no config.base_model_tp_plan (a Hugging Face "
                         f"transformers model declares one); write the plan by hand (README, 'Using it': the styles)")
    prefix = getattr(model, "base_model_prefix", "")
    prefix = prefix + "." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    modules = dict(model.named_modules())
    styled = next((n for n, m in modules.items() if hasattr(m, "tp_style")), None)
    if styled is not None:
        raise ValueError(f"hf_plan: {type(model).__name__} is parallelized already ({styled} has a parallel style); "
                         f"a model is parallelized once: make the plan of an unmodified copy")
    rules = [(_pattern(prefix, k), k, v) for k, v in tp.items()]
    found = {}  # concrete module or parameter name -> (strategy, the tp plan's key)
    for name in [*modules, *(n for n, _ in model.named_parameters())]:
        for pattern, key, strategy in rules:
            if pattern.match(name):
                found[name] = (strategy, key)
    world = None if ctx is None else ctx.world_size
    col = ColwiseParallel(ctx, fallback=fallback, sequence_parallel=sequence_parallel)
    row = RowwiseParallel(ctx, fallback=fallback, sequence_parallel=sequence_parallel)
    heads = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan: dict[str, ParallelStyle] = {}
    experts = [_pattern(prefix, k) for k in expert_keys(config)]
    blocks = {_parent(n) for n in modules if any(p.match(n) for p in experts)}
    for block in sorted(blocks):
        try:  # (raised now, naming the block and what the style cannot take, not halfway through)
            check_block(modules[block], world, expert_parallel)
        except (TypeError, ValueError) as e:
            raise type(e)(f"hf_plan: {block}: {e}") from None
        plan[block] = MoEParallel(ctx, fallback=fallback, expert_parallel=expert_parallel,
                                  sequence_parallel=sequence_parallel)
    latent = _latent_attention(modules, found, config, ctx, sequence_parallel)
    plan.update(latent.styles)
    plan.update(_gathered_attention(modules, found, ctx, fallback))
    halved = _halved_mlps(modules, found)
    plan.update(_linear_attention(modules, found, ctx, fallback, sequence_parallel))
    plan.update(_fused_qkv_attention(modules, found, ctx, fallback, sequence_parallel))
    plan.update(_sink_attention(modules, found, ctx, fallback, sequence_parallel, shared_inputs))
    columns: dict[str, list[str]] = {}
    whole = blocks | {n for n, style in plan.items() if isinstance(style, WHOLE_MODULE)}
    for name, (strategy, key) in found.items():
        if any(name == b or name.startswith(b + ".") for b in whole):
            continue  # inside a sparse-MoE block or an attention layer whose style takes the whole module
        if strategy in KEPT_WHOLE and isinstance(modules.get(name), nn.Embedding) or name in latent.styles:
            continue
        if strategy in ("colwise", "rowwise"):
            m = modules.get(name)
            if type(m) is not nn.Linear:
                raise ValueError(f"hf_plan: {name} ({type(m).__name__ if m is not None else 'a parameter'}) is "
                                 f"{strategy!r} in the model's plan ({key!r}); these styles take nn.Linear layers")
            width = m.out_features if strategy == "colwise" else m.in_features
            if world is not None and width % world:
                raise ValueError(f"hf_plan: {name} is {strategy!r} in the model's plan, but its "
                                 f"{'output' if strategy == 'colwise' else 'input'} width {width} is not divisible "
                                 f"by the world size {world}")
            head_dim = getattr(modules.get(_parent(name)), "head_dim", None)  # (an attention layer's projection)
            if world is not None and isinstance(head_dim, int) and head_dim > 0 and width % head_dim == 0 \
                    and width // head_dim % world:
                raise ValueError(f"hf_plan: {name} is {strategy!r} in the model's plan, but its {width // head_dim} "
                                 f"heads (of {head_dim}) are not divisible by the world size {world}: a rank would "
                                 f"hold part of a head")
            if strategy == "colwise" and name in latent.ups:  # reads the gathered latent: a local product
                plan[name] = ColwiseParallel(ctx, fallback=fallback, sequence_parallel=False)
            elif name in halved:  # its output split in two by the model: this rank's half of each
                plan[name] = ColwiseParallel(ctx, fallback=fallback, sequence_parallel=sequence_parallel, chunks=2)
            elif strategy == "colwise":
                columns.setdefault(_parent(name), []).append(name)
            else:
                plan[name] = row
        elif strategy == "replicated_with_grad_allreduce":
            plan[name] = heads
        else:
            raise ValueError(f"hf_plan: {name} is {strategy!r} in the model's plan ({key!r}), which these styles do "
                             f"not reproduce; write the plan by hand (README, 'Using it': the styles)")
    if not columns and not plan:
        raise ValueError(f"hf_plan: the plan of {type(model).__name__} names no column or row linear layer "
                         f"({sorted(set(tp.values()))}); write the plan by hand (README, 'Using it': the styles)")
    clipped = getattr(config, "clip_qkv", None) is not None  # (OLMo's q/k/v clamped in place: no shared views)
    for parent, names in columns.items():  # (layers reading inputs of different widths cannot share one)
        clamped = clipped and any(n.endswith(("q_proj", "k_proj", "v_proj")) for n in names)
        if shared_inputs and not clamped and len(names) > 1 and len({modules[n].in_features for n in names}) == 1:
            plan[parent] = SharedInputColwise(ctx, tuple(n[len(parent) + 1:] for n in names), fallback=fallback,
                                              sequence_parallel=sequence_parallel)
        else:
            plan.update({n: col for n in names})
    layers = _layers(model, modules, prefix, tp)
    plan.update({n: heads for n in _head_norms(modules, found, layers) if n not in plan})
    if sequence_parallel:
        plan.update(_sequence_edges(modules, *_ends(model, modules, prefix, layers), layers, ctx))
    _check_covered(modules, plan, layers, sequence_parallel, latent.norms)
    return plan


class _Latent:
    """What ``_latent_attention`` found: ``styles`` (down-projection name -> ReplicatedLatent), ``ups`` (the
    up-projections' names) and ``norms`` (the latents' norms' names)."""

    def __init__(self):
        self.styles, self.ups, self.norms = {}, set(), set()


def _gathered_attention(modules, found, ctx, fallback: str) -> dict[str, ParallelStyle]:
    """Attention whose plan gathers q/k/v ("colwise_gather_output", ``GATHERED``) for a norm over all heads and
    splits ``o_proj``'s input ("rowwise_split_input"): its entries in ``found`` become "colwise" and "rowwise" (each
    rank keeps its heads), and a whole-width norm of a projection's output is returned with ``ColwiseRMSNorm``
    (a per-head norm, ``head_dim`` wide, is then left to ``_head_norms``). Other layouts are left as they are
    (and refused)."""
    styles: dict[str, ParallelStyle] = {}
    for out, (strategy, key) in list(found.items()):
        parent = _parent(out)
        if strategy != "rowwise_split_input" or out != f"{parent}.{GATHERED_OUT}" or \
                type(modules.get(out)) is not nn.Linear:
            continue
        gathered = [n for n, (s, _) in found.items() if _parent(n) == parent and s == "colwise_gather_output"]
        if not gathered or any(n.rsplit(".", 1)[1] not in GATHERED or type(modules.get(n)) is not nn.Linear
                               for n in gathered):
            continue
        norms = {}
        head_dim = getattr(modules.get(parent), "head_dim", None)
        for n in gathered:
            norm = GATHERED[n.rsplit(".", 1)[1]]
            m = modules.get(f"{parent}.{norm}") if norm else None
            weight = getattr(m, "weight", None)
            if m is None or isinstance(m, nn.Identity) or isinstance(weight, nn.Parameter) and \
                    weight.numel() == head_dim:
                continue  # no norm, or a per-head one
            if not isinstance(weight, nn.Parameter):
                raise ValueError(f"hf_plan: {parent}.{norm} reads {n}'s output and has no weight; ColwiseRMSNorm "
                                 f"takes an RMSNorm with one; write the plan by hand")
            if weight.numel() != modules[n].out_features:
                raise ValueError(f"hf_plan: {parent}.{norm} reads {n}'s output ({modules[n].out_features} wide) but "
                                 f"its weight has {weight.numel()} elements; write the plan by hand")
            check_norm(m, f"hf_plan: {parent}.{norm}")
            norms[f"{parent}.{norm}"] = ColwiseRMSNorm(ctx, fallback=fallback)
        styles.update(norms)
        for n in gathered:
            found[n] = ("colwise", found[n][1])
        found[out] = ("rowwise", key)
    return styles


def _sink_attention(modules, found, ctx, fallback: str, sequence_parallel: bool,
                    shared_inputs: bool) -> dict[str, ParallelStyle]:
    """Attention with a parameter ``sinks`` of its own (a learned sink per query head: GPT-OSS's, whose plan names
    none of its layers): ``SinkAttentionParallel`` on the module, where the plan leaves its q/k/v/o layers out or
    names them "colwise" and "rowwise" (other strategies are left to the rules, and refused)."""
    world = None if ctx is None else ctx.world_size
    styles: dict[str, ParallelStyle] = {}
    for name, m in modules.items():
        if "sinks" not in dict(m.named_parameters(recurse=False)):
            continue
        planned = {n: found[f"{name}.{n}"][0] for n in SINK_LAYERS if f"{name}.{n}" in found}
        if any(strategy != ("rowwise" if n == SINK_LAYERS[-1] else "colwise") for n, strategy in planned.items()):
            continue
        try:
            check_sink_attention(m, world)
        except (TypeError, ValueError) as e:
            raise type(e)(f"hf_plan: {name}: {e}") from None
        styles[name] = SinkAttentionParallel(ctx, fallback=fallback, sequence_parallel=sequence_parallel,
                                             shared_inputs=shared_inputs)
    return styles


def _halved_mlps(modules, found) -> set[str]:
    """The fused gate/up layers (``HALVED``) whose plan gathers their output for the model to split it in two
    ("colwise_gather_output", the down-projection "rowwise_split_input"), where the down-projection reads each
    hidden column from that column's gate and up alone (``_splits_by_column``): their entries in ``found`` become
    "colwise" and "rowwise", and their names are returned (``ColwiseParallel(chunks=2)``). Other layouts are left as
    they are (and refused)."""
    halved = set()
    fused, down = HALVED
    for name, (strategy, key) in list(found.items()):
        parent = _parent(name)
        if strategy != "colwise_gather_output" or name != f"{parent}.{fused}" or \
                found.get(f"{parent}.{down}", ("",))[0] != "rowwise_split_input" or \
                not _splits_by_column(modules[parent], fused, down):
            continue
        found[name] = ("colwise", key)
        found[f"{parent}.{down}"] = ("rowwise", found[f"{parent}.{down}"][1])
        halved.add(name)
    return halved


def _splits_by_column(mlp, fused: str, down: str) -> bool:
    """Whether ``mlp`` (its ``fused`` gate/up and ``down`` nn.Linear layers, no other parameter) feeds ``down`` a
    function of each hidden column's gate and up alone: with half of the gate's and of the up's outputs, ``down``'s
    input is those columns of the whole layer's (so each rank's down-projection reads its own columns). Checked on a
    probe: a shallow copy of the MLP whose two layers are small float64 stand-ins on the CPU (8 hidden columns), so
    that the check costs nothing at a real model's size; any error of the probe is a no."""
    up, out = getattr(mlp, fused, None), getattr(mlp, down, None)
    if type(up) is not nn.Linear or type(out) is not nn.Linear or out.in_features * 2 != up.out_features or \
            any(n.partition(".")[0] not in (fused, down) for n, _ in mlp.named_parameters()):
        return False
    g = torch.Generator().manual_seed(0)
    hidden, dim = 8, 4
    gate_up = nn.Linear(dim, 2 * hidden, bias=up.bias is not None).to(torch.float64)
    downs = nn.Linear(hidden, dim, bias=out.bias is not None).to(torch.float64)
    probe = copy.copy(mlp)
    probe._modules = {**mlp._modules, fused: gate_up, down: downs}
    seen = []
    downs.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            for p in (*gate_up.parameters(), *downs.parameters()):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
            x = torch.randn(3, dim, generator=g, dtype=torch.float64)
            type(mlp).forward(probe, x)  # (not the MLP's hooks)
            whole, full = seen.pop(), [t.clone() for t in gate_up.parameters()]
            for r in range(2):
                half = torch.arange(r * hidden // 2, (r + 1) * hidden // 2)
                rows = shard_rows((hidden, hidden), 2, r)  # (this half's gate rows, then its up rows)
                gate_up._parameters["weight"] = nn.Parameter(full[0][rows])
                if gate_up.bias is not None:
                    gate_up._parameters["bias"] = nn.Parameter(full[1][rows])
                gate_up.out_features, downs.in_features = hidden, hidden // 2
                downs._parameters["weight"] = nn.Parameter(torch.randn(dim, hidden // 2, generator=g,
                                                                       dtype=torch.float64))
                type(mlp).forward(probe, x)
                if not torch.allclose(seen.pop(), whole[:, half], rtol=1e-12, atol=1e-12):
                    return False
    except Exception:  # noqa: BLE001 - an MLP the probe cannot run is not one this style can take
        return False
    return True


def _linear_attention(modules, found, ctx, fallback: str, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Qwen3.5's and Qwen3-Next's gated delta-rule layers, whose plans gather every projection
    ("colwise_gather_output" on ``IN_PROJ`` or ``IN_PROJ_BY_HEAD`` and ``out_proj``): ``GatedDeltaNetParallel`` on
    the layer, which keeps each rank's heads (its TypeError or ValueError, naming the layer, where it cannot take
    it)."""
    styles: dict[str, ParallelStyle] = {}
    world = None if ctx is None else ctx.world_size
    for name, (strategy, _) in found.items():
        parent = _parent(name)
        projections = next((p for p in (IN_PROJ, IN_PROJ_BY_HEAD) if name == f"{parent}.{p[0]}"), None)
        if strategy != "colwise_gather_output" or projections is None or parent in styles:
            continue
        if any(found.get(f"{parent}.{n}", ("",))[0] != "colwise_gather_output" for n in (*projections, "out_proj")):
            continue
        try:
            check_layer(modules[parent], "GatedDeltaNetParallel", world)
        except (TypeError, ValueError) as e:
            raise type(e)(f"hf_plan: {parent}: {e}") from None
        styles[parent] = GatedDeltaNetParallel(ctx, fallback=fallback, sequence_parallel=sequence_parallel)
    return styles


def _fused_qkv_attention(modules, found, ctx, fallback: str, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Attention whose plan gathers its fused q/k/v layer ("colwise_gather_output" on ``FUSED_QKV[0]``,
    "rowwise_split_input" on ``FUSED_QKV[1]``: Phi-3's, Phi-4's): ``FusedQKVParallel`` on the attention module (its
    TypeError or ValueError, naming the module, where it cannot take it)."""
    styles: dict[str, ParallelStyle] = {}
    world = None if ctx is None else ctx.world_size
    qkv, out = FUSED_QKV
    for name, (strategy, _) in found.items():
        parent = _parent(name)
        if strategy != "colwise_gather_output" or name != f"{parent}.{qkv}" or \
                found.get(f"{parent}.{out}", ("",))[0] != "rowwise_split_input":
            continue
        try:
            check_fused_qkv(modules[parent], world, qkv, out)
        except (TypeError, ValueError) as e:
            raise type(e)(f"hf_plan: {parent}: {e}") from None
        styles[parent] = FusedQKVParallel(ctx, fallback=fallback, sequence_parallel=sequence_parallel, qkv=qkv,
                                          out=out)
    return styles


def _latent_attention(modules, found, config, ctx, sequence_parallel: bool) -> _Latent:
    """Multi-head latent attention (DeepSeek-V2/V3's, Kimi K2's), where the model's plan marks a kv down-projection
    ``MLA_STRATEGY``: each down-projection of ``MLA`` becomes a ``ReplicatedLatent`` (the kv one with its rotary
    key's ``config.qk_rope_head_dim`` columns as ``partial_tail``), its up-projection a ``ColwiseParallel`` without
    sequence parallelism (it reads the gathered latent), and its norm runs unstyled on the latent, which every rank
    holds whole. ValueError, naming the module, for any other layout."""
    latent = _Latent()
    for name, (strategy, key) in found.items():
        if strategy != MLA_STRATEGY:
            continue
        parent, rope = _parent(name), getattr(config, "qk_rope_head_dim", None)
        attn = modules.get(parent)
        norm, up = MLA["kv_a_proj_with_mqa"]
        if not name.endswith(".kv_a_proj_with_mqa") or not isinstance(rope, int) or not isinstance(
                getattr(attn, up, None), nn.Linear) or not isinstance(getattr(attn, norm, None), nn.Module):
            raise ValueError(f"hf_plan: {name} is {strategy!r} in the model's plan ({key!r}); these styles take "
                             f"DeepSeek-V2/V3's latent attention (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, and "
                             f"config.qk_rope_head_dim); write the plan by hand")
        for down, (norm, up) in MLA.items():
            if getattr(attn, down, None) is None:  # (no q_a_proj where q_lora_rank is None: q_proj reads the stream)
                continue
            if found.get(f"{parent}.{up}", ("",))[0] != "colwise":
                raise ValueError(f"hf_plan: {parent}.{up} reads the latent of {parent}.{down} but is not 'colwise' "
                                 f"in the model's plan; write the plan by hand")
            tail = rope if down == "kv_a_proj_with_mqa" else 0
            latent.styles[f"{parent}.{down}"] = ReplicatedLatent(ctx, sequence_parallel=sequence_parallel,
                                                                 partial_tail=tail)
            latent.ups.add(f"{parent}.{up}")
            latent.norms.add(f"{parent}.{norm}")
    return latent


def expert_keys(config) -> list[str]:
    """The keys of a Hugging Face config's tp and ep plans that mark a sparse-MoE block's experts (``EXPERTS``)."""
    plans = (getattr(config, "base_model_tp_plan", None) or {}, getattr(config, "base_model_ep_plan", None) or {})
    return [k for plan in plans for k, v in plan.items() if v in EXPERTS]


def _pattern(prefix: str, key: str) -> re.Pattern:
    """A plan's key (``layers.*.mlp.experts``) as the pattern of the concrete names it stands for."""
    return re.compile(re.escape(prefix + key).replace(r"\*", r"[^.]+") + "$")


def _ends(model, modules, prefix, layers: str):
    """(embedding, final norm): ``config.base_model_pp_plan``'s first and last entries, with ``layers`` between
    them (a dropout between the embedding and the layers is left as it is); without that plan, transformers'
    convention: ``embed_tokens`` (an ``nn.Embedding``), ``layers`` and ``norm`` (a norm), children of one module in
    that order (OLMoE, Granite-MoE, Hunyuan-MoE); else ValueError."""
    stages = [prefix + s for s in getattr(model.config, "base_model_pp_plan", None) or ()]
    base = layers[:-len("layers")]  # "model." (or "" for a base model)
    if not stages and layers.endswith("layers") and (not base or base.endswith(".")):
        names = [n for n, _ in modules[base[:-1]].named_children()]
        embed, norm = modules.get(f"{base}embed_tokens"), modules.get(f"{base}norm")
        if isinstance(embed, nn.Embedding) and norm is not None and type(norm).__name__.lower().endswith("norm") \
                and names.index("embed_tokens") < names.index("layers") < names.index("norm"):
            return f"{base}embed_tokens", f"{base}norm"
    if layers not in stages[1:-1] or any(s not in modules for s in stages):
        raise ValueError(f"hf_plan: sequence parallelism needs the model's embedding, layers and final norm "
                         f"(config.base_model_pp_plan), found {[s[len(prefix):] for s in stages]} in "
                         f"{type(model).__name__}; sequence_parallel=False, or write the plan by hand")
    return stages[0], stages[-1]


def _layers(model, modules, prefix, tp) -> str:
    """The name of the decoder layers' ModuleList: the part of the tp plan's keys (and the ep plan's, where the tp
    plan names no layer: GPT-OSS's) before their first ``.*``."""
    ep = getattr(model.config, "base_model_ep_plan", None) or {}
    for keys in (tp, [*tp, *ep]):
        heads = {prefix + k.split(".*", 1)[0] for k in keys if ".*" in k}
        lists = sorted(h for h in heads if isinstance(modules.get(h), nn.ModuleList))
        if len(lists) == 1:
            return lists[0]
    raise ValueError(f"hf_plan: cannot tell the decoder layers of {type(model).__name__} from its plan's keys "
                     f"({sorted(tp)}); write the plan by hand (README, 'Using it': the styles)")


def _head_norms(modules, found, layers: str) -> list[str]:
    """Per-head norms that the model's plan leaves out (GLM-4.5's q/k norms): a norm inside the decoder layers, its
    weight ``head_dim`` elements of the module holding it, beside a layer the plan shards column-wise. It reads
    this rank's heads ``[B, S, heads, head_dim]``, as Qwen3's q/k norms, which that model's plan marks
    "replicated_with_grad_allreduce", so it takes their style (torch's ``SequenceParallel`` on the heads' dim)."""
    norms = []
    for name, m in modules.items():
        parent = _parent(name)
        head_dim, weight = getattr(modules.get(parent), "head_dim", None), getattr(m, "weight", None)
        if name.startswith(layers + ".") and name not in found and type(m).__name__.lower().endswith("norm") \
                and isinstance(head_dim, int) and isinstance(weight, nn.Parameter) and weight.numel() == head_dim \
                and any(_parent(n) == parent and s == "colwise" for n, (s, _) in found.items()):
            norms.append(name)
    return norms


def _check_covered(modules, plan, layers: str, sequence_parallel: bool, whole=()) -> None:
    """ValueError for a module inside the decoder layers whose own parameters no style of ``plan`` takes, where
    it reads part of the activations (this rank's heads or columns, or, sequence parallel, this rank's tokens) and
    so its gradient would be this rank's part only. Without sequence parallelism a decoder layer's direct children
    with no sharded layer inside them (its norms) read the whole residual stream, the same on every rank, and need
    no style; nor do the modules named in ``whole``, which read activations every rank holds whole (latent
    attention's norms)."""
    covered = set(whole)
    for name, style in plan.items():
        if isinstance(style, SharedInputColwise):
            covered.update(f"{name}.{m}" for m in style.layers)
        elif isinstance(style, (MoEParallel, *WHOLE_MODULE)):
            covered.update(n for n in modules if n == name or n.startswith(name + "."))
        else:
            covered.add(name)
    for name, m in modules.items():
        if not name.startswith(layers + ".") or name in covered:
            continue
        own = [n for n, _ in m.named_parameters(recurse=False)]
        depth = name[len(layers) + 1:].count(".")  # 0: a decoder layer, 1: its direct child
        sharded_below = any(c.startswith(name + ".") for c in covered)
        if own and (sequence_parallel or depth > 1 or sharded_below):
            raise ValueError(f"hf_plan: {name} ({type(m).__name__}) has parameters {own} that the model's plan "
                             f"leaves out; it reads this rank's part of the activations, so their gradients would "
                             f"be this rank's part only; write the plan by hand (README, 'Using it': the styles)")


def _sequence_edges(modules, embed: str, norm: str, layers: str, ctx) -> dict[str, ParallelStyle]:
    """The sequence-parallel region's edges and norms: ShardSequence on the embedding, SequenceParallel on each
    decoder layer's own norms, GatherSequence on the final norm."""
    edges: dict[str, ParallelStyle] = {embed: ShardSequence(ctx), norm: GatherSequence(ctx)}
    for layer_name, layer in modules[layers].named_children():
        for child, m in layer.named_children():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.lower().endswith("norm"):
                edges[f"{layers}.{layer_name}.{child}"] = SequenceParallel()
    return edges


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


__all__ = ["hf_plan"]
