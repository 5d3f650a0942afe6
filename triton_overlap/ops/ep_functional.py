"""The functional forms of expert-parallel dispatch and combine: one op per Context (per capacity in low-latency
mode), kept by the Context."""
from __future__ import annotations

import torch

from .ep_low_latency import ExpertParallelLowLatency, LowLatencyHandle
from .ep_routing import EPHandle
from .expert_parallel import ExpertParallel


def low_latency_op(ctx, max_tokens_per_rank: int) -> ExpertParallelLowLatency:
    """The low-latency op the functional forms use on ``ctx`` for ``max_tokens_per_rank``."""
    return ctx.cached(("functional op", ExpertParallelLowLatency.KIND, max_tokens_per_rank),
                      lambda: ExpertParallelLowLatency(ctx, max_tokens_per_rank,
                                                       name=f"{ExpertParallelLowLatency.KIND}.{max_tokens_per_rank}"))


def ep_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, num_experts: int,
                ctx, scales: torch.Tensor | None = None, max_tokens_per_rank: int | None = None,
                expert_weight: torch.Tensor | None = None):
    """ExpertParallel.dispatch (returns an EPHandle; ``expert_weight``: also ``d.projected``, the rows' product with
    their experts' weight, by torch after the rows: the GEMM started per source as they land needs an op with
    ``ExpertParallelConfig(experts_gemm="overlap")``), or with ``max_tokens_per_rank`` the low-latency mode's
    (ExpertParallelLowLatency.dispatch: no host synchronisation, fixed shapes; returns a LowLatencyHandle; no
    ``expert_weight``)."""
    if max_tokens_per_rank is None:
        return ExpertParallel.shared(ctx).dispatch(x, topk_ids, topk_weights, num_experts=num_experts, scales=scales,
                                                   expert_weight=expert_weight)
    if expert_weight is not None:
        raise ValueError("ep_dispatch: expert_weight is for the normal mode; the low-latency mode's rows are "
                         "d.tokens [W * capacity * topk, H] by local expert (d.offsets), for the caller's grouped "
                         "GEMM")
    return low_latency_op(ctx, max_tokens_per_rank).dispatch(x, topk_ids, topk_weights, num_experts=num_experts,
                                                             scales=scales)


def ep_combine(y: torch.Tensor, d, *, ctx, out: torch.Tensor | None = None,
               expert_weight: torch.Tensor | None = None):
    """The combine of the mode ``d`` came from: ExpertParallel.combine for an EPHandle (with ``expert_weight``: the
    down projection computed by the combine, ``(out, parts)`` returned), the low-latency op's for a
    LowLatencyHandle."""
    if isinstance(d, LowLatencyHandle):
        if expert_weight is not None:
            raise ValueError("ep_combine: expert_weight is for the normal mode; in the low-latency mode y is the "
                             "experts' output")
        return low_latency_op(ctx, d.capacity).combine(y, d, out=out)
    if not isinstance(d, EPHandle):
        raise ValueError(f"ep_combine: d must be the handle ep_dispatch returned, got {type(d).__name__}")
    return ExpertParallel.shared(ctx).combine(y, d, out=out, expert_weight=expert_weight)


__all__ = ["ep_combine", "ep_dispatch", "low_latency_op"]
