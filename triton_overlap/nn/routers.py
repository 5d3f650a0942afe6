"""The routing rules ``MoEParallel`` computes on this rank's tokens, and how a Hugging Face router is matched to
one: the router's own forward and each rule run side by side on a probe (a float64 copy of the router with random
weights and buffers, on random rows), and the first rule that gives the same logits, expert ids and weights is the
router's. So a router of any model whose rule is one of these is taken whatever its class is called, and any other
router is refused, by name, before the model changes.

The rules (each in float32 whatever the autocast state, as ``nn.moe.route_local``: the top-k choice turns on small
differences):

* ``Softmax(renormalize)``: softmax over the experts' logits, the k largest, divided by their sum where
  ``renormalize`` (Mixtral, Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE, OLMoE; GPT-OSS's, its logits biased).
* ``GroupedSigmoid()``: DeepSeek-V3's (GLM-4.5, dots.llm1 and the models that copy its router): scores
  ``sigmoid(logits)``; the choice among ``scores + e_score_correction_bias`` (a buffer of the router, read at every
  call: training updates it outside autograd), restricted to the ``topk_group`` groups (of ``num_group`` equal
  groups of experts) whose two best choice scores sum highest; the weights are the chosen experts' scores, divided
  by their sum (+ 1e-20) where ``norm_topk_prob``, times ``routed_scaling_factor``.
* ``GroupedSigmoid(renormalize=True)``: the same with the weights always divided by their sum: MiniMax-M2's, whose
  router has no groups and takes the correction bias, a buffer of the block, as its forward's second argument
  (``router_rule``'s ``bias``; the block's forward passes it at every call). The scale may be named
  ``router_scaling_factor`` (Hunyuan's).
* ``GroupedSoftmax()``: DeepSeek-V2's (V2, V2-Lite, V2.5): softmax over the experts; with ``topk_method``
  "group_limited_greedy" the choice is restricted to the ``topk_group`` groups (of ``num_group``) whose best
  expert scores highest; the weights are the chosen scores (divided by their sum + 1e-20 where ``norm_topk_prob``)
  times ``routed_scaling_factor``.
* ``BiasedSoftmax(renormalize)``: Ernie 4.5's: softmax over the experts; the choice among ``scores +
  e_score_correction_bias`` (a parameter without gradient, which Ernie keeps in the router's child
  ``moe_statics``); the weights are the chosen scores, divided by their sum (at least ``norm_min``) where
  ``renormalize``, times the router's scale where it has one.

A router holds one trainable parameter, its ``weight``, or two where the second is a ``bias`` [E] added to the
logits (GPT-OSS's: softmax over its k largest logits, which is ``Softmax(renormalize=True)`` on biased logits); a
correction bias may be a buffer or a parameter without gradient, of the router or of a child of it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .moe import route_local

#: rows and seed of the probe that matches a router to its rule
PROBE_ROWS, PROBE_SEED = 32, 20261204


@dataclass(frozen=True)
class Softmax:
    """Softmax over the experts, the top ``gate.top_k``, divided by their sum where ``renormalize``."""
    renormalize: bool

    def __call__(self, gate, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 logit_bias: torch.Tensor | None = None):
        """(logits float32 [T, E], weights float32 [T, k], ids int64 [T, k]) of rows [T, dim] (``bias``: unused;
        ``logit_bias``: the router's own bias [E], added to the logits)."""
        return route_local(rows, weight, gate.top_k, self.renormalize, logit_bias)


@dataclass(frozen=True)
class GroupedSigmoid:
    """DeepSeek-V3's rule (module docstring), its parameters read from the router at every call. ``renormalize``:
    None, the router's ``norm_topk_prob`` says whether the weights are divided by their sum; True, always."""
    renormalize: bool | None = None

    def __call__(self, gate, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """(logits float32 [T, E], weights float32 [T, k], ids int64 [T, k]) of rows [T, dim]; a group's score is
        the sum of its two best choice scores, as transformers computes it (so groups of two experts or more).
        ``bias``: the correction bias where the block holds it (None: the router's ``e_score_correction_bias``)."""
        groups, keep = _groups(gate)
        bias = correction_bias(gate) if bias is None else bias
        with torch.autocast(rows.device.type, enabled=False):
            logits = rows.float() @ weight.float().t()
            scores = torch.sigmoid(logits)
            choice = scores + bias.float().reshape(-1)
            if keep < groups:  # a group's score: the sum of its two best choice scores
                best = choice.view(choice.shape[0], groups, -1).topk(2, dim=-1).values.sum(-1)
                choice = choice.masked_fill(~_kept_groups(best, keep, choice.shape[1]), float("-inf"))
            ids = choice.topk(gate.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
            if self.renormalize if self.renormalize is not None else getattr(gate, "norm_topk_prob", False):
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            weights = weights * _scale(gate)
        return logits, weights, ids


@dataclass(frozen=True)
class GroupedSoftmax:
    """DeepSeek-V2's rule (module docstring), its parameters read from the router at every call."""

    def __call__(self, gate, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """(logits float32 [T, E], weights float32 [T, k], ids int64 [T, k]) of rows [T, dim] (``bias``: unused)."""
        groups, keep = _groups(gate)
        with torch.autocast(rows.device.type, enabled=False):
            logits = rows.float() @ weight.float().t()
            scores = logits.softmax(-1)
            choice = scores
            if getattr(gate, "topk_method", "greedy") == "group_limited_greedy" and keep < groups:
                best = scores.view(scores.shape[0], groups, -1).amax(-1)  # (a group's score: its best expert's)
                choice = scores.masked_fill(~_kept_groups(best, keep, scores.shape[1]), 0.0)
            ids = choice.topk(gate.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
            if getattr(gate, "norm_topk_prob", False):
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            weights = weights * _scale(gate)
        return logits, weights, ids


@dataclass(frozen=True)
class BiasedSoftmax:
    """Ernie 4.5's rule (module docstring)."""
    renormalize: bool

    def __call__(self, gate, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """(logits float32 [T, E], weights float32 [T, k], ids int64 [T, k]) of rows [T, dim]; ``bias``: the
        correction bias where the block holds it (None: the router's)."""
        bias = correction_bias(gate) if bias is None else bias
        with torch.autocast(rows.device.type, enabled=False):
            logits = rows.float() @ weight.float().t()
            scores = logits.softmax(-1)
            ids = (scores + bias.float().reshape(-1)).topk(gate.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
            if self.renormalize:
                weights = weights / weights.sum(-1, keepdim=True).clamp(min=float(getattr(gate, "norm_min", 0.0)))
            weights = weights * _scale(gate)
        return logits, weights, ids


def _kept_groups(best: torch.Tensor, keep: int, experts: int) -> torch.Tensor:
    """bool [T, experts]: the experts of the ``keep`` groups of highest score ``best`` [T, groups] (equal groups of
    consecutive experts)."""
    chosen = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(keep, dim=-1).indices, True)
    return chosen.unsqueeze(-1).expand(-1, -1, experts // best.shape[1]).reshape(best.shape[0], experts)


def correction_bias(gate) -> torch.Tensor | None:
    """The router's ``e_score_correction_bias`` (a buffer, or a parameter without gradient, of the router or of a
    child of it: Ernie 4.5's ``moe_statics``), or None: attribute reads only, as every call of a rule reads it."""
    found = []
    for m in (gate, *gate.children()):
        bias = getattr(m, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            found.append(bias)
    return found[0] if len(found) == 1 else None


def _scale(gate) -> float:
    """A router's scale of its weights: ``routed_scaling_factor`` (or ``router_scaling_factor``), else 1."""
    return float(getattr(gate, "routed_scaling_factor", getattr(gate, "router_scaling_factor", 1.0)) or 1.0)


def _groups(gate) -> tuple[int, int]:
    """(groups, groups kept) of a grouped router (``num_group`` or ``n_group``, ``topk_group``; 1, 1 if none)."""
    groups = int(getattr(gate, "num_group", getattr(gate, "n_group", None)) or 1)
    return groups, int(getattr(gate, "topk_group", None) or groups)


def router_rule(gate, who: str, bias: torch.Tensor | None = None):
    """The rule (one of the module docstring's) that reproduces the router ``gate`` (a module with a ``weight``
    [E, dim], no other trainable parameter, ``top_k``, and a forward from rows [T, dim] to (logits [T, E], top-k
    weights, top-k ids)), found by the probe of the module docstring; TypeError naming ``who`` (the caller) and the
    router's class where none does. The probe is a copy on the CPU whatever device the router is on (``meta``
    included): every floating tensor of it is drawn anew. ``bias``: the correction bias [E] that the block passes to the
    router's forward after the rows (MiniMax-M2's), or None where the forward takes the rows alone; the probe draws
    it anew too."""
    name = type(gate).__name__
    params = [n for n, p in gate.named_parameters() if p.requires_grad or n in ("weight", "bias")]
    weight = getattr(gate, "weight", None)
    if params not in (["weight"], ["weight", "bias"]) or weight.dim() != 2 or \
            not isinstance(getattr(gate, "top_k", None), int) or \
            params[1:] and tuple(gate.bias.shape) != (weight.shape[0],):
        raise TypeError(f"{who}: router {name} must hold one trainable parameter, weight [E, dim] (and a bias [E] of "
                        f"its logits), and top_k (it has {params})")
    E, dim = weight.shape
    probe = copy.deepcopy(gate).to_empty(device="cpu").to(torch.float64)
    g = torch.Generator().manual_seed(PROBE_SEED)
    cpu = dict(generator=g, dtype=torch.float64, device="cpu")  # (not the default device a caller may have set)
    with torch.no_grad():
        for t in [*probe.parameters(), *(b for b in probe.buffers() if b.is_floating_point())]:
            t.copy_(torch.randn(t.shape, **cpu) * (dim ** -0.5 if t is probe.weight else 0.5))
        rows = torch.randn(PROBE_ROWS, dim, **cpu)  # (logits about N(0, 1))
        extra = () if bias is None else (torch.randn(tuple(bias.shape), **cpu) * 0.5,)
        try:
            own = type(probe).forward(probe, rows, *extra)  # (not its hooks: transformers' recorders may hold some)
        except Exception as e:  # (a router whose forward takes more than the rows)
            raise TypeError(f"{who}: router {name}'s forward on rows [T, dim] failed: {e}") from None
        k = probe.top_k
        if isinstance(own, tuple) and len(own) == 3 and isinstance(own[0], torch.Tensor) and \
                not own[0].is_floating_point():
            own = own[::-1]  # (ids, weights, logits): the Granite models' routers' order in transformers 5.17
        if not (isinstance(own, tuple) and len(own) == 3 and tuple(own[0].shape) == (PROBE_ROWS, E)
                and all(tuple(t.shape) == (PROBE_ROWS, k) for t in own[1:])):
            raise TypeError(f"{who}: router {name} must return (logits [T, E], weights [T, k], ids [T, k]) "
                            f"as transformers 5's routers do")
        biased = logit_bias(probe) is not None
        for rule in [Softmax(True), Softmax(False)] if biased else _candidates(probe, *extra):
            try:
                mine = rule(probe, rows, probe.weight, *extra, **({"logit_bias": probe.bias} if biased else {}))
            except (AttributeError, RuntimeError):  # (a rule needing what this router does not hold)
                continue
            if _same_routes(own, mine):
                return rule
    raise TypeError(f"{who}: router {name} computes none of the rules it reproduces (softmax top-k with or "
                    f"without renormalization, of biased logits too; DeepSeek-V3's sigmoid top-k with a correction "
                    f"bias and groups; DeepSeek-V2's softmax top-k with groups and a scale; Ernie 4.5's softmax top-k "
                    f"with a correction bias)")


def logit_bias(gate) -> torch.Tensor | None:
    """The router's own bias [E] of its logits (a parameter ``bias``, GPT-OSS's), or None."""
    bias = getattr(gate, "bias", None)
    return bias if isinstance(bias, torch.Tensor) and bias.dim() == 1 else None


def _candidates(gate, bias: torch.Tensor | None = None) -> list:
    """The rules to try on ``gate``, in order: softmax with and without renormalization; where there is a
    correction bias (the router's, or ``bias`` from the block) Ernie 4.5's with and without, then DeepSeek-V3's (as
    the router's ``norm_topk_prob`` says, then always renormalized); and DeepSeek-V2's. The grouped rules where the
    router's groups divide its experts."""
    rules = [Softmax(True), Softmax(False)]
    bias = correction_bias(gate) if bias is None else bias
    if isinstance(bias, torch.Tensor):
        rules += [BiasedSoftmax(True), BiasedSoftmax(False)]
    groups, keep = _groups(gate)
    if gate.weight.shape[0] % groups or not 0 < keep <= groups:
        return rules
    if isinstance(bias, torch.Tensor):
        rules += [GroupedSigmoid(), GroupedSigmoid(renormalize=True)]
    return rules + [GroupedSoftmax()]


def _same_routes(own, mine) -> bool:
    """Whether two routers' (logits, weights, ids) agree: the same logits, the same set of ids per row and each
    id's weight (a router may return its k choices in any order), to float32's precision."""
    (l1, w1, i1), (l2, w2, i2) = own, mine
    o1, o2 = i1.long().sort(-1), i2.long().sort(-1)
    if not torch.equal(o1.values, o2.values):
        return False
    w1, w2 = w1.double().gather(1, o1.indices), w2.double().gather(1, o2.indices)
    return bool(torch.allclose(l1.double(), l2.double(), rtol=1e-4, atol=1e-5)
                and torch.allclose(w1, w2, rtol=1e-4, atol=1e-6))


__all__ = ["BiasedSoftmax", "GroupedSigmoid", "GroupedSoftmax", "Softmax", "correction_bias", "logit_bias",
           "router_rule"]
