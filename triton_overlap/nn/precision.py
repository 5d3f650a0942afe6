"""The dtype a layer computes in: the kernels take 16-bit operands (bf16 / fp16), so a layer follows
``torch.autocast`` as ``nn.Linear`` does, and refuses float32 without it rather than lowering precision silently."""
from __future__ import annotations

import torch

#: dtypes the overlapped kernels compute in
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def compute_dtype(where: str, x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``where``'s call computes in: the autocast dtype where autocast is on for ``x``'s device (float32
    parameters under ``torch.autocast(dtype=torch.bfloat16)``, how mixed-precision training runs), else the
    parameters' own, which must be 16-bit and match ``x``'s. Raises TypeError otherwise, before any launch."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if dt not in COMPUTE_DTYPES:
            raise TypeError(f"{where}: autocast dtype {dt} is not one the kernels compute in (bfloat16, float16)")
        return dt
    if weight.dtype not in COMPUTE_DTYPES:
        raise TypeError(f"{where}: parameters are {weight.dtype}; the kernels compute in bfloat16 or float16. Build "
                        f"the layer with dtype=torch.bfloat16 (or float16; a model: model.to(torch.bfloat16), or "
                        f"from_pretrained(..., dtype=torch.bfloat16)), or call it under "
                        f"torch.autocast(device_type={dev!r}, dtype=torch.bfloat16) to keep float32 parameters")
    if x.dtype != weight.dtype:
        raise TypeError(f"{where}: input is {x.dtype} but the parameters are {weight.dtype}; pass "
                        f"{weight.dtype} activations, or run under torch.autocast")
    return weight.dtype


def compute_operands(where: str, x: torch.Tensor, *params):
    """``x`` and ``params`` (None kept) in :func:`compute_dtype`'s dtype; a cast is differentiable, so float32
    parameters receive float32 gradients."""
    dt = compute_dtype(where, x, params[0])
    return (x.to(dt),) + tuple(p if p is None else p.to(dt) for p in params)


__all__ = ["COMPUTE_DTYPES", "compute_dtype", "compute_operands"]
