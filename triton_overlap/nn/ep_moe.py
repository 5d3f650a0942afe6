"""An expert-parallel mixture-of-experts layer (SwiGLU experts, softmax top-k router) on ``ExpertParallel``'s
dispatch and combine, with autograd through both.

Every rank holds its own tokens (``[T_local, dim]``, or ``[S, *, dim]`` flattened; the ranks' T_local may differ),
the whole router (replicated) and E/W whole experts: rank r owns experts ``[r·E/W, (r+1)·E/W)``. A forward is

* the router on this rank's tokens, as ``TPMoE`` computes it (``nn.moe.route_local``: logits in float32, softmax,
  top-k, optionally renormalized);
* ``dispatch`` with the experts' gate and up projections: each token's row to the ranks that own its choices
  (``ops.expert_parallel``), the received rows grouped by local expert (``d.tokens``, bounds ``d.offsets``) and
  their product with ``w13`` (``d.projected``): after the rows, as the down projection, or with
  ``experts_gemm="overlap"`` by a grouped GEMM that starts on each source's rows as they land (ops.ep_experts);
* ``silu(gate) * up`` and the down projection: ``torch._grouped_mm`` where it takes the operands (bfloat16, widths
  multiples of 8, CPU or a GPU of compute capability 9.0 or newer: ``ops.moe_routing.expert_grads``' rule), else a
  matmul per expert (the offsets read back to the host);
* ``combine``: each token's ``Σ_j p[t, j] · y_row(t, j)`` back on its own rank, summed in float32.

Backward, piece by piece (``torch.autograd.Function``s below; the router and ``silu(gate) * up`` by torch):

* combine, w.r.t. the experts' outputs: row ``(t of source s, choice j)`` gets ``p[t, j] · g[t]``. The output
  gradient ``g`` [T_local, dim] is dispatched with the forward's ids and weights (a second ``dispatch`` through the
  same op: the order of ``d.tokens`` follows from the routing alone, so its rows land in the forward's order; the
  layer checks that both dispatches moved the same counts) and multiplied by the rows' weights in float32.
* combine, w.r.t. the top-k weights: ``<y_row(t, j), g[t]>`` in float32 on the owner (its rows of ``g`` came with
  the dispatch above), per received token and choice ``[U, topk]``, sent back to the tokens' ranks by
  ``torch.distributed.all_to_all_single`` on the Context's process group in float32 (16-bit would round the
  gradient), where each token's value is summed over its owners (one nonzero per choice). Not overlapped.
* dispatch, w.r.t. the input: the rows' gradient summed per token over its choices on each owner and sent back:
  ``combine`` of the rows' gradient with a handle whose weights are all 1 (``dataclasses.replace`` of the
  forward's handle: a handle is the data it holds, and ``1.0 · v`` is exact, so this is the unweighted return on
  the op's own path, copies and fixed-order float32 sums included).
* the experts' weights: ``a_e^T @ b_e`` over each local expert's rows (``ops.moe_routing.expert_grads``: one
  ``torch._grouped_mm`` where it takes the operands), the rows' gradient by the grouped GEMM with ``w^T``.
* the router: through the top-k weights by torch autograd, as for ``TPMoE``. It is computed from this rank's
  tokens only: call ``sync_replicated_grads()`` after backward (a sum over ranks), or leave it to a data-parallel
  reducer.

What overlaps what: where the op takes its overlapped path (``last_path == "overlap"``), the rows of a dispatch or a
combine move into the peers' symmetric buffers (stored by kernels, or by copy engine where the receive buffers must
grow), with a flag per source; with ``experts_gemm="overlap"`` the forward's gate and up projections start on each
source's rows as its flag lands (``op.last_gemm`` names the kernel, "torch" where they ran after the rows, the
default); with ``combine_stages`` the forward's down projection runs in stages over consecutive experts, each
stage's partials sent as it ends (``DownCombine``, ops.ep_combine; docs/decisions.md, Expert-parallel MoE, says
where that can pay). Not overlapped: the backward's GEMMs with their dispatch and combine. Not overlapped at all:
the router, the weights' gradient exchange (process group), the experts' weight gradients (local), and one host
synchronisation per dispatch (the counts), so two per training step and layer. ``fallback="always"`` takes the
process group's ``all_to_all_single`` for every exchange. The dispatch reads counts back to the host, so the
layer runs outside ``torch.compile``'s graphs (a graph break) and cannot be captured in a CUDA graph, but for its
decode forward (``max_tokens_per_rank``, no autograd: ``ops.ep_low_latency``), which can.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from ..ops.ep_low_latency import ExpertParallelLowLatency
from ..ops.expert_parallel import ExpertParallel, ExpertParallelConfig
from ..ops.moe_routing import count_ids, expert_grads, grouped_mm, sort_pairs, takes_grouped_mm
from .moe import (SWIGLU, Activation, ReplicatedRouter, check_moe_layer, full_moe, record_experts, route_local,
                  shard_experts)
from .precision import compute_dtype


def ep_op(ctx, fallback: str, experts_gemm: str = "after", combine_stages: int | None = None) -> ExpertParallel:
    """The ExpertParallel op of the EPMoE layers on ``ctx`` with the fallback rule ``fallback`` and
    ExpertParallelConfig's ``experts_gemm`` and ``combine_stages`` (None: 1): one per setting, shared by the layers
    (its dispatches number themselves, so layers in flight together stay apart)."""
    stages = 1 if combine_stages is None else combine_stages
    cfg = ExpertParallelConfig(experts_gemm=experts_gemm, combine_stages=stages)
    return ctx.cached(("nn ep_moe op", fallback, experts_gemm, stages),
                      lambda: ExpertParallel(ctx, cfg, fallback=fallback,
                                             name=f"nn.ep_moe.{fallback}.{experts_gemm}.{stages}"))


# ----------------------------------------------------------------------------------------------- the experts
class GroupedMM(torch.autograd.Function):
    """``grouped_mm(rows, w, offsets)`` with its gradients: the rows' by the grouped GEMM with ``w^T``, the
    weights' by ``expert_grads`` (each expert's ``rows_e^T @ grad_e``, zero for experts without rows)."""

    @staticmethod
    def forward(fctx, rows, w, offsets):
        fctx.save_for_backward(rows, w, offsets)
        return grouped_mm(rows, w, offsets)

    @staticmethod
    def backward(fctx, grad):
        rows, w, offsets = fctx.saved_tensors
        grad = grad.contiguous()
        grad_rows = grouped_mm(grad, w.transpose(1, 2), offsets) if fctx.needs_input_grad[0] else None
        grad_w = expert_grads(rows, grad, offsets) if fctx.needs_input_grad[1] else None
        return grad_rows, grad_w, None


def row_biases(biases: tuple, offsets: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """Each of ``biases`` ([E, n] each) of each of ``rows`` rows grouped by expert (bounds ``offsets`` [E + 1], from
    0): [rows, n] each, 0 on rows past the last group. The grouped GEMMs leave those rows unwritten, forward and
    backward, so their gradient is whatever memory held: ``torch.where`` keeps it from the biases'."""
    at = torch.arange(rows, dtype=offsets.dtype, device=offsets.device)
    # (bounds from 0: the search of all of them, less one; Inductor in torch 2.11 cannot lower a search of a slice)
    expert = (torch.searchsorted(offsets, at, right=True) - 1).clamp(max=offsets.shape[0] - 2)
    inside = (at < offsets[-1]).unsqueeze(1)
    return [torch.where(inside, bias[expert], 0) for bias in biases]


def swiglu_rows(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
                act: Activation = SWIGLU, bias13: torch.Tensor | None = None) -> torch.Tensor:
    """The local experts on ``rows`` [R, dim] grouped by expert (bounds ``offsets``): ``w13`` [E/W, dim,
    2 * hidden] (gate columns, then up), ``act`` (``silu(gate) * up``; after ``bias13`` [R, 2 * hidden], each row's
    expert's gate/up bias, where the experts have them), ``w2`` [E/W, hidden, dim]. Returns [R, dim] in the rows'
    dtype (down-projection biases not added)."""
    h = GroupedMM.apply(rows, w13, offsets)
    if bias13 is not None:
        h = h + bias13.to(h.dtype)
    return GroupedMM.apply(act(h), w2, offsets)


def partial_experts(rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, first: int = 0, act: Activation = SWIGLU,
                    biases: tuple | None = None) -> torch.Tensor:
    """This rank's share of the experts on ``rows`` [T, dim] that every rank holds (decode: no tokens to
    gather): ``Σ_j weights[t, j] · (silu(rows[t] @ gate_e) * (rows[t] @ up_e)) @ down_e`` (``act`` in place of
    ``silu(gate) * up``) over the choices ``e = ids[t, j]`` among this rank's experts ``first .. first + E_local``
    (``w13`` [E_local, dim, 2 * width]: gate columns, then up; ``w2`` [E_local, width, dim]); the other choices add
    nothing. ``biases``: (gate/up [E_local, 2 * width] in ``w13``'s column order, down [E_local, dim] or None), the
    experts' biases (GPT-OSS's), added where each expert's products are (a down bias belongs in one rank's share
    only). The ranks' shares sum to the layer's output: each rank's slice of every expert's width (tensor parallel,
    ``first = 0``), or its whole experts (expert parallel). [T, dim] in float32 (float64 for float64 rows), with
    autograd.

    The (token, choice) pairs are sorted by expert on the device, this rank's experts first, and the two grouped
    GEMMs (``swiglu_rows``: one ``torch._grouped_mm`` each where it takes the operands) cover only those; the
    other pairs' rows are never computed and ``torch.where`` (not a product with 0, which would carry a NaN of
    unwritten memory, forward or backward) keeps them out of the sum and of the gradients. No host
    synchronisation where ``torch._grouped_mm`` takes the operands, so a decode step holding it can be captured in
    a CUDA graph."""
    E, (T, k) = w13.shape[0], ids.shape
    local = (ids - first).reshape(-1)
    group = torch.where((local >= 0) & (local < E), local, E)  # another rank's expert: the last group, uncomputed
    order, _ = sort_pairs(group, E + 1, None, 1)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=rows.device)
    offsets[1:] = torch.cumsum(count_ids(group, E + 1)[:E], 0)
    mine = (group[order] < E).unsqueeze(1)
    token = order // k
    a = torch.where(mine, rows[token], 0)
    acc = torch.promote_types(rows.dtype, torch.float32)
    # (other ranks' pairs: past the last group)
    b13, b2 = row_biases(biases, offsets, T * k) if biases is not None else (None, None)
    y = swiglu_rows(a, w13, w2, offsets, act, b13).to(acc)
    if b2 is not None:
        y = y + b2.to(acc)
    y = torch.where(mine, y, 0) * weights.reshape(-1)[order].unsqueeze(1).to(acc)
    return torch.zeros(T, y.shape[1], dtype=acc, device=rows.device).index_add(0, token, y)


# ------------------------------------------------------------------------------------- dispatch and combine
class Routing:
    """What one forward's dispatch hands to its combine and to both backwards: ``handle`` (the EPHandle, its rows
    detached so that it holds no autograd graph: the graph's nodes hold this object), ``ids`` and ``weights`` (the
    top-k, detached)."""

    __slots__ = ("handle", "ids", "weights")


class Combine(torch.autograd.Function):
    """``op.combine(y, routing.handle)`` as a function of the experts' outputs ``y`` [R, dim] and of the top-k
    ``weights`` [T_local, k] (float32). Backward: module docstring."""

    @staticmethod
    def forward(fctx, y, weights, op, routing):
        fctx.save_for_backward(y)
        fctx.op, fctx.routing = op, routing
        return op.combine(y.contiguous(), routing.handle)

    @staticmethod
    def backward(fctx, grad_out):
        (y,) = fctx.saved_tensors
        op, d = fctx.op, fctx.routing.handle
        rows = output_grad_rows(op, fctx.routing, grad_out, y.dtype)
        grad_y = (rows * d.weights[:, None]).to(y.dtype) if fctx.needs_input_grad[0] else None
        grad_w = weight_grads(op.ctx, y, rows, d) if fctx.needs_input_grad[1] else None
        return grad_y, grad_w, None, None


class DownCombine(torch.autograd.Function):
    """``op.combine(a, routing.handle, expert_weight=w2)`` (the down projection in the op's ``combine_stages``,
    each stage's partials sent as it ends: ops.ep_combine) as a function of the activations ``a`` [R, hidden], of
    ``w2`` and of the top-k ``weights``. Backward: Combine's for the projection's rows, then GroupedMM's."""

    @staticmethod
    def forward(fctx, a, w2, weights, op, routing):
        out, parts = op.combine(a.contiguous(), routing.handle, expert_weight=w2)
        fctx.save_for_backward(a, w2, *parts)
        fctx.op, fctx.routing = op, routing
        return out

    @staticmethod
    def backward(fctx, grad_out):
        a, w2, *parts = fctx.saved_tensors
        op, d = fctx.op, fctx.routing.handle
        rows = output_grad_rows(op, fctx.routing, grad_out, a.dtype)
        grad_a = grad_w2 = None
        if fctx.needs_input_grad[0] or fctx.needs_input_grad[1]:
            grad_y = (rows * d.weights[:, None]).to(a.dtype)
            grad_a = grouped_mm(grad_y, w2.transpose(1, 2), d.offsets) if fctx.needs_input_grad[0] else None
            grad_w2 = expert_grads(a, grad_y, d.offsets) if fctx.needs_input_grad[1] else None
        grad_w = weight_grads(op.ctx, parts, rows, d) if fctx.needs_input_grad[2] else None
        return grad_a, grad_w2, grad_w, None, None


def output_grad_rows(op, routing: Routing, grad_out: torch.Tensor, dtype) -> torch.Tensor:
    """float32 [R, N]: the output gradient of each row's token (row i: ``g[t]`` of the forward's row i), dispatched
    with the forward's ids and weights through ``op`` (module docstring)."""
    d = routing.handle
    g = op.dispatch(grad_out.to(dtype).contiguous(), routing.ids, routing.weights, num_experts=d.num_experts)
    if g.traffic != d.traffic:  # the same ids move the same counts; anything else is a bug (or changed ids)
        raise RuntimeError(f"EPMoE backward: rank {d.rank}: the output gradient's dispatch moved other counts than "
                           f"the forward's ({g.traffic} vs {d.traffic})")
    return g.tokens.float()


def weight_grads(ctx, y, g_rows: torch.Tensor, d) -> torch.Tensor:
    """float32 [T_local, k]: ``dL/dp[t, j] = <y_row(t, j), g[t]>``. On the owner, the dot of each row ``y`` [R, N]
    (or a sequence of its consecutive pieces) with its token's output gradient ``g_rows`` [R, N] (float32), placed
    per received token and choice [U, k] (0 where the choice is another rank's); ``all_to_all_single`` on the
    Context's group sends each source its tokens' values in float32 (the combine fallback's layout: received tokens
    per source, back in each source's send order), where each token's values are summed over its owners."""
    R, k = d.num_rows, d.slots.shape[1]
    parts, at, dots = (y,) if isinstance(y, torch.Tensor) else y, 0, []
    for p in parts:
        dots.append((p.float() * g_rows[at:at + p.shape[0]]).sum(1))
        at += p.shape[0]
    dots = torch.cat(dots + [torch.zeros(1, dtype=torch.float32, device=g_rows.device)])
    slots = d.slots.long()
    per = dots[torch.where(slots >= 0, slots, R)].contiguous()  # [U, k], index R: the zero
    back = torch.empty((sum(d.sent), k), dtype=torch.float32, device=g_rows.device)
    dist.all_to_all_single(back, per, list(d.sent), list(d.received), group=ctx.group)
    back = torch.cat([back, back.new_zeros(1, k)])
    pos = d.positions.long()  # [T_local, W]: the token's row in the send order per owner, -1: not sent there
    return back[torch.where(pos >= 0, pos, back.shape[0] - 1)].sum(1)


class DispatchProject(torch.autograd.Function):
    """``op.dispatch(..., expert_weight=w13)`` as a function of the tokens and of ``w13``: returns ``d.projected``
    [R, 2 * hidden] (each received row @ w13[its local expert]; computed as the rows land where the op's
    ``experts_gemm`` is "overlap": ops.ep_experts) and fills ``routing``. Backward: the rows' gradient by the grouped
    GEMM with ``w13^T``, summed per token over its choices on each owner and sent back (the op's combine with unit
    weights: module docstring); ``w13``'s by ``expert_grads`` over the received rows."""

    @staticmethod
    def forward(fctx, x, ids, weights, w13, op, num_experts, routing):
        d = op.dispatch(x.contiguous(), ids, weights, num_experts=num_experts, expert_weight=w13)
        routing.handle, routing.ids, routing.weights = replace(d, projected=None), ids, weights
        fctx.save_for_backward(d.tokens, w13)
        fctx.op, fctx.routing = op, routing
        return d.projected

    @staticmethod
    def backward(fctx, grad):
        tokens, w13 = fctx.saved_tensors
        d = fctx.routing.handle
        grad = grad.contiguous()
        grad_w = expert_grads(tokens, grad, d.offsets) if fctx.needs_input_grad[3] else None
        grad_x = None
        if fctx.needs_input_grad[0]:
            unit = replace(d, slot_weights=torch.ones_like(d.slot_weights))  # the op's combine, unweighted
            grad_x = fctx.op.combine(grouped_mm(grad, w13.transpose(1, 2), d.offsets), unit)
        return grad_x, None, None, grad_w, None, None, None


def ep_swiglu(rows, ids, weights, w13, w2, op, num_experts: int, staged: bool = False, act: Activation = SWIGLU,
              biases: tuple | None = None) -> torch.Tensor:
    """This rank's tokens ``rows`` [T_local, dim] through their top-k experts wherever they live, back as
    [T_local, dim]: dispatch with the gate and up projections (``DispatchProject``: started on each source's rows
    as they land where the op overlaps), ``act`` (``silu(gate) * up``), the down projection, combine,
    differentiable in ``rows``, ``weights`` (float32 [T_local, k]), ``w13`` and ``w2``. ``ids`` int [T_local, k].
    ``staged``: the down projection by the op's combine, in its ``combine_stages`` (``DownCombine``), else by torch
    before it. ``biases``: (gate/up [E/W, 2 * hidden], down [E/W, dim]) of this rank's experts (GPT-OSS's), added
    to each received row by its expert before the combine (not with ``staged``)."""
    if biases is not None and staged:
        raise ValueError("ep_swiglu: the experts' biases need the down projection by torch (staged=False)")
    routing = Routing()
    h = DispatchProject.apply(rows, ids, weights.detach(), w13, op, num_experts, routing)
    if biases is not None:
        b13, b2 = row_biases(biases, routing.handle.offsets, h.shape[0])
        h = h + b13.to(h.dtype)
    if staged:
        return DownCombine.apply(act(h), w2, weights, op, routing)
    y = GroupedMM.apply(act(h), w2, routing.handle.offsets)
    if biases is not None:
        y = y + b2.to(y.dtype)
    return Combine.apply(y, weights, op, routing)


# -------------------------------------------------------------------------------------------------- the layer
class EPMoE(ReplicatedRouter, nn.Module):
    """Expert-parallel mixture of ``num_experts`` SwiGLU experts of width ``hidden``, ``topk`` of them per token.

    ``[T_local, dim]`` (or ``[S, *, dim]``) -> the same shape: this rank's own tokens, any number per rank (zero
    included). Parameters: ``router`` (``nn.Linear(dim, E, bias=False)``, replicated: the same on every rank),
    ``w13`` [E/W, dim, 2 * hidden] (each local expert's gate columns, then its up columns) and ``w2`` [E/W, hidden,
    dim] (its down projection), in the ops' [E, K, N] layout (``TPMoE``'s, with whole experts); rank r's local
    expert i is expert ``r·E/W + i``. ``out[t] = sum_j p[t, j] * (silu(x[t] @ gate_e) * (x[t] @ up_e)) @ down_e``
    with ``e = ids[t, j]``, ``(p, ids)`` the top-k of ``softmax(x @ router.weight^T)`` (``renormalize``: ``p``
    divided by its sum over the k choices), exactly ``TPMoE``'s router. Checkpoints (nn.state_dict: full, and DCP
    at any world size) hold ``TPMoE``'s unmodified experts ``w1``, ``w3`` and ``w2``: one layer's loads into the other.

    Overlapped: the rows of each dispatch and combine (forward and backward), with a flag per source, where the op
    takes its overlapped path, and with ``experts_gemm="overlap"`` the forward's gate and up projections with the
    dispatch's rows, source by source (default "after": ``torch._grouped_mm`` once the rows are in, measured faster on
    2 H200s; ExpertParallelConfig). With ``combine_stages`` (an int), the forward's down projection runs in that
    many launches over consecutive experts, each stage's partials sent to their tokens' ranks as it ends
    (ops.ep_combine; None, the default: by torch, then the combine). Not overlapped: the other GEMMs with their
    transfers, the top-k weights' gradient (``all_to_all_single`` on the process group), the experts' weight
    gradients and the router. The module docstring says what each backward piece does.

    Gradients: the experts' are complete on their owner. The router's covers this rank's tokens only: call
    ``sync_replicated_grads()`` after backward (a sum over ranks) or hand it to your data-parallel reducer.

    Decode: with ``max_tokens_per_rank``, a forward without autograd (``torch.no_grad``, ``torch.inference_mode``)
    takes ``ExpertParallelLowLatency``'s dispatch and combine: no host synchronisation where the experts' GEMM is
    one ``torch._grouped_mm`` (``takes_grouped_mm``), so a decode step holding the layer can be captured in a CUDA
    graph (one eager call first). A rank with more tokens raises ValueError (its peers: ops.ep_low_latency); for a
    prefill without autograd set ``layer.low_latency = False`` on every rank (the ranks must take the same mode).

    Parameters are bfloat16 (default) or float16; float32 parameters work under ``torch.autocast`` (cast per call,
    as ``nn.Linear`` is) and raise TypeError without it. ``fallback`` is the op's rule ("auto": the process group
    where W = 1 or across hosts of different sizes, and in low-latency mode across hosts; "never", "always"). Every
    rank must call the layer (forward and backward) in the same order, as for any collective.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, topk: int, *, ctx, renormalize: bool = True,
                 dtype=None, device=None, fallback: str = "auto", max_tokens_per_rank: int | None = None,
                 experts_gemm: str = "after", combine_stages: int | None = None):
        super().__init__()
        W = ctx.world_size
        if num_experts % W:
            raise ValueError(f"EPMoE: num_experts = {num_experts} is not divisible by the world size {W} (rank r "
                             f"owns experts [r*E/W, (r+1)*E/W))")
        check_moe_layer("EPMoE", num_experts, topk, fallback)
        if combine_stages is not None and (not isinstance(combine_stages, int) or combine_stages < 1):
            raise ValueError(f"EPMoE: combine_stages must be None or an int >= 1, got {combine_stages!r}")
        kw = {"dtype": dtype or torch.bfloat16, "device": device or ctx.device}
        self.ctx, self.fallback = ctx, fallback
        self.dim, self.hidden, self.num_experts, self.topk = dim, hidden, num_experts, topk
        self.renormalize = renormalize
        self.experts_local = num_experts // W
        self.op = ep_op(ctx, fallback, experts_gemm, combine_stages)
        self.combine_stages = combine_stages
        self.low_latency = max_tokens_per_rank is not None
        self.decode_op = (None if max_tokens_per_rank is None else ctx.cached(
            ("nn ep_moe low-latency op", fallback, max_tokens_per_rank),
            lambda: ExpertParallelLowLatency(ctx, max_tokens_per_rank, fallback=fallback,
                                             name=f"nn.ep_moe.{fallback}.{max_tokens_per_rank}")))
        self.router = nn.Linear(dim, num_experts, bias=False, **kw)
        self.w13 = nn.Parameter(torch.empty(self.experts_local, dim, 2 * hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(self.experts_local, hidden, dim, **kw))
        k = self.experts_local
        record_experts(self, [slice(0, hidden)] * W, [slice(q * k, (q + 1) * k) for q in range(W)], ctx)
        with torch.no_grad():  # nn.Linear's default range: fan-in of each projection
            self.w13.uniform_(-dim ** -0.5, dim ** -0.5)
            self.w2.uniform_(-hidden ** -0.5, hidden ** -0.5)

    @classmethod
    def from_full(cls, router: nn.Linear, experts, ctx, *, topk: int, renormalize: bool = True, dtype=None,
                  device=None, fallback: str = "auto", max_tokens_per_rank: int | None = None,
                  experts_gemm: str = "after", combine_stages: int | None = None) -> "EPMoE":
        """This rank's experts of an unsharded MoE, the same on every rank (``TPMoE.from_full``'s arguments):
        ``router`` an ``nn.Linear(dim, E)`` without bias; ``experts`` either ``(w1, w3, w2)``, stacked tensors in
        ``nn.Linear``'s [out, in] convention (Mixtral's, Qwen3-MoE's): gate ``w1`` [E, hidden, dim], up ``w3``
        [E, hidden, dim], down ``w2`` [E, dim, hidden]; or a sequence of E expert modules, each with
        ``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/``down_proj`` ``nn.Linear`` layers without bias. Only
        rank r's experts ``[r·E/W, (r+1)·E/W)`` are copied. ``dtype``: the parameters' (default: the router's where
        16-bit, else bfloat16)."""
        w1, w3, w2, dtype = full_moe("EPMoE", router, experts, dtype)
        E, hidden, dim = w1.shape
        moe = cls(dim, hidden, E, topk, ctx=ctx, renormalize=renormalize, dtype=dtype, device=device,
                  fallback=fallback, max_tokens_per_rank=max_tokens_per_rank, experts_gemm=experts_gemm,
                  combine_stages=combine_stages)
        mine = slice(*moe.expert_range)
        moe.load(router, *shard_experts(w1[mine], w3[mine], w2[mine], 0, 1))  # whole experts: one "shard"
        return moe

    @property
    def expert_range(self) -> tuple:
        """(first, end): the global ids of this rank's experts."""
        first = self.ctx.rank * self.experts_local
        return first, first + self.experts_local

    @property
    def last_path(self) -> str | None:
        """The path the layer's op took on its latest call (shared by every EPMoE with this Context and fallback
        rule): ``"overlap"``, ``"fallback"`` (the process group's all_to_all_single), or None before any call."""
        return self._last.last_path if getattr(self, "_last", None) is not None else self.op.last_path

    def decodes(self) -> bool:
        """Whether a forward now takes the low-latency mode: the layer has ``max_tokens_per_rank``, ``low_latency``
        is on and autograd is off (the mode has no backward). Not the token count: every rank must take the same
        mode, and a rank knows only its own tokens."""
        return self.decode_op is not None and self.low_latency and not torch.is_grad_enabled()

    def route(self, rows: torch.Tensor):
        """This rank's (top-k ids int64 [T_local, k], top-k weights float32 [T_local, k]): ``TPMoE``'s router,
        with no exchange (each rank routes its own tokens)."""
        _, weights, ids = route_local(rows, self.router.weight, self.topk, self.renormalize)
        return ids, weights

    @torch.compiler.disable  # the dispatch reads the counts back to the host: no graph can hold it
    def forward(self, x):
        dtype = compute_dtype("EPMoE", x, self.w13)
        rows = x.reshape(-1, x.shape[-1]).to(dtype)
        ids, weights = self.route(rows)
        w13, w2 = self.w13.to(dtype), self.w2.to(dtype)
        if self.decodes():
            self._last = self.decode_op
            d = self.decode_op.dispatch(rows.contiguous(), ids, weights, num_experts=self.num_experts)
            y = self.decode_op.combine(swiglu_rows(d.tokens, w13, w2, d.offsets), d)
        else:
            self._last = self.op
            y = ep_swiglu(rows, ids, weights, w13, w2, self.op, self.num_experts, self.combine_stages is not None)
        return y.reshape(*x.shape[:-1], y.shape[-1])


__all__ = ["Combine", "DispatchProject", "DownCombine", "EPMoE", "GroupedMM", "Routing", "ep_op", "ep_swiglu",
           "grouped_mm", "partial_experts", "swiglu_rows", "takes_grouped_mm", "weight_grads"]
