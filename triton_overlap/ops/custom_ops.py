"""The overlapped ops registered as torch custom ops, with autograd, so ``torch.compile`` traces models that use
them.

``torch.ops.triton_overlap.ag_gemm``, ``.gemm_rs``, ``.gemm_ar``, ``.all_reduce``, ``.cp_attention``,
``.cp_attention_bwd``, ``.ag_moe`` and ``.moe_rs`` take an integer ``handle`` naming an op object (an AllGatherGEMM,
GEMMReduceScatter, GEMMAllReduce, AllReduce, ContextParallelAttention, AllGatherMoEGEMM or MoEGEMMReduceScatter
bound to a Context) registered with :func:`handle`; a traced graph keeps the integer, and
the op's Context keeps the object (this module names it weakly) until it closes. Each has a fake (meta)
implementation that gives output shapes without running anything, and the GEMM pairs (dense and MoE) and attention
have backward formulas written with the same custom ops, so forward and backward graphs trace without breaks.
``.swiglu`` (backward ``.swiglu_grad``) and ``.moe_row_grads`` are the MoE layers' local row passes
(kernels.moe_rows), one kernel each. ``triton_overlap.nn`` goes through these.
"""
from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from ..context.collectives import all_gather_rows as _all_gather_rows
from ..context.collectives import reduce_scatter_rows as _reduce_scatter_rows
from ..kernels import moe_rows
from .base import agree_across_ranks
from .moe_routing import MoERouting, expert_grads

if dist.is_available() and not dist.is_initialized():
    # torch.distributed.nn.functional's functions take the default group as a default argument, bound when the module
    # is first imported; torch imports it on a custom op's first call (through torch._dynamo). Imported after
    # init_process_group, it keeps that group alive past destroy_process_group, and a gloo group kept alive can abort
    # the process at exit (docs/decisions.md). Imported now, before there is a group, its defaults are None.
    import torch.distributed.nn.functional  # noqa: F401

#: handle -> op, held by the op's Context (Context.keep), not here
_OPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_next = itertools.count(1)  # handles are never reused: a traced graph's stale handle names no other op


def handle(op) -> int:
    """A new integer naming ``op`` for the custom ops; the name is dropped when the op's Context closes."""
    h = next(_next)
    _OPS[h] = op
    op.ctx.keep(op)
    op.ctx.on_close(lambda: _OPS.pop(h, None))
    return h


def op_of(h: int):
    """The op object ``h`` names."""
    op = _OPS.get(h)
    if op is None:
        raise RuntimeError(f"triton_overlap custom op: handle {h} names no op (its Context is closed)")
    return op


def _rows_agreed(a: torch.Tensor, h: int, what: str):
    """The op ``h`` names, once every rank passed ``a`` of the same shape and dtype to the process group's
    collective ``what`` (checked once per shape: a gather or reduce-scatter of rows of different sizes aborts the
    process over gloo and is undefined over NCCL)."""
    op = op_of(h)
    agree_across_ranks(f"{what} (every rank's rows: TPMoE's tokens, GatherSequence's sequence shard)", op.ctx,
                       (tuple(a.shape), str(a.dtype)), op.state.setdefault(f"agreed {what}", set()))
    return op


# ------------------------------------------------------------------ AllGather-GEMM
@torch.library.custom_op("triton_overlap::ag_gemm", mutates_args=())
def ag_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, ag: int, rs: int, world: int,
            keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather(a) @ w + bias, gather(a)) with ``keep``, else (gather(a) @ w + bias, an empty tensor);
    ``rs`` names the GEMMReduceScatter its backward uses."""
    if keep:
        return op_of(ag)(a.contiguous(), w, bias, return_gathered=True)
    return op_of(ag)(a.contiguous(), w, bias), a.new_empty(0)


@ag_gemm.register_fake
def _(a, w, bias, ag, rs, world, keep):
    return a.new_empty(a.shape[0] * world, w.shape[1]), a.new_empty((a.shape[0] * world, a.shape[1]) if keep else 0)


@torch.library.custom_op("triton_overlap::all_gather_rows", mutates_args=())
def all_gather_rows(a: torch.Tensor, ag: int, world: int) -> torch.Tensor:
    """Every rank's ``a`` stacked along dim 0, in rank order (NCCL/gloo all-gather on the op's group)."""
    out = a.new_empty(a.shape[0] * world, *a.shape[1:])
    return _all_gather_rows(out, a.contiguous(), group=_rows_agreed(a, ag, "all_gather_rows").ctx.group)


@all_gather_rows.register_fake
def _(a, ag, world):
    return a.new_empty(a.shape[0] * world, *a.shape[1:])


@torch.library.custom_op("triton_overlap::gather_sequence", mutates_args=())
def gather_sequence(x: torch.Tensor, ag: int, world: int, dim: int) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (the sequence-parallel region's exit); the
    gradient is this rank's slice of the full one (everything after the gather runs replicated, the loss once)."""
    full = all_gather_rows(x.movedim(dim, 0).contiguous(), ag, world)
    return full.movedim(0, dim).contiguous()


@gather_sequence.register_fake
def _(x, ag, world, dim):
    shape = list(x.shape)
    shape[dim] *= world
    return x.new_empty(shape)


def _gather_sequence_setup(ctx, inputs, output):
    ctx.ag, ctx.world, ctx.dim = inputs[1], inputs[2], inputs[3]


def _gather_sequence_backward(ctx, grad):
    n = grad.shape[ctx.dim] // ctx.world
    return grad.narrow(ctx.dim, op_of(ctx.ag).ctx.rank * n, n).contiguous(), None, None, None


gather_sequence.register_autograd(_gather_sequence_backward, setup_context=_gather_sequence_setup)


@torch.library.custom_op("triton_overlap::shard_sequence", mutates_args=())
def shard_sequence(x: torch.Tensor, ag: int, world: int, dim: int) -> torch.Tensor:
    """This rank's slice along ``dim`` of ``x`` (the same on every rank: the sequence-parallel region's entry); the
    gradient is every rank's slice gradient gathered, the whole of it on every rank."""
    n = x.shape[dim] // world
    return x.narrow(dim, op_of(ag).ctx.rank * n, n).clone(memory_format=torch.contiguous_format)


@shard_sequence.register_fake
def _(x, ag, world, dim):
    shape = list(x.shape)
    shape[dim] //= world
    return x.new_empty(shape)


def _shard_sequence_setup(ctx, inputs, output):
    ctx.ag, ctx.world, ctx.dim = inputs[1], inputs[2], inputs[3]


def _shard_sequence_backward(ctx, grad):
    return gather_sequence(grad, ctx.ag, ctx.world, ctx.dim), None, None, None


shard_sequence.register_autograd(_shard_sequence_backward, setup_context=_shard_sequence_setup)


def weight_grad(x: torch.Tensor, grad_out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x^T @ grad_out``, the gradient of ``w`` in ``x @ w``, in ``w``'s layout: where ``w`` is ``weight.t()`` (an
    ``nn.Linear`` weight seen transposed, as the layers pass it) it is computed as ``(grad_out^T @ x)^T``, so the
    weight's gradient comes out contiguous and autograd's accumulation into ``weight.grad`` need not copy it into
    the weight's layout (one copy of every weight per step otherwise)."""
    if w.stride(0) == 1 and w.stride(1) != 1:
        return (grad_out.t() @ x).t()
    return x.t() @ grad_out


def _kept_or_gathered(ctx, saved: torch.Tensor, ag: int) -> torch.Tensor:
    """The gathered input a forward kept for the weight's gradient (``ctx.keep``), else ``saved``, this rank's rows,
    gathered again."""
    return saved if ctx.keep else all_gather_rows(saved, ag, ctx.world)


def _ag_setup(ctx, inputs, output):
    a, w, bias, ag, rs, world, keep = inputs
    ctx.save_for_backward(output[1] if keep else a, w)
    ctx.handles, ctx.world, ctx.has_bias, ctx.keep = (ag, rs), world, bias is not None, keep
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # (no zero-filled gradient for the gathered rows, which nothing reads)


def _ag_backward(ctx, grad_out, _grad_gathered):
    """Only the gradients asked for (a frozen weight needs neither its product nor the input gathered again; an
    input without a gradient, no GEMM-ReduceScatter). Whether each is asked for is the model's structure, the same
    on every rank, so the ranks make the same collective calls."""
    saved, w = ctx.saved_tensors
    ag, rs = ctx.handles
    if grad_out is None:  # (grads are not materialised: the output took no part in the loss)
        return None, None, None, None, None, None, None
    need_a, need_w, need_b = ctx.needs_input_grad[:3]
    grad_out = grad_out.contiguous()
    grad_a = gemm_rs(grad_out, w.t(), None, rs, ag, ctx.world) if need_a else None  # this rank's rows of the sum
    grad_w = None
    if need_w:
        grad_w = weight_grad(_kept_or_gathered(ctx, saved, ag), grad_out, w)
    grad_b = grad_out.sum(0) if ctx.has_bias and need_b else None
    return grad_a, grad_w, grad_b, None, None, None, None


ag_gemm.register_autograd(_ag_backward, setup_context=_ag_setup)


# ------------------------------------------------------------------ GEMM-ReduceScatter
@torch.library.custom_op("triton_overlap::gemm_rs", mutates_args=())
def gemm_rs(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, rs: int, ag: int,
            world: int) -> torch.Tensor:
    """This rank's rows of sum over ranks of a @ w, + bias; ``ag`` names the AllGatherGEMM its backward uses."""
    return op_of(rs)(a.contiguous(), w, bias)


@gemm_rs.register_fake
def _(a, w, bias, rs, ag, world):
    return a.new_empty(a.shape[0] // world, w.shape[1])


def _rs_setup(ctx, inputs, output):
    a, w, bias, rs, ag, world = inputs
    ctx.save_for_backward(a, w)
    ctx.handles, ctx.world, ctx.has_bias = (rs, ag), world, bias is not None


def _rs_backward(ctx, grad_out):
    """Only the gradients asked for, as ``_ag_backward``: the weight's and the bias's need the output gradient
    gathered, the input's the AllGather-GEMM (which gathers it on the way)."""
    a, w = ctx.saved_tensors
    rs, ag = ctx.handles
    need_a, need_w, need_b = ctx.needs_input_grad[:3]
    need_full = need_w or (ctx.has_bias and need_b)
    grad_out = grad_out.contiguous()
    if need_a:
        grad_a, grad_full = ag_gemm(grad_out, w.t(), None, ag, rs, ctx.world, need_full)
    else:
        grad_a, grad_full = None, all_gather_rows(grad_out, ag, ctx.world) if need_full else None
    grad_w = weight_grad(a, grad_full, w) if need_w else None
    # the bias is added once: its gradient sees every row
    grad_b = grad_full.sum(0) if ctx.has_bias and need_b else None
    return grad_a, grad_w, grad_b, None, None, None


gemm_rs.register_autograd(_rs_backward, setup_context=_rs_setup)


# ------------------------------------------------------------------ context-parallel attention
@torch.library.custom_op("triton_overlap::cp_attention", mutates_args=())
def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: int, causal: bool, scale: float,
                 keep: bool, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, gathered k, gathered v); the last two are empty unless ``keep`` (for backward). ``cu``: packed
    documents' global boundaries, an integer tensor read on the host (empty: none)."""
    with torch.no_grad():
        res = op_of(op).forward(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale, keep=keep,
                              cu=tuple(cu.tolist()))
    if keep:
        return res
    return res[0], res[1], k.new_empty(0), v.new_empty(0)


@cp_attention.register_fake
def _(q, k, v, op, causal, scale, keep, cu):
    B, S, Hq, _ = q.shape
    W = op_of(op).ctx.world_size
    kept = (B, W * S, k.shape[2], k.shape[3]) if keep else (0,)
    return (q.new_empty(q.shape), q.new_empty(B, Hq, S, dtype=torch.float32), k.new_empty(kept),
            v.new_empty(kept))


@torch.library.custom_op("triton_overlap::cp_attention_bwd", mutates_args=())
def cp_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     dout: torch.Tensor, kept_k: torch.Tensor, kept_v: torch.Tensor, op: int, causal: bool,
                     scale: float, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv; K/V from ``kept_k``/``kept_v`` when they are not empty, else gathered again."""
    keep = kept_k.numel() > 0
    return op_of(op).backward(q.contiguous(), k.contiguous(), v.contiguous(), out, lse, dout.contiguous(), causal,
                            scale, kept_k if keep else None, kept_v if keep else None, tuple(cu.tolist()))


@cp_attention_bwd.register_fake
def _(q, k, v, out, lse, dout, kept_k, kept_v, op, causal, scale, cu):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _cp_setup(ctx, inputs, output):
    q, k, v, op, causal, scale, keep, cu = inputs
    ctx.save_for_backward(q, k, v, *output, cu)
    ctx.op, ctx.causal, ctx.scale = op, causal, scale
    ctx.mark_non_differentiable(*output[1:])
    # no zero-filled gradients for lse and the kept K/V, which nothing reads: three fills fewer per backward
    ctx.set_materialize_grads(False)


def _cp_backward(ctx, dout, _dlse, _dk, _dv):
    if dout is None:  # (the output took no part in the loss)
        return None, None, None, None, None, None, None, None
    q, k, v, out, lse, kept_k, kept_v, cu = ctx.saved_tensors
    dq, dk, dv = cp_attention_bwd(q, k, v, out, lse, dout, kept_k, kept_v, ctx.op, ctx.causal, ctx.scale, cu)
    return dq, dk, dv, None, None, None, None, None


cp_attention.register_autograd(_cp_backward, setup_context=_cp_setup)


# ------------------------------------------------------------------ GEMM + AllReduce
@torch.library.custom_op("triton_overlap::gemm_ar", mutates_args=())
def gemm_ar(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, op: int) -> torch.Tensor:
    """The sum over ranks of a @ w, + bias, on every rank (a GEMMAllReduce)."""
    return op_of(op)(a, w, bias)


@gemm_ar.register_fake
def _(a, w, bias, op):
    return a.new_empty(a.shape[0], w.shape[1])


def _ar_setup(ctx, inputs, output):
    a, w, bias, op = inputs
    ctx.save_for_backward(a, w)
    ctx.has_bias = bias is not None


def _ar_backward(ctx, grad_out):
    # the output is the same on every rank and so is its gradient: each rank's inputs get their share locally
    a, w = ctx.saved_tensors
    need_a, need_w, need_b = ctx.needs_input_grad[:3]
    grad_b = grad_out.sum(0) if ctx.has_bias and need_b else None
    return grad_out @ w.t() if need_a else None, weight_grad(a, grad_out, w) if need_w else None, grad_b, None


gemm_ar.register_autograd(_ar_backward, setup_context=_ar_setup)


# ------------------------------------------------------------------ AllReduce
@torch.library.custom_op("triton_overlap::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, op: int) -> torch.Tensor:
    """The sum over ranks of ``x`` on every rank (an AllReduce)."""
    return op_of(op)(x)


@all_reduce.register_fake
def _(x, op):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# the output is the same on every rank and so is its gradient: each rank's summand gets it whole, as gemm_ar's
all_reduce.register_autograd(lambda ctx, grad: (grad, None))


# ------------------------------------------------------------------ MoE: AllGather + grouped GEMM, grouped GEMM + RS
@torch.library.custom_op("triton_overlap::all_gather_rows_with_grad", mutates_args=())
def all_gather_rows_with_grad(a: torch.Tensor, ag: int, world: int) -> torch.Tensor:
    """all_gather_rows with a gradient: backward sums the gradient over ranks and keeps this rank's rows."""
    return all_gather_rows(a, ag, world)


@all_gather_rows_with_grad.register_fake
def _(a, ag, world):
    return a.new_empty(a.shape[0] * world, *a.shape[1:])


@torch.library.custom_op("triton_overlap::reduce_scatter_rows", mutates_args=())
def reduce_scatter_rows(a: torch.Tensor, ag: int, world: int) -> torch.Tensor:
    """This rank's rows of the sum over ranks of ``a`` (NCCL/gloo reduce-scatter on the op's group)."""
    out = a.new_empty(a.shape[0] // world, *a.shape[1:])
    return _reduce_scatter_rows(out, a.contiguous(), group=_rows_agreed(a, ag, "reduce_scatter_rows").ctx.group)


@reduce_scatter_rows.register_fake
def _(a, ag, world):
    return a.new_empty(a.shape[0] // world, *a.shape[1:])


def _gather_setup(ctx, inputs, output):
    ctx.ag, ctx.world = inputs[1], inputs[2]


all_gather_rows_with_grad.register_autograd(
    lambda ctx, grad: (reduce_scatter_rows(grad, ctx.ag, ctx.world), None, None), setup_context=_gather_setup)


@torch.library.custom_op("triton_overlap::ag_moe", mutates_args=())
def ag_moe(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, ag: int, rs: int, world: int,
           keep: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An AllGatherMoEGEMM in the expert-sorted layout: (rows [T * topk, N], the routing's order [P] int64,
    position [P] int32 and offsets [E + 1] int32, the gathered x [T, K], or with ``keep=False`` an empty tensor:
    the weights' gradient gathers x again); ``rs`` names the MoEGEMMReduceScatter its backward uses."""
    if not keep:
        rows, routing = op_of(ag)(x.contiguous(), w, ids, sorted_output=True)
        return rows, routing.order, routing.position, routing.offsets, x.new_empty(0)
    rows, routing, gathered = op_of(ag)(x.contiguous(), w, ids, sorted_output=True, return_gathered=True)
    return rows, routing.order, routing.position, routing.offsets, gathered


@ag_moe.register_fake
def _(x, w, ids, ag, rs, world, keep=True):
    P = ids.shape[0] * ids.shape[1]
    return (x.new_empty(P, w.shape[2]), ids.new_empty(P, dtype=torch.int64), ids.new_empty(P, dtype=torch.int32),
            ids.new_empty(w.shape[0] + 1, dtype=torch.int32),
            x.new_empty((x.shape[0] * world, x.shape[1]) if keep else (0,)))


def _ag_moe_setup(ctx, inputs, output):
    x, w, ids, ag, rs, world, keep = inputs
    ctx.save_for_backward(w, ids, *output[1:4], output[4] if keep else x)
    ctx.handles, ctx.world, ctx.keep = (ag, rs), world, keep
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _ag_moe_backward(ctx, grad_rows, *_):
    if grad_rows is None:
        return None, None, None, None, None, None, None
    w, ids, order, position, offsets, saved = ctx.saved_tensors
    ag, rs = ctx.handles
    grad_rows = grad_rows.contiguous()
    # the input's gradient, sum over ranks and choices of grad_rows @ w^T, reduce-scattered: the converse op (where
    # asked for: the model's structure, the same on every rank)
    grad_x = None
    if ctx.needs_input_grad[0]:
        ones = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
        grad_x = moe_rs(grad_rows, w.transpose(1, 2), ids, ones, order, position, offsets, rs, ag, ctx.world,
                        w.shape[2])
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = moe_expert_grads(_kept_or_gathered(ctx, saved, ag)[order // ids.shape[1]], grad_rows, offsets)
    return grad_x, grad_w, None, None, None, None, None


ag_moe.register_autograd(_ag_moe_backward, setup_context=_ag_moe_setup)


@torch.library.custom_op("triton_overlap::moe_rs", mutates_args=())
def moe_rs(h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
           position: torch.Tensor, offsets: torch.Tensor, rs: int, ag: int, world: int, ag_n: int) -> torch.Tensor:
    """A MoEGEMMReduceScatter on ``h`` in the layout ``ag_moe`` returned (its order, position, offsets): this rank's
    tokens [T / W, N]; ``ag`` names the AllGatherMoEGEMM that made the layout (from x [T / W, N] and w [E, N,
    ``ag_n``], which say whether it has rank runs: AllGatherMoEGEMM.keeps_rank_runs) and that its backward uses."""
    runs = op_of(ag).keeps_rank_runs(ids.shape[0] // world, w.shape[2], ag_n, w.shape[0], ids.shape[1], h.dtype)
    routing = MoERouting(order, position, offsets, w.shape[0], ids.shape[1], runs)
    return op_of(rs)(h.contiguous(), w, ids, weights, routing=routing)


@moe_rs.register_fake
def _(h, w, ids, weights, order, position, offsets, rs, ag, world, ag_n):
    return h.new_empty(ids.shape[0] // world, w.shape[2])


def _moe_rs_setup(ctx, inputs, output):
    h, w, ids, weights, order, position, offsets, rs, ag, world, _ = inputs
    ctx.save_for_backward(h, w, ids, weights, order, position, offsets)
    ctx.handles, ctx.world = (rs, ag), world


def _moe_rs_backward(ctx, grad_out):
    h, w, ids, weights, order, position, offsets = ctx.saved_tensors
    rs, ag = ctx.handles
    # every token's grad_out @ w[e]^T through the converse op, moved from its sorted layout into the forward's
    g_rows, _, g_position, _, g_all = ag_moe(grad_out.contiguous(), w.transpose(1, 2), ids, ag, rs, ctx.world,
                                             ctx.needs_input_grad[1])  # (the gathered grad_out: w's gradient)
    scale = weights.reshape(-1)[order].float()  # each sorted row's top-k weight
    # d out / d weights[t, j] = <grad_out[t], h[t, j] @ w[e]> = <g[t, j], h[t, j]>: this rank's part of the sum
    grad_h, h_scaled, dots = moe_row_grads(g_rows, g_position[order], scale, h, ctx.needs_input_grad[1])
    grad_weights = dots[position.long()].view(ids.shape).to(weights.dtype)
    grad_w = moe_expert_grads(h_scaled, g_all[order // ids.shape[1]], offsets) if ctx.needs_input_grad[1] else None
    return grad_h, grad_w, None, grad_weights, None, None, None, None, None, None, None


moe_rs.register_autograd(_moe_rs_backward, setup_context=_moe_rs_setup)


@torch.library.custom_op("triton_overlap::moe_row_grads", mutates_args=())
def moe_row_grads(g: torch.Tensor, src: torch.Tensor, scale: torch.Tensor, h: torch.Tensor,
                  scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_rs's backward of each sorted row p in one pass (kernels.moe_rows.scaled_grads): (``scale[p] · g[src[p]]``
    and ``scale[p] · h[p]`` in ``h``'s dtype [P, N], ``<g[src[p]], h[p]>`` float32 [P]); ``g`` rows of N, ``src`` int
    [P], ``scale`` float32 [P], ``h`` [P, N]; ``scaled=False`` (the experts' weights need no gradient) leaves the
    second out, empty [0, N]."""
    return moe_rows.scaled_grads(g.contiguous(), src.contiguous(), scale.contiguous(), h.contiguous(), scaled)


@moe_row_grads.register_fake
def _(g, src, scale, h, scaled=True):
    return (h.new_empty(h.shape), h.new_empty(h.shape[0] if scaled else 0, h.shape[1]),
            h.new_empty(h.shape[0], dtype=torch.float32))


@torch.library.custom_op("triton_overlap::swiglu", mutates_args=())
def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of rows ``h`` [R, 2n] (gate columns, then up) -> [R, n], in one pass
    (kernels.moe_rows.swiglu; float32 arithmetic, one rounding). Differentiable once: its backward is one kernel
    too, without a backward of its own."""
    return moe_rows.swiglu(h.contiguous())


@swiglu.register_fake
def _(h):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


@torch.library.custom_op("triton_overlap::swiglu_grad", mutates_args=())
def swiglu_grad(h: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``swiglu`` at rows ``h`` [R, 2n] for the output's gradient ``grad`` [R, n]: [R, 2n]."""
    return moe_rows.swiglu_grad(h.contiguous(), grad.contiguous())


@swiglu_grad.register_fake
def _(h, grad):
    return h.new_empty(h.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


swiglu.register_autograd(lambda ctx, grad: swiglu_grad(ctx.saved_tensors[0], grad), setup_context=_swiglu_setup)


@torch.library.custom_op("triton_overlap::moe_expert_grads", mutates_args=())
def moe_expert_grads(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[E, K, N]: each expert's ``a_e^T @ b_e`` over its rows (moe_routing.expert_grads)."""
    return expert_grads(a, b, offsets)


@moe_expert_grads.register_fake
def _(a, b, offsets):
    return a.new_empty(offsets.shape[0] - 1, a.shape[1], b.shape[1])


__all__ = ["ag_gemm", "ag_moe", "all_gather_rows", "all_gather_rows_with_grad", "all_reduce", "cp_attention",
           "cp_attention_bwd", "gemm_ar", "gemm_rs", "handle", "moe_expert_grads", "moe_row_grads", "moe_rs",
           "op_of", "reduce_scatter_rows", "swiglu", "swiglu_grad"]
