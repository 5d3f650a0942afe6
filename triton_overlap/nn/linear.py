"""Tensor-parallel linear layers (sequence parallel, and row-parallel without) built on the ops, with autograd.

Activations are sequence-first, ``[S, *, features]``, and sharded along S
between the layers: ``ColumnParallelLinear`` takes ``[S/W, *, in]`` and gives
``[S, *, out/W]`` (AllGather-GEMM); ``RowParallelLinear`` takes
``[S, *, in/W]`` and gives ``[S/W, *, out]`` (GEMM-ReduceScatter). Each
backward uses the other op: the pair is closed under differentiation. The
layers call the custom ops of ``triton_overlap.ops.custom_ops``, so ``torch.compile``
traces them (forward and backward) without graph breaks.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import skinny_gemm
from ..ops import custom_ops
from ..ops.all_gather_gemm import AllGatherGEMM
from ..ops.all_reduce import AllReduce
from ..ops.all_reduce_rmsnorm import AllReduceRMSNorm
from ..ops.gemm_all_reduce import GEMMAllReduce
from ..ops.gemm_reduce_scatter import GEMMReduceScatter
from .precision import compute_operands
from .state_dict import rows_of


def layer_ops(ctx, fallback: str):
    """Handles (``custom_ops.handle``) of one AllGatherGEMM and one GEMMReduceScatter per (Context, fallback rule),
    shared by every layer and parallel style with them: the column layer's forward and the row layer's backward
    call the first, the other two the second."""
    return ctx.cached(("nn ops", fallback), lambda: (
        custom_ops.handle(AllGatherGEMM(ctx, fallback=fallback, name=f"nn.ag.{fallback}")),
        custom_ops.handle(GEMMReduceScatter(ctx, fallback=fallback, name=f"nn.rs.{fallback}"))))


def gemm_ar_op(ctx, fallback: str) -> int:
    """The handle of the GEMMAllReduce per (Context, fallback rule) that row layers without sequence parallelism
    share."""
    return ctx.cached(("nn gemm_ar", fallback), lambda: custom_ops.handle(
        GEMMAllReduce(ctx, fallback=fallback, name=f"nn.ar.{fallback}")))


def all_reduce_op(ctx, fallback: str) -> int:
    """The handle of the AllReduce per (Context, fallback rule) that MoE blocks without sequence parallelism and
    norms over column-parallel outputs share."""
    return ctx.cached(("nn all_reduce", fallback), lambda: custom_ops.handle(
        AllReduce(ctx, fallback=fallback, name=f"nn.all_reduce.{fallback}")))


def column_rows(x, weight, bias, ctx, fallback: str, keep_gathered_input: bool = True):
    """AllGather-GEMM on rows, with autograd: ``x`` ``[R, in]`` this rank's rows, ``weight`` ``[out/W, in]`` (as
    ``nn.Linear`` stores it) -> ``[W*R, out/W]``, every rank's rows in rank order. The gathered input is kept for
    the weight's gradient only where it will have one (a frozen weight's layer, and a call without autograd,
    keep nothing)."""
    ag, rs = layer_ops(ctx, fallback)
    keep = keep_gathered_input and weight.requires_grad and torch.is_grad_enabled()
    return custom_ops.ag_gemm(x, weight.t(), bias, ag, rs, ctx.world_size, keep)[0]


def row_rows(x, weight, bias, ctx, fallback: str, sequence_parallel: bool = True):
    """GEMM-ReduceScatter on rows, with autograd: ``x`` ``[W*R, in/W]``, ``weight`` ``[out, in/W]`` ->
    ``[R, out]``, this rank's block of rows summed over the ranks; ``sequence_parallel=False``: GEMM + AllReduce,
    ``[M, in/W]`` -> ``[M, out]`` on every rank."""
    if not sequence_parallel:
        return custom_ops.gemm_ar(x, weight.t(), bias, gemm_ar_op(ctx, fallback))
    ag, rs = layer_ops(ctx, fallback)
    return custom_ops.gemm_rs(x, weight.t(), bias, rs, ag, ctx.world_size)


def local_linear(x, weight, bias=None):
    """``F.linear(x, weight, bias)`` for a layer's local product (a column-wise layer without sequence parallelism,
    a row-wise layer's partial before ``forward_rmsnorm``'s fused AllReduce): at decode (no autograd to record, at
    most ``kernels.skinny_gemm.MAX_ROWS`` rows of ``x``, a 16-bit weight of 4096 to 8192 rows by at least 4096, on
    an H100 or H200: ``skinny_gemm.usable``) a kernel that streams the weight faster than cuBLAS
    (docs/decisions.md, Decode's local products); otherwise ``F.linear`` itself."""
    return skinny_gemm.linear(x, weight, bias)


def _column(x, weight, bias, layer):
    return column_rows(x, weight, bias, layer.ctx, layer.fallback, layer.keep_gathered_input)


def _row(x, weight, bias, layer):
    return row_rows(x, weight, bias, layer.ctx, layer.fallback, layer.sequence_parallel)


class _TPLinear(nn.Module):
    def __init__(self, in_features, out_features, ctx, bias, dtype, device, shard_out, fallback):
        super().__init__()
        self.fallback = fallback
        self.ctx = ctx
        self._handles = layer_ops(ctx, fallback)
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
        # the unmodified nn.Linear's layout (nn.state_dict: full and DCP checkpoints, grads.grad_norm)
        every = [slice(q * (dim // W), (q + 1) * (dim // W)) for q in range(W)]
        rows_of(self, "weight", 0 if shard_out else 1, every, ctx)
        if bias and shard_out:
            rows_of(self, "bias", 0, every, ctx)

    @classmethod
    def from_full_weight(cls, linear: nn.Linear, ctx, **kw):
        """Shard an unsharded ``nn.Linear`` (same on every rank) into this layer. ``kw``: the constructor's keywords
        (``dtype``, default the linear's; ``device``; ``fallback``; the layer's own); others raise TypeError."""
        allowed = {"dtype", "device", "fallback", cls._own_keyword}
        unknown = sorted(set(kw) - allowed)
        if unknown:
            raise TypeError(f"{cls.__name__}.from_full_weight() got unexpected keyword arguments {unknown}; "
                            f"it takes {sorted(allowed)}")
        extra = {k: v for k, v in kw.items() if k == cls._own_keyword}
        layer = cls(linear.in_features, linear.out_features, ctx=ctx, bias=linear.bias is not None,
                    dtype=kw.get("dtype", linear.weight.dtype), device=kw.get("device", ctx.device),
                    fallback=kw.get("fallback", "auto"), **extra)
        with torch.no_grad():
            layer.weight.copy_(layer._shard(linear.weight, 0 if layer._shard_out else 1))
            if linear.bias is not None:
                layer.bias.copy_(layer._shard(linear.bias, 0) if layer._shard_out else linear.bias)
        return layer

    @property
    def ops(self):
        """The AllGatherGEMM and the GEMMReduceScatter this layer's forward and backward call (shared by every
        layer with the same Context and fallback rule)."""
        return tuple(custom_ops.op_of(h) for h in self._handles)

    def _shard(self, t, dim):
        W, r = self.ctx.world_size, self.ctx.rank
        n = t.shape[dim] // W
        return t.narrow(dim, r * n, n)

    @property
    def last_path(self) -> str | None:
        """The path this layer's forward op took on its last call: ``"overlap"`` (the overlapped kernels) or
        ``"fallback"`` (torch + the process group, where ``fallback="auto"`` judged the overlap cannot pay, or
        ``"always"``); None before any call. The op is shared by every layer with this Context and fallback rule,
        so this is the path of the latest such call."""
        return self._forward_op.last_path

    def forward(self, x):
        x, weight, bias = compute_operands(type(self).__name__, x, self.weight, self.bias)
        # [S, *rest, features] flattens sequence-first, so gathering or scattering rows moves whole positions
        y = self._fn(x.reshape(-1, x.shape[-1]), weight, bias, self)
        return y.reshape(-1, *x.shape[1:-1], y.shape[-1])


class ColumnParallelLinear(_TPLinear):
    """``[S/W, *, in]`` -> AllGather-GEMM -> ``[S, *, out/W]``. The weight holds rows ``r*out/W ...``.

    Backward: grad of the input through GEMM-ReduceScatter; grad of the weight
    from the gathered input. ``keep_gathered_input=True`` (default) keeps the
    gathered ``[S, in]`` from forward (memory held per layer until backward);
    ``False`` keeps only this rank's ``[S/W, in]`` and gathers again in
    backward with one NCCL all_gather, after the input-gradient GEMM-RS.
    """

    _fn, _shard_out, _own_keyword = staticmethod(_column), True, "keep_gathered_input"

    def __init__(self, in_features, out_features, *, ctx, bias=True, dtype=None, device=None, fallback="auto",
                 keep_gathered_input: bool = True):
        super().__init__(in_features, out_features, ctx, bias, dtype, device, shard_out=True, fallback=fallback)
        self.keep_gathered_input = keep_gathered_input
        self._forward_op = custom_ops.op_of(self._handles[0])


class RowParallelLinear(_TPLinear):
    """``[S, *, in/W]`` -> GEMM-ReduceScatter -> ``[S/W, *, out]``. The weight holds columns ``r*in/W ...``.

    Backward: grad of the input through AllGather-GEMM, whose gathered grad
    output also gives the grads of the weight and of the (replicated) bias.

    ``sequence_parallel=False``: ``[*, in/W]`` -> GEMM + AllReduce -> ``[*, out]`` on every rank (decode, or a
    layer whose activations are not sharded along the sequence); backward is local.
    """

    _fn, _shard_out, _own_keyword = staticmethod(_row), False, "sequence_parallel"

    def __init__(self, in_features, out_features, *, ctx, bias=True, dtype=None, device=None, fallback="auto",
                 sequence_parallel: bool = True):
        super().__init__(in_features, out_features, ctx, bias, dtype, device, shard_out=False, fallback=fallback)
        self.sequence_parallel = sequence_parallel
        self._forward_op = custom_ops.op_of(self._handles[1] if sequence_parallel else gemm_ar_op(ctx, fallback))

    @property
    def ops(self):
        """The ops this layer's forward and backward call: the AllGatherGEMM and the GEMMReduceScatter where
        sequence-parallel, the GEMMAllReduce alone without it (its backward is local; ``forward_rmsnorm`` takes an
        AllReduceRMSNorm instead); shared by every layer with the same Context and fallback rule."""
        return super().ops if self.sequence_parallel else (self._forward_op,)

    @torch.no_grad()
    def forward_rmsnorm(self, x, residual, norm_weight, eps: float):
        """Decode (inference, no autograd): this layer's output added to ``residual``, then the next block's
        RMSNorm, with the AllReduce, the add and the norm in one kernel (ops.all_reduce_rmsnorm): ``x`` [*, in/W]
        (16-bit, or float32 under autocast), ``residual`` [*, out] and ``norm_weight`` [out] the same on every rank
        -> ``(normed, new_residual)``, [*, out] each in the compute dtype, the same bits on every rank. The local
        GEMM's partial product (with the bias on rank 0 only, so the sum holds it once) goes to the fused kernel in
        place of GEMM + AllReduce; ``residual`` is not modified. Graph-safe as the AllReduce is."""
        x, weight, bias = compute_operands(type(self).__name__, x, self.weight, self.bias)
        part = local_linear(x, weight, bias if self.ctx.rank == 0 else None)
        op = self.ctx.cached(("nn all_reduce_rmsnorm", self.fallback), lambda: AllReduceRMSNorm(
            self.ctx, fallback=self.fallback, name=f"nn.ar_rmsnorm.{self.fallback}"))
        rows = part.reshape(-1, part.shape[-1])
        normed, new_residual = op(rows, residual.reshape(rows.shape).to(rows.dtype), norm_weight, eps=eps)
        return normed.view(part.shape), new_residual.view(part.shape)


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "column_rows", "gemm_ar_op", "layer_ops", "local_linear",
           "row_rows"]
