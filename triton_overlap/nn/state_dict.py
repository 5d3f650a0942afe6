"""A parallelized model's weights in the unmodified model's layout, and back.

The styles keep each rank's shards as plain tensors under the unmodified model's names (``state_dict()`` then holds
this rank's rows, columns, heads or experts), and ``MoEParallel`` joins a shared expert to the routed experts. So:

* ``full_state_dict(model)``: the state dict of the model as it was before ``parallelize_module``: every name, shape
  and layout it had (a shared expert's weights included), each sharded tensor gathered from the ranks of its style's
  Context. Collective: every rank of the group calls it, and every rank gets the whole state dict (``device="cpu"``
  moves each tensor there once gathered; ``rank0_only=True`` keeps it on global rank 0 alone). What
  ``save_pretrained`` or ``torch.save`` writes of it, the unmodified model loads.
* ``load_full_state_dict(model, state_dict)``: such a state dict (the unmodified model's, a checkpoint's) loaded into
  the parallelized model, each rank copying its own shards; no communication.

How each style shards a tensor is recorded when it is applied (``record``): a tensor of the parallelized module is
made of pieces, each one tensor of the unmodified module (its ``source``, by name relative to the recording module)
through views that are the same on every rank (a reshape, a transpose) and selections along a dim that differ per rank
(this rank's slice, or its rows of an index), placed at a region of the tensor. Loading runs the pieces forward on
the given tensors; gathering collects every rank's tensor and writes each piece back where it came from. Tensors no
style sharded (the norms', the embeddings', replicated DTensors, FSDP2's shards: their full value) pass as they are.

For ``torch.distributed.checkpoint`` (DCP), which writes each rank's part of a tensor and reshards on load:

* ``sharded_state_dict(model)``: the unmodified model's names and shapes, each tensor a style split in equal
  consecutive slices along one dim (the column and row layers', the norms' over heads) a DTensor ``Shard(dim)`` over
  its Context's group whose local tensor is the parameter itself (beside FSDP2, which splits that shard again over
  its own mesh: the shard gathered over FSDP2's mesh, a copy); tensors no style sharded as the model holds them; the
  others (experts' fused or interleaved layouts, selections by index) gathered whole as ``full_state_dict`` does, so
  DCP writes them once;
* ``load_sharded_state_dict(model, state_dict)``: after ``dcp.load`` into such a dict, what it loaded copied into
  the parameters (the shards were loaded in place; the gathered tensors give each rank its pieces).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..context.collectives import all_gather_rows


@dataclass(frozen=True)
class Piece:
    """Part of a sharded tensor: the unmodified module's tensor ``source`` (a name relative to the recording module)
    of shape ``shape``, through ``ops`` in order, fills ``region`` of the tensor (``(dim, start, stop)`` narrowings;
    empty: the whole). An op is ``("view", shape)``, ``("transpose", a, b)`` or ``("select", dim, per_rank)``, with
    ``per_rank[r]`` rank r's slice (step 1) or index tensor along ``dim``. After a selection by index only
    transposes may follow."""
    source: str
    shape: tuple
    ops: tuple
    region: tuple = ()


def selection(dim: int, per_rank) -> tuple:
    """A select op of a Piece: ``per_rank`` (rank r's slice or index tensor, for every rank) along ``dim``."""
    return ("select", dim, tuple(i if isinstance(i, slice) else torch.as_tensor(i, dtype=torch.int64).cpu()
                                 for i in per_rank))


def record(owner: nn.Module, name: str, pieces, ctx) -> None:
    """Note on ``owner`` that its tensor ``name`` (relative to ``owner``, e.g. ``"weight"``, ``"experts.down_proj"``)
    is made of ``pieces`` over the ranks of ``ctx``'s group, replacing what was noted for ``name`` before."""
    if "tp_full" not in owner.__dict__:
        owner.tp_full = {}
    owner.tp_full[name] = (tuple(pieces), ctx)


def rows_of(owner: nn.Module, name: str, dim: int, per_rank, ctx) -> None:
    """``record`` of the common case: ``name`` is rank r's ``per_rank[r]`` along ``dim`` of the unmodified tensor
    of that name, whose shape is the recorded one but along ``dim``, where it is the sum over ranks."""
    local = tensor_at(owner, name).shape
    shape = list(local)
    shape[dim] = sum(i.stop - i.start if isinstance(i, slice) else len(i) for i in per_rank)
    record(owner, name, [Piece(name, tuple(shape), (selection(dim, per_rank),))], ctx)


def partitioned(owner: nn.Module, names, ctx) -> None:
    """Note on ``owner`` that its parameters ``names`` (relative to ``owner``) each hold this rank's part of a
    weight partitioned over the ranks of ``ctx``'s group (what the ``from_full`` layers' sharded weights are, under
    their own names: no unmodified layout to record). grads.grad_norm sums their parts over the group;
    sharded_state_dict saves every rank's."""
    if "tp_partitioned" not in owner.__dict__:
        owner.tp_partitioned = {}
    for name in names:
        owner.tp_partitioned[name] = ctx


def tensor_at(module: nn.Module, name: str):
    """The parameter or buffer ``name`` (dotted, relative to ``module``) as the module holds it now."""
    owner, _, leaf = name.rpartition(".")
    m = module.get_submodule(owner) if owner else module
    return m._parameters[leaf] if leaf in m._parameters else m._buffers[leaf]


def recorded(model: nn.Module):
    """(the recording module's state-dict key prefix, the module, the tensor's name relative to it, pieces, Context)
    of every tensor of ``model`` a style recorded, under every name a shared module has."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, (pieces, ctx) in module.__dict__.get("tp_full", {}).items():
            yield f"{prefix}." if prefix else "", module, name, pieces, ctx


def marked(model: nn.Module):
    """(the marking module's state-dict key prefix, the module, the parameter's name relative to it, Context) of
    every weight of ``model`` noted ``partitioned``, under every name a shared module has."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, ctx in module.__dict__.get("tp_partitioned", {}).items():
            yield f"{prefix}." if prefix else "", module, name, ctx


def _records(model: nn.Module) -> dict:
    """state-dict key of every recorded tensor -> (the recording module's key prefix, pieces, ctx)."""
    return {prefix + name: (prefix, pieces, ctx) for prefix, _, name, pieces, ctx in recorded(model)}


def _value(t: torch.Tensor) -> torch.Tensor:
    """A state dict's tensor as a plain one: a DTensor's full value (replicated: this rank's; FSDP2's shards:
    gathered over its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _forward(t: torch.Tensor, ops, rank: int) -> torch.Tensor:
    for op in ops:
        if op[0] == "view":
            t = t.reshape(op[1])
        elif op[0] == "transpose":
            t = t.transpose(op[1], op[2])
        else:
            dim, index = op[1], op[2][rank]
            t = t.narrow(dim, index.start, index.stop - index.start) if isinstance(index, slice) \
                else t.index_select(dim, index.to(t.device))
    return t


def _place(full: torch.Tensor, ops, local: torch.Tensor, rank: int) -> None:
    """Write rank ``rank``'s ``local`` (``_forward(full, ops, rank)``'s value) into ``full``."""
    v = full
    for i, op in enumerate(ops):
        if op[0] == "view":
            v = v.view(op[1])
        elif op[0] == "transpose":
            v = v.transpose(op[1], op[2])
        else:
            dim, index = op[1], op[2][rank]
            if isinstance(index, slice):
                v = v.narrow(dim, index.start, index.stop - index.start)
                continue
            for later in reversed(ops[i + 1:]):
                if later[0] != "transpose":
                    raise ValueError(f"state_dict: a {later[0]} after a selection by index cannot be undone")
                local = local.transpose(later[1], later[2])
            v.index_copy_(dim, index.to(v.device), local.to(v.dtype))
            return
    v.copy_(local)


def _region(t: torch.Tensor, region) -> torch.Tensor:
    for dim, start, stop in region:
        t = t.narrow(dim, start, stop - start)
    return t


def _gather(local: torch.Tensor, ctx) -> list[torch.Tensor]:
    """Every rank's ``local`` (the same shape and dtype on every rank), in rank order."""
    W = ctx.world_size
    flat = local.detach().contiguous().view(-1).view(torch.uint8)
    out = torch.empty((W, flat.numel()), dtype=torch.uint8, device=flat.device)
    all_gather_rows(out, flat.view(1, -1), group=ctx.group)
    return [row.view(local.dtype).view(local.shape) for row in out]


def _unmodified(t: torch.Tensor, pieces, ctx, keep: bool = True) -> list[tuple[str, torch.Tensor]]:
    """(source, the unmodified tensor) of each piece, from every rank's ``t`` (a plain tensor) gathered over
    ``ctx``'s group. Collective; ``keep=False``: this rank takes part in the gather and builds nothing."""
    ranks = _gather(t, ctx)
    out = []
    for piece in (pieces if keep else ()):
        full = torch.empty(piece.shape, dtype=t.dtype, device=t.device)
        for r, local in enumerate(ranks):
            _place(full, piece.ops, _region(local, piece.region), r)
        out.append((piece.source, full))
    return out


def _shard_of(target: torch.Tensor, sources, rank: int) -> torch.Tensor:
    """``target``'s value on rank ``rank`` (its global shape where it is a DTensor: the tensor-parallel shard that
    FSDP2 splits) from ``sources``, (unmodified tensor, piece) of each of its pieces."""
    local = torch.empty(tuple(target.shape), dtype=target.dtype, device=target.device)
    for full, piece in sources:
        _region(local, piece.region).copy_(_forward(full.to(local.device), piece.ops, rank))
    return local


def full_state_dict(model: nn.Module, *, device=None, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The unmodified model's state dict from ``model`` parallelized by this package's styles (module docstring):
    its names, shapes and layouts, every sharded tensor gathered over its Context's group. Collective over every
    rank of the groups; every rank returns the whole dict, or with ``rank0_only`` global rank 0 alone (the others
    take part in every gather and return an empty dict: a large model's whole state in one process's memory, not in
    every rank's). ``device``: where each tensor goes once gathered (e.g. ``"cpu"``, so that at most one gathered
    tensor is on the GPU at a time); None: where the parameter is. The dtypes are the parameters' (float32
    parameters under autocast stay float32)."""
    records = _records(model)
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        t = _value(t.detach())  # (collective for FSDP2's shards: every rank)
        if key not in records:
            if keep:
                out[key] = t if device is None else t.to(device)
            continue
        prefix, pieces, ctx = records[key]
        for source, full in _unmodified(t, pieces, ctx, keep):
            out[prefix + source] = full if device is None else full.to(device)
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict, *, strict: bool = True) -> None:
    """Load ``state_dict`` in the unmodified model's layout (``full_state_dict``'s, or a checkpoint of the model
    before ``parallelize_module``) into ``model`` parallelized: each rank copies its shards of every tensor a style
    sharded (into the parameters in place: optimizers and FSDP2 keep them) and the rest whole. ``strict``: a key
    missing from ``state_dict``, one the model has no place for, or a tensor of another shape raises KeyError /
    ValueError before anything is copied; otherwise such keys are skipped."""
    records = _records(model)
    own = model.state_dict(keep_vars=True)
    plan, used = [], set()
    for key, target in own.items():  # (a tensor no style sharded: one piece, itself whole)
        prefix, pieces, ctx = records.get(key) or ("", (Piece(key, tuple(target.shape), ()),), None)
        names = [prefix + p.source for p in pieces]
        missing = [n for n in names if n not in state_dict]
        bad = [(n, p) for n, p in zip(names, pieces) if n in state_dict and tuple(state_dict[n].shape) != p.shape]
        if not missing and not bad:
            plan.append((target, [(state_dict[n], p) for n, p in zip(names, pieces)], ctx))
        used.update(names)
        if strict and missing:
            raise KeyError(f"load_full_state_dict: the state dict has no {missing[0]!r}" + (
                f" (of {len(names)} tensors the model's {key!r} is made of)" if key in records else ""))
        if strict and bad:
            name, piece = bad[0]
            raise ValueError(f"load_full_state_dict: {name!r} is {tuple(state_dict[name].shape)}, the unmodified "
                             f"model's is {piece.shape}")
    unexpected = sorted(set(state_dict) - used)
    if strict and unexpected:
        raise KeyError(f"load_full_state_dict: the model has no place for {unexpected[:3]}"
                       f"{' and more' if len(unexpected) > 3 else ''}")
    with torch.no_grad():
        for target, sources, ctx in plan:
            if ctx is None:  # (whole)
                _copy(target, sources[0][0])
                continue
            _copy(target, _shard_of(target, sources, ctx.rank))


def _copy(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target`` (a parameter or buffer; a DTensor: replicated, or FSDP2's shard of it) = ``value``, its full
    value."""
    if isinstance(target, DTensor):
        value = value.to(device=target.device, dtype=target.dtype)
        target.copy_(distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None))
    else:
        target.copy_(value)


def _even_shard(t: torch.Tensor, pieces, name: str, ctx) -> int | None:
    """The dim along which ``t`` (a recorded tensor, ``pieces`` its record) is rank r's r-th of W equal consecutive
    slices of the unmodified tensor of the same name, which DCP reads as a DTensor ``Shard(dim)``; None otherwise.
    (FSDP2's DTensor of such a shard: by its full shape, the shard's.)"""
    if len(pieces) != 1:
        return None
    (piece,) = pieces
    if piece.source != name or piece.region or len(piece.ops) != 1 or piece.ops[0][0] != "select":
        return None
    _, dim, per_rank = piece.ops[0]
    W, n = ctx.world_size, t.shape[dim]
    want = tuple(slice(r * n, (r + 1) * n) for r in range(W))
    even = len(per_rank) == W and all(isinstance(i, slice) and (i.start, i.stop, i.step in (None, 1)) == (
        w.start, w.stop, True) for i, w in zip(per_rank, want))
    return dim if even and piece.shape == tuple(n * W if d == dim else s for d, s in enumerate(t.shape)) else None


class _ForDCP:
    """How each of a model's tensors goes into a DCP state dict (sharded_state_dict's docstring): by state-dict
    key, its record (prefix, pieces, ctx) and the dim of an even shard, or the Context of a ``partitioned`` weight;
    the tensors as the modules hold them (``own``); the device meshes of the Contexts' groups."""

    def __init__(self, model: nn.Module):
        self.records = _records(model)
        self.marks = {prefix + name: ctx for prefix, _, name, ctx in marked(model)}
        self.meshes: dict[int, DeviceMesh] = {}
        self.own = model.state_dict(keep_vars=True)  # (the tensors as the modules hold them)
        self.even = {key: _even_shard(self.own[key], pieces, key[len(prefix):], ctx)
                     for key, (prefix, pieces, ctx) in self.records.items() if key in self.own}

    def _mesh(self, ctx, t: torch.Tensor) -> DeviceMesh:
        mesh = self.meshes.get(id(ctx))
        if mesh is None:
            mesh = self.meshes[id(ctx)] = DeviceMesh.from_group(ctx.group, t.device.type)
        return mesh

    def kind(self, key: str):
        """("shard", ctx, dim, global shape), ("pieces", ctx) (gathered whole), ("stacked", ctx) (each rank's
        tensor a row of [W, ...]) or None (as it is)."""
        if key in self.records:
            prefix, pieces, ctx = self.records[key]
            dim = self.even.get(key)
            return ("pieces", ctx) if dim is None else ("shard", ctx, dim, pieces[0].shape)
        return ("stacked", self.marks[key]) if key in self.marks else None

    def shard(self, t: torch.Tensor, ctx, dim: int, shape) -> DTensor:
        """``t`` (this rank's slice) as the DTensor ``Shard(dim)`` of global ``shape``, sharing t's storage (FSDP2's
        DTensor: its full value over FSDP2's mesh, gathered)."""
        t = _value(t.detach())
        stride = tuple(int(torch.Size(shape[d + 1:]).numel()) for d in range(len(shape)))
        return DTensor.from_local(t, self._mesh(ctx, t), [Shard(dim)], run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def stacked(self, t: torch.Tensor, ctx) -> DTensor:
        """Every rank's ``t`` (the same shape on each; a DTensor: its full value) as the rows of [W, *t.shape]: a
        checkpoint that loads at the same world size and layout only."""
        t = _value(t.detach())
        return self.shard(t.unsqueeze(0), ctx, 0, (ctx.world_size, *t.shape))


def sharded_state_dict(model: nn.Module, *, device=None) -> dict[str, torch.Tensor]:
    """The unmodified model's state dict from ``model`` parallelized by this package's styles, for
    ``torch.distributed.checkpoint`` (module docstring): every name and global shape ``full_state_dict`` has; a tensor
    sharded in equal consecutive slices along one dim as a DTensor ``Shard(dim)`` over its Context's group, its local
    tensor the parameter itself (no copy: ``dcp.load`` writes the shard in place); one sharded otherwise gathered whole
    over the group (collective, as ``full_state_dict``; ``device``: where such a tensor goes once gathered, e.g.
    ``"cpu"``); a weight of a ``from_full`` layer (ColumnParallelLinear, TPMoE, EPMoE: its own names, no
    unmodified layout) under its name as the rows of [W, ...], one per rank, which loads at the same world size only;
    the rest as ``model.state_dict()`` holds it (plain tensors, replicated DTensors, FSDP2's shards), which DCP saves as
    it saves any model's. Every rank of the groups calls it. Save it with ``dcp.save(sd, checkpoint_id=...)``; load with
    ``dcp.load`` into a fresh ``sharded_state_dict`` of the model, then ``load_sharded_state_dict``. A checkpoint of the
    unmodified model (any world size, or none) loads the same way: DCP reads each rank's slices of it."""
    how = _ForDCP(model)
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        kind = how.kind(key)
        if kind is None:
            out[key] = t
        elif kind[0] == "shard":
            out[key] = how.shard(t, *kind[1:])
        elif kind[0] == "stacked":
            out[key] = how.stacked(t, kind[1])
        else:
            prefix, pieces, ctx = how.records[key]
            for source, full in _unmodified(_value(t.detach()), pieces, ctx):
                out[prefix + source] = full if device is None else full.to(device)
    return out


def load_sharded_state_dict(model: nn.Module, state_dict: dict) -> None:
    """Copy into ``model`` (parallelized by the styles) what ``dcp.load`` loaded into ``state_dict``, a
    ``sharded_state_dict(model)``: each shard's local tensor (a ``from_full`` layer's: its row) and each tensor no
    style sharded into its parameter where it is not that parameter already; each gathered tensor's pieces into this
    rank's shards (no communication). A key of the model missing from ``state_dict`` raises KeyError, a plain tensor
    where a shard belongs ValueError, before anything is copied."""
    how = _ForDCP(model)
    plan = []
    for key, target in how.own.items():
        prefix, pieces, _ = how.records.get(key) or ("", (Piece(key, tuple(target.shape), ()),), None)
        names = [prefix + p.source for p in pieces]
        missing = [n for n in names if n not in state_dict]
        if missing:
            raise KeyError(f"load_sharded_state_dict: the state dict has no {missing[0]!r} (not a "
                           f"sharded_state_dict of this model?)")
        kind = how.kind(key)
        if kind is not None and kind[0] != "pieces" and not isinstance(state_dict[key], DTensor):
            raise ValueError(f"load_sharded_state_dict: {key!r} is a plain tensor where sharded_state_dict(model) "
                             f"has a DTensor of this rank's part (a full state dict: load_full_state_dict)")
        plan.append((target, [(state_dict[n], p) for n, p in zip(names, pieces)], kind))
    with torch.no_grad():
        for target, sources, kind in plan:
            value = sources[0][0]
            if kind is not None and kind[0] != "pieces":  # (a shard or a row: this rank's, loaded in place)
                value = value.to_local()[0] if kind[0] == "stacked" else value.to_local()
                if value.data_ptr() != _local(target).data_ptr():
                    _copy(target, value)
                continue
            if kind is None:  # (a tensor no style sharded: loaded in place, or copied whole)
                if _local(value).data_ptr() == _local(target).data_ptr():
                    continue
                if isinstance(value, DTensor) and isinstance(target, DTensor):
                    target.copy_(value)
                else:
                    _copy(target, _value(value))
                continue
            _copy(target, _shard_of(target, sources, kind[1].rank))


def sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer``'s state for ``torch.distributed.checkpoint``, as torch's ``get_optimizer_state_dict(model,
    optimizer)`` gives it (keyed by parameter names), with every state tensor but scalars of a weight that a style or a
    ``from_full`` layer shards made a DTensor: a state of the weight's shape, where ``sharded_state_dict`` makes the
    weight a ``Shard(dim)``, the same ``Shard(dim)`` (it reshards on load as the weight does); any other (a gathered
    layout's, a ``from_full`` layer's, a state of another shape such as a factored second moment) every rank's tensor as
    the rows of [W, ...], which loads at the same world size and layout only. The local tensors are the optimizer's own
    (``dcp.load`` writes them in place), but where FSDP2 shards a sharded weight: its state is gathered over FSDP2's
    mesh first (collective), a copy. An optimizer without state yet gets its initial state (torch's step at lr 0 on zero
    gradients) even where parameters hold gradients, where torch's function would leave it empty and a checkpoint's
    state would find no place to load into."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    grads = {}
    if not optimizer.state:  # (torch initialises an empty state only where no parameter holds a gradient)
        grads = {p: p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
        for p in grads:
            p.grad = None
    try:
        osd = get_optimizer_state_dict(model, optimizer)
    finally:
        for p, g in grads.items():
            p.grad = g
    how = _ForDCP(model)
    for name, state in osd["state"].items():
        kind = how.kind(name)
        if kind is not None:  # (a new dict: torch's may be the optimizer's own)
            osd["state"][name] = {k: _state_for_dcp(how, kind, t, how.own[name]) for k, t in state.items()}
    return osd


def _state_for_dcp(how: _ForDCP, kind: tuple, t, param: torch.Tensor):
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    if _as_shard(kind, t, param):
        return how.shard(t, *kind[1:])
    return how.stacked(t, kind[1])


def _as_shard(kind: tuple, local: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether an optimizer state of ``param`` (a weight of ``kind``), of ``local``'s local shape, goes into DCP as
    its weight's ``Shard(dim)`` (else stacked)."""
    return kind[0] == "shard" and tuple(local.shape) == tuple(param.shape)


def load_sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Load into ``optimizer`` what ``dcp.load`` loaded into ``state_dict``, a ``sharded_optimizer_state_dict(model,
    optimizer)``: each shard or row back to this rank's tensor (a DTensor again where the state was one: FSDP2's),
    then torch's ``set_optimizer_state_dict``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    how = _ForDCP(model)
    plain = {"state": {}, "param_groups": state_dict["param_groups"]}
    for name, state in state_dict["state"].items():
        kind, param = how.kind(name), how.own.get(name)
        now = optimizer.state.get(param, {})  # (the optimizer's state: the local shapes the DTensors were made of)
        local = {}
        for k, t in state.items():
            if kind is not None and isinstance(t, DTensor) and t.dim() > 0:  # (made by sharded_optimizer_state_dict)
                mine = now.get(k)
                shard = _as_shard(kind, mine, param) if isinstance(mine, torch.Tensor) else (
                    kind[0] == "shard" and tuple(t.shape) == tuple(kind[3]))
                t = t.to_local() if shard else t.to_local()[0]
                if isinstance(mine, DTensor):  # (FSDP2's: this rank's part of it again)
                    t = distribute_tensor(t, mine.device_mesh, mine.placements, src_data_rank=None)
            local[k] = t
        plain["state"][name] = local
    set_optimizer_state_dict(model, optimizer, plain)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


__all__ = ["Piece", "full_state_dict", "load_full_state_dict", "load_sharded_optimizer_state_dict",
           "load_sharded_state_dict", "marked", "partitioned", "record", "recorded", "rows_of", "selection",
           "sharded_optimizer_state_dict", "sharded_state_dict", "tensor_at"]
