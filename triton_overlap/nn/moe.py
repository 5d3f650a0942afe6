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

from dataclasses import dataclass

import torch
from torch import nn

from ..kernels import moe_rows
from ..ops import custom_ops
from ..ops.all_gather_moe import AllGatherMoEGEMM
from ..ops.moe_reduce_scatter import MoEGEMMReduceScatter
from .precision import COMPUTE_DTYPES, compute_dtype
from .state_dict import Piece, record, selection


def moe_ops(ctx, fallback: str):
    """Handles of one AllGatherMoEGEMM and one MoEGEMMReduceScatter per (Context, fallback rule), shared by the
    layers. Their routing checks are off: the layer's ids come from one all-gather, the same on every rank, and from
    a top-k over E experts, so in range (the check costs a device-to-host copy and a host exchange per call)."""
    return ctx.cached(("nn moe ops", fallback), lambda: (
        custom_ops.handle(AllGatherMoEGEMM(ctx, fallback=fallback, check_routing=False, name=f"nn.moe_ag.{fallback}")),
        custom_ops.handle(MoEGEMMReduceScatter(ctx, fallback=fallback, check_routing=False,
                                               name=f"nn.moe_rs.{fallback}"))))


def route_local(x: torch.Tensor, weight: torch.Tensor, topk: int, renormalize: bool,
                bias: torch.Tensor | None = None):
    """The router on rows ``x`` [T, dim] with ``weight`` [E, dim] (and ``bias`` [E] added to the logits, GPT-OSS's
    router's), in float32 whatever the autocast state (the top-k choice turns on small differences): (logits
    [T, E], top-k weights [T, k], top-k ids int64 [T, k]), the weights of ``softmax(logits)`` divided by their sum
    over the k choices where ``renormalize`` (which is the softmax of the k largest logits)."""
    with torch.autocast(x.device.type, enabled=False):
        logits = x.float() @ weight.float().t()
        if bias is not None:
            logits = logits + bias.float()
        weights, ids = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
    return logits, weights, ids


def fold_shared(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, shared, layer: str):
    """The routed experts (gate ``w1``, up ``w3`` [E, hidden, dim], down ``w2`` [E, dim, hidden]) followed by a
    shared expert ``shared`` = (gate [H, dim], up [H, dim], down [dim, H]) cut into ``m = H / hidden`` experts of
    width ``hidden``, its hidden units in order: ((w1, w3, w2) [E + m, ...], m). A SwiGLU MLP is a sum over its
    hidden units, so the m parts, each given every token with one weight (``add_shared_routes``), compute the
    shared expert exactly, inside the routed experts' gather and reduce-scatter (docs/decisions.md). ValueError
    naming ``layer`` where H is not a multiple of ``hidden`` or the shapes differ."""
    s1, s3, s2 = (t.detach().to(w1.dtype) for t in shared)
    _, hidden, dim = w1.shape
    H = s1.shape[0]
    if tuple(s1.shape) != (H, dim) or tuple(s3.shape) != (H, dim) or tuple(s2.shape) != (dim, H):
        raise ValueError(f"{layer}: the shared expert must be gate, up [H, {dim}] and down [{dim}, H], got "
                         f"{tuple(s1.shape)}, {tuple(s3.shape)}, {tuple(s2.shape)}")
    if H == 0 or H % hidden:
        raise ValueError(f"{layer}: the shared expert's width {H} is not a multiple of the experts' width {hidden}")
    m = H // hidden
    return (torch.cat([w1, s1.reshape(m, hidden, dim)]), torch.cat([w3, s3.reshape(m, hidden, dim)]),
            torch.cat([w2, s2.reshape(dim, m, hidden).transpose(0, 1)]), m)


def add_shared_routes(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                      num_shared: int, gate_weight: torch.Tensor | None = None):
    """This rank's routes (top-k weights float32 [T, k], ids [T, k]) with the shared expert's ``num_shared`` parts
    (``fold_shared``) appended for every token: ids ``E .. E + m - 1``, each weighted by ``sigmoid(x @ gate^T)``
    in float32 where the shared expert has a gate ``gate_weight`` [1, dim] (Qwen2-MoE's, Qwen3-Next's), else by 1.
    Returns (weights [T, k + m], ids [T, k + m])."""
    if not num_shared:
        return weights, ids
    T = x.shape[0]
    g = weights.new_ones(T, 1) if gate_weight is None else shared_gate(x, gate_weight)
    extra = torch.arange(num_experts, num_experts + num_shared, device=ids.device, dtype=ids.dtype)
    return torch.cat([weights, g.expand(T, num_shared)], dim=1), torch.cat([ids, extra.expand(T, num_shared)], dim=1)


def shared_gate(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """A shared expert's gate on rows ``x`` [T, dim]: ``sigmoid(x @ gate_weight^T)`` [T, 1] in float32 whatever the
    autocast state."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.sigmoid(x.float() @ gate_weight.float().t())


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


@dataclass(frozen=True)
class Activation:
    """What the experts compute between their gate/up and down projections, on rows [R, 2 * width] (gate columns,
    then up): ``silu(gate) * up`` (SwiGLU, ``alpha`` None), or GPT-OSS's clamped form, ``gate`` clamped above at
    ``limit`` and ``up`` to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``. Row-wise, so
    the rows may come in any order (the experts' sorted layouts). SwiGLU on 2-D 16-bit or float32 rows on a GPU or
    in Triton's interpreter is one kernel each way (``custom_ops.swiglu``, kernels.moe_rows), in float32 with one
    rounding, differentiable once; float64 rows and the clamped form are torch's."""
    alpha: float | None = None
    limit: float | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.alpha is None and h.dim() == 2 and moe_rows.runs_kernels(h):
            return custom_ops.swiglu(h)  # (one pass each way: kernels.moe_rows)
        gate, up = h.split(h.shape[-1] // 2, dim=-1)
        if self.alpha is None:
            return nn.functional.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


#: the SwiGLU experts' activation (Mixtral's, Qwen's, DeepSeek's)
SWIGLU = Activation()


def routed_bias(weights: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The experts' down-projection biases ``bias`` [E, dim] as the top-k combine weighs their outputs:
    ``Σ_j weights[t, j] · bias[ids[t, j]]``, [T, dim] in float32 (``weights`` [T, k], ``ids`` [T, k])."""
    with torch.autocast(weights.device.type, enabled=False):
        return (weights.float().unsqueeze(-1) * bias.float()[ids]).sum(1)


def swiglu_experts(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, handles, world_size: int, act: Activation = SWIGLU,
                   bias13: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's rows [T/W, dim] through every rank's share of the experts and back, summed over ranks:
    ``ag_moe`` (gather + gate/up grouped GEMM, rows in expert-sorted order), ``act`` (``silu(gate) * up``; after
    ``bias13`` [E, 2 * hidden/W], this rank's columns of the gate/up biases, where the experts have them) in that
    order, ``moe_rs`` (down grouped GEMM, top-k weighted combine, reduce-scatter). ``w13`` [E, dim, 2 * hidden/W]
    (gate columns, then up), ``w2`` [E, hidden/W, dim], both in ``rows``' dtype; ``ids``/``weights`` every rank's
    (``gather_routes``); ``handles`` from ``moe_ops``. Returns [T/W, dim] (down-projection biases not added:
    ``routed_bias``)."""
    ag, rs = handles
    keep = w13.requires_grad and torch.is_grad_enabled()  # (the gathered rows, for w13's gradient)
    h, order, position, offsets, _ = custom_ops.ag_moe(rows, w13, ids, ag, rs, world_size, keep)
    if bias13 is not None:  # (sorted row p holds the pair order[p] = t * topk + j)
        h = h + bias13[ids.reshape(-1)[order]].to(h.dtype)
    return custom_ops.moe_rs(act(h), w2, ids, weights, order, position, offsets, rs, ag, world_size, w13.shape[-1])


def shard_experts(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, rank: int, world_size: int):
    """Rank ``rank``'s share of SwiGLU experts stored as ``nn.Linear``'s [out, in] (gate ``w1`` and up ``w3``
    [E, hidden, dim], down ``w2`` [E, dim, hidden]) in the ops' [E, K, N] layout: (w13 [E, dim, 2 * hidden/W], its
    hidden columns of gate then of up; w2 [E, hidden/W, dim], its rows of down). New contiguous tensors."""
    n = w1.shape[1] // world_size
    cols = slice(rank * n, (rank + 1) * n)
    return (torch.cat([w1[:, cols], w3[:, cols]], dim=1).transpose(1, 2).contiguous(),
            w2[:, :, cols].transpose(1, 2).contiguous())


def record_experts(layer: nn.Module, columns, experts, ctx) -> None:
    """Note on an MoE layer (nn.state_dict.record) how its ``w13`` [E_local, dim, 2 * n] and ``w2`` [E_local, n,
    dim] come from the unmodified experts ``w1``, ``w3`` [E, hidden, dim] and ``w2`` [E, dim, hidden] (``from_full``'s,
    in ``nn.Linear``'s [out, in]): rank q's hidden units ``columns[q]`` (tensor parallel) and its experts
    ``experts[q]`` (expert parallel; None: every expert), as ``shard_experts`` takes them. Full and DCP checkpoints
    then hold ``w1``, ``w3`` and ``w2``, whatever the world size or the kind of parallelism."""
    E, dim, n = layer.w13.shape[0], layer.w13.shape[1], layer.w13.shape[2] // 2
    W = len(columns)
    hidden = sum(c.stop - c.start for c in columns) if experts is None else n
    total = E if experts is None else E * W
    turn = ("transpose", 1, 2)
    pick = (selection(2, columns),) if experts is None else (selection(0, experts),)
    rows = (selection(1, columns),) if experts is None else (selection(0, experts),)
    record(layer, "w13", [Piece(name, (total, hidden, dim), (turn,) + pick, ((2, start, start + n),))
                          for name, start in (("w1", 0), ("w3", n))], ctx)
    record(layer, "w2", [Piece("w2", (total, dim, hidden), (turn,) + rows)], ctx)


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

    def load(self, router: nn.Linear, w13: torch.Tensor, w2: torch.Tensor, shared_gate: nn.Linear | None = None):
        with torch.no_grad():
            self.router.weight.copy_(router.weight)
            self.w13.copy_(w13)
            self.w2.copy_(w2)
            if shared_gate is not None:
                self.shared_gate.weight.copy_(shared_gate.weight)

    def replicated_parameters(self):
        gate = getattr(self, "shared_gate", None)
        return list(self.router.parameters()) + (list(gate.parameters()) if gate is not None else [])

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
    its sum over the k choices). Checkpoints (nn.state_dict: full, and DCP at any world size) hold the unmodified
    experts as ``from_full`` takes them, ``w1``, ``w3`` [E, hidden, dim] and ``w2`` [E, dim, hidden], as ``EPMoE``'s do.

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
    * not overlapped: the experts' weight gradients (one ``torch._grouped_mm`` each where it takes the operands, else a
      matmul per expert: local work after the op; none for frozen experts, nor their left operands), the gradient of the
      top-k weights (this rank's part of each ``<grad_out[t], h[t, j] @ w2[e]>``, reduce-scattered by the process group:
      [T, 2k] float32), and the router's, which is local to each rank's tokens: the router's gradient is per rank
      partial, so call ``sync_replicated_grads()`` after backward (a sum over ranks) or hand it to your data-parallel
      reducer.

    Parameters are bfloat16 (default) or float16; float32 parameters work under ``torch.autocast`` (cast per call
    to the autocast dtype, as ``nn.Linear`` is) and raise TypeError without it. ``fallback`` is passed to the ops
    ("auto": NCCL + torch for small shards; "never", "always").

    Shared expert (Qwen2-MoE's and Qwen3-Next's, gated; DeepSeekMoE's, ungated): ``shared_hidden`` > 0 adds a
    SwiGLU expert of that width (a multiple of ``hidden``) that every token passes through, weighted by
    ``sigmoid(x @ shared_gate.weight^T)`` where ``shared_gate`` (an ``nn.Linear(dim, 1, bias=False)``, replicated),
    else by 1. It is held as ``num_shared = shared_hidden / hidden`` more experts at the end of ``w13`` and ``w2``
    (``fold_shared``) that every token is routed to: it runs in the same grouped GEMMs and rides the same gather
    and reduce-scatter, so it adds no communication.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, topk: int, *, ctx, renormalize: bool = True,
                 dtype=None, device=None, fallback: str = "auto", shared_hidden: int = 0, shared_gate: bool = False):
        super().__init__()
        W = ctx.world_size
        if hidden % W:
            raise ValueError(f"TPMoE: hidden = {hidden} is not divisible by the world size {W}")
        if shared_hidden < 0 or shared_hidden % hidden or (shared_gate and not shared_hidden):
            raise ValueError(f"TPMoE: shared_hidden = {shared_hidden} must be 0 or a multiple of hidden = {hidden}"
                             + (", and > 0 with shared_gate" if shared_gate else ""))
        check_moe_layer("TPMoE", num_experts, topk, fallback)
        kw = {"dtype": dtype or torch.bfloat16, "device": device or ctx.device}
        self.ctx, self.fallback = ctx, fallback
        self.dim, self.hidden, self.num_experts, self.topk = dim, hidden, num_experts, topk
        self.renormalize = renormalize
        self.hidden_local = hidden // W
        self.num_shared = shared_hidden // hidden
        self._handles = moe_ops(ctx, fallback)
        self.router = nn.Linear(dim, num_experts, bias=False, **kw)
        self.shared_gate = nn.Linear(dim, 1, bias=False, **kw) if shared_gate else None
        slots = num_experts + self.num_shared
        self.w13 = nn.Parameter(torch.empty(slots, dim, 2 * self.hidden_local, **kw))
        self.w2 = nn.Parameter(torch.empty(slots, self.hidden_local, dim, **kw))
        n = self.hidden_local
        record_experts(self, [slice(q * n, (q + 1) * n) for q in range(W)], None, ctx)
        with torch.no_grad():  # nn.Linear's default range: fan-in of each projection
            self.w13.uniform_(-dim ** -0.5, dim ** -0.5)
            self.w2.uniform_(-hidden ** -0.5, hidden ** -0.5)

    @classmethod
    def from_full(cls, router: nn.Linear, experts, ctx, *, topk: int, renormalize: bool = True, dtype=None,
                  device=None, fallback: str = "auto", shared=None, shared_gate: nn.Linear | None = None) -> "TPMoE":
        """Shard an unsharded MoE, the same on every rank: ``router`` an ``nn.Linear(dim, E)`` without bias;
        ``experts`` either ``(w1, w3, w2)``, stacked tensors in ``nn.Linear``'s [out, in] convention (Mixtral's,
        Qwen3-MoE's): gate ``w1`` [E, hidden, dim], up ``w3`` [E, hidden, dim], down ``w2`` [E, dim, hidden]; or a
        sequence of E expert modules, each with ``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/``down_proj``
        ``nn.Linear`` layers without bias. ``dtype``: the parameters' (default: the router's where 16-bit, else
        bfloat16). ``shared``: a shared expert, (gate [H, dim], up [H, dim], down [dim, H]) tensors or a module
        with w1/w3/w2 or gate_proj/up_proj/down_proj linears, H a multiple of the experts' width; ``shared_gate``:
        its ``nn.Linear(dim, 1, bias=False)`` gate, if it has one."""
        w1, w3, w2, dtype = full_moe("TPMoE", router, experts, dtype)
        E, hidden, dim = w1.shape
        if shared is None and shared_gate is not None:
            raise ValueError("TPMoE.from_full: shared_gate without a shared expert")
        if shared is not None:
            w1, w3, w2, _ = fold_shared(w1, w3, w2, shared_weights(shared, "TPMoE.from_full"), "TPMoE.from_full")
            if shared_gate is not None and (shared_gate.bias is not None or
                                            tuple(shared_gate.weight.shape) != (1, dim)):
                raise ValueError(f"TPMoE.from_full: shared_gate must be nn.Linear({dim}, 1, bias=False)")
        moe = cls(dim, hidden, E, topk, ctx=ctx, renormalize=renormalize, dtype=dtype, device=device,
                  fallback=fallback, shared_hidden=(w1.shape[0] - E) * hidden, shared_gate=shared_gate is not None)
        moe.load(router, *shard_experts(w1, w3, w2, ctx.rank, ctx.world_size), shared_gate)
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
        [T/W, dim]: the router in float32 here, the shared expert's parts appended (k grows by ``num_shared``),
        then one all-gather."""
        _, weights, ids = route_local(x, self.router.weight, self.topk, self.renormalize)
        gate = None if self.shared_gate is None else self.shared_gate.weight
        weights, ids = add_shared_routes(x, weights, ids, self.num_experts, self.num_shared, gate)
        return gather_routes(weights, ids, self._handles[0], self.ctx.world_size)

    def forward(self, x):
        dtype = self._compute_dtype(x)
        rows = x.reshape(-1, x.shape[-1]).to(dtype)  # sequence-first: rank r's rows are tokens r*T/W, ...
        ids, weights = self.route(rows)
        y = swiglu_experts(rows, self.w13.to(dtype), self.w2.to(dtype), ids, weights, self._handles,
                           self.ctx.world_size)
        return y.reshape(-1, *x.shape[1:-1], y.shape[-1])


def shared_weights(shared, layer: str):
    """A shared expert's (gate [H, dim], up [H, dim], down [dim, H]) from three tensors or a module with
    w1/w3/w2 or gate_proj/up_proj/down_proj linears."""
    if isinstance(shared, (tuple, list)):
        if len(shared) == 3 and all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in shared):
            return tuple(shared)
        raise ValueError(f"{layer}: a shared expert given as tensors must be three 2-D tensors (gate, up, down)")
    return tuple(t[0] for t in stacked_experts([shared], layer))


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


__all__ = ["ReplicatedRouter", "TPMoE", "add_shared_routes", "check_moe_layer", "fold_shared", "full_moe",
           "gather_routes", "moe_ops", "record_experts", "route_local", "shard_experts", "shared_gate",
           "shared_weights", "stacked_experts", "swiglu_experts"]
