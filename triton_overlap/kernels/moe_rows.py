"""Row-wise passes of the MoE layers between their grouped GEMMs, each one pass over the rows.

* SwiGLU on the gate/up rows ``h`` [R, 2n] (gate columns, then up): ``silu(gate) * up`` forward, and both halves'
  gradients backward. In torch that is two kernels forward (the sigmoid-weighted gate, the product) and four
  backward, each over [R, n] and the last a concatenation; here one each, in float32 with one rounding.
* The row pass of a MoE-GEMM-ReduceScatter's backward. The forward's output is ``Σ_j s[t, j] · h[t, j] @ w[e]``
  summed over ranks (``s`` the top-k weights, ``h`` the rows in the expert-sorted layout). Given ``g = grad_out @
  w[e]^T`` per row (the converse AllGather-MoE's output, in its own sorted layout), the backward needs of every row
  p, from ``g``'s row ``src[p]`` and ``h[p]``: the input's gradient ``s[p] · g``, the product ``<g, h[p]>`` (the
  top-k weight's gradient, this rank's part of the sum over ranks) and ``s[p] · h[p]`` (the weight gradient's left
  operand). In torch that is a gather, two conversions to float32 and five elementwise passes over [P, N]; here
  each row is read once and each result written once (the same products, the dot summed in another order).

docs/decisions.md (Mixture of experts, the layer's backward) has the measurements.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..plan import cdiv
from .cached_launch import launch, triton_interprets

#: (rows, columns, warps) of a tile on GPUs and in the interpreter
TILE = (8, 256, 4)
TILE_INTERPRETED = (64, 64, 1)


#: the dtypes the kernels take (float32 arithmetic: float64 rows stay with torch)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def runs_kernels(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows go through these kernels: 16-bit or float32 rows on a GPU, or in Triton's interpreter
    (the host backend); elsewhere (float64, a CPU without the interpreter) the layers use torch. Traceable by
    torch.compile."""
    return t.dtype in DTYPES and (t.is_cuda or _interprets())


@torch.compiler.assume_constant_result
def _interprets() -> bool:  # (asked of triton, which torch.compile does not trace: a constant for it)
    return triton_interprets()


def _tile(t: torch.Tensor) -> tuple:
    return TILE if t.is_cuda else TILE_INTERPRETED


def _on(t: torch.Tensor):
    """``t``'s device made current for a launch (Triton launches on the current one)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@triton.jit
def _gate_up(h_ptr, R, N, stride_h, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of rows (axis 0) and columns (axis 1): (rows int64, columns, mask, gate, up float32)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (rows < R)[:, None] & (cols < N)[None, :]
    at = h_ptr + rows[:, None] * stride_h + cols[None, :]
    return rows, cols, m, tl.load(at, mask=m, other=0.0).to(tl.float32), tl.load(at + N, mask=m, other=0.0).to(
        tl.float32)


@triton.jit
def swiglu_rows(h_ptr, out_ptr, R, N, stride_h, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[r, n] = silu(h[r, n]) · h[r, N + n]`` for a tile of rows (axis 0) and columns (axis 1)."""
    rows, cols, m, gate, up = _gate_up(h_ptr, R, N, stride_h, BLOCK_M, BLOCK_N)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_rows_grad(h_ptr, grad_ptr, grad_h_ptr, R, N, stride_h, stride_grad, stride_grad_h,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The gradient of swiglu_rows: ``grad_h[r, n] = grad · up · σ(gate) · (1 + gate · (1 − σ(gate)))`` and
    ``grad_h[r, N + n] = grad · silu(gate)``."""
    rows, cols, m, gate, up = _gate_up(h_ptr, R, N, stride_h, BLOCK_M, BLOCK_N)
    g = tl.load(grad_ptr + rows[:, None] * stride_grad + cols[None, :], mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    out = grad_h_ptr + rows[:, None] * stride_grad_h + cols[None, :]
    tl.store(out, (g * up * sig * (1.0 + gate * (1.0 - sig))).to(grad_h_ptr.dtype.element_ty), mask=m)
    tl.store(out + N, (g * gate * sig).to(grad_h_ptr.dtype.element_ty), mask=m)


@triton.jit
def scaled_row_grads(g_ptr, src_ptr, scale_ptr, h_ptr, grad_h_ptr, hs_ptr, dot_ptr, P, N, stride_g, stride_h,
                     stride_out, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows ``p`` of a tile (grid axis 0), walking their N columns in steps of BLOCK_N: ``grad_h[p] = scale[p] ·
    g[src[p]]``, where SCALED ``hs[p] = scale[p] · h[p]`` (both rounded once to their dtype, rows ``stride_out``
    apart) and ``dot[p] = Σ_n g[src[p], n] · h[p, n]`` (float32)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    ok = rows < P
    src = tl.load(src_ptr + rows, mask=ok, other=0).to(tl.int64)
    s = tl.load(scale_ptr + rows, mask=ok, other=0.0)
    dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        m = ok[:, None] & (cols < N)[None, :]
        g = tl.load(g_ptr + src[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dot += tl.sum(g * h, axis=1)
        at = rows[:, None] * stride_out + cols[None, :]
        tl.store(grad_h_ptr + at, (g * s[:, None]).to(grad_h_ptr.dtype.element_ty), mask=m)
        if SCALED:
            tl.store(hs_ptr + at, (h * s[:, None]).to(hs_ptr.dtype.element_ty), mask=m)
    tl.store(dot_ptr + rows, dot, mask=ok)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of rows ``h`` [R, 2n] (unit column stride) -> [R, n] in ``h``'s dtype, on the current
    stream."""
    if h.shape[1] % 2:
        raise ValueError(f"swiglu: the rows [R, 2n] hold gate then up columns, got an odd width {h.shape[1]}")
    R, N = h.shape[0], h.shape[1] // 2
    out = h.new_empty(R, N)
    if R and N:
        block_m, block_n, warps = _tile(h)
        with _on(h):
            launch(swiglu_rows, (cdiv(R, block_m), cdiv(N, block_n)), (h, out, R, N, h.stride(0), out.stride(0)),
                   dict(BLOCK_M=block_m, BLOCK_N=block_n), num_warps=warps)
    return out


def swiglu_grad(h: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``swiglu`` at rows ``h`` [R, 2n] for the output's gradient ``grad`` [R, n] (unit column
    strides) -> [R, 2n] in ``h``'s dtype."""
    R, N = grad.shape
    grad_h = torch.empty_like(h, memory_format=torch.contiguous_format)
    if R and N:
        block_m, block_n, warps = _tile(h)
        with _on(h):
            launch(swiglu_rows_grad, (cdiv(R, block_m), cdiv(N, block_n)), (
                h, grad, grad_h, R, N, h.stride(0), grad.stride(0), grad_h.stride(0)),
                dict(BLOCK_M=block_m, BLOCK_N=block_n), num_warps=warps)
    return grad_h


def scaled_grads(g: torch.Tensor, src: torch.Tensor, scale: torch.Tensor, h: torch.Tensor, scaled: bool = True):
    """``g`` [*, N] rows to read at ``src`` int [P]; ``scale`` float32 [P]; ``h`` [P, N] (unit column strides,
    ``src`` and ``scale`` contiguous): (``scale[p] · g[src[p]]`` and ``scale[p] · h[p]`` [P, N] in ``h``'s dtype,
    ``<g[src[p]], h[p]>`` float32 [P]), on the current stream. ``scaled=False`` (no weight gradient to compute)
    skips ``scale[p] · h[p]`` and returns it empty, [0, N]."""
    P, N = h.shape
    if g.shape[1] != N or src.shape != (P,) or scale.shape != (P,):
        raise ValueError(f"scaled_grads: rows g {tuple(g.shape)}, src {tuple(src.shape)} and scale "
                         f"{tuple(scale.shape)} do not fit h {tuple(h.shape)}")
    grad_h, hs = h.new_empty(P, N), h.new_empty(P if scaled else 0, N)
    dot = torch.empty(P, dtype=torch.float32, device=h.device)
    if P:
        block_m, block_n, warps = _tile(h)
        with _on(h):
            launch(scaled_row_grads, (cdiv(P, block_m),), (  # (unscaled: grad_h stands in for the unused hs)
                g, src, scale, h, grad_h, hs if scaled else grad_h, dot, P, N, g.stride(0), h.stride(0),
                grad_h.stride(0)), dict(SCALED=scaled, BLOCK_M=block_m, BLOCK_N=block_n), num_warps=warps)
    return grad_h, hs, dot


__all__ = ["DTYPES", "runs_kernels", "scaled_grads", "scaled_row_grads", "swiglu", "swiglu_grad", "swiglu_rows",
           "swiglu_rows_grad"]
