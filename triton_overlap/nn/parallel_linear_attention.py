"""A parallel style for the gated delta-rule linear attention of Hugging Face's Qwen3.5 and Qwen3-Next models
(transformers 5's ``Qwen3_5GatedDeltaNet``, ``Qwen3_5MoeGatedDeltaNet`` and ``Qwen3NextGatedDeltaNet``), for
``torch.distributed.tensor.parallel.parallelize_module``.

Their own plan gathers every projection to its full width on every rank ("colwise_gather_output"), so each rank
would compute every head's recurrence. Here each rank keeps its heads, as attention's column and row layers do: the
layer's heads are independent (its depthwise convolution mixes positions, not channels; its per-head decay
``A_log``, ``dt_bias`` and gates read their own head), so rank r keeps key heads ``[r·Hk/W, (r+1)·Hk/W)`` and
value heads ``[r·Hv/W, (r+1)·Hv/W)`` of everything. Qwen3.5's fused ``in_proj_qkv`` (query, key and value channels
one after the other) and the convolution over the same channels are reordered once, when the style is applied, so
that each rank's contiguous shard holds its query, key and value channels in that order; Qwen3-Next's
``in_proj_qkvz`` and ``in_proj_ba`` are laid out by key head already (each key head's query, key, values and gates
together), so that their contiguous shards are a rank's heads as they are, and only its convolution is reordered.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from .parallel import (FALLBACKS, RowwiseParallel, SharedInputColwise, check_mesh, replicated_local,
                       replicated_parameter, shard_rows, styled_class)
from .state_dict import rows_of

#: the projections that read the layer's input, in the order they are grouped into one AllGather-GEMM: Qwen3.5's,
#: and Qwen3-Next's (by key head)
IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
IN_PROJ_BY_HEAD = ("in_proj_qkvz", "in_proj_ba")
#: the attributes the layer's forward reads its widths from (made this rank's when applied)
WIDTHS = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")


class GatedDeltaNetParallel(ParallelStyle):
    """Qwen3.5's or Qwen3-Next's gated delta-rule layer (``linear_attn``), tensor parallel by heads (module
    docstring).

    Applied to the layer: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` (Qwen3-Next:
    ``in_proj_qkvz`` and ``in_proj_ba``) become one ``SharedInputColwise`` group (sequence parallel: the layer's
    input gathered once into one AllGather-GEMM), ``out_proj`` a ``RowwiseParallel`` layer (GEMM-ReduceScatter;
    without sequence parallelism GEMM + AllReduce); the convolution keeps this rank's channels, ``A_log`` and
    ``dt_bias`` its value heads (their gradients are complete: each head's sees every token); the gated norm's
    weight, shared by every head, becomes a replicated DTensor whose gradient is left partial (this rank's heads'
    part, summed by DTensor where read), as the router's of ``MoEParallel``. The layer's width attributes
    (``num_k_heads``, ``num_v_heads``, ``key_dim``, ``value_dim``, ``conv_dim``) become this rank's, so that its own
    forward reshapes its local heads; a KV cache holds this rank's heads' states; a padding mask is applied to the
    sequence shard before the gather. Both head counts must be divisible by W. The input projections are always one
    group (``hf_plan``'s ``shared_inputs`` does not apply). ``fallback`` and ``sequence_parallel`` as the linear
    styles'. The gated norm's rule is checked on a probe when applied (``x * rsqrt(mean(x²) + eps) * weight``, times
    ``silu(gate)``).
    """

    def __init__(self, ctx, *, fallback: str = "auto", sequence_parallel: bool = True):
        if fallback not in FALLBACKS:
            raise ValueError(f"GatedDeltaNetParallel: fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.ctx, self.fallback, self.sequence_parallel = ctx, fallback, bool(sequence_parallel)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        check_mesh(self, device_mesh)
        if hasattr(module, "tp_style"):
            raise ValueError(f"GatedDeltaNetParallel: {type(module).__name__} is parallelized already")
        projections = check_layer(module, "GatedDeltaNetParallel", self.ctx.world_size)
        W, r = self.ctx.world_size, self.ctx.rank
        parts = (module.key_dim, module.key_dim, module.value_dim)  # the query, key and value channels
        conv = module.conv1d
        every = [shard_rows(parts, W, q) for q in range(W)]  # each rank's channels (nn.state_dict records them)
        with torch.no_grad():
            if projections == IN_PROJ:  # every rank's query, key and value channels side by side, rank by rank
                qkv = module.in_proj_qkv
                qkv.weight = nn.Parameter(qkv.weight[torch.cat(every)].clone(), requires_grad=qkv.weight.requires_grad)
            conv.weight = nn.Parameter(conv.weight[every[r]].clone(), requires_grad=conv.weight.requires_grad)
            rows_of(conv, "weight", 0, every, self.ctx)
            for name in ("A_log", "dt_bias"):
                p = getattr(module, name)
                heads = [shard_rows([p.shape[0]], W, q) for q in range(W)]
                setattr(module, name, nn.Parameter(p[heads[r]].clone(), requires_grad=p.requires_grad))
                rows_of(module, name, 0, heads, self.ctx)
            module.norm.weight = replicated_parameter(module.norm.weight, device_mesh)
        conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]
        kw = dict(fallback=self.fallback, sequence_parallel=self.sequence_parallel)
        SharedInputColwise(self.ctx, projections, **kw)._apply(module, device_mesh)
        RowwiseParallel(self.ctx, **kw)._apply(module.out_proj, device_mesh)
        if projections == IN_PROJ:  # (reordered above: rank q's contiguous rows are its rows of the unmodified one)
            rows_of(module.in_proj_qkv, "weight", 0, every, self.ctx)
        for name in WIDTHS:
            setattr(module, name, getattr(module, name) // W)
        module.norm.__class__ = styled_class(type(module.norm), _gated_norm_forward, "GatedDeltaNetParallel")
        module.tp_style, module.tp_mesh = self, device_mesh
        module.__class__ = styled_class(type(module), _layer_forward, "GatedDeltaNetParallel")
        return module


def _layer_forward(module, hidden_states, *args, **kwargs):
    """The layer's own forward; in the sequence-parallel region (a DTensor sequence shard) a padding mask
    ``[B, S]`` is applied here, to this rank's positions, as the layer's first step applies it to the whole
    sequence (the mask is a plain tensor, which a DTensor does not multiply). The other arguments pass through as
    given: the cache is ``cache_params`` in transformers 5.17, ``cache`` in later releases; the mask comes after
    it, by name or third."""
    named = "attention_mask" in kwargs
    attention_mask = kwargs.get("attention_mask") if named else (args[1] if len(args) > 1 else None)
    if isinstance(hidden_states, DTensor) and attention_mask is not None:
        x = hidden_states
        W, r = module.tp_mesh.size(), module.tp_mesh.get_local_rank()
        s = x.shape[1] // W  # (batch-first: the sequence shard is dim 1, as torch's SequenceParallel places it)
        local = attention_mask.narrow(1, r * s, s)[:, :, None].to(x.dtype)
        hidden_states = (x * DTensor.from_local(local, module.tp_mesh, [Shard(1)], run_check=False)).to(x.dtype)
        if named:
            kwargs["attention_mask"] = None
        else:
            args = (args[0], None, *args[2:])
    return type(module).__mro__[1].forward(module, hidden_states, *args, **kwargs)


def check_layer(module: nn.Module, who: str, world: int | None = None) -> tuple:
    """The layer's input projections (``IN_PROJ``, or Qwen3-Next's ``IN_PROJ_BY_HEAD``); TypeError naming ``who``
    where ``module`` is not a gated delta-rule layer laid out as Qwen3.5's or Qwen3-Next's (those projections and
    ``out_proj`` as ``nn.Linear`` without biases, a depthwise ``conv1d`` over the query, key and value channels,
    ``A_log`` and ``dt_bias`` per value head, a gated RMSNorm ``norm`` of one head's width); ValueError where a head
    count is not divisible by ``world``."""
    name = type(module).__name__
    projections = IN_PROJ_BY_HEAD if hasattr(module, IN_PROJ_BY_HEAD[0]) else IN_PROJ
    linears = [getattr(module, n, None) for n in (*projections, "out_proj")]
    conv = getattr(module, "conv1d", None)
    widths = [getattr(module, n, None) for n in WIDTHS]
    if not all(type(m) is nn.Linear and m.bias is None for m in linears) or not isinstance(conv, nn.Conv1d) or \
            not all(isinstance(w, int) for w in widths):
        raise TypeError(f"{who}: {name} is not a gated delta-rule layer laid out as Qwen3.5's ({list(IN_PROJ)}) or "
                        f"Qwen3-Next's ({list(IN_PROJ_BY_HEAD)}), out_proj, all without biases, a depthwise conv1d, "
                        f"{list(WIDTHS)})")
    nk, nv, key_dim, value_dim, conv_dim = widths
    outs = [m.out_features for m in linears[:-1]]
    want = [conv_dim, value_dim, nv, nv] if projections == IN_PROJ else [conv_dim + value_dim, 2 * nv]
    if conv_dim != 2 * key_dim + value_dim or conv.groups != conv_dim or conv.bias is not None or outs != want or \
            {module.A_log.numel(), module.dt_bias.numel()} != {nv} or module.out_proj.in_features != value_dim or \
            nv % nk:
        raise TypeError(f"{who}: {name}'s widths are not a gated delta-rule layer's (query, key and value channels "
                        f"{key_dim} + {key_dim} + {value_dim} through a depthwise conv1d of {conv_dim}, "
                        f"{list(projections)} {want} wide, A_log and dt_bias per value head, value heads a multiple of "
                        f"key heads)")
    _check_gated_norm(module.norm, who, value_dim // nv)
    if world is not None and (nk % world or nv % world):
        raise ValueError(f"{who}: {name}'s {nk} key heads and {nv} value heads must be divisible by the world size "
                         f"{world}")
    return projections


def _check_gated_norm(norm: nn.Module, who: str, width: int) -> None:
    """TypeError naming ``who`` where ``norm`` is not a gated RMSNorm of ``width`` (checked on a float64 probe)."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, nn.Parameter) or tuple(weight.shape) != (width,) or not isinstance(eps, float) or \
            [n for n, _ in norm.named_parameters()] != ["weight"]:
        raise TypeError(f"{who}: {type(norm).__name__} is not a gated RMSNorm of one weight [{width}] and "
                        f"variance_epsilon")
    probe = copy.deepcopy(norm).to_empty(device="cpu").to(torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(width, generator=g, dtype=torch.float64))
        x, gate = (torch.randn(6, width, generator=g, dtype=torch.float64) for _ in range(2))
        own = type(probe).forward(probe, x, gate)
        mine = _gated_norm(x, gate, probe.weight, eps)
    if not (isinstance(own, torch.Tensor) and own.shape == mine.shape and
            torch.allclose(own, mine, rtol=1e-5, atol=1e-6)):
        raise TypeError(f"{who}: {type(norm).__name__} does not compute x * rsqrt(mean(x^2) + eps) * weight * "
                        f"silu(gate)")


def _gated_norm(x, gate, weight, eps):
    """RMSNorm of ``x`` in float32, times ``weight`` in ``x``'s dtype, times ``silu(gate)`` in float32; ``x``'s
    dtype."""
    h = x.float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * nn.functional.silu(gate.float())).to(x.dtype)


def _gated_norm_forward(norm, hidden_states, gate):
    """The gated norm on this rank's heads, its replicated weight's gradient left partial."""
    return _gated_norm(hidden_states, gate, replicated_local(norm.weight), norm.variance_epsilon)


__all__ = ["GatedDeltaNetParallel", "IN_PROJ", "IN_PROJ_BY_HEAD", "check_layer"]
