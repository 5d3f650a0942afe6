"""GEMM + AllReduce: ``sum over ranks of a_r @ w_r (+ bias)`` on every rank, the row-parallel GEMM of a layer without
sequence parallelism (decode).

Up to ``fused_max_rows`` rows (decode), one kernel (kernels.gemm_all_reduce) computes the partial product tile by
tile and sends each tile to every rank as it is done, then sums the tiles that arrived: one launch, and the
transfer of a tile hides behind the next tiles' products. Above it, torch.matmul writes the partial product and
the AllReduce op sums it (its kernels, or the process group for large messages). Either way the bias rides in rank
0's partial, so it is added once, and partials are rounded to the output dtype before they are summed in float32.
"""
from __future__ import annotations

import torch

from ..kernels.cached_launch import launch
from ..kernels.gemm_all_reduce import gemm_all_reduce
from ..kernels.signal import waiter
from ..plan import cdiv
from .all_reduce import TWO_SHOT_MAX_BYTES, AllReduce, pow2_at_least, slot_elements
from .base import OverlapOp
from .checks import check_operands
from .config import GEMMAllReduceConfig

#: algorithm="auto": the fused kernel up to this many rows (docs/decisions.md: against matmul + the AllReduce), at
#: W = 2 up to FUSED_MAX_ROWS_W2 (measured there with the tagged one-shot; other world sizes not since)
FUSED_MAX_ROWS = 16
FUSED_MAX_ROWS_W2 = 64
#: tiles of at most this many rows compute the weight's columns as the MMA's tall side (kernels.gemm_all_reduce's
#: SWAP_AB; docs/decisions.md, Decode's local products)
SWAP_MAX_ROWS = 16
ALGORITHMS = ("auto", "fused", "one_shot", "two_shot")


class GEMMAllReduce(OverlapOp):
    """Reusable GEMM + AllReduce bound to a Context.

    ``op(a, w, bias=None, *, out=None)``: ``a`` [M, K_local], ``w`` [K_local, N] (any 2-D strided views, as
    ``weight.t()``), float16 or bfloat16; ``bias`` [N], the same on every rank (rank 0's is added); returns
    [M, N], the same on every rank. Ranks may hold different K_local (K not divisible by W); M, N and the dtype
    must agree.

    ``algorithm``: "auto" (the fused kernel up to ``fused_max_rows`` rows, None: FUSED_MAX_ROWS_W2 at W = 2,
    FUSED_MAX_ROWS elsewhere; above it torch.matmul and the
    AllReduce op's own choice by ``one_shot_max_bytes`` / ``two_shot_max_bytes``; None: the AllReduce's default),
    "fused" (always the fused kernel), "one_shot" or "two_shot" (torch.matmul, then that AllReduce kernel).
    ``fallback``: "always" takes torch.matmul + the process group's all_reduce; "auto" does so for W = 1 and on a
    group that spans hosts; "never" never does. ``config``: the fused kernel's tiles (GEMMAllReduceConfig; None:
    tuned, else defaults).

    The fused kernel's slots grow to the largest output seen (2 x W x its size per rank, collectively, on a size's
    first call); make one eager call at the largest size before capturing calls in a CUDA graph.
    """

    KIND = "gemm_ar"

    def __init__(self, ctx, config: GEMMAllReduceConfig | None = None, *, algorithm: str = "auto",
                 fallback: str = "auto", fused_max_rows: int | None = None,
                 one_shot_max_bytes: int | None = None, two_shot_max_bytes: int = TWO_SHOT_MAX_BYTES,
                 name: str | None = None):
        super().__init__(ctx, config, fallback=fallback, name=name, replay=False)  # one launch: nothing to replay
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.algorithm = algorithm
        if fused_max_rows is None:
            fused_max_rows = FUSED_MAX_ROWS_W2 if ctx.world_size == 2 else FUSED_MAX_ROWS
        self.fused_max_rows = int(fused_max_rows)
        self.all_reduce = AllReduce(ctx, algorithm="auto" if algorithm == "fused" else algorithm,
                                    fallback=fallback, one_shot_max_bytes=one_shot_max_bytes,
                                    two_shot_max_bytes=two_shot_max_bytes, name=f"{self.name}.all_reduce")
        self.last_algorithm = None  # "fused", "one_shot", "two_shot" or "process group": what the last call took

    def default_config(self, shape, variant=""):
        return GEMMAllReduceConfig.defaults(self.ctx, shape[0], shape[1], self.ctx.num_compute_units())

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
        if out is not None and (out.data_ptr() in (a.data_ptr(), w.data_ptr())):
            raise ValueError("gemm_ar: out must not be a or w")
        M, N = want
        if self._fused(M, N):
            self.agree((M, N, str(dtype)))
            out = torch.empty(want, dtype=dtype, device=a.device) if out is None else out
            self._launch(a, w, bias, out)
            self.last_path, self.last_algorithm = "overlap", "fused"
            return out
        # the AllReduce's rule picks its path (and is this op's fallback rule); the process group sums in place, so
        # there the partial product is the output
        in_place = self.all_reduce.takes_process_group(M * N * a.element_size())
        partial = out if in_place and out is not None else torch.empty(want, dtype=dtype, device=a.device)
        if bias is not None and ctx.rank == 0:
            torch.addmm(bias, a, w, out=partial)
        else:
            torch.matmul(a, w, out=partial)
        out = self.all_reduce.sum_in_place(partial) if in_place else self.all_reduce(partial, out=out)
        self.last_path, self.last_algorithm = self.all_reduce.last_path, self.all_reduce.last_algorithm
        return out

    def _fused(self, M: int, N: int) -> bool:
        """Whether a call with an [M, N] output takes the fused kernel."""
        if self.fallback == "always" or self.fallback == "auto" and self.ctx.world_size == 1:
            return False
        if self.algorithm in ("one_shot", "two_shot") or not self.overlap_possible():
            return False
        fits = self.fits(M, N)
        if self.algorithm == "fused":
            if not fits:
                raise ValueError(f"gemm_ar: an output of {M} x {N} is too large for the fused kernel's slots at "
                                 f"W = {self.ctx.world_size}; algorithm='auto' takes matmul + AllReduce there")
            return True
        return fits and M <= self.fused_max_rows

    def fits(self, M: int, N: int) -> bool:
        """Whether the fused kernel can take an [M, N] output: its slot offsets are int32, 2 x W slots of the
        output's size."""
        return 2 * self.ctx.world_size * pow2_at_least(M * N) < 2 ** 31

    def _launch(self, a, w, bias, out) -> None:
        ctx = self.ctx
        W = ctx.world_size
        (M, K), N = a.shape, w.shape[1]
        cfg = self.config_for((M, N))
        tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
        cap = slot_elements(ctx, f"{self.name}.slots", M * N, out.dtype)
        max_tiles = pow2_at_least(tiles)
        data = ctx.symmetric(f"{self.name}.slots", (2, W, cap), out.dtype)
        flags = ctx.symmetric(f"{self.name}.flags", (W, max_tiles), torch.int32)
        header = ctx.symmetric(f"{self.name}.header", (2, W, 4), torch.int32)
        state = ctx.symmetric(f"{self.name}.state", (2,), torch.int32)  # call count, programs out
        self.state["buffers"] = {"slots": data.local}
        call = self.call_header((M, N, out.dtype, cfg.block_m, cfg.block_n), (M, N))
        programs = max(1, min(tiles, ctx.num_compute_units()))
        has_bias = bias is not None and ctx.rank == 0
        launch(gemm_all_reduce, (programs,), (
            a, w, bias if has_bias else out, out, data.ptrs, flags.ptrs, header.ptrs, data.local, flags.local,
            header.local, state.local, M, N, K, a.stride(0), a.stride(1), w.stride(0), w.stride(1),
            bias.stride(0) if has_bias else 0, cap, max_tiles, waiter(ctx, self.op), W, call.fingerprint),
            dict(HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                 BLOCK_W=pow2_at_least(W), EVEN_K=K % cfg.block_k == 0, DOT_F32=ctx.interpreted,
                 CLOCK=ctx.clock, SWAP_AB=cfg.block_m <= SWAP_MAX_ROWS), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        ctx.after_launch()


def gemm_ar(a: torch.Tensor, w: torch.Tensor, *, ctx, bias: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Functional form of GEMMAllReduce: one op per Context, kept by the Context."""
    return GEMMAllReduce.shared(ctx)(a, w, bias, out=out)


__all__ = ["GEMMAllReduce", "gemm_ar"]
