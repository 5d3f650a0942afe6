"""A parallel style for an RMSNorm over the whole output of a column-parallel layer, for
``torch.distributed.tensor.parallel.parallelize_module``: OLMo-2's, OLMo-3's, OLMoE's, FlexOlmo's and MiniMax-M2's
q/k norms, which normalize the query (key) of all heads together, ``q_norm(q_proj(x))`` with ``q_norm``'s weight
as wide as ``q_proj``'s output. Their models' own plans gather the projection's output to its full width on
every rank ("colwise_gather_output") and split it again before the output projection ("rowwise_split_input"), so
every rank computes the attention of every head. Here each rank keeps its heads: the norm's mean square is summed
over the ranks' columns (one AllReduce of one float32 per row), and each rank normalizes its own columns with its
slice of the weight; the attention stays tensor parallel.
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ..ops import custom_ops
from .linear import all_reduce_op
from .parallel import FALLBACKS, check_mesh, local_input, styled_class, summed_grad
from .state_dict import rows_of

#: the attribute names under which an RMSNorm module holds its epsilon (Hugging Face's, torch's)
EPS_NAMES = ("variance_epsilon", "eps")


class ColwiseRMSNorm(ParallelStyle):
    """An RMSNorm module (a ``weight`` [N], its epsilon as ``variance_epsilon`` or ``eps``; it must compute
    ``x * rsqrt(mean(x², -1) + eps) * weight``, which a probe checks when applied) whose input is this rank's
    columns ``[..., N/W]`` of a ``ColwiseParallel`` layer's output, as the whole-width norm computes them.

    Applied, the module keeps rank r's slice ``weight[r·N/W : (r+1)·N/W]`` as a plain parameter, as
    ``ColwiseParallel`` keeps its rows (its gradient is complete: the slice sees every token of its columns).
    Forward: the sum of squares of this rank's columns, in float32, summed over the ranks by one AllReduce
    (``ops.all_reduce``: graph-safe; ``fallback`` as the other styles'), then this rank's columns normalized in
    float32 and scaled by the weight with the module's own order of cast (``check_norm``), ``[..., N/W]``, a plain
    tensor. Backward: through the
    AllReduce, the sum of the ranks' gradients of the mean square. A DTensor input must be sharded on its last
    dim."""

    def __init__(self, ctx, *, fallback: str = "auto"):
        if fallback not in FALLBACKS:
            raise ValueError(f"ColwiseRMSNorm: fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.ctx, self.fallback = ctx, fallback

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        check_mesh(self, device_mesh)
        if hasattr(module, "tp_style"):
            raise ValueError(f"ColwiseRMSNorm: {type(module).__name__} is parallelized already")
        eps, cast_first = check_norm(module, "ColwiseRMSNorm")
        W, r = self.ctx.world_size, self.ctx.rank
        n = module.weight.shape[0]
        if n % W:
            raise ValueError(f"ColwiseRMSNorm: the norm's width {n} is not divisible by the world size {W}")
        every = [slice(q * (n // W), (q + 1) * (n // W)) for q in range(W)]
        with torch.no_grad():
            module.weight = nn.Parameter(module.weight[every[r]].clone(), requires_grad=module.weight.requires_grad)
        rows_of(module, "weight", 0, every, self.ctx)
        module.tp_style, module.tp_mesh, module.tp_width, module.tp_eps = self, device_mesh, n, eps
        module.tp_cast_first = cast_first
        module.tp_all_reduce = all_reduce_op(self.ctx, self.fallback)
        module.__class__ = styled_class(type(module), _norm_forward, "ColwiseRMSNorm", _last_path, _ops)
        return module


def check_norm(module: nn.Module, who: str) -> tuple[float, bool]:
    """(the epsilon, whether the weight multiplies the normalized rows after they are cast back to the input's dtype)
    of ``module`` where it is an RMSNorm of one weight [N] that computes ``x * rsqrt(mean(x², -1) + eps) * weight``
    (checked on a float64 probe on the CPU, random weight and rows, to float32's precision: norms compute in
    float32). The order of the cast: Llama's, OLMoE's and MiniMax-M2's norms multiply ``weight * normed.to(dtype)``
    (a float32 weight under autocast then returns float32), OLMo-2's ``(weight * normed).to(dtype)``; a bfloat16
    probe with a float32 weight tells them apart by the dtype it returns. TypeError naming ``who`` and the module's
    class otherwise."""
    name = type(module).__name__
    params = [n for n, _ in module.named_parameters()]
    eps = next((getattr(module, e) for e in EPS_NAMES if isinstance(getattr(module, e, None), float)), None)
    weight = getattr(module, "weight", None)
    if params != ["weight"] or weight.dim() != 1 or eps is None:
        raise TypeError(f"{who}: {name} must hold one parameter, weight [N], and its epsilon as one of "
                        f"{EPS_NAMES} (it has {params})")
    probe = copy.deepcopy(module).to_empty(device="cpu").to(torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(weight.shape, generator=g, dtype=torch.float64))
        x = torch.randn(8, weight.shape[0], generator=g, dtype=torch.float64) * 3
        own = type(probe).forward(probe, x)
        mine = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * probe.weight
    same = isinstance(own, torch.Tensor) and own.shape == mine.shape and torch.allclose(own, mine, rtol=1e-5,
                                                                                         atol=1e-6)
    if not same:
        raise TypeError(f"{who}: {name} does not compute x * rsqrt(mean(x^2) + eps) * weight")
    probe = probe.to(torch.float32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's RMSNorm warns of the mixed dtypes)
        cast = type(probe).forward(probe, x.to(torch.bfloat16)).dtype
    return eps, cast == torch.float32


def _norm_forward(module, x):
    """This rank's columns of the whole-width RMSNorm (class docstring)."""
    x = local_input(x, "ColwiseRMSNorm", -1)
    with torch.autocast(x.device.type, enabled=False):
        xf = x.float()
        squares = summed_grad(xf.pow(2).sum(-1, keepdim=True), module.tp_mesh)
        total = custom_ops.all_reduce(squares, module.tp_all_reduce)
        normed = xf * torch.rsqrt(total / module.tp_width + module.tp_eps)
        if module.tp_cast_first:  # (check_norm: the module's own order)
            return module.weight * normed.to(x.dtype)
        return (normed * module.weight.float()).to(x.dtype)


def _ops(module) -> tuple:
    """The AllReduce that sums the norm's squares over the ranks (shared by every such norm and MoE block without
    sequence parallelism with the same Context and fallback rule)."""
    return (custom_ops.op_of(module.tp_all_reduce),)


def _last_path(module) -> str | None:
    """The path the norm's AllReduce took on its latest call: ``"overlap"`` (its kernel), ``"fallback"`` (the
    process group), or None before any call."""
    return _ops(module)[0].last_path


__all__ = ["ColwiseRMSNorm", "check_norm"]
