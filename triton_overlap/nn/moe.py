"""A tensor-parallel mixture-of-experts layer (SwiGLU experts, softmax top-k router) on the MoE ops, with autograd.

Like ``TPMLP``, activations are sequence-first and sharded along the sequence between layers: ``[S/W, *, dim]`` ->
``[S/W, *, dim]``. Every rank holds every expert, with a slice of each expert's hidden width; the tokens of all ranks
meet at each rank's experts:

* router (replicated, logits in float32) on this rank's tokens, then every rank's top-k ids and weights gathered;
* gate/up, column-sharded ``[E, dim, 2 * hidden/W]``: ``ag_moe_gemm`` gathers the tokens once, by copy engine,
  behind the grouped GEMM, and returns its rows in this rank's expert-sorted layout;
* ``silu(gate) * up`` on those rows, in that layout (no permutation back to token order);
* down, row-sharded ``[E, hidden/W, dim]``: ``moe_gemm_rs`` on the sorted rows, the top-k weighted combine and the
  reduce-scatter to each token's owner behind its grouped GEMM.

The layer calls the custom ops of ``triton_overlap.ops.custom_ops`` (``ag_moe``, ``moe_rs``), so ``torch.compile``
traces forward and backward without graph breaks.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops import custom_ops
from ..ops.all_gather_moe import AllGatherMoEGEMM
from ..ops.moe_reduce_scatter import MoEGEMMReduceScatter
from .precision import COMPUTE_DTYPES, compute_dtype


def moe_ops(ctx, fallback: str):
    """Handles of one AllGatherMoEGEMM and one MoEGEMMReduceScatter per (Context, fallback rule), shared by the
    layers. Their routing checks are off: the layer's ids come from one all-gather, the same on every rank, and from
    a top-k over E experts, so in range (the check costs a device-to-host copy and a host exchange per call)."""
    return ctx.cached(("nn moe ops", fallback), lambda: (
        custom_ops.handle(AllGatherMoEGEMM(ctx, fallback=fallback, check_routing=False, name=f"nn.moe_ag.{fallback}")),
        custom_ops.handle(MoEGEMMReduceScatter(ctx, fallback=fallback, check_routing=False,
                                               name=f"nn.moe_rs.{fallback}"))))


def route_local(x: torch.Tensor, weight: torch.Tensor, topk: int, renormalize: bool):
    """The router on rows ``x`` [T, dim] with ``weight`` [E, dim], in float32 whatever the autocast state (the top-k
    choice turns on small differences): (logits [T, E], top-k weights [T, k], top-k ids int64 [T, k]), the weights
    of ``softmax(logits)`` divided by their sum over the k choices where ``renormalize``."""
    with torch.autocast(x.device.type, enabled=False):
        logits = x.float() @ weight.float().t()
        weights, ids = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    return logits, weights, ids


def gather_routes(weights: torch.Tensor, ids: torch.Tensor, ag, world_size: int):
    """Every rank's choices from this rank's (top-k weights float32 [T/W, k], ids [T/W, k]): one all-gather through
    the op ``ag``'s process group of ``[T/W, 2k]`` float32 (the ids as exact small integers), differentiable in the
    weights (backward: this rank's rows of their gradient). Returns (ids int64 [T, k], weights float32 [T, k]), rows
    in rank order."""
    k = ids.shape[-1]
    with torch.autocast(weights.device.type, enabled=False):
        both = custom_ops.all_gather_rows_with_grad(torch.cat([weights.float(), ids.float()], dim=1), ag,
                                                    world_size)
    return both[:, k:].long(), both[:, :k]


def swiglu_experts(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, handles, world_size: int) -> torch.Tensor:
    """This rank's rows [T/W, dim] through every rank's share of the SwiGLU experts and back, summed over ranks:
    ``ag_moe`` (gather + gate/up grouped GEMM, rows in expert-sorted order), ``silu(gate) * up`` in that order,
    ``moe_rs`` (down grouped GEMM, top-k weighted combine, reduce-scatter). ``w13`` [E, dim, 2 * hidden/W] (gate
    columns, then up), ``w2`` [E, hidden/W, dim], both in ``rows``' dtype; ``ids``/``weights`` every rank's
    (``gather_routes``); ``handles`` from ``moe_ops``. Returns [T/W, dim]."""
    ag, rs = handles
    h, order, position, offsets, _ = custom_ops.ag_moe(rows, w13, ids, ag, rs, world_size)
    gate, up = h.split(w13.shape[-1] // 2, dim=-1)
    return custom_ops.moe_rs(nn.functional.silu(gate) * up, w2, ids, weights, order, position, offsets, rs, ag,
                             world_size, w13.shape[-1])


def shard_experts(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, rank: int, world_size: int):
    """Rank ``rank``'s share of SwiGLU experts stored as ``nn.Linear``'s [out, in] (gate ``w1`` and up ``w3``
    [E, hidden, dim], down ``w2`` [E, dim, hidden]) in the ops' [E, K, N] layout: (w13 [E, dim, 2 * hidden/W], its
    hidden columns of gate then of up; w2 [E, hidden/W, dim], its rows of down). New contiguous tensors."""
    n = w1.shape[1] // world_size
    cols = slice(rank * n, (rank + 1) * n)
    return (torch.cat([w1[:, cols], w3[:, cols]], dim=1).transpose(1, 2).contiguous(),
            w2[:, :, cols].transpose(1, 2).contiguous())


def check_moe_layer(layer: str, num_experts: int, topk: int, fallback: str) -> None:
    """The arguments every MoE layer checks (ValueError naming ``layer``)."""
    if not 1 <= topk <= num_experts:
        raise ValueError(f"{layer}: topk = {topk} must lie in [1, num_experts = {num_experts}]")
    if fallback not in ("auto", "never", "always"):
        raise ValueError(f'{layer}: fallback must be "auto", "never" or "always", got {fallback!r}')


def full_moe(layer: str, router: nn.Linear, experts, dtype):
    """A ``from_full``'s unsharded MoE, checked: (w1, w3, w2 stacked as stacked_experts returns them, the
    parameters' dtype: ``dtype``, else the router's where 16-bit, else bfloat16)."""
    w1, w3, w2 = stacked_experts(experts, layer)
    E, hidden, dim = w1.shape
    if router.bias is not None or tuple(router.weight.shape) != (E, dim):
        raise ValueError(f"{layer}.from_full: router must be nn.Linear({dim}, {E}, bias=False), got weight "
                         f"{tuple(router.weight.shape)}{' with a bias' if router.bias is not None else ''}")
    if tuple(w3.shape) != (E, hidden, dim) or tuple(w2.shape) != (E, dim, hidden):
        raise ValueError(f"{layer}.from_full: experts must be w1, w3 [E, hidden, dim] and w2 [E, dim, hidden], got "
                         f"{tuple(w1.shape)}, {tuple(w3.shape)}, {tuple(w2.shape)}")
    if dtype is None:
        dtype = router.weight.dtype if router.weight.dtype in COMPUTE_DTYPES else torch.bfloat16
    return w1, w3, w2, dtype


class ReplicatedRouter:
    """What both MoE layers do with their replicated router (a mixin on nn.Module): load a full MoE's router and
    this rank's expert weights, and sum the router's gradient over the ranks after backward."""

    def load(self, router: nn.Linear, w13: torch.Tensor, w2: torch.Tensor) -> None:
        with torch.no_grad():
            self.router.weight.copy_(router.weight)
            self.w13.copy_(w13)
            self.w2.copy_(w2)

    def replicated_parameters(self):
        return list(self.router.parameters())

    @torch.no_grad()
    def sync_replicated_grads(self):
        for p in self.replicated_parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=self.ctx.group)


class TPMoE(ReplicatedRouter, nn.Module):
    """Tensor-parallel mixture of ``num_experts`` SwiGLU experts of width ``hidden``, ``topk`` of them per token.

    ``[S/W, *, dim]`` -> ``[S/W, *, dim]`` (rows sequence-first, as ``TPMLP``). Parameters: ``router`` (an
    ``nn.Linear(dim, E, bias=False)``, replicated), ``w13`` [E, dim, 2 * hidden/W] (rank r's columns of each expert's
    gate, then of its up projection) and ``w2`` [E, hidden/W, dim] (rank r's rows of each expert's down projection),
    in the ops' [E, K, N] layout. ``out[t] = sum_j p[t, j] * (silu(x[t] @ gate_e) * (x[t] @ up_e)) @ down_e`` with
    ``e = ids[t, j]``, ``(p, ids)`` the top-k of ``softmax(x @ router.weight^T)`` (``renormalize``: ``p`` divided by
    its sum over the k choices).

    Routing: each rank computes the logits of its own tokens (in float32: the top-k choice turns on small
    differences, and the router is a sliver of the layer's work) and its top-k, then one all-gather (process group)
    of ``[T/W, 2k]`` float32 (the weights, and the ids as exact small integers) gives every rank every token's
    choices, which both ops need. Gathering the logits instead would move E/(2k) times as much (E = 256, k = 8: 16x)
    and repeat the softmax and top-k of every token on every rank. The gather is not overlapped; it is small.

    Backward (autograd through the custom ops):

    * grad of the down projection's input: ``ag_moe_gemm`` of this rank's output gradient with ``w2^T`` (the
      gather overlapped), permuted into the forward's sorted layout and scaled by the top-k weights; the gathered
      output gradient it returns gives ``w2``'s gradient.
    * grad of the input: ``moe_gemm_rs`` of the gate/up rows' gradient with ``w13^T`` and unit weights, on the
      forward's sorted layout (the reduce-scatter overlapped); ``w13``'s gradient from the tokens the forward
      gathered (kept until backward, [T, dim] per layer).
    * not overlapped: the experts' weight gradients (one ``torch._grouped_mm`` each where it takes the operands,
      else a matmul per expert: local work after the op), the gradient of the top-k weights (this rank's part of
      each ``<grad_out[t], h[t, j] @ w2[e]>``, reduce-scattered by the process group: [T, 2k] float32), and the
      router's, which is local to each rank's tokens: the router's gradient is per rank partial, so call
      ``sync_replicated_grads()`` after backward (a sum over ranks) or hand it to your data-parallel reducer.

    Parameters are bfloat16 (default) or float16; float32 parameters work under ``torch.autocast`` (cast per call
    to the autocast dtype, as ``nn.Linear`` is) and raise TypeError without it. ``fallback`` is passed to the ops
    ("auto": NCCL + torch for small shards; "never", "always").
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, topk: int, *, ctx, renormalize: bool = True,
                 dtype=None, device=None, fallback: str = "auto"):
        super().__init__()
        W = ctx.world_size
        if hidden % W:
            raise ValueError(f"TPMoE: hidden = {hidden} is not divisible by the world size {W}")
        check_moe_layer("TPMoE", num_experts, topk, fallback)
        kw = {"dtype": dtype or torch.bfloat16, "device": device or ctx.device}
        self.ctx, self.fallback = ctx, fallback
        self.dim, self.hidden, self.num_experts, self.topk = dim, hidden, num_experts, topk
        self.renormalize = renormalize
        self.hidden_local = hidden // W
        self._handles = moe_ops(ctx, fallback)
        self.router = nn.Linear(dim, num_experts, bias=False, **kw)
        self.w13 = nn.Parameter(torch.empty(num_experts, dim, 2 * self.hidden_local, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, self.hidden_local, dim, **kw))
        with torch.no_grad():  # nn.Linear's default range: fan-in of each projection
            self.w13.uniform_(-dim ** -0.5, dim ** -0.5)
            self.w2.uniform_(-hidden ** -0.5, hidden ** -0.5)

    @classmethod
    def from_full(cls, router: nn.Linear, experts, ctx, *, topk: int, renormalize: bool = True, dtype=None,
                  device=None, fallback: str = "auto") -> "TPMoE":
        """Shard an unsharded MoE, the same on every rank: ``router`` an ``nn.Linear(dim, E)`` without bias;
        ``experts`` either ``(w1, w3, w2)``, stacked tensors in ``nn.Linear``'s [out, in] convention (Mixtral's,
        Qwen3-MoE's): gate ``w1`` [E, hidden, dim], up ``w3`` [E, hidden, dim], down ``w2`` [E, dim, hidden]; or a
        sequence of E expert modules, each with ``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/``down_proj``
        ``nn.Linear`` layers without bias. ``dtype``: the parameters' (default: the router's where 16-bit, else
        bfloat16)."""
        w1, w3, w2, dtype = full_moe("TPMoE", router, experts, dtype)
        E, hidden, dim = w1.shape
        moe = cls(dim, hidden, E, topk, ctx=ctx, renormalize=renormalize, dtype=dtype, device=device,
                  fallback=fallback)
        moe.load(router, *shard_experts(w1, w3, w2, ctx.rank, ctx.world_size))
        return moe

    @property
    def last_path(self) -> str | None:
        """The path the layer's MoE ops took on their latest call (shared by every layer with this Context and
        fallback rule): ``"overlap"``, ``"fallback"`` (NCCL + torch), or None before any call."""
        return self.ops[0].last_path

    @property
    def ops(self):
        """The AllGatherMoEGEMM and the MoEGEMMReduceScatter this layer's forward and backward call (shared by every
        MoE layer with the same Context and fallback rule)."""
        return tuple(custom_ops.op_of(h) for h in self._handles)

    def _compute_dtype(self, x) -> torch.dtype:
        """The dtype the experts run in (nn.precision.compute_dtype: autocast's, else the 16-bit parameters')."""
        return compute_dtype("TPMoE", x, self.w13)

    def route(self, x: torch.Tensor):
        """Every token's (top-k ids int64 [T, k], top-k weights float32 [T, k]) from this rank's tokens ``x``
        [T/W, dim]: the router in float32 here, then one all-gather."""
        _, weights, ids = route_local(x, self.router.weight, self.topk, self.renormalize)
        return gather_routes(weights, ids, self._handles[0], self.ctx.world_size)

    def forward(self, x):
        dtype = self._compute_dtype(x)
        rows = x.reshape(-1, x.shape[-1]).to(dtype)  # sequence-first: rank r's rows are tokens r*T/W, ...
        ids, weights = self.route(rows)
        y = swiglu_experts(rows, self.w13.to(dtype), self.w2.to(dtype), ids, weights, self._handles,
                           self.ctx.world_size)
        return y.reshape(-1, *x.shape[1:-1], y.shape[-1])


def stacked_experts(experts, layer: str = "TPMoE"):
    """(w1, w3, w2) stacked [E, hidden, dim], [E, hidden, dim], [E, dim, hidden] from a ``from_full``'s ``experts``
    (the three tensors, or expert modules with w1/w3/w2 or gate_proj/up_proj/down_proj linears); ``layer`` names the
    caller in errors."""
    if isinstance(experts, (tuple, list)) and len(experts) == 3 and all(isinstance(t, torch.Tensor) for t in experts):
        return tuple(t.detach() for t in experts)
    names = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
    mods = list(experts)
    for three in names:
        if mods and all(all(isinstance(getattr(m, n, None), nn.Linear) for n in three) for m in mods):
            if any(getattr(m, n).bias is not None for m in mods for n in three):
                raise ValueError(f"{layer}.from_full: experts with biases are not supported")
            return tuple(torch.stack([getattr(m, n).weight.detach() for m in mods]) for n in three)
    raise ValueError(f"{layer}.from_full: experts must be (w1, w3, w2) tensors or expert modules with w1/w3/w2 or "
                     "gate_proj/up_proj/down_proj nn.Linear layers")


__all__ = ["ReplicatedRouter", "TPMoE", "check_moe_layer", "full_moe", "gather_routes", "moe_ops", "route_local",
           "shard_experts", "stacked_experts", "swiglu_experts"]
