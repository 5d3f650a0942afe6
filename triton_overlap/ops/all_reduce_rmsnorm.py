"""AllReduce + residual add + RMSNorm, the step between a row-parallel layer and the next block's norm at decode:
``new_residual = residual + sum over ranks of x`` and ``normed = rmsnorm(new_residual) * weight``.

At decode the three separate kernels' launches cost about as much as their work, so one kernel does all three
(kernels.all_reduce_rmsnorm): the one-shot AllReduce with one block per row, whose epilogue adds the residual and
normalises the row; small messages travel as tagged words (ops.all_reduce.tagged_buffers), larger ones as plain
rows with a flag per row (ops.all_reduce.exchange_buffers). Both count calls on the device as the AllReduce does,
so it is graph-safe the same way: no barrier and no host synchronisation per call. Above ``max_bytes``, for rows
longer than one program holds, for W = 1 and on a group that spans hosts, the process group's all_reduce, then
torch's add and RMSNorm.
"""
from __future__ import annotations

import math

import torch

from ..kernels.all_reduce_rmsnorm import one_shot_all_reduce_rmsnorm, one_shot_all_reduce_rmsnorm_flags
from ..kernels.cached_launch import launch
from ..kernels.signal import waiter
from .all_reduce import (DTYPES, ONE_SHOT_MAX_BYTES, dependent_launch, exchange_buffers, pow2_at_least,
                         process_group_only, process_group_sum, tagged_buffers, values_per_word, word_io)
from .base import OverlapOp

#: the longest row one program normalises (its BLOCK, a power of two, holds the row in registers)
MAX_HIDDEN = 16384
#: fallback="auto": the fused kernel up to this many bytes of x at W = 2 (measured ahead of the three separate calls
#: at every shape to 1 MiB, docs/decisions.md), up to the AllReduce's one-shot limit at other world sizes
MAX_BYTES_W2 = 1 << 20
#: messages up to this many bytes go over tagged words, larger ones over plain slots and a flag per row
#: (kernels.all_reduce_rmsnorm; the crossing point measured on 2 H200s, docs/decisions.md)
TAGGED_MAX_BYTES = 32 << 10


#: an fp8 output's largest value (float8_e4m3fn), and the smallest scale (float32's least normal)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 2.0 ** -126


def rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype=None) -> torch.Tensor:
    """``h * rsqrt(mean(h ** 2, last dim) + eps) * weight`` in float32, in ``h``'s dtype (or ``out_dtype``): the
    fallback's norm, the kernel's arithmetic."""
    hf = h.float()
    return (hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(out_dtype or h.dtype)


def quantize_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [M, H] -> (fp8 [M, H], float32 scales [M, 1]) with ``scale = max(|row|) / FP8_MAX`` (at least
    MIN_SCALE): the kernel's per-row quantisation."""
    scale = (y.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (y / scale).to(FP8), scale


class AllReduceRMSNorm(OverlapOp):
    """Reusable AllReduce + residual add + RMSNorm bound to a Context: holds its symmetric receive slots and flags.

    ``op(x, residual, weight, *, eps, out=None, residual_out=None)`` -> ``(normed, new_residual)``: ``x`` and
    ``residual`` [M, H] of one dtype (float32, float16 or bfloat16), ``weight`` [H] of that dtype or float32; the
    sum over ranks of ``x`` and the add are in float32, rounded once into ``new_residual``, and ``normed`` is the
    RMSNorm (float32) of that rounded residual times ``weight``, both in ``x``'s dtype and the same bits on every
    rank. ``x`` is not modified; ``residual_out`` may be ``residual`` (updated in place, as serving engines do).
    ``out_dtype=torch.float8_e4m3fn``: ``normed`` in fp8 with a per-row scale, for an fp8 GEMM next; the call then
    returns ``(normed, new_residual, scales)``, ``scales`` float32 [M, 1] with ``normed.float() * scales`` the norm
    (each row's largest magnitude maps to 448).

    ``fallback``: "auto" takes the process group's all_reduce, then torch's add and RMSNorm, above ``max_bytes`` of
    ``x`` (None: MAX_BYTES_W2 at W = 2, the AllReduce's ONE_SHOT_MAX_BYTES elsewhere), for H > MAX_HIDDEN, for
    W = 1 and on a group that spans hosts; "always" always does; "never" never does (H > MAX_HIDDEN raises
    ValueError). The kernel moves messages up to ``tagged_max_bytes`` as tagged words (one trip over the link),
    larger ones as plain rows and a flag per row (half the bytes). The receive slots grow to the largest message
    seen (collectively, on a size's first call); make one eager call at the largest size before capturing calls in a
    CUDA graph.
    """

    KIND = "all_reduce_rmsnorm"

    def __init__(self, ctx, *, fallback: str = "auto", max_bytes: int | None = None,
                 tagged_max_bytes: int = TAGGED_MAX_BYTES, name: str | None = None):
        super().__init__(ctx, None, fallback=fallback, name=name, replay=False)  # one launch: nothing to replay
        if max_bytes is None:
            max_bytes = MAX_BYTES_W2 if ctx.world_size == 2 else ONE_SHOT_MAX_BYTES
        self.max_bytes = int(max_bytes)
        self.tagged_max_bytes = int(tagged_max_bytes)

    def default_config(self, shape, variant=""):
        return None

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float,
                 out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> tuple:
        ctx = self.ctx
        ctx.ensure_usable()
        xdt = getattr(x, "dtype", None)
        if out_dtype not in (None, xdt, FP8):
            raise ValueError(f"{self.KIND}: out_dtype must be None or x's dtype, or torch.float8_e4m3fn, got "
                             f"{out_dtype!r}")
        odt = out_dtype or xdt
        self._check(x, residual, weight, eps, out, residual_out, odt)
        M, H = x.shape
        self.agree((M, H, str(x.dtype), str(weight.dtype), str(odt), float(eps)))
        out = torch.empty((M, H), dtype=odt, device=x.device) if out is None else out
        residual_out = torch.empty((M, H), dtype=x.dtype, device=x.device) if residual_out is None else residual_out
        scales = torch.empty((M, 1), dtype=torch.float32, device=x.device) if odt == FP8 else None
        if self._kernel(x):
            self.last_path = "overlap"
            if x.numel():
                self._launch(x.contiguous(), residual.contiguous(), weight.contiguous(), float(eps), out,
                             residual_out, scales)
        else:
            self.last_path = "fallback"
            total = process_group_sum(ctx, x.contiguous().clone())  # x is not modified
            residual_out.copy_(residual + total)
            if scales is None:
                out.copy_(rmsnorm(residual_out, weight, float(eps)))
            else:
                q, s = quantize_rows(rmsnorm(residual_out, weight, float(eps), torch.float32))
                out.copy_(q), scales.copy_(s)
        return (out, residual_out) if scales is None else (out, residual_out, scales)

    def _check(self, x, residual, weight, eps, out, residual_out, out_dtype) -> None:
        """ValueError for anything the kernel cannot take, before any launch."""
        kind, dev = self.KIND, self.ctx.device
        for name, t in (("x", x), ("residual", residual), ("weight", weight)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{kind}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != dev:
                raise ValueError(f"{kind}: {name} is on {t.device}, the Context is on {dev}")
        if x.dim() != 2:
            raise ValueError(f"{kind}: x must be 2-D [M, H], got shape {tuple(x.shape)}")
        if x.dtype not in DTYPES:
            raise ValueError(f"{kind}: x must be float32, float16 or bfloat16, got {x.dtype}")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"{kind}: residual must be a {x.dtype} tensor of x's shape {tuple(x.shape)}, got "
                             f"{residual.dtype} {tuple(residual.shape)}")
        if weight.shape != (x.shape[1],) or weight.dtype not in (x.dtype, torch.float32):
            raise ValueError(f"{kind}: weight must be a {x.dtype} or float32 tensor of shape ({x.shape[1]},), got "
                             f"{weight.dtype} {tuple(weight.shape)}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"{kind}: eps must be a finite number >= 0, got {eps!r}")
        for name, t, dt in (("out", out, out_dtype), ("residual_out", residual_out, x.dtype)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape != x.shape or t.dtype != dt
                                  or t.device != dev or not t.is_contiguous()):
                got = (f"{'a non-contiguous ' if not t.is_contiguous() else ''}{t.dtype} {tuple(t.shape)} on "
                       f"{t.device}" if isinstance(t, torch.Tensor) else type(t).__name__)
                raise ValueError(f"{kind}: {name} must be a contiguous {dt} tensor of shape {tuple(x.shape)} "
                                 f"on {dev}, got {got}")
        if x.numel() == 0:
            return
        taken = {x.data_ptr(): "x", weight.data_ptr(): "weight"}
        if out is not None:
            if out.data_ptr() in (x.data_ptr(), weight.data_ptr(), residual.data_ptr()):
                raise ValueError(f"{kind}: out must not be x, residual or weight")
            taken[out.data_ptr()] = "out"
        if residual_out is not None and residual_out.data_ptr() in taken:
            raise ValueError(f"{kind}: residual_out must not be {taken[residual_out.data_ptr()]} (it may be "
                             f"residual)")

    def _kernel(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` takes the fused kernel (else the process group and torch)."""
        if process_group_only(self):
            return False
        M, H = x.shape
        # slot offsets are int32 in the kernel: 2 x W slots of the message
        fits = H <= MAX_HIDDEN and 2 * self.ctx.world_size * pow2_at_least(M * pow2_at_least(H)) < 2 ** 31
        if self.fallback == "never":
            if not fits:
                raise ValueError(f"{self.KIND}: [{M}, {H}] is too large for the fused kernel (rows up to "
                                 f"{MAX_HIDDEN}); fallback='auto' takes the process group there")
            return True
        return fits and x.numel() * x.element_size() <= self.max_bytes

    def _launch(self, x, residual, weight, eps, out, residual_out, scales) -> None:
        ctx = self.ctx
        M, H = x.shape
        call = self.call_header((M, H, x.dtype, out.dtype, eps), (M, H))  # (eps too: every rank's norm alike)
        block, pack = pow2_at_least(H), values_per_word(x.dtype)
        programs = max(1, min(M, ctx.num_compute_units()))
        rows = (x, residual, weight, out, out if scales is None else scales, residual_out)  # (scale_ptr: any, unread)
        wide = [t for t in (x, residual, weight, out, residual_out) if t.dtype == x.dtype]  # (read 32 bits at a time)
        common = dict(BLOCK=block, PACK=pack, WORD_IO=word_io(H, *wide),
                      BLOCK_W=pow2_at_least(ctx.world_size), CLOCK=ctx.clock,
                      FP8_MAX=0.0 if scales is None else FP8_MAX)
        warps = max(4, min(16, block // 512))
        pdl, pdl_option = dependent_launch(ctx, programs * warps)
        common.update(pdl)
        if x.numel() * x.element_size() <= self.tagged_max_bytes:
            ex = tagged_buffers(ctx, self.name, M * (block // pack))
            self.state["buffers"] = {"slots": ex.words.local}
            launch(one_shot_all_reduce_rmsnorm, (programs,), (*rows, *ex.args(), M, H, eps, ex.cap,
                                                               waiter(ctx, self.op), ctx.world_size, call.fingerprint),
                   dict(common, ONE_PROGRAM=programs == 1), num_warps=warps, **pdl_option)
        else:
            ex = exchange_buffers(ctx, self.name, M * H, x.dtype, M)
            self.state["buffers"] = {"slots": ex.data.local}
            launch(one_shot_all_reduce_rmsnorm_flags, (programs,), (*rows, *ex.args(), M, H, eps, ex.cap, ex.blocks,
                                                                     waiter(ctx, self.op), ctx.world_size,
                                                                     call.fingerprint), common, num_warps=warps,
                   **pdl_option)
        ctx.after_launch()


def all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, eps: float, ctx,
                       out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> tuple:
    """Functional form of AllReduceRMSNorm: ``(rmsnorm(residual + sum over ranks of x) * weight, residual + sum over
    ranks of x)`` (``out_dtype=torch.float8_e4m3fn``: the norm in fp8, then its per-row scales third); one op per
    Context, kept by the Context."""
    return AllReduceRMSNorm.shared(ctx)(x, residual, weight, eps=eps, out=out, residual_out=residual_out,
                                        out_dtype=out_dtype)


__all__ = ["AllReduceRMSNorm", "all_reduce_rmsnorm"]
