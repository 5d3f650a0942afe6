"""A tensor-parallel SwiGLU MLP built on the sequence-parallel linear layers."""
from __future__ import annotations

import torch
from torch import nn

from .linear import ColumnParallelLinear, RowParallelLinear
from .state_dict import Piece, record, selection


class TPMLP(nn.Module):
    """SwiGLU MLP: gate and up column-parallel (fused into one layer, so ``x`` is gathered once), down row-parallel.

    ``[S/W, *, dim]`` -> ``[S/W, *, dim]``; the hidden activations live as ``[S, *, hidden/W]``. Rank r's rows of
    ``gate_up`` are its rows of the gate, then of the up projection; full and DCP checkpoints (nn.state_dict) hold
    the unmodified MLP's ``gate``, ``up`` and ``down`` weights (and biases), whatever the world size.
    """

    def __init__(self, dim, hidden, *, ctx, bias=False, dtype=None, device=None, fallback="auto",
                 keep_gathered_input=True):
        super().__init__()
        self.hidden_local = hidden // ctx.world_size
        self.gate_up = ColumnParallelLinear(dim, 2 * hidden, ctx=ctx, bias=bias, dtype=dtype, device=device,
                                            fallback=fallback, keep_gathered_input=keep_gathered_input)
        self.down = RowParallelLinear(hidden, dim, ctx=ctx, bias=bias, dtype=dtype, device=device, fallback=fallback)
        self._record()

    def _record(self) -> None:
        """Note (nn.state_dict.record) that ``gate_up``'s rows are rank r's rows of ``gate`` and then of ``up``, in
        place of the column layer's own note (consecutive rows of one fused weight)."""
        W, n = self.gate_up.ctx.world_size, self.hidden_local
        every = [slice(q * n, (q + 1) * n) for q in range(W)]
        for name in ("weight", "bias"):
            t = getattr(self.gate_up, name)
            self.gate_up.tp_full.pop(name, None)
            if t is not None:
                shape = (n * W, *t.shape[1:])
                record(self, f"gate_up.{name}", [Piece(f"{part}.{name}", shape, (selection(0, every),),
                                                       ((0, start, start + n),))
                                                 for part, start in (("gate", 0), ("up", n))], self.gate_up.ctx)

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
        mlp._record()
        return mlp

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.hidden_local, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


__all__ = ["TPMLP"]
