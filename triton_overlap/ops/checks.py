"""Input checks that need no communication: they raise ValueError before anything is launched."""
from __future__ import annotations

import torch

from ..kernels.capability import capability

DTYPES = (torch.float16, torch.bfloat16)
#: fp8 inputs (AllGather-GEMM and the plain GEMM): e4m3 with per-tensor float32 scales, output bf16 or fp16
FP8 = torch.float8_e4m3fn


def check_operands(op: str, ctx, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                   scale_a=None, scale_b=None, out_dtype=None, fp8: bool = False) -> torch.dtype:
    """Shape/dtype/device checks that need no communication; raise ValueError before any launch. Returns the
    output dtype: ``a``'s, or for fp8 operands (ops that accept them: ``fp8=True``) ``out_dtype`` (default
    bf16), with ``scale_a`` and ``scale_b`` float32 one-element tensors on the device."""
    allowed = DTYPES + ((FP8,) if fp8 else ())
    for name, t in (("a", a), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype not in allowed:
            kinds = "float16, bfloat16 or float8_e4m3fn" if fp8 else "float16 or bfloat16"
            raise ValueError(f"{op}: {name} must be {kinds}, got {t.dtype}")
        if t.device != ctx.device:
            raise ValueError(f"{op}: {name} is on {t.device}, the Context is on {ctx.device}")
    if a.dtype != w.dtype:
        raise ValueError(f"{op}: a and w have different dtypes ({a.dtype} vs {w.dtype})")
    if a.shape[1] != w.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ: a is {tuple(a.shape)}, w is {tuple(w.shape)}")
    if a.shape[0] == 0 or a.shape[1] == 0 or w.shape[1] == 0:
        raise ValueError(f"{op}: empty operand: a {tuple(a.shape)}, w {tuple(w.shape)}")
    out = check_scales(op, ctx, a.dtype, scale_a, scale_b, out_dtype)
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != w.shape[1]:
            raise ValueError(f"{op}: bias must have shape ({w.shape[1]},), got {tuple(bias.shape)}")
        if bias.dtype != out or bias.device != a.device:
            raise ValueError(f"{op}: bias must be {out} on {a.device}, got {bias.dtype} on {bias.device}")
    return out


def result_dtype(dtype, out_dtype) -> torch.dtype:
    """The output dtype of operands of ``dtype`` given the caller's ``out_dtype`` (None: the operands' own, bf16
    for fp8); check_scales says which combinations are valid."""
    return out_dtype or (torch.bfloat16 if dtype == FP8 else dtype)


def check_scales(op: str, ctx, dtype, scale_a, scale_b, out_dtype) -> torch.dtype:
    """fp8's extra arguments (see check_operands); the output dtype."""
    if dtype != FP8:
        if scale_a is not None or scale_b is not None:
            raise ValueError(f"{op}: scale_a and scale_b are for float8_e4m3fn operands, got {dtype}")
        if out_dtype is not None and out_dtype != dtype:
            raise ValueError(f"{op}: out_dtype must be the operands' dtype ({dtype}) for {dtype} operands")
        return dtype
    if ctx.backend == "hip":
        raise ValueError(f"{op}: float8_e4m3fn is not supported on AMD here (MI300 uses e4m3fnuz; not built)")
    if ctx.backend == "cuda" and capability(ctx.device.index) < (8, 9):
        raise ValueError(f"{op}: float8_e4m3fn needs compute capability 8.9 or later, "
                         f"this GPU has {capability(ctx.device.index)}")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32 or s.device != ctx.device:
            got = f"{s.dtype} {tuple(s.shape)} on {s.device}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"{op}: float8_e4m3fn operands need {name}, a one-element float32 tensor on "
                             f"{ctx.device} (per-tensor scale), got {got}")
    out = result_dtype(dtype, out_dtype)
    if out not in DTYPES:
        raise ValueError(f"{op}: out_dtype must be float16 or bfloat16, got {out_dtype}")
    return out
