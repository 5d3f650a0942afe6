"""Decode's local products: ``y = x @ w.T (+ bias)`` for a few rows of ``x`` (``MAX_ROWS``) against an
``nn.Linear`` weight ``w`` [N, K], a weight-streaming kernel that reads ``w`` once at close to the memory's bandwidth.

At decode a tensor-parallel layer's product is a handful of rows against a weight shard of tens to hundreds of MB:
the time is the weight's read. Each program takes BLOCK_N rows of ``w`` (output columns) and walks K in BLOCK_K
steps, the weight's rows as the MMA's M side and ``x``'s rows (padded to 16) as its N side, so the tensor cores
see a full-height tile however few rows ``x`` has (the "swap AB" arrangement); the whole K of a column block in one
program, so every output is one program's float32 sum and the result does not depend on the launch. Where it
beats cuBLAS (``torch.matmul``) and where not: docs/decisions.md, Decode's local products; ``fits`` holds the
rule measured there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cached_launch import launch
from .capability import is_sm90
from .gemm_operands import aligned

#: the most rows of ``x`` the kernel takes (one MMA's N side)
MAX_ROWS = 16
#: output columns (weight rows) per program, K per step, pipeline stages, warps
BLOCK_N, BLOCK_K, STAGES, WARPS = 64, 256, 4, 4
#: the weights [N, K] it takes: N from MIN_N to MAX_N (a program per 64 columns, up to about one per SM), K from
#: MIN_K; outside them cuBLAS was as fast or faster on all but one of the shapes measured (docs/decisions.md,
#: Decode's local products)
MIN_N, MAX_N, MIN_K = 4096, 8192, 4096


@triton.jit
def skinny_gemm(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N),): ``y[:, cols] = x @ w[cols].T (+ bias[cols])`` for this program's BLOCK_N columns,
    K a multiple of BLOCK_K, x's rows M <= BLOCK_M."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    row_ok = rows < M
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + rows.to(tl.int64)[None, :] * stride_xm + ks[:, None]  # x.T's [BLOCK_K, BLOCK_M] block
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        xt = tl.load(x_ptrs, mask=row_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rows.to(tl.int64)[None, :] * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=col_ok[:, None] & row_ok[None, :])


def usable(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``skinny_linear`` takes ``x`` [M, K] @ ``w`` [N, K].T where they are: plain tensors (not DTensor or
    fake ones) on the current CUDA device, an NVIDIA GPU of compute capability 9.0 (where the rule was measured,
    and whose shared memory holds the kernel's stages), and ``fits``."""
    if torch.version.hip is not None or x.device.type != "cuda" or x.device.index != torch.cuda.current_device():
        return False
    if any(t is not None and (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device != x.device)
           for t in (x, w, bias)):
        return False
    return is_sm90(x.device.index) and fits(x, w, bias)


def fits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """The kernel's rule, on any device: 16-bit operands of one dtype, 1 to MAX_ROWS rows, unit stride along K and
    16-byte aligned rows, K a whole number of BLOCK_K steps, a bias of N values, the weight's N in [MIN_N, MAX_N]
    and its K at least MIN_K (MIN_N's comment says why)."""
    if x.dim() != 2 or w.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return False
    M, K = x.shape
    N = w.shape[0]
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (N,) or bias.stride(0) != 1):
        return False
    if not 1 <= M <= MAX_ROWS or w.shape[1] != K or not MIN_N <= N <= MAX_N or K < MIN_K or K % BLOCK_K:
        return False
    return x.stride(1) == 1 and w.stride(1) == 1 and aligned(x, x.stride(0)) and aligned(w, w.stride(0))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, w, bias)`` (``x`` [*, K]), through ``skinny_linear`` where it applies: its
    rule (``usable``, on x's rows), no autograd to record, no autocast to another dtype, and not inside
    ``torch.compile``'s tracing (which keeps ``F.linear``); else ``F.linear`` itself. The kernel's sums differ from
    cuBLAS's in rounding, so the same call on 17 rows, under autograd or compiled gives other low bits."""
    if (torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                                                        or (bias is not None and bias.requires_grad)))
            or (torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") != x.dtype)):
        return torch.nn.functional.linear(x, w, bias)
    rows = x.reshape(-1, x.shape[-1])
    if not usable(rows, w, bias):
        return torch.nn.functional.linear(x, w, bias)
    return skinny_linear(rows, w, bias).view(*x.shape[:-1], w.shape[0])


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` -> [M, N] (``out`` if given) on the current stream; ``usable(x, w, bias)`` must hold."""
    M, K = x.shape
    N = w.shape[0]
    if out is not None and (out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device
                            or out.stride(1) != 1):
        raise ValueError(f"skinny_linear: out must be [{M}, {N}] {x.dtype} on {x.device} with unit stride along N, "
                         f"got {list(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}")
    y = torch.empty(M, N, device=x.device, dtype=x.dtype) if out is None else out
    launch(skinny_gemm, (triton.cdiv(N, BLOCK_N),), (
        x, w, bias if bias is not None else w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
    ), dict(BLOCK_N=BLOCK_N, BLOCK_M=MAX_ROWS, BLOCK_K=BLOCK_K, HAS_BIAS=bias is not None),
        num_warps=WARPS, num_stages=STAGES)
    return y


__all__ = ["MAX_N", "MAX_ROWS", "MIN_K", "MIN_N", "fits", "linear", "skinny_gemm", "skinny_linear", "usable"]
