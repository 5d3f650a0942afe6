"""GEMM + AllReduce: ``sum over ranks of a_r @ w_r (+ bias)`` on every rank, the row-parallel GEMM of a layer without
sequence parallelism (decode). Each rank's GEMM (torch.matmul) writes its partial product; the AllReduce op sums
the partials (its one-shot kernel for small messages, the process group for large ones). The bias rides in rank 0's
partial, so it is added once and costs no kernel of its own.
"""
from __future__ import annotations

import torch

from .all_reduce import ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES, AllReduce
from .base import OverlapOp
from .checks import check_operands


class GEMMAllReduce(OverlapOp):
    """Reusable GEMM + AllReduce bound to a Context.

    ``op(a, w, bias=None, *, out=None)``: ``a`` [M, K_local], ``w`` [K_local, N] (any 2-D strided view, as
    ``weight.t()``), float16 or bfloat16; ``bias`` [N], the same on every rank (rank 0's is added); returns
    [M, N], the same on every rank. ``algorithm``, ``fallback`` and the thresholds are the AllReduce's
    (ops.all_reduce). The partial products are summed in float32 and rounded once to the output dtype.
    """

    KIND = "gemm_ar"

    def __init__(self, ctx, *, algorithm: str = "auto", fallback: str = "auto",
                 one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES, two_shot_max_bytes: int = TWO_SHOT_MAX_BYTES,
                 name: str | None = None):
        super().__init__(ctx, None, fallback=fallback, name=name, replay=False)
        self.all_reduce = AllReduce(ctx, algorithm=algorithm, fallback=fallback, one_shot_max_bytes=one_shot_max_bytes,
                                    two_shot_max_bytes=two_shot_max_bytes, name=f"{self.name}.all_reduce")

    def default_config(self, shape, variant=""):
        return None

    @torch.no_grad()
    def __call__(self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        ctx = self.ctx
        ctx.ensure_usable()
        dtype = check_operands(self.KIND, ctx, a, w, bias)
        want = (a.shape[0], w.shape[1])
        if out is not None and (tuple(out.shape) != want or out.dtype != dtype or out.device != a.device
                                or not out.is_contiguous()):
            raise ValueError(f"gemm_ar: out must be a contiguous {dtype} tensor of shape {want} on {a.device}")
        partial = torch.empty(want, dtype=dtype, device=a.device)
        if bias is not None and ctx.rank == 0:
            torch.addmm(bias, a, w, out=partial)
        else:
            torch.matmul(a, w, out=partial)
        out = self.all_reduce(partial, out=out)
        self.last_path = self.all_reduce.last_path
        return out


def gemm_ar(a: torch.Tensor, w: torch.Tensor, *, ctx, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Functional form of GEMMAllReduce: one op per Context, kept by the Context."""
    return GEMMAllReduce.shared(ctx)(a, w, bias, out=out)


__all__ = ["GEMMAllReduce", "gemm_ar"]
