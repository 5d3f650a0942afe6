"""A parallelized model's weights in the unmodified model's layout, and back.

The styles keep each rank's shards as plain tensors under the unmodified model's names (``state_dict()`` then holds
this rank's rows, columns, heads or experts), and ``MoEParallel`` joins a shared expert to the routed experts; the
``from_full`` layers hold theirs under their own names (TPMLP's ``gate_up``, the MoE layers' ``w13``), their
unmodified tensors being what ``from_full`` took (an ``nn.Linear``'s, the MLP's ``gate``/``up``/``down``, the experts'
``w1``/``w3``/``w2``). So:

* ``full_state_dict(model)``: the state dict of the model as it was before ``parallelize_module``: every name, shape
  and layout it had (a shared expert's weights included), each sharded tensor gathered from the ranks of its style's
  Context. Collective: every rank of the group calls it, and every rank gets the whole state dict (``device="cpu"``
  moves each tensor there once gathered; ``rank0_only=True`` keeps it on global rank 0 alone). What
  ``save_pretrained`` or ``torch.save`` writes of it, the unmodified model loads. ``full_grads(model)``: the same
  for the parameters' gradients after a backward, e.g. to compare them with the unmodified model's.
* ``load_full_state_dict(model, state_dict)``: such a state dict (the unmodified model's, a checkpoint's) loaded into
  the parallelized model, each rank copying its own shards; no communication.

How each style shards a tensor is recorded when it is applied, and each ``from_full`` layer's when it is built
(``record``): a tensor of the parallelized module is made of pieces, each one tensor of the unmodified module (its
``source``, by name relative to the recording module) through views that are the same on every rank (a reshape, a
transpose) and selections along a dim that differ per rank (this rank's slice, or its rows of an index), placed at a
region of the tensor. Loading runs the pieces forward on the given tensors; gathering collects every rank's tensor
and writes each piece back where it came from. Tensors no style sharded (the norms', the embeddings', replicated
DTensors, FSDP2's shards: their full value) pass as they are.

For ``torch.distributed.checkpoint`` (DCP), which writes each rank's part of a tensor and reshards on load:

* ``sharded_state_dict(model)``: the unmodified model's names and shapes, each tensor of which every rank holds its r-th
  of W equal consecutive slices along one dim (the column and row layers', the norms' over heads, the ``from_full``
  layers') a DTensor ``Shard(dim)`` over its Context's group whose local tensor is a view of the parameter (beside
  FSDP2, which splits that shard again over its own mesh: of FSDP2's local tensor, the DTensor on a mesh of both
  groups); tensors no style sharded as the model holds them; the others (Hugging Face experts' fused or interleaved
  layouts, selections by index) gathered whole as ``full_state_dict`` does, so DCP writes them once;
* ``load_sharded_state_dict(model, state_dict)``: after ``dcp.load`` into such a dict, what it loaded copied into
  the parameters (the shards were loaded in place; the gathered tensors give each rank its pieces);
* ``sharded_optimizer_state_dict`` / ``load_sharded_optimizer_state_dict``: an optimizer's state in the same layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

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
    """(source, the unmodified tensor) of each source of ``pieces`` (several pieces may come from one source), from
    every rank's ``t`` (a plain tensor) gathered over ``ctx``'s group. Collective; ``keep=False``: this rank takes
    part in the gather and builds nothing."""
    ranks = _gather(t, ctx)
    out: dict[str, torch.Tensor] = {}
    for piece in (pieces if keep else ()):
        full = out.get(piece.source)
        if full is None:
            full = out[piece.source] = torch.empty(piece.shape, dtype=t.dtype, device=t.device)
        for r, local in enumerate(ranks):
            _place(full, piece.ops, _region(local, piece.region), r)
    return list(out.items())


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
    return _full(model, model.state_dict().items(), device, rank0_only)


def full_grads(model: nn.Module, *, device=None, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The gradients the unmodified model's parameters would hold, from ``model``'s after a backward, under
    ``full_state_dict``'s keys (the unmodified model's names; under a ``torch.compile``'d submodule with its
    ``_orig_mod.``, as ``state_dict()`` has them): each sharded gradient gathered into the unmodified layout, a
    DTensor's its full value (a replicated parameter's partial gradients summed over its mesh), each a copy (a later
    backward or clipping does not change it); parameters without a gradient are left out. So a parallelized model's
    backward compares with the unmodified model's name by name. Gradients a layer leaves for the user to sum
    (``sync_replicated_grads``) are taken as they are: call it first. Collective as ``full_state_dict``, with the
    same ``device`` (e.g. ``"cpu"``: a large model's gradients gathered one at a time on the GPU) and ``rank0_only``;
    every rank must hold a gradient for the same parameters (checked over the default group first: ValueError naming
    the parameters where the ranks differ)."""
    params = [(k, p) for k, p in model.state_dict(keep_vars=True).items() if isinstance(p, nn.Parameter)]
    have = [k for k, p in params if p.grad is not None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, have)
        differ = sorted(set().union(*map(set, every)) - set.intersection(*map(set, every)))
        if differ:
            raise ValueError(f"full_grads: the ranks hold gradients for different parameters: {differ[:4]} (ranks "
                             f"with them: {[r for r, keys in enumerate(every) if differ[0] in keys]})")
    return _full(model, [(k, p.grad) for k, p in params if p.grad is not None], device, rank0_only, copy=True)


def _full(model: nn.Module, items, device, rank0_only: bool, copy: bool = False) -> dict[str, torch.Tensor]:
    """``items``, (a key of ``model``'s state dict, a tensor of its parameter's layout), in the unmodified layout
    (full_state_dict); ``copy``: the tensors no gather made are copies too, not the items' own."""
    records = _records(model)
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for key, t in items:
        t = _value(t.detach())  # (collective for FSDP2's shards: every rank)
        if key not in records:
            if keep:
                out[key] = t.to(t.device if device is None else device, copy=copy)
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


@dataclass(frozen=True)
class _Slice:
    """A piece of a recorded tensor that is rank r's r-th of W equal consecutive slices of its source along one dim,
    which DCP reads as the DTensor ``Shard(dim)`` of the source: ``key`` the source's state-dict key, ``shape`` its
    global shape, ``dim`` in the source's dims; the piece's ``region`` of the tensor and the transposes its record
    takes before and after the selection."""
    key: str
    dim: int
    shape: tuple
    region: tuple
    before: tuple
    after: tuple

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the source in the source's layout: a view of ``t`` (the recorded tensor's local
        value, or an optimizer state of its shape)."""
        t = _region(t, self.region)
        for _, a, b in reversed(self.before + self.after):
            t = t.transpose(a, b)
        return t


def _even_slices(t: torch.Tensor, prefix: str, pieces, ctx) -> list[_Slice] | None:
    """Each piece of ``t`` (a recorded tensor, ``pieces`` its record; FSDP2's DTensor: by its full shape, the
    tensor-parallel shard's) as a ``_Slice`` where every piece is one: its own source, transposes around one selection
    of rank r's r-th of W equal consecutive slices; None otherwise (the tensor is gathered whole for DCP)."""
    if len({p.source for p in pieces}) != len(pieces):
        return None
    W, out = ctx.world_size, []
    for piece in pieces:
        kinds = [op[0] for op in piece.ops]
        if kinds.count("select") != 1 or "view" in kinds:
            return None
        i = kinds.index("select")
        _, dim, per_rank = piece.ops[i]
        before, after = piece.ops[:i], piece.ops[i + 1:]
        shape = list(t.shape)  # the piece's local shape, taken back through the transposes to the source's dims
        for d, start, stop in piece.region:
            shape[d] = stop - start
        perm = list(range(len(shape)))
        for _, a, b in before:
            perm[a], perm[b] = perm[b], perm[a]
        for _, a, b in reversed(before + after):
            shape[a], shape[b] = shape[b], shape[a]
        n, src_dim = shape[perm[dim]], perm[dim]
        even = len(per_rank) == W and all(isinstance(s, slice) and s.step in (None, 1) and (s.start, s.stop) == (
            r * n, (r + 1) * n) for r, s in enumerate(per_rank))
        if not even or tuple(piece.shape) != tuple(n * W if d == src_dim else s for d, s in enumerate(shape)):
            return None
        out.append(_Slice(prefix + piece.source, src_dim, tuple(piece.shape), piece.region, before, after))
    return out


def _dtensor(local: torch.Tensor, mesh: DeviceMesh, placements, shape) -> DTensor:
    """``local`` as this rank's part of the DTensor of global ``shape`` (contiguous) placed by ``placements``."""
    stride = tuple(int(torch.Size(shape[d + 1:]).numel()) for d in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


class _ForDCP:
    """How each of a model's tensors goes into a DCP state dict (sharded_state_dict's docstring): by state-dict
    key, its record (prefix, pieces, ctx) and its ``_Slice``s where it is made of even slices; the tensors as the
    modules hold them (``own``); the device meshes of the Contexts' groups."""

    def __init__(self, model: nn.Module):
        self.records = _records(model)
        self.meshes: dict = {}  # id(ctx), or (id(ctx), id(FSDP2's mesh)) -> DeviceMesh
        self.own = model.state_dict(keep_vars=True)  # (the tensors as the modules hold them)
        # torch's optimizer state dicts name parameters without torch.compile's wrappers (``_orig_mod.``)
        self.by_fqn = {_fqn(k): k for k in self.own}
        self.slices = {key: _even_slices(self.own[key], prefix, pieces, ctx)
                       for key, (prefix, pieces, ctx) in self.records.items() if key in self.own}

    def _mesh(self, ctx, t: torch.Tensor) -> DeviceMesh:
        mesh = self.meshes.get(id(ctx))
        if mesh is None:
            mesh = self.meshes[id(ctx)] = DeviceMesh.from_group(ctx.group, t.device.type)
        return mesh

    def kind(self, key: str):
        """("shard", ctx, its _Slices), ("pieces", ctx) (gathered whole) or None (not recorded: as it is)."""
        if key not in self.records:
            return None
        slices = self.slices.get(key)
        return ("pieces", self.records[key][2]) if slices is None else ("shard", self.records[key][2], slices)

    def sources(self, key: str) -> list[str]:
        """The state-dict keys of the unmodified tensors that the tensor ``key`` is made of, in order, each once."""
        if key not in self.records:
            return [key]
        prefix, pieces, _ = self.records[key]
        return list(dict.fromkeys(prefix + p.source for p in pieces))

    def shard(self, t: torch.Tensor, ctx, s: _Slice) -> DTensor:
        """``s``'s slice of ``t`` (the recorded tensor's value, or an optimizer state of its shape) as the DTensor
        ``Shard(s.dim)`` of the source, a view of t. Beside FSDP2 (t its DTensor, split along one dim over its mesh),
        where the slice spans that dim of t: the slice of FSDP2's local tensor as the source's DTensor on a
        (tensor-parallel, FSDP2) mesh, sharded along ``s.dim`` and then along the dim FSDP2 splits, a view too;
        elsewhere beside FSDP2 (a slice of t along the dim FSDP2 splits) of t's full value over FSDP2's mesh,
        gathered (a copy)."""
        t = t.detach()
        if isinstance(t, DTensor) and t.device_mesh.ndim == 1 and isinstance(t.placements[0], Shard) \
                and all(d != t.placements[0].dim for d, _, _ in s.region):
            q = t.placements[0].dim  # (the dim FSDP2 splits, taken to the source's dims as s.local takes t's)
            for _, a, b in reversed(s.before + s.after):
                q = b if q == a else a if q == b else q
            return _dtensor(s.local(t.to_local()), self._grid(ctx, t.device_mesh), [Shard(s.dim), Shard(q)], s.shape)
        local = s.local(_value(t))
        return _dtensor(local, self._mesh(ctx, local), [Shard(s.dim)], s.shape)

    def _grid(self, ctx, fsdp: DeviceMesh) -> DeviceMesh:
        """The 2-D mesh of ``ctx``'s group (dim 0) and FSDP2's mesh ``fsdp`` (dim 1): the tensor-parallel groups'
        ranks at each FSDP2 coordinate, gathered over FSDP2's group (collective there, once)."""
        mesh = self.meshes.get((id(ctx), id(fsdp)))
        if mesh is None:
            tp = dist.get_process_group_ranks(ctx.group)
            every = [None] * fsdp.size()
            dist.all_gather_object(every, (fsdp.get_local_rank(), tp), group=fsdp.get_group())
            groups = dict(every)  # FSDP2 coordinate -> the tensor-parallel group's ranks there
            grid = torch.tensor([[groups[f][r] for f in range(fsdp.size())] for r in range(len(tp))])
            mesh = self.meshes[(id(ctx), id(fsdp))] = DeviceMesh.from_group(
                [ctx.group, fsdp.get_group()], fsdp.device_type, mesh=grid, mesh_dim_names=("tp", "dp"))
        return mesh

    def stacked(self, t: torch.Tensor, ctx) -> DTensor:
        """Every rank's ``t`` (the same shape on each; a DTensor: its full value) as the rows of [W, *t.shape]: a
        checkpoint that loads at the same world size and layout only."""
        t = _value(t.detach()).unsqueeze(0)
        return _dtensor(t, self._mesh(ctx, t), [Shard(0)], (ctx.world_size, *t.shape[1:]))

    def unmodified(self, key: str, t: torch.Tensor):
        """(name, tensor) of each unmodified tensor that ``t`` (the recorded tensor ``key``'s value, or an optimizer
        state of its shape) is part of: its ``shard`` DTensors, or the tensors gathered whole (collective)."""
        kind = self.kind(key)
        if kind[0] == "shard":
            return [(s.key, self.shard(t, kind[1], s)) for s in kind[2]]
        prefix, pieces, ctx = self.records[key]
        return [(prefix + source, full) for source, full in _unmodified(_value(t.detach()), pieces, ctx)]

    def local_of(self, key: str, like: torch.Tensor, loaded) -> torch.Tensor | None:
        """This rank's value of the recorded tensor ``key`` (``like``'s shape and dtype) from ``loaded(name)``, the
        tensor DCP loaded for each unmodified tensor ``unmodified`` named: its slices (None where they were loaded
        into ``like`` in place: ``_assembled``), or its pieces of the gathered tensors."""
        kind = self.kind(key)
        if kind[0] == "shard":
            return _assembled(like, [(loaded(s.key), s) for s in kind[2]])
        prefix, pieces, ctx = self.records[key]
        return _shard_of(like, [(loaded(prefix + p.source), p) for p in pieces], ctx.rank)


def _fqn(key: str) -> str:
    """A state-dict key as torch's optimizer state dicts name it: without torch.compile's wrappers."""
    return key.replace("_orig_mod.", "")


def _assembled(like: torch.Tensor, parts) -> torch.Tensor | None:
    """A recorded tensor's local value (``like``'s shape and dtype; FSDP2's DTensor: its full value) from ``parts``,
    (DTensor, _Slice) of each of its slices: None where DCP loaded every slice into ``like`` in place, else a copy of
    it with each slice written in (a slice on a (tensor-parallel, FSDP2) mesh gathered over FSDP2's mesh first)."""
    if all(v.to_local().data_ptr() == s.local(_local(like.detach())).data_ptr() for v, s in parts):
        return None
    local = _value(like.detach()).clone()
    for v, s in parts:
        if v.device_mesh.ndim > 1:
            v = v.redistribute(v.device_mesh, [v.placements[0]] + [Replicate()] * (v.device_mesh.ndim - 1))
        s.local(local).copy_(v.to_local())
    return local


def sharded_state_dict(model: nn.Module, *, device=None) -> dict[str, torch.Tensor]:
    """The unmodified model's state dict from ``model`` parallelized by this package's styles or built by the
    ``from_full`` layers, for ``torch.distributed.checkpoint`` (module docstring): every name and global shape
    ``full_state_dict`` has; each unmodified tensor of which every rank holds its r-th of W equal consecutive slices
    along one dim (the column and row layers' weights and biases, the norms over heads, TPMLP's gate and up, TPMoE's and
    EPMoE's experts) a DTensor ``Shard(dim)`` over its Context's group whose local tensor is a view of the parameter (no
    copy: ``dcp.load`` writes the slice in place); a tensor sharded otherwise (Hugging Face experts' fused, interleaved
    or folded layouts, selections by index) gathered whole as ``full_state_dict`` does, so DCP writes it once
    (collective; ``device``: where such a tensor goes once gathered, e.g. ``"cpu"``); the rest as ``model.state_dict()``
    holds it (plain tensors, replicated DTensors, FSDP2's shards), which DCP saves as it saves any model's. Beside
    FSDP2, which splits a tensor-parallel shard again over its mesh, a view of FSDP2's local tensor on a
    (tensor-parallel, FSDP2) mesh (``_ForDCP.shard``). Every rank of the groups calls it. Save it with ``dcp.save(sd,
    checkpoint_id=...)``; load with ``dcp.load`` into a fresh ``sharded_state_dict`` of the model, then
    ``load_sharded_state_dict``. DCP reshards on load, so a checkpoint of the unmodified model, or of this one at
    another world size, loads the same way."""
    how = _ForDCP(model)
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        kind = how.kind(key)
        if kind is None:
            out[key] = t
            continue
        for name, v in how.unmodified(key, t):
            out[name] = v if device is None or isinstance(v, DTensor) else v.to(device)
    return out


def load_sharded_state_dict(model: nn.Module, state_dict: dict) -> None:
    """Copy into ``model`` (parallelized by the styles, or built by the ``from_full`` layers) what ``dcp.load``
    loaded into ``state_dict``, a ``sharded_state_dict(model)``: each shard where DCP did not load it into the
    parameter in place, each tensor no style sharded where it is not that parameter already, and each
    gathered tensor's pieces into this rank's shards (no communication). A key missing from ``state_dict`` raises
    KeyError, a plain tensor where a shard belongs ValueError, before anything is copied."""
    how = _ForDCP(model)
    plan = []
    for key, target in how.own.items():
        names = how.sources(key)
        missing = [n for n in names if n not in state_dict]
        if missing:
            raise KeyError(f"load_sharded_state_dict: the state dict has no {missing[0]!r} (not a "
                           f"sharded_state_dict of this model?)")
        kind = how.kind(key)
        if kind is not None and kind[0] == "shard":
            plain = [n for n in names if not isinstance(state_dict[n], DTensor)]
            if plain:
                raise ValueError(f"load_sharded_state_dict: {plain[0]!r} is a plain tensor where "
                                 f"sharded_state_dict(model) has a DTensor of this rank's part (a full state dict: "
                                 f"load_full_state_dict)")
        plan.append((key, target, kind))
    with torch.no_grad():
        for key, target, kind in plan:
            if kind is not None:  # (this rank's slices, loaded in place or copied; its pieces of gathered tensors)
                local = how.local_of(key, target, state_dict.__getitem__)
                if local is not None:
                    _copy(target, local)
                continue
            value = state_dict[key]  # (a tensor no style sharded: loaded in place, or copied whole)
            if _local(value).data_ptr() == _local(target).data_ptr():
                continue
            if isinstance(value, DTensor) and isinstance(target, DTensor):
                target.copy_(value)
            else:
                _copy(target, _value(value))


def sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer``'s state for ``torch.distributed.checkpoint`` in the unmodified model's layout: torch's
    ``get_optimizer_state_dict(model, optimizer)`` (keyed by parameter names), where every state tensor of a sharded
    weight's shape goes where ``sharded_state_dict`` puts the weight: under the unmodified tensors' names, as the same
    ``Shard(dim)`` views (they reshard on load as the weights do) or gathered whole (collective), and scalars (a step
    count) under each of those names. A state of another shape (a factored second moment) is stacked per rank into
    [W, ...] under the first name, which loads at the same world size and layout only. The param groups name the
    unmodified tensors. So the checkpoint also loads into the unmodified model's optimizer (``get_optimizer_state_dict``
    of it), and theirs into this one, wherever one weight here is one tensor there. Beside FSDP2 the same views of
    FSDP2's local tensors as the weights'. An optimizer without state yet gets its initial
    state (torch's step at lr 0 on zero gradients) even where parameters hold gradients, where torch's function would
    leave it empty and a checkpoint's state would find no place to load into."""
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
    state = {}
    for name, st in osd["state"].items():
        key = how.by_fqn.get(name, name)
        kind = how.kind(key)
        if kind is None:
            state[name] = st
            continue
        names = [_fqn(n) for n in how.sources(key)]
        for n in names:
            state[n] = {}
        for k, t in st.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                for n in names:
                    state[n][k] = t
            elif tuple(t.shape) != tuple(how.own[key].shape):
                state[names[0]][k] = how.stacked(t, kind[1])
            else:
                for n, v in how.unmodified(key, t):
                    state[_fqn(n)][k] = v
    osd["state"] = state
    osd["param_groups"] = [{**g, "params": [_fqn(n) for p in g["params"] for n in how.sources(how.by_fqn.get(p, p))]}
                           for g in osd["param_groups"]]
    return osd


def load_sharded_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Load into ``optimizer`` what ``dcp.load`` loaded into ``state_dict``, a ``sharded_optimizer_state_dict(model,
    optimizer)``: each weight's state from the unmodified tensors' (its slices, or this rank's pieces of the gathered
    tensors, or its row of a stacked state; a DTensor again where the state was one: FSDP2's), then torch's
    ``set_optimizer_state_dict``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    how = _ForDCP(model)
    saved, plain, back = state_dict["state"], {}, {}
    for key, param in how.own.items():
        kind = how.kind(key)
        if kind is None:  # (a tensor no style sharded: its state passes as it is, below)
            continue
        name, names = _fqn(key), [_fqn(n) for n in how.sources(key)]
        back.update((n, name if i == 0 else None) for i, n in enumerate(names))  # (None: a weight's other sources)
        if not any(n in saved for n in names):
            continue
        now = optimizer.state.get(param, {})  # (the optimizer's own state: the local shapes and placements)
        local = {}
        for k in dict.fromkeys(k for n in names for k in saved.get(n, {})):
            t = next(saved[n][k] for n in names if k in saved.get(n, {}))
            mine = now.get(k)
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                if _stacked(kind, t, mine, param):
                    t = t.to_local()[0]  # (this rank's row)
                else:
                    like = mine if isinstance(mine, torch.Tensor) else torch.empty(
                        tuple(param.shape), dtype=t.dtype, device=_local(param).device)
                    t = how.local_of(key, like, lambda n, k=k: saved[_fqn(n)][k])
                    t = like if t is None else t
                if isinstance(mine, DTensor) and not isinstance(t, DTensor):  # (FSDP2's: this rank's part again)
                    t = distribute_tensor(t, mine.device_mesh, mine.placements, src_data_rank=None)
            local[k] = t
        plain[name] = local
    plain.update((n, st) for n, st in saved.items() if n not in back)  # (tensors no style sharded, by their names)
    groups = [{**g, "params": [back.get(n, n) for n in g["params"] if back.get(n, n) is not None]}
              for g in state_dict["param_groups"]]
    set_optimizer_state_dict(model, optimizer, {"state": plain, "param_groups": groups})


def _stacked(kind: tuple, t: torch.Tensor, mine, param: torch.Tensor) -> bool:
    """Whether ``t``, a loaded state of ``param`` (a weight of ``kind``), is one ``sharded_optimizer_state_dict``
    stacked per rank: where the optimizer holds the state (``mine``), one of another shape than the weight's; else a
    DTensor that is not the weight's slice (a gathered layout's states are plain tensors)."""
    if isinstance(mine, torch.Tensor) and mine.dim() > 0:
        return tuple(mine.shape) != tuple(param.shape)
    return isinstance(t, DTensor) and not (kind[0] == "shard" and tuple(t.shape) == kind[2][0].shape)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


__all__ = ["Piece", "full_grads", "full_state_dict", "load_full_state_dict", "load_sharded_optimizer_state_dict",
           "load_sharded_state_dict", "record", "recorded", "rows_of", "selection",
           "sharded_optimizer_state_dict", "sharded_state_dict", "tensor_at"]
