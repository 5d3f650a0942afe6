"""A tensor-parallel SwiGLU MLP built on the sequence-parallel linear layers."""
from __future__ import annotations

import torch
from torch import nn

from .linear import ColumnParallelLinear, RowParallelLinear


class TPMLP(nn.Module):
    """SwiGLU MLP: gate and up column-parallel (fused into one layer, so ``x`` is gathered once), down row-parallel.

    ``[S/W, *, dim]`` -> ``[S/W, *, dim]``; the hidden activations live as ``[S, *, hidden/W]``.
    """

    def __init__(self, dim, hidden, *, ctx, bias=False, dtype=None, device=None, fallback="auto",
                 keep_gathered_input=True):
        super().__init__()
        self.hidden_local = hidden // ctx.world_size
        self.gate_up = ColumnParallelLinear(dim, 2 * hidden, ctx=ctx, bias=bias, dtype=dtype, device=device,
                                            fallback=fallback, keep_gathered_input=keep_gathered_input)
        self.down = RowParallelLinear(hidden, dim, ctx=ctx, bias=bias, dtype=dtype, device=device, fallback=fallback)

    @classmethod
    def from_full(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, ctx, **kw):
        """Shard an unsharded SwiGLU MLP (``down(silu(gate(x)) * up(x))``), the same on every rank. ``kw``:
        ``dtype``, ``device``, ``fallback``, ``keep_gathered_input``; others raise TypeError."""
        unknown = sorted(set(kw) - {"dtype", "device", "fallback", "keep_gathered_input"})
        if unknown:
            raise TypeError(f"TPMLP.from_full() got unexpected keyword arguments {unknown}")
        W = ctx.world_size
        dim, hidden = gate.in_features, gate.out_features
        if hidden % W:
            raise ValueError(f"TPMLP: hidden = {hidden} is not divisible by the world size {W}")
        n = hidden // W
        # rank r's rows of the fused layer are [gate rows of r; up rows of r]
        fused = nn.Linear(dim, 2 * hidden, bias=gate.bias is not None, dtype=gate.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([torch.cat([gate.weight[r * n:(r + 1) * n], up.weight[r * n:(r + 1) * n]])
                                          for r in range(W)]))
            if gate.bias is not None:
                fused.bias.copy_(torch.cat([torch.cat([gate.bias[r * n:(r + 1) * n], up.bias[r * n:(r + 1) * n]])
                                            for r in range(W)]))
        mlp = cls(dim, hidden, ctx=ctx, bias=gate.bias is not None, dtype=kw.get("dtype"), device=kw.get("device"),
                  fallback=kw.get("fallback", "auto"), keep_gathered_input=kw.get("keep_gathered_input", True))
        mlp.gate_up = ColumnParallelLinear.from_full_weight(fused, ctx, **kw)
        mlp.down = RowParallelLinear.from_full_weight(down, ctx, **{k: v for k, v in kw.items()
                                                                   if k != "keep_gathered_input"})
        return mlp

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.hidden_local, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


__all__ = ["TPMLP"]
