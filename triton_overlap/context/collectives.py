"""The process group's own collectives, as the fallbacks and baselines call them.

torch >= 2.13 names the single-tensor all-gather and reduce-scatter ``all_gather_single`` and
``reduce_scatter_single`` (``all_gather_into_tensor`` and ``reduce_scatter_tensor`` warn there); older torch has
only the latter names.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(out: torch.Tensor, inp: torch.Tensor, group=None) -> torch.Tensor:
    """``out`` (``W * rows`` rows) = every rank's ``inp`` stacked along dim 0, in rank order."""
    _all_gather(out, inp, group=group)
    return out


def reduce_scatter_rows(out: torch.Tensor, inp: torch.Tensor, group=None) -> torch.Tensor:
    """``out`` = this rank's block of rows of the sum over ranks of ``inp`` (``W * rows`` rows)."""
    _reduce_scatter(out, inp, group=group)
    return out
