"""Tensor-parallel linear layers (sequence parallel) built on the overlapped ops, with autograd.

Activations are sequence-first, ``[S, *, features]``, and sharded along S
between the layers: ``ColumnParallelLinear`` takes ``[S/W, *, in]`` and gives
``[S, *, out/W]`` (AllGather-GEMM); ``RowParallelLinear`` takes
``[S, *, in/W]`` and gives ``[S/W, *, out]`` (GEMM-ReduceScatter). Each
backward uses the other op: the pair is closed under differentiation. The
layers call the custom ops of ``triton_overlap.library``, so ``torch.compile``
traces them (forward and backward) without graph breaks.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import library
from ..ops.ag_gemm import AllGatherGEMM
from ..ops.gemm_rs import GEMMReduceScatter


def _ops(layer):
    """Handles of one AllGatherGEMM and one GEMMReduceScatter per (Context, fallback rule), shared by the layers."""
    ctx, fallback = layer.ctx, layer.fallback
    ops = ctx.__dict__.setdefault("_nn_ops", {})
    if fallback not in ops:
        ops[fallback] = (library.handle(AllGatherGEMM(ctx, fallback=fallback, name=f"nn.ag.{fallback}")),
                         library.handle(GEMMReduceScatter(ctx, fallback=fallback, name=f"nn.rs.{fallback}")))
    return ops[fallback]


def _column(x, weight, bias, layer):
    ag, rs = layer._handles
    return library.ag_gemm(x, weight.t(), bias, ag, rs, layer.ctx.world_size, layer.keep_gathered_input)[0]


def _row(x, weight, bias, layer):
    ag, rs = layer._handles
    return library.gemm_rs(x, weight.t(), bias, rs, ag, layer.ctx.world_size)


class _TPLinear(nn.Module):
    def __init__(self, in_features, out_features, ctx, bias, dtype, device, shard_out, fallback):
        super().__init__()
        self.fallback = fallback
        self.ctx = ctx
        self._handles = _ops(self)
        W = ctx.world_size
        dim = out_features if shard_out else in_features
        if dim % W:
            raise ValueError(f"{type(self).__name__}: {'out' if shard_out else 'in'}_features = {dim} "
                             f"is not divisible by the world size {W}")
        self.ctx, self.in_features, self.out_features = ctx, in_features, out_features
        shape = (out_features // W, in_features) if shard_out else (out_features, in_features // W)
        kw = {"dtype": dtype or torch.bfloat16, "device": device or ctx.device}
        self.weight = nn.Parameter(torch.empty(shape, **kw))
        n_bias = out_features // W if shard_out else out_features
        self.bias = nn.Parameter(torch.zeros(n_bias, **kw)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @classmethod
    def from_full_weight(cls, linear: nn.Linear, ctx, **kw):
        """Shard an unsharded ``nn.Linear`` (same on every rank) into this layer."""
        extra = {k: v for k, v in kw.items() if k == "keep_gathered_input" and cls._shard_out}  # column layers
        layer = cls(linear.in_features, linear.out_features, ctx=ctx, bias=linear.bias is not None,
                    dtype=kw.get("dtype", linear.weight.dtype), device=kw.get("device", ctx.device),
                    fallback=kw.get("fallback", "auto"), **extra)
        with torch.no_grad():
            layer.weight.copy_(layer._shard(linear.weight, 0 if layer._shard_out else 1))
            if linear.bias is not None:
                layer.bias.copy_(layer._shard(linear.bias, 0) if layer._shard_out else linear.bias)
        return layer

    def _shard(self, t, dim):
        W, r = self.ctx.world_size, self.ctx.rank
        n = t.shape[dim] // W
        return t.narrow(dim, r * n, n)

    def forward(self, x):
        # [S, *rest, features] flattens sequence-first, so gathering or scattering rows moves whole positions
        y = self._fn(x.reshape(-1, x.shape[-1]), self.weight, self.bias, self)
        return y.reshape(-1, *x.shape[1:-1], y.shape[-1])


class ColumnParallelLinear(_TPLinear):
    """``[S/W, *, in]`` -> AllGather-GEMM -> ``[S, *, out/W]``. The weight holds rows ``r*out/W ...``.

    Backward: grad of the input through GEMM-ReduceScatter; grad of the weight
    from the gathered input. ``keep_gathered_input=True`` (default) keeps the
    gathered ``[S, in]`` from forward (memory held per layer until backward);
    ``False`` keeps only this rank's ``[S/W, in]`` and gathers again in
    backward with one NCCL all_gather, after the input-gradient GEMM-RS.
    """

    _fn, _shard_out = staticmethod(_column), True

    def __init__(self, in_features, out_features, *, ctx, bias=True, dtype=None, device=None, fallback="auto",
                 keep_gathered_input: bool = True):
        super().__init__(in_features, out_features, ctx, bias, dtype, device, shard_out=True, fallback=fallback)
        self.keep_gathered_input = keep_gathered_input


class RowParallelLinear(_TPLinear):
    """``[S, *, in/W]`` -> GEMM-ReduceScatter -> ``[S/W, *, out]``. The weight holds columns ``r*in/W ...``.

    Backward: grad of the input through AllGather-GEMM, whose gathered grad
    output also gives the grads of the weight and of the (replicated) bias.
    """

    _fn, _shard_out = staticmethod(_row), False

    def __init__(self, in_features, out_features, *, ctx, bias=True, dtype=None, device=None, fallback="auto"):
        super().__init__(in_features, out_features, ctx, bias, dtype, device, shard_out=False, fallback=fallback)



class TPMLP(nn.Module):
    """SwiGLU MLP: gate and up column-parallel (fused into one layer, so ``x`` is gathered once), down row-parallel.

    ``[S/W, *, dim]`` -> ``[S/W, *, dim]``; the hidden activations live as ``[S, *, hidden/W]``.
    """

    def __init__(self, dim, hidden, *, ctx, bias=False, dtype=None, device=None, fallback="auto",
                 keep_gathered_input=True):
        super().__init__()
        self.hidden_local = hidden // ctx.world_size
        self.gate_up = ColumnParallelLinear(dim, 2 * hidden, ctx=ctx, bias=bias, dtype=dtype, device=device,
                                            fallback=fallback, keep_gathered_input=keep_gathered_input)
        self.down = RowParallelLinear(hidden, dim, ctx=ctx, bias=bias, dtype=dtype, device=device, fallback=fallback)

    @classmethod
    def from_full(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, ctx, **kw):
        """Shard an unsharded SwiGLU MLP (``down(silu(gate(x)) * up(x))``), the same on every rank."""
        W = ctx.world_size
        dim, hidden = gate.in_features, gate.out_features
        if hidden % W:
            raise ValueError(f"TPMLP: hidden = {hidden} is not divisible by the world size {W}")
        n = hidden // W
        # rank r's rows of the fused layer are [gate rows of r; up rows of r]
        fused = nn.Linear(dim, 2 * hidden, bias=gate.bias is not None, dtype=gate.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([torch.cat([gate.weight[r * n:(r + 1) * n], up.weight[r * n:(r + 1) * n]])
                                          for r in range(W)]))
            if gate.bias is not None:
                fused.bias.copy_(torch.cat([torch.cat([gate.bias[r * n:(r + 1) * n], up.bias[r * n:(r + 1) * n]])
                                            for r in range(W)]))
        mlp = cls(dim, hidden, ctx=ctx, bias=gate.bias is not None, dtype=kw.get("dtype"), device=kw.get("device"),
                  fallback=kw.get("fallback", "auto"), keep_gathered_input=kw.get("keep_gathered_input", True))
        mlp.gate_up = ColumnParallelLinear.from_full_weight(fused, ctx, **kw)
        mlp.down = RowParallelLinear.from_full_weight(down, ctx, **kw)
        return mlp

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.hidden_local, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class ParallelTransformerBlock(nn.Module):
    """A pre-norm transformer block on a sequence sharded over the Context's ranks (zigzag, ``triton_overlap.cp``).

    ``[B, S/W, dim]`` -> ``[B, S/W, dim]``. Attention is context-parallel
    (``ContextParallelAttention``: every rank holds every head and the full
    q/k/v/out projections, and sees the whole sequence's K/V through the copy
    engines); the MLP is tensor-parallel (``TPMLP``: sharded weights, the
    sequence gathered by AllGather-GEMM and scattered back by
    GEMM-ReduceScatter, which works on any row order, zigzag included).

    The replicated parameters (norms, attention projections) get per-rank
    partial gradients: call ``sync_replicated_grads()`` after backward (a sum
    over ranks), or wrap them in your data-parallel reducer. No rotary
    embedding: positions in the zigzag layout come from ``cp.positions``.
    Packed documents: ``block(x, cu_seqlens=...)`` with B = 1 and ``x`` sharded
    with the same boundaries (``cp.shard(x, ctx, cu_seqlens=...)``); attention
    stays within each document, the MLP is row-wise.
    """

    def __init__(self, dim, n_heads, n_kv_heads, hidden, *, ctx, causal=True, dtype=None, device=None,
                 fallback="auto", attention_config=None):
        super().__init__()
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(f"ParallelTransformerBlock: dim {dim} must split into n_heads {n_heads}, a multiple "
                             f"of n_kv_heads {n_kv_heads}")
        from ..ops.cp_attention import ContextParallelAttention

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


__all__ = ["ColumnParallelLinear", "ParallelTransformerBlock", "RowParallelLinear", "TPMLP"]
