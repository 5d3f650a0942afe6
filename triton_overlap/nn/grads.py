"""The gradient norm of a parallelized model, and clipping by it, as the unmodified model would have them; and its
parameters in the groups torch's foreach and fused optimizers take.

``torch.nn.utils.clip_grad_norm_`` cannot serve a model parallelized by this package's styles or layers: their
sharded weights are plain tensors holding this rank's rows, columns or experts, beside replicated DTensors (norms,
latent down-projections), and torch raises on a mix of Tensor and DTensor gradients; over plain tensors alone it
would take each rank's shards for the whole model, so each rank would clip by another factor and the ranks' shards
would drift apart. Here:

* a weight a style or layer partitions over its Context's ranks (each element of the unmodified weight on exactly
  one rank: the tensors ``state_dict.record`` notes, for the styles and the ``from_full`` layers alike) adds its
  shard's part on every rank, summed over the group (one all-reduce of a scalar per group);
* a DTensor gradient (a replicated weight's, partial or not; FSDP2's shards) is taken at its full value over its
  mesh, as torch takes it;
* any other gradient is the same on every rank (a weight outside the parallel region, or a layer's replicated
  weight after its ``sync_replicated_grads()``) and is counted once.

Collective over the groups of every partitioned weight: every rank calls it. Every rank gets the same norm and
scales its gradients by the same factor; no host synchronisation (unless ``error_if_nonfinite``).

The same mix keeps torch's optimizers from their multi-tensor kernels: ``foreach=True`` and ``fused=True`` (torchtitan's
and Hugging Face's defaults) raise on a list holding both plain tensors and DTensors, and by default torch takes one
kernel per parameter (it does not batch DTensors). An optimizer steps each parameter group with its own kernels, so
``param_groups(model)`` (plain tensors in one group, the DTensors of each mesh in another) lets them run.

float16 training's loss scaling has both problems: ``torch.amp.GradScaler`` unscales every gradient of an optimizer
in one multi-tensor call per device and dtype (which raises on the mix), and each rank checks only its own shards
for inf or nan, so one rank could skip a step the others take (its shards then lag the others', and where the step
of a DTensor communicates, as for a partial gradient, the ranks' collectives no longer match and hang).
``GradScaler`` here unscales DTensors' local tensors beside the plain ones and takes the maximum of the overflow
flag over every rank before the step is taken or skipped.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .state_dict import recorded, tensor_at


def _groups(model: nn.Module) -> dict:
    """id of each partitioned tensor -> its Context (the tensor as its module holds it now: FSDP2's DTensor
    included; a recorded buffer's id matches no parameter)."""
    return {id(tensor_at(owner, name)): ctx for _, owner, name, _, ctx in recorded(model)}


def _norm(grads, q: float, device) -> torch.Tensor:
    """The q-norm of ``grads`` (plain tensors, or DTensors at their full value over their mesh) as a float32
    tensor on ``device``; 0 for none."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    by_mesh: dict = {}
    for g in grads:  # (torch's norm takes a list of DTensors on one mesh at a time)
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    parts = []
    for mesh, gs in by_mesh.items():
        n = torch.nn.utils.get_total_norm(gs, q)
        parts.append((n.full_tensor() if isinstance(n, DTensor) else n).to(device=device, dtype=torch.float32))
    return torch.nn.utils.get_total_norm(parts, q) if len(parts) > 1 else parts[0]


@torch.no_grad()
def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm (a positive number or ``inf``) of every gradient of ``model`` as the unmodified model
    would have it (module docstring): a float32 scalar tensor on the parameters' device, the same on every rank.
    Collective: every rank of the partitioned weights' groups calls it."""
    q = float(norm_type)
    if not q > 0:
        raise ValueError(f"grad_norm: norm_type must be positive or inf, got {norm_type}")
    params = list(model.parameters())
    if not params:
        raise ValueError("grad_norm: the model has no parameters")
    device = params[0].device
    groups = _groups(model)
    whole, by_ctx = [], {}  # by_ctx: id(ctx) -> (ctx, its partitioned weights' gradients)
    for p in params:  # every partitioned weight's group, grad or not: the same all-reduces on every rank
        ctx = groups.get(id(p))
        grads = whole if ctx is None else by_ctx.setdefault(id(ctx), (ctx, []))[1]
        if p.grad is not None:
            grads.append(p.grad)
    parts = [_norm(whole, q, device)]
    for ctx, grads in by_ctx.values():
        local = _norm(grads, q, device)
        if math.isinf(q):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=ctx.group)
            parts.append(local)
        else:
            total = local.pow(q)
            dist.all_reduce(total, group=ctx.group)
            parts.append(total.pow(1.0 / q))
    return torch.nn.utils.get_total_norm(parts, q) if len(parts) > 1 else parts[0]


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model parallelized by this package: scales every gradient of
    ``model`` in place by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` being ``grad_norm(model, norm_type)``
    (the unmodified model's, the same on every rank), and returns ``norm``. ``error_if_nonfinite``: raise
    RuntimeError where the norm is nan or inf (reads it back to the host). Collective, as ``grad_norm``. Layers
    whose replicated weights' gradients are per-rank partial (``TPMoE``, ``EPMoE``, ``ParallelTransformerBlock``)
    need their ``sync_replicated_grads()`` first."""
    total = grad_norm(model, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {float(norm_type)} of the gradients is "
                           f"{float(total)}; error_if_nonfinite=False clips anyway")
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.mul_(coef.to(g.device))
    return total


def param_groups(model: nn.Module, **options) -> list[dict]:
    """``model``'s parameters as torch optimizer parameter groups, each of one kind: the plain tensors, then the
    DTensors of each device mesh (module docstring), each group a dict with ``"params"`` and ``options`` (e.g.
    ``weight_decay``). ``torch.optim.AdamW(param_groups(model), lr=..., fused=True)`` then runs where
    ``AdamW(model.parameters(), fused=True)`` raises; the step is the same."""
    kinds: dict = {}
    for p in model.parameters():
        kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": ps, **options} for ps in kinds.values()]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a model parallelized by this package's styles or layers (module docstring): the
    same arguments and use (``scale``, ``unscale_``, ``step``, ``update``), plus ``group``: the ranks that must step or
    skip together (None: every rank of the default group). ``unscale_`` (and ``step`` without it) unscales plain and
    DTensor gradients (their local tensors) in place, then takes the maximum of the inf / nan flag over ``group`` (one
    all-reduce of a scalar per unscale), so every rank skips the step, and lowers its scale, where any rank found
    one."""

    def __init__(self, device: str = "cuda", *args, group=None, **kwargs):
        super().__init__(device, *args, **kwargs)
        self.group = group

    def __getstate__(self):  # (a process group does not pickle: a copy takes the default group)
        state = super().__getstate__()
        state["group"] = None
        return state

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        by_device: dict = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if not allow_fp16 and g.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")  # (torch's words)
                    g = g.to_local() if isinstance(g, DTensor) else g
                    if g.is_sparse:
                        g = g.coalesce()._values() if g.dtype == torch.float16 else g._values()
                    by_device[g.device][g.dtype].append(g)
            for device, per_dtype in by_device.items():
                flag = found_inf if device == found_inf.device else torch.zeros_like(found_inf, device=device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
                if flag is not found_inf:
                    found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
            if dist.is_initialized():
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.group)
        return {found_inf.device: found_inf}


__all__ = ["GradScaler", "clip_grad_norm_", "grad_norm", "param_groups"]
