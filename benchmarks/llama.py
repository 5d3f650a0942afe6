"""A Llama-3 style decoder stack for the model-level benchmarks, and the plans that make it tensor parallel.

One module, three ways of running it, unmodified:

(a) on one device, as written;
(b) under torch's tensor + sequence parallelism (``tp_plan_torch``: torchtitan's plan, with torch's
    ColwiseParallel, RowwiseParallel(output_layouts=Shard(1)), SequenceParallel and PrepareModuleInput);
(c) under this project's styles (``tp_plan_ours``: triton_overlap.nn's SharedInputColwise on wq/wk/wv and on
    w1/w3 (ColwiseParallel on a fused wqkv / w13), RowwiseParallel on wo/w2, torch's SequenceParallel on the
    norms, ShardSequence on the embedding, GatherSequence on the final norm).

And for decode (one token per step against a KV cache, every activation replicated): ``decode_plan_ours``
(row-wise layers through GEMM + AllReduce), ``decode_plan_torch`` (torch's styles: matmul + NCCL all-reduce) and
``decode_plan_symm_mem`` (torch's symmetric-memory one-shot all-reduce); ``decode_fused_norm`` runs a step of
the model under ``decode_plan_ours`` with each AllReduce, residual add and next RMSNorm in one kernel.

Layout: batch-first ``[B, S, D]``; sequence parallel shards dim 1. Attention takes the sequence length and the
local head count from tensor shapes (``view(bs, seqlen, -1, head_dim)`` with ``seqlen`` from its input's
``.shape``), so it reads the global length from the DTensor that plan (c) hands it, and the replicated length
from plan (b)'s. The same work in (b) and (c): the embedding is replicated and its output sliced to this rank's
sequence shard in both, and the final norm runs on the gathered sequence in both. There is no output head
(``lm_head``): the step ends at the final norm, and the timing is the decoder stack's. The embedding is kept small
(32000 rows by default) so that the layers dominate the step.

``build(..., fuse_for=W)`` gives the same weights with fused projections (one ``wqkv``, one ``w13``, rows laid out
for W ranks; fuse_projections); the plans match either layout.
"""
from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle


@dataclasses.dataclass(frozen=True)
class Shape:
    """One decoder layer's sizes (the released Llama 3 configurations), and the stack's vocabulary."""

    name: str
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab: int = 32000
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


SHAPES = {
    "8b": Shape("llama3-8b", 4096, 32, 8, 14336),
    "70b": Shape("llama3-70b", 8192, 64, 8, 28672),
    "tiny": Shape("tiny", 64, 4, 2, 128, vocab=256),  # the host-backend test's
}


class RMSNorm(nn.Module):
    """Root-mean-square norm, written in elementwise ops (so DTensor runs it on any sharding), in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq: int, theta: float, device=None):
    """cos and sin, ``[max_seq, head_dim]`` float32, for the rotate-half form of rotary embeddings."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq, device=device, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate ``x`` ``[B, S, H, hd]`` by the positions' angles (``cos``, ``sin``: ``[S, hd]``), in float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[None, :, None, :] + rotated * sin[None, :, None, :]).type_as(x)


def local_rows(linear: nn.Linear) -> int:
    """Output features this rank computes: the weight's rows, the local shard's where it is a DTensor."""
    w = linear.weight
    return (w.to_local() if hasattr(w, "to_local") else w).shape[0]


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings; causal over the step's tokens, or over a KV cache.

    The head counts are never stored, only their ratio: they follow from the projections' outputs, so that the
    same code runs with every head here (one device) or a rank's share of them (tensor parallel)."""

    def __init__(self, s: Shape):
        super().__init__()
        self.head_dim = s.head_dim
        self.head_ratio = (s.n_heads, s.n_kv_heads)  # how a fused wqkv's output splits into q, k, v
        self.wq = nn.Linear(s.dim, s.n_heads * s.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.n_kv_heads * s.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.n_kv_heads * s.head_dim, bias=False)
        self.wo = nn.Linear(s.n_heads * s.head_dim, s.dim, bias=False)
        self.cache_k = self.cache_v = None

    def setup_cache(self, batch: int, max_seq: int, dtype, device) -> None:
        """A KV cache of ``max_seq`` positions for this rank's KV heads (call after parallelizing)."""
        if hasattr(self, "wqkv"):
            hq, hkv = self.head_ratio
            kv_rows = local_rows(self.wqkv) * hkv // (hq + 2 * hkv)
        else:
            kv_rows = local_rows(self.wk)
        shape = (batch, kv_rows // self.head_dim, max_seq, self.head_dim)
        self.cache_k = torch.zeros(shape, dtype=dtype, device=device)
        self.cache_v = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x, cos, sin, input_pos):
        return self.wo(self.attend(x, cos, sin, input_pos))

    def attend(self, x, cos, sin, input_pos):
        """The attention's output before ``wo``: ``[B, S, heads x head_dim]`` (this rank's heads)."""
        bs, seqlen, _ = x.shape  # the global sequence length where x is a sequence-sharded DTensor
        if hasattr(self, "wqkv"):  # fused (fuse_projections): this rank's [q | k | v] rows, in the heads' ratio
            qkv = self.wqkv(x)
            hq, hkv = self.head_ratio
            nk = qkv.shape[-1] * hkv // (hq + 2 * hkv)
            q, k, v = qkv.split([qkv.shape[-1] - 2 * nk, nk, nk], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bs, seqlen, -1, self.head_dim)
        k = k.view(bs, seqlen, -1, self.head_dim)
        v = v.view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if input_pos is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # decode: write this step's K/V at input_pos, attend to every position up to it
            self.cache_k.index_copy_(2, input_pos, k)
            self.cache_v.index_copy_(2, input_pos, v)
            positions = torch.arange(self.cache_k.shape[2], device=x.device)
            mask = positions[None, :] <= input_pos[:, None]
            out = F.scaled_dot_product_attention(q, self.cache_k, self.cache_v, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(bs, seqlen, -1)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, s: Shape):
        super().__init__()
        self.w1 = nn.Linear(s.dim, s.ffn_dim, bias=False)
        self.w3 = nn.Linear(s.dim, s.ffn_dim, bias=False)
        self.w2 = nn.Linear(s.ffn_dim, s.dim, bias=False)

    def forward(self, x):
        return self.w2(self.inner(x))

    def inner(self, x):
        """The SwiGLU's product before ``w2``: ``silu(x w1) * (x w3)`` (this rank's columns)."""
        if hasattr(self, "w13"):  # fused (fuse_projections): this rank's [w1 | w3] rows
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return F.silu(gate) * up


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.attention_norm = RMSNorm(s.dim, s.norm_eps)
        self.attention = Attention(s)
        self.ffn_norm = RMSNorm(s.dim, s.norm_eps)
        self.feed_forward = FeedForward(s)

    def forward(self, x, cos, sin, input_pos=None):
        # positional arguments: torch's PrepareModuleInput matches layouts to them one by one
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Embedding, ``n_layers`` blocks, final norm; no output head. ``forward(tokens)``: a training step's
    causal pass over ``tokens`` ``[B, S]``; ``forward(tokens, input_pos)``: decode, ``tokens`` ``[B, 1]`` at
    positions ``input_pos`` (a tensor, so a CUDA graph replays it at any position) against the KV cache."""

    def __init__(self, s: Shape, n_layers: int, max_seq: int):
        super().__init__()
        self.shape = s
        self.tok_embeddings = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList(Block(s) for _ in range(n_layers))
        self.norm = RMSNorm(s.dim, s.norm_eps)
        cos, sin = rope_tables(s.head_dim, max_seq, s.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def setup_cache(self, batch: int, max_seq: int) -> None:
        dtype, device = self.tok_embeddings.weight.dtype, self.rope_cos.device
        for layer in self.layers:
            layer.attention.setup_cache(batch, max_seq, dtype, device)

    def forward(self, tokens, input_pos=None):
        h = self.tok_embeddings(tokens)
        if input_pos is None:
            cos, sin = self.rope_cos[:tokens.shape[1]], self.rope_sin[:tokens.shape[1]]
        else:
            cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        for layer in self.layers:
            h = layer(h, cos, sin, input_pos)
        return self.norm(h)


def build(shape: Shape | str, n_layers: int, dtype=torch.bfloat16, device=None, max_seq: int = 16384,
          seed: int = 0, fuse_for: int = 0) -> Transformer:
    """The unsharded model, initialised on ``device`` from ``seed`` (the same weights on every rank, as
    parallelize_module expects), parameters in ``dtype``; the rotary tables stay float32. Weights ~ N(0, 0.02),
    the embedding ~ N(0, 1), norms 1, as torchtitan initialises them. ``fuse_for=W``: the same weights with
    fused projections laid out for W ranks (fuse_projections)."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    device = torch.device(device or "cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = Transformer(s, n_layers, max_seq)
        for name, p in model.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=1.0 if name == "tok_embeddings.weight" else 0.02)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return fuse_projections(model, fuse_for) if fuse_for else model


def _interleave(weights, shards: int):
    """Rows of ``weights`` concatenated shard by shard: ``[a_0 | b_0 | a_1 | b_1 ...]`` where ``a_r`` is shard r of
    ``a``'s rows, so that cutting the result into ``shards`` equal row blocks gives each rank its own part of
    every weight."""
    return torch.cat([part for parts in zip(*(w.chunk(shards, dim=0) for w in weights)) for part in parts])


def fuse_projections(model: Transformer, shards: int) -> Transformer:
    """Replace wq/wk/wv by one ``wqkv`` and w1/w3 by one ``w13``, rows laid out for ``shards`` ranks
    (_interleave): a column-wise split over that many ranks gives each its q, k, v heads and its gate and up
    features, and the model splits them by the heads' ratio. What gpt-fast does; with it a sequence-parallel
    column layer gathers its input once per attention and once per MLP, where separate projections gather it
    once per projection (torch's PrepareModuleInput gathers once for all three, and torch's async TP fuses one
    gather with several matmuls). Run only on ``shards`` ranks (1: a single device)."""
    for layer in model.layers:
        att, ff = layer.attention, layer.feed_forward
        with torch.no_grad():
            att.wqkv = _fused_linear([att.wq, att.wk, att.wv], shards)
            ff.w13 = _fused_linear([ff.w1, ff.w3], shards)
        del att.wq, att.wk, att.wv, ff.w1, ff.w3
    return model


def _fused_linear(linears, shards: int) -> nn.Linear:
    w = _interleave([lin.weight for lin in linears], shards)
    fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    fused.weight.copy_(w)
    return fused


def mesh_of(ctx):
    """A one-dimensional DeviceMesh over the Context's ranks (the default process group's, which the Context
    is expected to span) on the Context's device type."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(ctx.device.type, list(range(ctx.world_size)))


# ------------------------------------------------------------------------------------------------ training plans
def tp_plan_torch() -> dict:
    """torchtitan's tensor + sequence parallel plan on torch's own styles (plan (b)). Between the blocks the
    activations are this rank's sequence shard ``[B, S/W, D]``; each block's attention and feed-forward gather
    it (PrepareModuleInput), and their row-wise output layers reduce-scatter back to it. The embedding is
    replicated and its output sliced (PrepareModuleOutput; backward all-gathers), and the final norm gathers
    its input: the same work as plan (c)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    return {
        "tok_embeddings": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                 desired_input_layouts=(Replicate(), None, None, None)),
        "layers.*.attention.w[qkv]*": ColwiseParallel(),  # wq, wk, wv, or the fused wqkv
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w[13]*": ColwiseParallel(),  # w1, w3, or the fused w13
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                   use_local_output=True),
    }


def tp_plan_ours(ctx, fallback: str = "auto", fused: bool = False, shared: bool = True) -> dict:
    """The same model on this project's styles (plan (c)): AllGather-GEMM in wq/wk/wv/w1/w3, GEMM-ReduceScatter
    in wo/w2, the residual stream a DTensor sharded on the sequence. Separate projections (``fused=False``) as
    SharedInputColwise groups (wq/wk/wv, w1/w3: the input gathered once per group; ``shared=False``: a
    ColwiseParallel each, which gathers once per projection); ``fused=True``: the model of fuse_projections (one
    wqkv, one w13). ``fallback="always"``: the same layers on torch + the process group, no overlap kernels."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from triton_overlap.nn import ColwiseParallel, GatherSequence, RowwiseParallel, ShardSequence, SharedInputColwise

    col = lambda: ColwiseParallel(ctx, fallback=fallback)  # noqa: E731
    row = lambda: RowwiseParallel(ctx, fallback=fallback)  # noqa: E731
    if fused or not shared:
        columns = {"layers.*.attention.w[qkv]*": col(),  # wq, wk, wv, or the fused wqkv
                   "layers.*.feed_forward.w[13]*": col()}  # w1, w3, or the fused w13
    else:
        columns = {"layers.*.attention": SharedInputColwise(ctx, ("wq", "wk", "wv"), fallback=fallback),
                   "layers.*.feed_forward": SharedInputColwise(ctx, ("w1", "w3"), fallback=fallback)}
    return {
        "tok_embeddings": ShardSequence(ctx),
        "layers.*.attention_norm": SequenceParallel(),
        **columns,
        "layers.*.attention.wo": row(),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward.w2": row(),
        "norm": GatherSequence(ctx),
    }


# -------------------------------------------------------------------------------------------------- decode plans
_COLUMNS = ("layers.*.attention.w[qkv]*", "layers.*.feed_forward.w[13]*")  # separate or fused projections
_ROWS = ("layers.*.attention.wo", "layers.*.feed_forward.w2")


def decode_plan_ours(ctx, fallback: str = "auto") -> dict:
    """Decode on this project's styles: replicated activations, column-wise layers a local matmul, row-wise
    layers GEMM + AllReduce (sequence_parallel=False). Embedding and norms stay replicated."""
    from triton_overlap.nn import ColwiseParallel, RowwiseParallel

    return {**{k: ColwiseParallel(ctx, sequence_parallel=False, fallback=fallback) for k in _COLUMNS},
            **{k: RowwiseParallel(ctx, sequence_parallel=False, fallback=fallback) for k in _ROWS}}


def decode_plan_torch() -> dict:
    """Decode on torch's styles: a local matmul in the column-wise layers, matmul + NCCL all-reduce (the
    DTensor Partial -> Replicate) in the row-wise ones."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**{k: ColwiseParallel() for k in _COLUMNS}, **{k: RowwiseParallel() for k in _ROWS}}


def decode_plan_symm_mem(group_name: str) -> dict:
    """Decode with torch's symmetric-memory one-shot all-reduce after each row-wise matmul
    (``torch.ops.symm_mem.one_shot_all_reduce``; needs enable_symm_mem_for_group first, and GPUs)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {**{k: ColwiseParallel() for k in _COLUMNS}, **{k: SymmMemRowwise(group_name) for k in _ROWS}}


def decode_fused_norm(model: Transformer, tokens, input_pos, op):
    """A decode step of ``model`` parallelized with decode_plan_ours, in which each row-wise layer's partial
    product goes with the residual to ``op`` (a triton_overlap AllReduceRMSNorm): the AllReduce, the residual add
    and the next RMSNorm (the block's ffn_norm after ``wo``, the next block's attention_norm or the final norm
    after ``w2``) in one kernel. Returns what ``model(tokens, input_pos)`` returns."""
    x = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[input_pos], model.rope_sin[input_pos]
    layers = list(model.layers)
    normed = layers[0].attention_norm(x)
    for i, block in enumerate(layers):
        after = layers[i + 1].attention_norm if i + 1 < len(layers) else model.norm
        normed, h = _row_norm(block.attention.wo, block.attention.attend(normed, cos, sin, input_pos), x,
                              block.ffn_norm, op)
        normed, x = _row_norm(block.feed_forward.w2, block.feed_forward.inner(normed), h, after, op)
    return normed


def _row_norm(linear: nn.Linear, a, residual, norm: RMSNorm, op):
    """``(norm(residual + Σ_ranks a Wᵀ), residual + Σ_ranks a Wᵀ)`` for a row-wise layer without bias (this rank's
    columns of W), the sum, the add and the norm by ``op``; the partial product as the row-wise layer's
    ``forward_rmsnorm`` takes it (triton_overlap.nn.local_linear)."""
    from triton_overlap.nn import local_linear

    w = linear.weight
    part = local_linear(a, w.to_local() if hasattr(w, "to_local") else w)
    rows = part.reshape(-1, part.shape[-1])
    normed, new_residual = op(rows, residual.reshape(rows.shape), norm.weight, eps=norm.eps)
    return normed.view(part.shape), new_residual.view(part.shape)


class SymmMemRowwise(ParallelStyle):
    """A row-wise ``nn.Linear`` (this rank's columns of the weight, a plain tensor) whose partial output the
    matmul writes straight into a symmetric-memory buffer, summed across ranks by torch's one-shot all-reduce.
    Inference only. The buffer of an input shape is made on its first call, before any CUDA-graph capture."""

    def __init__(self, group_name: str):
        super().__init__()
        self.group_name = group_name

    def _apply(self, module, device_mesh):
        W, r = device_mesh.size(), device_mesh.get_local_rank()
        shard = module.weight.detach().chunk(W, dim=1)[r].contiguous()
        module.weight = nn.Parameter(shard, requires_grad=False)
        module.forward = types.MethodType(_symm_mem_forward, module)
        module._symm_bufs, module._symm_group = {}, self.group_name
        return module


def _symm_mem_forward(self, x):
    import torch.distributed._symmetric_memory as symm_mem

    x2 = x.reshape(-1, x.shape[-1])
    key = (x2.shape[0], self.weight.shape[0], x.dtype)
    buf = self._symm_bufs.get(key)
    if buf is None:
        buf = symm_mem.empty(*key[:2], dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, self._symm_group)
        self._symm_bufs[key] = buf
    torch.mm(x2, self.weight.t(), out=buf)
    out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self._symm_group)
    return out.view(*x.shape[:-1], out.shape[-1])


def parallelize(model: Transformer, mesh, plan: dict) -> Transformer:
    """``parallelize_module(model, mesh, plan)``, warnings about unmatched keys turned into errors (a plan that
    silently skips a layer would compare different work)."""
    import warnings

    from torch.distributed.tensor.parallel import parallelize_module

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Parallelize plan key")
        return parallelize_module(model, mesh, plan)


def flops_per_token(s: Shape, n_layers: int, seq: int) -> float:
    """Forward + backward FLOPs per token of the stack (6 x matmul parameters, plus causal attention's
    ``6 * S * D`` per layer, half of the full ``12 * S * D``); for reading tokens/s as TFLOP/s."""
    hd = s.head_dim
    per_layer = s.dim * hd * (2 * s.n_heads + 2 * s.n_kv_heads) + 3 * s.dim * s.ffn_dim
    return n_layers * (6 * per_layer + 6 * seq * s.n_heads * hd)


__all__ = ["SHAPES", "Shape", "Transformer", "build", "decode_fused_norm", "decode_plan_ours",
           "decode_plan_symm_mem", "decode_plan_torch", "flops_per_token", "mesh_of", "parallelize", "tp_plan_ours",
           "tp_plan_torch"]
