"""A transformer block on a sequence sharded over the ranks: context-parallel attention and a tensor-parallel MLP."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.context_parallel_attention import ContextParallelAttention
from .mlp import TPMLP


class ParallelTransformerBlock(nn.Module):
    """A pre-norm transformer block on a sequence sharded over the Context's ranks (zigzag, ``triton_overlap.zigzag``).

    ``[B, S/W, dim]`` -> ``[B, S/W, dim]``. Attention is context-parallel
    (``ContextParallelAttention``: every rank holds every head and the full
    q/k/v/out projections, and sees the whole sequence's K/V through the copy
    engines); the MLP is tensor-parallel (``TPMLP``: sharded weights, the
    sequence gathered by AllGather-GEMM and scattered back by
    GEMM-ReduceScatter, which works on any row order, zigzag included).

    The replicated parameters (norms, attention projections) get per-rank
    partial gradients: call ``sync_replicated_grads()`` after backward (a sum
    over ranks), or wrap them in your data-parallel reducer. No rotary
    embedding: positions in the zigzag layout come from ``zigzag.positions``.
    Packed documents: ``block(x, cu_seqlens=...)`` with B = 1 and ``x`` sharded
    with the same boundaries (``zigzag.shard(x, ctx, cu_seqlens=...)``); attention
    stays within each document, the MLP is row-wise.
    ``fallback`` is the MLP's (``TPMLP``); attention has no torch path (``ContextParallelAttention`` always runs
    its kernels).
    """

    def __init__(self, dim, n_heads, n_kv_heads, hidden, *, ctx, causal=True, dtype=None, device=None,
                 fallback="auto", attention_config=None):
        super().__init__()
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(f"ParallelTransformerBlock: dim {dim} must split into n_heads {n_heads}, a multiple "
                             f"of n_kv_heads {n_kv_heads}")
        kw = {"dtype": dtype or torch.bfloat16, "device": device or ctx.device}
        self.ctx, self.causal = ctx, causal
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.norm1 = nn.RMSNorm(dim, eps=1e-6, **kw)
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False, **kw)
        self.proj = nn.Linear(dim, dim, bias=False, **kw)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6, **kw)
        self.mlp = TPMLP(dim, hidden, ctx=ctx, dtype=kw["dtype"], device=kw["device"], fallback=fallback)
        self.attn = ContextParallelAttention(ctx, config=attention_config)

    def replicated_parameters(self):
        return [p for m in (self.norm1, self.qkv, self.proj, self.norm2) for p in m.parameters()]

    @torch.no_grad()
    def sync_replicated_grads(self):
        for p in self.replicated_parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=self.ctx.group)

    def forward(self, x, cu_seqlens=None):
        B, S, dim = x.shape
        hq, hk, d = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([hq * d, hk * d, hk * d], dim=-1)
        o, _ = self.attn(q.reshape(B, S, hq, d), k.reshape(B, S, hk, d), v.reshape(B, S, hk, d), causal=self.causal,
                         cu_seqlens=cu_seqlens)
        x = x + self.proj(o.reshape(B, S, dim))
        h = self.norm2(x).transpose(0, 1)  # sequence-first rows for the TP MLP
        return x + self.mlp(h).transpose(0, 1)


__all__ = ["ParallelTransformerBlock"]
