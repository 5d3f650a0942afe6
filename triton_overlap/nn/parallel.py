"""Parallel styles for ``torch.distributed.tensor.parallel.parallelize_module``, backed by the overlapped ops: an
unmodified model (Hugging Face transformers, torchtitan) becomes tensor + sequence parallel by one call with a plan
of module-name patterns, the convention of torch's own tensor parallelism.

Activations are batch-first, ``[B, S, D]``, as those models keep them (``sequence_dim=0`` for sequence-first
models). Inside the sequence-parallel region the residual stream is a DTensor sharded on the sequence
(``Shard(1)``): its global shape is the full sequence, so a model that reshapes by its input's shape (Hugging
Face's attention) sees the true sequence length, while each rank holds ``S/W`` positions. A plan:

* ``ShardSequence`` on the module that produces the full activation (the token embedding): its output becomes this
  rank's shard; the gradient is gathered back.
* torch's ``SequenceParallel()`` on the norms inside the region (they run on the shard; their replicated weights'
  gradients are summed by DTensor).
* ``ColwiseParallel`` on the linear layers that read the residual stream (q/k/v, gate/up): AllGather-GEMM, the
  gather fused into the GEMM instead of torch's separate all-gather before attention and MLP; output this rank's
  columns of the full sequence, a plain tensor.
* ``SharedInputColwise`` on a module whose column layers read one input (attention's q/k/v, the MLP's
  gate/up), in place of their ``ColwiseParallel`` entries: one AllGather-GEMM for all of them, the input gathered
  once (and its gradient reduce-scattered once), as torch's plan gathers it once.
* ``RowwiseParallel`` on the linear layers that write it (o, down): GEMM-ReduceScatter, output the sequence shard.
* ``MoEParallel`` (``nn.parallel_moe``) on a sparse-MoE block (Mixtral's, Qwen3-MoE's ``mlp``), in place of the
  MLP's column and row styles: its experts tensor (or expert) parallel, the tokens gathered into their grouped
  GEMM; input and output the sequence shard.
* ``ReplicatedLatent`` on multi-head latent attention's down-projections (DeepSeek-V3's ``q_a_proj`` and
  ``kv_a_proj_with_mqa``): the narrow latent gathered to the full sequence, its up-projections local
  ``ColwiseParallel(sequence_parallel=False)`` layers.
* ``ColwiseRMSNorm`` (``nn.parallel_norm``) on a norm over the whole output of a column layer (OLMo-2's and
  MiniMax-M2's q/k norms over all heads): each rank normalizes its columns, the mean square summed by one AllReduce.
* ``GatedDeltaNetParallel`` (``nn.parallel_linear_attention``) on Qwen3.5's (Qwen3-Next's) gated delta-rule layer:
  its heads split over the ranks, its projections a ``SharedInputColwise`` group and a ``RowwiseParallel`` layer.
* ``GatherSequence`` on the module after the region (the final norm): its input is gathered to the full sequence;
  the gradient of a gather is this rank's slice.

Decode (one token per step, nothing to shard along the sequence): ``sequence_parallel=False`` on the linear, MoE
and latent styles, and no region edges: column layers multiply locally, row layers run GEMM + AllReduce, an MoE
block sums each rank's share of its experts by one AllReduce; activations are plain replicated tensors (DTensor
only carries the sum of the input gradients over the ranks in backward).

Batch-first rows of ``B > 1`` are not contiguous per rank: column layers permute their output and row layers
their input (one copy each); ``B = 1`` and ``sequence_dim=0`` move no data. The linear styles follow
``torch.autocast`` (``nn.precision``).

The mesh is the Context's group, 1-D. Beside data parallelism (torchtitan's FSDP2 x TP), a 2-D mesh's
tensor-parallel dimension: ``ctx = Context(mesh["tp"].get_group())``, ``parallelize_module(model, mesh["tp"],
plan)``, then ``fully_shard`` over ``mesh["dp"]``.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from ..ops import custom_ops
from ..ops.base import OverlapOp
from .linear import column_rows, gemm_ar_op, layer_ops, local_linear, row_rows
from .precision import compute_dtype, compute_operands
from .state_dict import rows_of

FALLBACKS = ("auto", "never", "always")


def check_mesh(style, device_mesh):
    """The mesh torch passes must be the Context's ranks, in order: the ops and DTensor then agree on who is
    rank r. ``style``: a style holding its Context as ``ctx``. A Context on a subgroup (the tensor-parallel group
    of a 2-D mesh, beside data parallelism: ``Context(mesh["tp"].get_group())``) takes that group's 1-D mesh
    (``mesh["tp"]``); the ranks compared are global."""
    ctx = style.ctx
    if device_mesh is None:
        raise ValueError(f"{type(style).__name__}: parallelize_module needs a device_mesh over the Context's ranks")
    ranks = device_mesh.mesh.flatten().tolist()
    if device_mesh.ndim != 1:
        raise ValueError(f"{type(style).__name__}: the device mesh is {device_mesh.ndim}-D; these styles take a 1-D "
                         f"mesh over the Context's {ctx.world_size} ranks in order, e.g. "
                         f"init_device_mesh({ctx.device.type!r}, ({ctx.world_size},)) or a 2-D mesh's mesh['tp']")
    group = getattr(ctx, "group", None)  # (a stand-in Context without a group, as the plan checks use: 0..W-1)
    want = list(range(ctx.world_size)) if group is None else dist.get_process_group_ranks(group)
    if ranks != want:
        raise ValueError(f"{type(style).__name__}: the device mesh's ranks {ranks} are not the Context's group's "
                         f"{want}, in order (a 1-D mesh over them, e.g. init_device_mesh({ctx.device.type!r}, "
                         f"({ctx.world_size},)) or a 2-D mesh's mesh['tp'] with Context(mesh['tp'].get_group()))")


def local_input(x, where, shard_dim):
    """A plain tensor from an input: a DTensor must be sharded on ``shard_dim`` (None: replicated) and gives its
    local part; a plain tensor is taken as that already."""
    if not isinstance(x, DTensor):
        return x
    p = x.placements[0]
    if shard_dim is None and isinstance(p, Replicate) or (
            shard_dim is not None and isinstance(p, Shard) and p.dim % x.ndim == shard_dim % x.ndim):
        return x.to_local()
    want = "Replicate()" if shard_dim is None else f"Shard({shard_dim})"
    raise ValueError(f"{where}: input DTensor placed {x.placements}; expected {want}")


def summed_grad(x, mesh):
    """``x`` (the same on every rank) forward; backward, its gradient summed over the ranks of ``mesh``, where
    each rank's is a partial sum (a replicated input read by this rank's heads, columns or experts only): the
    gradient of a replicated DTensor whose local part's gradient is ``Partial``. Where autograd does not record
    ``x``, ``x`` itself."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def replicated_local(p):
    """A replicated DTensor parameter as this rank's tensor, its gradient left partial (this rank's tokens' part,
    summed by DTensor where read); a plain tensor as it is."""
    return p.to_local(grad_placements=[Partial()]) if isinstance(p, DTensor) else p


def replicated_parameter(p, mesh) -> nn.Parameter:
    """``p``'s values as a parameter that is a replicated DTensor over ``mesh``, ``requires_grad`` kept."""
    return nn.Parameter(DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False),
                        requires_grad=p.requires_grad)


class _LinearStyle(ParallelStyle):
    chunks = 1  # (ColwiseParallel's: the parts of the output its module splits)

    def __init__(self, ctx, *, sequence_parallel: bool = True, sequence_dim: int = 1, fallback: str = "auto"):
        if fallback not in FALLBACKS:
            raise ValueError(f"{type(self).__name__}: fallback must be one of {FALLBACKS}, got {fallback!r}")
        if sequence_dim not in (0, 1):
            raise ValueError(f"{type(self).__name__}: sequence_dim must be 0 (sequence-first) or 1 (batch-first), "
                             f"got {sequence_dim}")
        self.ctx, self.sequence_parallel, self.sequence_dim, self.fallback = ctx, sequence_parallel, sequence_dim, \
            fallback

    def _check(self, module: nn.Module, device_mesh) -> None:
        """Raise, before anything changes, where this style cannot apply to ``module``."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{type(self).__name__} applies to nn.Linear, got {type(module).__name__}")
        if hasattr(module, "tp_style"):  # (two plan entries matching one layer would shard it twice)
            raise ValueError(f"{type(self).__name__}: this {type(module).__name__} already has a parallel style "
                             f"({type(module.tp_style).__name__}); a plan must match each layer once")
        check_mesh(self, device_mesh)
        dim = 0 if self._shard_out else 1
        n, W, parts = module.weight.shape[dim], self.ctx.world_size, self.chunks
        if isinstance(parts, tuple):
            if sum(parts) != n or any(p % W for p in parts):
                raise ValueError(f"{type(self).__name__}: chunks {parts} must sum to out_features = {n}, each "
                                 f"divisible by the world size {W}")
        elif n % (W * parts):
            raise ValueError(f"{type(self).__name__}: {'out' if dim == 0 else 'in'}_features = {n} is not "
                             f"divisible by the world size {W}" + (f" times chunks = {parts}" if parts > 1 else ""))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self._check(module, device_mesh)
        W, r = self.ctx.world_size, self.ctx.rank
        dim = 0 if self._shard_out else 1
        n = module.weight.shape[dim]
        parts = list(self.chunks) if isinstance(self.chunks, tuple) else [n // self.chunks] * self.chunks
        every = [shard_rows(parts if dim == 0 else [n], W, q) for q in range(W)]  # (every rank's: nn.state_dict)
        rows = every[r]
        with torch.no_grad():
            module.weight = nn.Parameter((module.weight[rows] if dim == 0 else module.weight[:, rows]).clone(),
                                         requires_grad=module.weight.requires_grad)
            if module.bias is not None and self._shard_out:
                module.bias = nn.Parameter(module.bias[rows].clone(), requires_grad=module.bias.requires_grad)
        rows_of(module, "weight", dim, every, self.ctx)
        if module.bias is not None and self._shard_out:
            rows_of(module, "bias", 0, every, self.ctx)
        module.tp_style, module.tp_mesh = self, device_mesh
        module.__class__ = styled_class(type(module), self._forward, type(self).__name__, _last_path, _style_ops)
        return module


def shard_rows(sizes, world: int, rank: int):
    """The rows rank ``rank`` keeps of a tensor whose rows are parts of ``sizes`` one after another, each split
    evenly over ``world`` ranks: its slice of each part, in order (an index tensor; one part: a slice). A column
    layer whose module splits its output into parts (``ColwiseParallel(chunks=)``) keeps these rows, so that the
    same split of its output gives this rank's columns of each part."""
    if len(sizes) == 1:
        return slice(rank * (sizes[0] // world), (rank + 1) * (sizes[0] // world))
    starts = itertools.accumulate([0, *sizes[:-1]])
    return torch.cat([torch.arange(s + rank * (n // world), s + (rank + 1) * (n // world))
                      for s, n in zip(starts, sizes)])


def styled_class(base, forward, name: str, last_path=None, ops=None):
    """``base`` with ``forward`` replaced and, given, ``last_path`` and ``tp_ops`` properties (one subclass per base
    class and forward, named ``name + base's name``, made with the properties of its first call), so that
    ``parallelize_module``, which keeps the module objects it is given, sees the parallel forward; a style swaps
    the module's class for it."""
    key = (base, forward)
    cls = _STYLED.get(key)
    if cls is None:
        attrs = {"forward": forward}
        if last_path is not None:
            attrs["last_path"] = property(last_path, doc=last_path.__doc__)
        if ops is not None:
            attrs["tp_ops"] = property(ops, doc=ops.__doc__)
        cls = _STYLED[key] = type(f"{name}{base.__name__}", (base,), attrs)
    return cls


_STYLED: dict = {}


def overlap_ops(model: nn.Module) -> list:
    """The overlapped ops (``OverlapOp``) that ``model``'s modules hold, each once, in the order first met: this
    package's layers' ``ops``, a styled module's ``tp_ops``, and ops held as attributes (a block's attention, an
    EPMoE's dispatch and combine). Layers with one Context and fallback rule share one op per kind, so a model has
    a few: each op's ``last_path`` says how its latest call ran, and its ``replays.stats`` how many calls replayed a
    captured graph (``rebound``: at new addresses) and how many were captured (ops.replay). Not included: ops made
    per Context outside the modules (``RowParallelLinear.forward_rmsnorm``'s AllReduce + RMSNorm)."""
    found: dict = {}
    for m in model.modules():
        listed = [getattr(m, name, ()) for name in ("ops", "tp_ops")]
        for op in [*vars(m).values(), *(op for ops in listed if isinstance(ops, (tuple, list)) for op in ops)]:
            if isinstance(op, OverlapOp):
                found.setdefault(id(op), op)
    return list(found.values())


def _style_ops(module) -> tuple:
    """The ops this layer's forward and backward call: AllGather-GEMM and GEMM-RS where sequence-parallel, the
    GEMM + AllReduce for a row layer without it (its backward is a local matmul), none for a column layer without
    it. Shared by every layer with the same Context and fallback rule."""
    style = module.tp_style
    if isinstance(style, ColwiseParallel) and not style.sequence_parallel:
        return ()
    if isinstance(style, RowwiseParallel) and not style.sequence_parallel:
        return (custom_ops.op_of(gemm_ar_op(style.ctx, style.fallback)),)
    return tuple(custom_ops.op_of(h) for h in layer_ops(style.ctx, style.fallback))


def _last_path(module) -> str | None:
    """The path this layer's forward took on its latest call through its op (shared by every layer with the same
    Context, style kind and fallback rule): ``"overlap"`` or ``"fallback"`` (torch + the process group); ``"local"``
    for a column layer without sequence parallelism (a local matmul); None before any call."""
    style, ops = module.tp_style, _style_ops(module)
    if not ops:
        return "local"
    return (ops[1] if isinstance(style, RowwiseParallel) and style.sequence_parallel else ops[0]).last_path


class ColwiseParallel(_LinearStyle):
    """An ``nn.Linear`` split by output features: this rank keeps rows ``r*out/W ...`` of the weight (and bias).

    Sequence parallel (default): the input is this rank's sequence shard (a DTensor ``Shard(sequence_dim)`` or the
    plain local ``[B, S/W, in]``); AllGather-GEMM gathers the sequence into the GEMM; the output is the plain
    ``[B, S, out/W]``. Backward: GEMM-ReduceScatter for the input's gradient (ColumnParallelLinear's).
    ``sequence_parallel=False``: the input is replicated, the product local, nothing communicated forward;
    backward sums the input's gradient over the ranks (an all-reduce, through DTensor), where one is needed.
    ``keep_gathered_input``: as ColumnParallelLinear's. ``chunks``: the module splits the layer's output into that
    many equal parts (GLM-4's fused ``gate_up_proj``, ``chunk(2)``), or into parts of these sizes (a tuple of
    output features: Phi-3's fused q/k/v, ``nn.parallel_attention``): this rank keeps its slice of each part, in
    order, so that the same split of its output gives its columns of each part.
    """

    _shard_out = True

    def __init__(self, ctx, *, sequence_parallel: bool = True, sequence_dim: int = 1, fallback: str = "auto",
                 keep_gathered_input: bool = True, chunks: int | tuple = 1):
        super().__init__(ctx, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, fallback=fallback)
        sizes = isinstance(chunks, (tuple, list)) and chunks and all(isinstance(c, int) and c > 0 for c in chunks)
        if not sizes and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
            raise ValueError(f"ColwiseParallel: chunks must be a positive int or a tuple of positive part sizes, "
                             f"got {chunks!r}")
        chunks = tuple(chunks) if sizes else chunks
        self.keep_gathered_input, self.chunks = keep_gathered_input, chunks

    @staticmethod
    def _forward(module, x):
        style = module.tp_style
        d = style.sequence_dim
        group = getattr(module, "tp_group", None)
        if group is not None and style.sequence_parallel:
            return group.output(module, x)
        x = local_input(x, "ColwiseParallel", d if style.sequence_parallel else None)
        x, weight, bias = compute_operands("ColwiseParallel", x, module.weight, module.bias)
        if not style.sequence_parallel:  # (each rank's input gradient is a partial sum)
            return local_linear(summed_grad(x, module.tp_mesh), weight, bias)
        return _gathered(x, weight, bias, style)


def _gathered(x, weight, bias, style):
    """AllGather-GEMM of this rank's sequence shard ``x`` with a column layer's (local) weight, in ``x``'s layout:
    ``[B, S/W, in]`` -> ``[B, S, out/W]`` (``sequence_dim=0``: ``[S/W, *, in]`` -> ``[S, *, out/W]``)."""
    d, W = style.sequence_dim, style.ctx.world_size
    y = column_rows(x.reshape(-1, x.shape[-1]), weight, bias, style.ctx, style.fallback,
                    style.keep_gathered_input)  # rows (rank, then x's rows in order)
    if d == 0:
        return y.view(W * x.shape[0], *x.shape[1:-1], y.shape[-1])
    B, s = x.shape[0], x.shape[1]
    y = y.view(W, B, s, *x.shape[2:-1], y.shape[-1])
    if B > 1:
        y = y.transpose(0, 1).contiguous()
    return y.view(B, W * s, *x.shape[2:-1], y.shape[-1])


class SharedInputColwise(ParallelStyle):
    """Column-wise layers of one module that read the same input (attention's q/k/v projections, the MLP's gate
    and up) as one AllGather-GEMM: applied to that module, naming them, e.g.
    ``{"model.layers.*.self_attn": SharedInputColwise(ctx, ("q_proj", "k_proj", "v_proj"))}``.

    Each named ``nn.Linear`` is made a ``ColwiseParallel`` layer (its own parameters, sharded as that style shards
    them; the keywords are its); in the sequence-parallel region, the first of them called with an input computes
    every one's output in one AllGather-GEMM over their weights concatenated (the input gathered once, as torch's
    plan gathers it once with ``PrepareModuleInput``) and keeps the others' for their own calls with that same
    input object; backward is one GEMM-ReduceScatter of the input's gradient instead of one each. Separate
    ``ColwiseParallel`` layers gather the shard once each and reduce-scatter once each. For layers that read one
    input: a layer called with another input object, after an in-place change of it, or under another grad or
    autocast mode computes every layer afresh (correct, but the others' outputs are wasted work, kept until the
    group's next call). Under ``torch.compile``, and for inference tensors (``torch.inference_mode``), an input's
    in-place changes are not counted: a change between the group's calls is not seen there. The outputs are views
    of one product (non-contiguous, each row as wide as all the layers together): autograd refuses an in-place op on
    them, where ``ColwiseParallel``'s output allows it.

    The layers' weight shards are laid out as consecutive rows of one tensor (each layer's ``weight`` a view of its
    rows), which the AllGather-GEMM reads in place; where that no longer holds (a ``.to()`` or a wrapper replaced
    them), and under ``torch.compile``, the weights are concatenated per forward (a copy). Weights already stored
    fused (one ``wqkv``) need no group: plain ``ColwiseParallel``. Without sequence parallelism (decode) each layer
    multiplies locally, as ``ColwiseParallel``'s.
    """

    def __init__(self, ctx, layers, **colwise):
        if isinstance(layers, str) or not layers:
            raise TypeError(f"SharedInputColwise: layers must be a sequence of the linear layers' names, got "
                            f"{layers!r}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"SharedInputColwise: a layer named twice in {list(layers)}")
        self.layers, self.colwise = tuple(layers), ColwiseParallel(ctx, **colwise)
        self.ctx = ctx

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        members = [module.get_submodule(name) for name in self.layers]
        for m in members:  # (before any layer changes: a refused member leaves the module as it was)
            self.colwise._check(m, device_mesh)
        sizes = {m.in_features for m in members if isinstance(m, nn.Linear)}
        if len(sizes) > 1:
            raise ValueError(f"SharedInputColwise: {list(self.layers)} of {type(module).__name__} read inputs of "
                             f"different widths {sorted(sizes)}; they cannot share one")
        for m in members:
            self.colwise._apply(m, device_mesh)
        with torch.no_grad():  # the shards side by side in one tensor, each layer's weight a view of its rows
            joined = torch.cat([m.weight for m in members])
            row = 0
            for m in members:
                n = m.weight.shape[0]
                m.weight = nn.Parameter(joined[row:row + n], requires_grad=m.weight.requires_grad)
                row += n
        group = _SharedInput(members)
        for i, m in enumerate(members):
            m.tp_group, m.tp_group_index = group, i
        return module


class _SharedInput:
    """SharedInputColwise's layers at run time: computes them together and keeps each one's output until that
    layer's call with the same input takes it."""

    def __init__(self, members):
        self.members, self.kept = members, None

    def output(self, member, x):
        i, kept, state = member.tp_group_index, self.kept, _call_state(x)
        if kept is not None and kept[0] is x and kept[1] == state and i in kept[2]:
            y = kept[2].pop(i)
            if not kept[2]:
                self.kept = None
            return y
        ys = self._all(x)
        rest = {j: y for j, y in enumerate(ys) if j != i}
        self.kept = (x, state, rest) if rest else None
        return ys[i]

    def _all(self, x):
        ms = self.members
        style = ms[0].tp_style
        local = local_input(x, "SharedInputColwise", style.sequence_dim)
        dt = compute_dtype("SharedInputColwise", local, ms[0].weight)
        weights = [m.weight for m in ms]
        # (under autocast each weight is cast on its own, then the casts concatenated: float32 is never copied)
        weight = _joined(weights) if weights[0].dtype == dt else torch.cat([w.to(dt) for w in weights])
        bias = None if all(m.bias is None for m in ms) else torch.cat(
            [m.weight.new_zeros(m.weight.shape[0], dtype=dt) if m.bias is None else m.bias.to(dt) for m in ms])
        y = _gathered(local.to(dt), weight, bias, style)
        return torch.split(y, [m.weight.shape[0] for m in ms], dim=-1)


def _call_state(x):
    """What a kept output must have been computed under for a later call with ``x`` to take it: ``x``'s version
    (an in-place change in between voids it; not readable while torch.compile traces, where the traced code is
    the caller's, nor kept for inference tensors), whether autograd records, and the autocast state of x's
    device."""
    dev = x.device.type
    autocast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    version = None if torch.compiler.is_compiling() or x.is_inference() else x._version
    return version, torch.is_grad_enabled(), autocast


def _joined(weights):
    """The weights' rows in one tensor, with autograd to each: a view where they are still the consecutive rows
    of one contiguous tensor (as SharedInputColwise lays them out), else their concatenation (a copy: after
    ``.to()`` or a wrapper replaced them, and under ``torch.compile``, which traces the copy)."""
    if len(weights) == 1:
        return weights[0]
    if torch.compiler.is_compiling():  # (traced tensors have no addresses to compare)
        return torch.cat(weights)
    w0 = weights[0]
    rows = sum(w.shape[0] for w in weights)
    at, storage = w0.data_ptr(), w0.untyped_storage().data_ptr()
    for w in weights:  # (adjacent rows of separate storages, as an allocator may place them, are not one tensor)
        if (not w.is_contiguous() or w.dtype != w0.dtype or w.device != w0.device or w.shape[1:] != w0.shape[1:]
                or w.data_ptr() != at or w.untyped_storage().data_ptr() != storage):
            return torch.cat(weights)
        at += w.numel() * w.element_size()
    view = w0.detach().as_strided((rows, *w0.shape[1:]), w0.stride(), w0.storage_offset())
    return _Rows.apply(view, *weights)


class _Rows(torch.autograd.Function):
    """``view`` (the weights' rows in place) forward; backward, each weight its rows of the gradient."""

    @staticmethod
    def forward(ctx, view, *weights):
        ctx.rows = [w.shape[0] for w in weights]
        return view.view_as(view)

    @staticmethod
    def backward(ctx, grad):
        return (None, *torch.split(grad, ctx.rows))


class RowwiseParallel(_LinearStyle):
    """An ``nn.Linear`` split by input features: this rank keeps columns ``r*in/W ...`` of the weight; the bias
    stays whole and is added once.

    Sequence parallel (default): the input is the plain ``[B, S, in/W]`` (a column layer's output, or a DTensor
    sharded on its last dim); GEMM-ReduceScatter sums the ranks' partial products and leaves each rank its sequence
    shard, returned as a DTensor ``Shard(sequence_dim)`` of the full ``[B, S, out]`` (``use_local_output=True``:
    the plain ``[B, S/W, out]``). Backward: AllGather-GEMM. ``sequence_parallel=False``: GEMM + AllReduce, the
    replicated ``[B, S, out]`` on every rank (decode).
    """

    _shard_out = False

    def __init__(self, ctx, *, sequence_parallel: bool = True, sequence_dim: int = 1, fallback: str = "auto",
                 use_local_output: bool = False):
        super().__init__(ctx, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim, fallback=fallback)
        self.use_local_output = use_local_output

    @staticmethod
    def _forward(module, x):
        style = module.tp_style
        d = style.sequence_dim
        x = local_input(x, "RowwiseParallel", -1)
        x, weight, bias = compute_operands("RowwiseParallel", x, module.weight, module.bias)
        if not style.sequence_parallel:
            y = row_rows(x.reshape(-1, x.shape[-1]), weight, bias, style.ctx, style.fallback, False)
            return y.view(*x.shape[:-1], y.shape[-1])
        W = style.ctx.world_size
        S = x.shape[d]
        if S % W:
            raise ValueError(f"RowwiseParallel: sequence length {S} (dim {d}) is not divisible by the world size {W}")
        if d == 1 and x.shape[0] > 1:  # rows ordered (rank, batch, position) for the scatter
            B = x.shape[0]
            x = x.view(B, W, S // W, *x.shape[2:]).transpose(0, 1).contiguous().view(B, S, *x.shape[2:])
        y = row_rows(x.reshape(-1, x.shape[-1]), weight, bias, style.ctx, style.fallback, True)
        shape = list(x.shape[:-1]) + [y.shape[-1]]
        shape[d] = S // W
        y = y.view(shape)
        if style.use_local_output:
            return y
        return DTensor.from_local(y, module.tp_mesh, [Shard(d)], run_check=False)


class ReplicatedLatent(ParallelStyle):
    """A low-rank down-projection that every rank keeps whole and whose output every rank needs for every token:
    multi-head latent attention's ``q_a_proj`` and ``kv_a_proj_with_mqa`` (DeepSeek-V2/V3, Kimi K2), whose
    up-projections (``q_b_proj``, ``kv_b_proj``) are ``ColwiseParallel(sequence_parallel=False)`` layers over the
    latent and whose latent norms run on it unstyled.

    Sequence parallel (default): the input is this rank's sequence shard (a DTensor ``Shard(sequence_dim)`` or the
    plain local shard); the product of its rows is gathered to the full sequence, a plain ``[B, S, out]``. The
    latent is far narrower than the residual stream (DeepSeek-V3: 576 and 1536 against 7168), so gathering it
    moves that much less than gathering the input for the up-projections would. The weight (and bias) become
    replicated DTensors whose gradients are left partial (this rank's rows), summed where read, as a norm's under
    torch's ``SequenceParallel``. Backward: the gather's gradient is this rank's slice of it; the up-projections
    sum their input's gradient over the ranks (each feeds its own heads), and the output's last ``partial_tail``
    columns (``kv_a_proj_with_mqa``'s rotary key, which feeds this rank's heads directly) have their gradient
    summed over the ranks here. ``sequence_parallel=False`` (decode): every token on every rank, a local product,
    the weights plain tensors (their gradients complete on every rank). The product is one ``nn.Linear`` call,
    following autocast (``nn.precision``).
    """

    def __init__(self, ctx, *, sequence_parallel: bool = True, sequence_dim: int = 1, partial_tail: int = 0):
        if sequence_dim not in (0, 1):
            raise ValueError(f"ReplicatedLatent: sequence_dim must be 0 (sequence-first) or 1 (batch-first), got "
                             f"{sequence_dim}")
        if partial_tail < 0:
            raise ValueError(f"ReplicatedLatent: partial_tail must be >= 0, got {partial_tail}")
        self.ctx, self.sequence_parallel, self.sequence_dim = ctx, sequence_parallel, sequence_dim
        self.partial_tail = partial_tail

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"ReplicatedLatent applies to nn.Linear, got {type(module).__name__}")
        if hasattr(module, "tp_style"):
            raise ValueError(f"ReplicatedLatent: this {type(module).__name__} already has a parallel style "
                             f"({type(module.tp_style).__name__}); a plan must match each layer once")
        check_mesh(self, device_mesh)
        if self.partial_tail > module.out_features:
            raise ValueError(f"ReplicatedLatent: partial_tail = {self.partial_tail} exceeds out_features = "
                             f"{module.out_features}")
        if self.sequence_parallel:
            with torch.no_grad():
                for name in ("weight", "bias"):
                    if getattr(module, name) is not None:
                        setattr(module, name, replicated_parameter(getattr(module, name), device_mesh))
        module.tp_style, module.tp_mesh = self, device_mesh
        module.__class__ = styled_class(type(module), _latent_forward, "ReplicatedLatent")
        return module


def _latent_forward(module, x):
    style = module.tp_style
    d, W = style.sequence_dim, style.ctx.world_size
    weight, bias = replicated_local(module.weight), replicated_local(module.bias)
    x = local_input(x, "ReplicatedLatent", d if style.sequence_parallel else None)
    x, weight, bias = compute_operands("ReplicatedLatent", x, weight, bias)
    y = nn.functional.linear(x, weight, bias)
    if style.sequence_parallel:
        y = _gather_latent(y, layer_ops(style.ctx, "auto")[0], W, d % y.ndim)
    tail = style.partial_tail
    if tail and torch.is_grad_enabled() and y.requires_grad:  # this rank's heads' part of its gradient: summed
        head, rot = y.split([y.shape[-1] - tail, tail], dim=-1)
        y = torch.cat([head, summed_grad(rot, module.tp_mesh)], dim=-1)
    return y


@torch.compiler.disable  # as GatherSequence's gather: outside torch.compile's graphs
def _gather_latent(y, handle: int, world: int, dim: int):
    return custom_ops.gather_sequence(y, handle, world, dim)


def _sequence_dim(style: str, dim: int) -> int:
    """``dim`` where it is 0 (sequence-first) or 1 (batch-first), else ValueError naming ``style``."""
    if dim not in (0, 1):
        raise ValueError(f"{style}: sequence_dim must be 0 (sequence-first) or 1 (batch-first), got {dim}")
    return dim


class ShardSequence(ParallelStyle):
    """Makes a module's output (the full activation, the same on every rank: a token embedding) this rank's
    sequence shard, a DTensor ``Shard(sequence_dim)`` whose global shape is the full one. Backward gathers the gradient,
    so the module before the region gets the whole of it."""

    def __init__(self, ctx, *, sequence_dim: int = 1):
        self.ctx, self.sequence_dim = ctx, _sequence_dim("ShardSequence", sequence_dim)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        check_mesh(self, device_mesh)
        dim, W = self.sequence_dim, self.ctx.world_size
        handle = layer_ops(self.ctx, "auto")[0]  # the custom op finds the Context's group through an op's handle

        @torch.compiler.disable  # a graph across the region's edge gives wrong gradients (docs/design.md)
        def shard(_, __, out):
            if isinstance(out, DTensor):
                out = out.full_tensor()
            if out.shape[dim] % W:
                raise ValueError(f"ShardSequence: sequence length {out.shape[dim]} (dim {dim}) is not divisible by "
                                 f"the world size {W}")
            local = custom_ops.shard_sequence(out, handle, W, dim % out.ndim)
            return DTensor.from_local(local, device_mesh, [Shard(dim % out.ndim)], run_check=False)

        module.register_forward_hook(shard)
        return module


class GatherSequence(ParallelStyle):
    """Gathers a module's first input (the sequence shard: a DTensor ``Shard(sequence_dim)``, or the plain local shard)
    into the full plain tensor before the module runs, so the module and everything after it run replicated (the
    final norm, then the LM head and the loss). Backward: this rank's slice of the gradient."""

    def __init__(self, ctx, *, sequence_dim: int = 1):
        self.ctx, self.sequence_dim = ctx, _sequence_dim("GatherSequence", sequence_dim)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        check_mesh(self, device_mesh)
        dim, W = self.sequence_dim, self.ctx.world_size
        handle = layer_ops(self.ctx, "auto")[0]  # as ShardSequence's

        @torch.compiler.disable  # as ShardSequence's
        def gather(_, args):
            x = local_input(args[0], "GatherSequence", dim)
            return (custom_ops.gather_sequence(x, handle, W, dim % x.ndim), *args[1:])

        module.register_forward_pre_hook(gather)
        return module


__all__ = ["ColwiseParallel", "GatherSequence", "ReplicatedLatent", "RowwiseParallel", "ShardSequence",
           "SharedInputColwise", "overlap_ops"]
