"""Parallel styles for attention that the model's own plan does not shard as Llama's: one whose query, key and value
projections are one linear layer that the module slices at offsets computed from its head counts (Phi-3's and
Phi-4's ``qkv_proj``: each rank keeps its query and key/value heads, and the module's head counts become this
rank's, so that its own slicing finds them), and one with a learned sink per query head that the model's plan
leaves out altogether (GPT-OSS's)."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from .parallel import FALLBACKS, ColwiseParallel, RowwiseParallel, SharedInputColwise, check_mesh, shard_rows
from .state_dict import rows_of

#: the module attributes holding head counts that the style makes this rank's
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads")


class LocalHeadsConfig:
    """A view of a model's config in which ``num_attention_heads`` and ``num_key_value_heads`` are one rank's;
    every other attribute is read from the model's config when asked (live: a later change of the attention
    implementation is seen)."""

    def __init__(self, config, heads: int, kv_heads: int):
        self._config = config
        self.num_attention_heads, self.num_key_value_heads = heads, kv_heads

    def __getattr__(self, name):
        if name == "_config":  # (not set yet: a copy being made)
            raise AttributeError(name)
        return getattr(self._config, name)


def check_fused_qkv(module: nn.Module, world: int | None = None, qkv: str = "qkv_proj", out: str = "o_proj"):
    """(query heads, key/value heads, head_dim) of attention this style takes, or TypeError / ValueError naming
    what differs: ``qkv`` and ``out`` plain ``nn.Linear`` layers, the module's ``head_dim``, its config's
    ``num_attention_heads`` and a key/value head count (the module's ``num_key_value_heads``, else the config's),
    ``qkv`` producing the query heads, then the key heads, then the value heads (``(H + 2 * H_kv) * head_dim``
    features), ``out`` reading ``H * head_dim``, no parameters of the module's own; with ``world``, both head counts
    divisible by it."""
    name = type(module).__name__
    layers = getattr(module, qkv, None), getattr(module, out, None)
    config, head_dim = getattr(module, "config", None), getattr(module, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(module, "num_key_value_heads", getattr(config, "num_key_value_heads", None))
    if any(type(m) is not nn.Linear for m in layers) or not all(isinstance(v, int) for v in (head_dim, heads, kv)):
        raise TypeError(f"FusedQKVParallel: {name} must hold nn.Linear {qkv} and {out}, an int head_dim and its "
                        f"config's num_attention_heads and num_key_value_heads")
    if isinstance(config, LocalHeadsConfig):
        raise ValueError(f"FusedQKVParallel: {name} is parallelized already")
    if layers[0].out_features != (heads + 2 * kv) * head_dim or layers[1].in_features != heads * head_dim:
        raise TypeError(f"FusedQKVParallel: {name}.{qkv} has {layers[0].out_features} output features and {out} "
                        f"{layers[1].in_features} input features; with {heads} query and {kv} key/value heads of "
                        f"{head_dim} they must be {(heads + 2 * kv) * head_dim} and {heads * head_dim}")
    own = [n for n, _ in module.named_parameters(recurse=False)]
    if own:
        raise TypeError(f"FusedQKVParallel: {name} has parameters of its own {own}, which the style would not split")
    if world is not None and (heads % world or kv % world):
        raise ValueError(f"FusedQKVParallel: {name}'s {heads} query and {kv} key/value heads are not divisible by "
                         f"the world size {world}")
    return heads, kv, head_dim


class FusedQKVParallel(ParallelStyle):
    """Attention with one fused q/k/v layer that the module slices at offsets it computes from its head counts
    (Phi-3, Phi-4: ``qkv_proj``, rows of the query heads, then of the key heads, then of the value heads; its
    model's own plan gathers that layer's output to the full width on every rank, "colwise_gather_output", and
    splits ``o_proj``'s input again). Here each rank keeps its heads instead: ``ColwiseParallel(chunks=(H * D,
    H_kv * D, H_kv * D))`` on ``qkv_proj`` (its slice of each part), ``RowwiseParallel`` on ``o_proj``, and the
    module's head counts become this rank's: its ``config`` is a ``LocalHeadsConfig`` over the model's, and its
    own ``num_heads``, ``num_attention_heads``, ``num_key_value_heads`` attributes are divided by W. Its other
    attributes (``head_dim``, the groups of query heads per key/value head) are unchanged. ``sequence_parallel``
    and ``fallback`` go to both layers' styles."""

    def __init__(self, ctx, *, fallback: str = "auto", sequence_parallel: bool = True, qkv: str = "qkv_proj",
                 out: str = "o_proj"):
        if fallback not in FALLBACKS:
            raise ValueError(f"FusedQKVParallel: fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.ctx, self.fallback, self.sequence_parallel = ctx, fallback, bool(sequence_parallel)
        self.qkv, self.out = qkv, out

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        check_mesh(self, device_mesh)
        W = self.ctx.world_size
        heads, kv, d = check_fused_qkv(module, W, self.qkv, self.out)
        kw = dict(fallback=self.fallback, sequence_parallel=self.sequence_parallel)
        styles = ((ColwiseParallel(self.ctx, chunks=(heads * d, kv * d, kv * d), **kw), getattr(module, self.qkv)),
                  (RowwiseParallel(self.ctx, **kw), getattr(module, self.out)))
        for style, layer in styles:  # (both checked before either changes)
            style._check(layer, device_mesh)
        for style, layer in styles:
            style._apply(layer, device_mesh)
        module.config = LocalHeadsConfig(module.config, heads // W, kv // W)
        for attr in HEAD_COUNTS:
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, getattr(module, attr) // W)
        module.tp_style = self
        return module


#: the projections of attention with sinks (q, k, v, then the output projection)
SINK_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj")


def check_sink_attention(module: nn.Module, world: int | None = None) -> tuple[int, int]:
    """(query heads, key/value heads) of attention ``SinkAttentionParallel`` takes, or TypeError / ValueError naming
    what differs: plain ``nn.Linear`` ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj``, an int ``head_dim`` that
    divides their widths, a parameter ``sinks`` of one value per query head and no other parameter of the module's
    own; with ``world``, both head counts divisible by it."""
    name = type(module).__name__
    layers = [getattr(module, n, None) for n in SINK_LAYERS]
    head_dim, sinks = getattr(module, "head_dim", None), getattr(module, "sinks", None)
    if any(type(m) is not nn.Linear for m in layers) or not isinstance(head_dim, int) or \
            not isinstance(sinks, nn.Parameter) or sinks.dim() != 1:
        raise TypeError(f"SinkAttentionParallel: {name} must hold nn.Linear {', '.join(SINK_LAYERS)}, an int head_dim "
                        f"and a parameter sinks [heads]")
    q, k, v, o = layers
    heads, kv = q.out_features // head_dim, k.out_features // head_dim
    if q.out_features % head_dim or k.out_features % head_dim or v.out_features != k.out_features or \
            o.in_features != q.out_features or sinks.numel() != heads:
        raise TypeError(f"SinkAttentionParallel: {name}'s widths (q {q.out_features}, k {k.out_features}, v "
                        f"{v.out_features}, o reads {o.in_features}, {sinks.numel()} sinks) are not those of heads "
                        f"of {head_dim} with one sink each")
    own = [n for n, _ in module.named_parameters(recurse=False) if n != "sinks"]
    if own:
        raise TypeError(f"SinkAttentionParallel: {name} has parameters of its own {own}, which the style would not "
                        f"split")
    if world is not None and (heads % world or kv % world):
        raise ValueError(f"SinkAttentionParallel: {name}'s {heads} query and {kv} key/value heads are not divisible "
                         f"by the world size {world}")
    return heads, kv


class SinkAttentionParallel(ParallelStyle):
    """Attention with a learned sink per query head (GPT-OSS's ``sinks`` [H]: a logit that each head's softmax
    counts beside the keys', then drops), whose model's plan leaves the attention out: each rank keeps its heads.
    ``q_proj``, ``k_proj`` and ``v_proj`` column-wise (one ``SharedInputColwise``: the input gathered once for all
    three; ``shared_inputs=False``: a ``ColwiseParallel`` each), ``o_proj`` ``RowwiseParallel``, and ``sinks`` this
    rank's heads' values ([H/W]: the heads whose rows ``q_proj`` keeps), whose gradient is then theirs whole. The
    module splits its projections' outputs into heads of ``head_dim`` (their number inferred), so it needs no
    attribute of its own changed. ``sequence_parallel`` and ``fallback`` go to the layers' styles."""

    def __init__(self, ctx, *, fallback: str = "auto", sequence_parallel: bool = True, shared_inputs: bool = True):
        if fallback not in FALLBACKS:
            raise ValueError(f"SinkAttentionParallel: fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.ctx, self.fallback, self.sequence_parallel = ctx, fallback, bool(sequence_parallel)
        self.shared_inputs = bool(shared_inputs)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        check_mesh(self, device_mesh)
        W, r = self.ctx.world_size, self.ctx.rank
        heads, _ = check_sink_attention(module, W)
        kw = dict(fallback=self.fallback, sequence_parallel=self.sequence_parallel)
        col, row = ColwiseParallel(self.ctx, **kw), RowwiseParallel(self.ctx, **kw)
        *inputs, out = (getattr(module, n) for n in SINK_LAYERS)
        for layer in inputs:  # (every layer checked before any changes)
            col._check(layer, device_mesh)
        row._check(out, device_mesh)
        if self.shared_inputs:
            SharedInputColwise(self.ctx, SINK_LAYERS[:3], **kw)._apply(module, device_mesh)
        else:
            for layer in inputs:
                col._apply(layer, device_mesh)
        row._apply(out, device_mesh)
        every = [shard_rows([heads], W, q) for q in range(W)]
        with torch.no_grad():
            module.sinks = nn.Parameter(module.sinks[every[r]].clone(), requires_grad=module.sinks.requires_grad)
        rows_of(module, "sinks", 0, every, self.ctx)
        module.tp_style = self
        return module


__all__ = ["FusedQKVParallel", "LocalHeadsConfig", "SinkAttentionParallel", "check_fused_qkv",
           "check_sink_attention"]
