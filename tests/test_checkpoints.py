"""Checkpoints of the layers ``from_full`` builds (ColumnParallelLinear, RowParallelLinear, TPMLP, TPMoE with and
without a shared expert, EPMoE), on the host backend at W = 2 and 3:

* ``nn.full_state_dict`` gives the unmodified module's tensors (an ``nn.Linear``'s weight and bias; the MLP's
  ``gate``, ``up`` and ``down``; the experts' ``w1``, ``w3`` and ``w2`` in ``nn.Linear``'s [out, in], as ``from_full``
  takes them, a shared expert as more experts after the routed ones), bit for bit, and ``load_full_state_dict``
  loads them back (refs.check_full_state_dict);
* ``nn.sharded_state_dict`` holds each of them as a DTensor ``Shard`` that is a view of its parameter; its DCP
  checkpoint read into plain tensors is the unmodified module's, so it loads at any world size, and a checkpoint of
  the unmodified module loads into the layer (refs.check_sharded_checkpoint); TPMoE's loads into an EPMoE;
* the optimizer's state: AdamW's after a step of TPMoE and EPMoE, saved through ``sharded_optimizer_state_dict``,
  loads into the unmodified module's AdamW (torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``)
  with each moment equal bit for bit to the layer's gathered by hand; that state saved by the unmodified module
  loads into a fresh layer's AdamW as the layer's own, bit for bit;
* ``nn.full_grads``: the layers' gradients after a backward in the same layout, by the unmodified module's names,
  equal bit for bit to the layer's gathered by hand.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import triton_overlap as to
from refs import check_full_state_dict, check_sharded_checkpoint, shared_directory

DIM = 8


def _seeded(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))  # (the same on every rank)


def _linear(n_in, n_out, seed, bias=True):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out, bias=bias)


def _experts(E, hidden, seed):
    return _seeded(E, hidden, DIM, seed=seed), _seeded(E, hidden, DIM, seed=seed + 1), _seeded(E, DIM, hidden,
                                                                                                 seed=seed + 2)


def test_even_slices_undo_the_transposes_in_order():
    """``state_dict._even_slices`` on records whose transposes before and after the selection differ (3-D sources,
    every pair of transposes, every dim selected, W = 3): each accepted slice's ``local`` view of rank r's tensor is
    rank r's slice of the source, element for element (undoing the transposes in the wrong order passes the shape
    checks in some of these cases and reads the wrong elements)."""
    from types import SimpleNamespace

    from triton_overlap.nn.state_dict import Piece, _even_slices, _forward, selection

    W, turns = 3, [(), (("transpose", 0, 1),), (("transpose", 1, 2),), (("transpose", 0, 2),)]
    src = torch.arange(6 * 9 * 12, dtype=torch.float32).reshape(6, 9, 12)
    accepted = 0
    for before in turns:
        for after in turns:
            for dim in range(3):
                n = _forward(src, before, 0).shape[dim] // W
                ops = before + (selection(dim, [slice(r * n, (r + 1) * n) for r in range(W)]),) + after
                piece = Piece("w", tuple(src.shape), ops)
                perm = list(range(3))
                for _, a, b in before:
                    perm[a], perm[b] = perm[b], perm[a]
                for r in range(W):
                    local = _forward(src, ops, r)
                    slices = _even_slices(local, "", [piece], SimpleNamespace(world_size=W, rank=r))
                    assert slices is not None, (before, after, dim)
                    (s,) = slices
                    assert s.dim == perm[dim]
                    assert torch.equal(s.local(local), src.narrow(s.dim, r * n, n)), (before, after, dim, r)
                    accepted += 1
    assert accepted == len(turns) ** 2 * 3 * W


def _layer_checkpoints():
    import torch.distributed.checkpoint as dcp

    from triton_overlap.nn import (TPMLP, ColumnParallelLinear, EPMoE, RowParallelLinear, TPMoE, full_state_dict,
                                   load_sharded_state_dict, sharded_state_dict)

    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        hidden = 4 * W

        def on(d):
            return {k: v.detach().to(dev) for k, v in d.items()}

        col, row = _linear(DIM, hidden, 1), _linear(hidden, DIM, 2)
        gate, up, down = _linear(DIM, hidden, 3), _linear(DIM, hidden, 4), _linear(hidden, DIM, 5)
        router = _linear(DIM, 2 * W, 6, bias=False)
        w1, w3, w2 = _experts(2 * W, hidden, 7)
        s1, s3, s2 = _seeded(2 * hidden, DIM, seed=10), _seeded(2 * hidden, DIM, seed=11), _seeded(DIM, 2 * hidden,
                                                                                                   seed=12)
        shared_gate = _linear(DIM, 1, 13, bias=False)
        f32 = {"dtype": torch.float32}
        cases = {
            "ColumnParallelLinear": (ColumnParallelLinear.from_full_weight(col, ctx, **f32), col.state_dict()),
            "RowParallelLinear": (RowParallelLinear.from_full_weight(row, ctx, **f32), row.state_dict()),
            "TPMLP": (TPMLP.from_full(gate, up, down, ctx, **f32), {
                **{f"gate.{k}": v for k, v in gate.state_dict().items()},
                **{f"up.{k}": v for k, v in up.state_dict().items()},
                **{f"down.{k}": v for k, v in down.state_dict().items()}}),
            "TPMoE": (TPMoE.from_full(router, (w1, w3, w2), ctx, topk=2, **f32),
                      {"router.weight": router.weight, "w1": w1, "w3": w3, "w2": w2}),
            # the shared expert's 2 * hidden units: two more experts of width hidden after the routed ones
            "TPMoE, shared expert": (TPMoE.from_full(router, (w1, w3, w2), ctx, topk=2, shared=(s1, s3, s2),
                                                     shared_gate=shared_gate, **f32), {
                "router.weight": router.weight, "shared_gate.weight": shared_gate.weight,
                "w1": torch.cat([w1, s1.reshape(2, hidden, DIM)]), "w3": torch.cat([w3, s3.reshape(2, hidden, DIM)]),
                "w2": torch.cat([w2, s2.reshape(DIM, 2, hidden).transpose(0, 1)])}),
            "EPMoE": (EPMoE.from_full(router, (w1, w3, w2), ctx, topk=2, **f32),
                      {"router.weight": router.weight, "w1": w1, "w3": w3, "w2": w2}),
        }
        for name, (layer, unmodified) in cases.items():
            try:
                check_full_state_dict(layer, on(unmodified))
                check_sharded_checkpoint(layer, on(unmodified))
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from e
        # the same unmodified tensors: a tensor-parallel MoE's checkpoint loads into an expert-parallel one
        tp = cases["TPMoE"][0]
        ep = EPMoE.from_full(_linear(DIM, 2 * W, 14, bias=False), _experts(2 * W, hidden, 15), ctx, topk=2, **f32)
        with shared_directory() as where:
            dcp.save(sharded_state_dict(tp), checkpoint_id=where)
            sd = sharded_state_dict(ep)
            dcp.load(sd, checkpoint_id=where)
            load_sharded_state_dict(ep, sd)
        got, want = full_state_dict(ep), full_state_dict(tp)
        assert all(torch.equal(got[k], v) for k, v in want.items()), "EPMoE loaded from TPMoE's checkpoint differs"
        ctx.check()
        return True


def test_from_full_layers_checkpoint_in_the_unmodified_layout(pool):
    if pool.world == 4:
        pytest.skip("W = 2, 3")
    assert all(pool.run(_layer_checkpoints))


class _Unmodified(nn.Module):
    """An MoE's parameters as ``from_full`` takes them (the unmodified module, for its optimizer's state)."""

    def __init__(self, E, hidden, seed):
        super().__init__()
        self.router = _linear(DIM, E, seed, bias=False)
        self.w1, self.w3, self.w2 = (nn.Parameter(t) for t in _experts(E, hidden, seed + 1))


class _MLP(nn.Module):
    """A SwiGLU MLP's linears as ``TPMLP.from_full`` takes them (the unmodified module)."""

    def __init__(self, hidden, seed):
        super().__init__()
        self.gate, self.up = _linear(DIM, hidden, seed), _linear(DIM, hidden, seed + 1)
        self.down = _linear(hidden, DIM, seed + 2, bias=False)  # (a row layer's bias: each rank's gradient part)


def _gathered(t, ctx):
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t.contiguous(), group=ctx.group)
    return parts


def _optimizer_interop():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from triton_overlap.nn import (TPMLP, EPMoE, RowParallelLinear, TPMoE, full_grads,
                                   load_sharded_optimizer_state_dict, sharded_optimizer_state_dict)

    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        E, hidden, n = 2 * W, 4 * W, 4
        x = _seeded(4 * W, DIM, seed=20)[ctx.rank * 4:][:4].to(dev)

        def into_unmodified(model, opt, plain, path):
            """``opt``'s state saved through sharded_optimizer_state_dict, loaded into ``plain``'s new AdamW."""
            dcp.save({"optim": sharded_optimizer_state_dict(model, opt)}, checkpoint_id=path)
            popt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
            state = {"optim": get_optimizer_state_dict(plain, popt)}
            dcp.load(state, checkpoint_id=path)
            set_optimizer_state_dict(plain, popt, state["optim"])
            return popt

        def back_into(fresh, plain, popt, model, opt, path, what):
            """``popt``'s state saved by the unmodified module, loaded into ``fresh``'s new AdamW: ``opt``'s state of
            ``model``, bit for bit."""
            dcp.save({"optim": get_optimizer_state_dict(plain, popt)}, checkpoint_id=path)
            fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            state = {"optim": sharded_optimizer_state_dict(fresh, fopt)}
            dcp.load(state, checkpoint_id=path)
            load_sharded_optimizer_state_dict(fresh, fopt, state["optim"])
            for mine, theirs in zip(fresh.parameters(), model.parameters()):
                for k, v in opt.state[theirs].items():
                    assert torch.equal(fopt.state[mine][k], v), f"{what}: {k} of {tuple(v.shape)} differs"

        with shared_directory() as where:
            for cls in (TPMoE, EPMoE):
                plain = _Unmodified(E, hidden, 30).to(dev)
                layer = cls.from_full(plain.router, (plain.w1, plain.w3, plain.w2), ctx, topk=2,
                                      dtype=torch.float32, fallback="never")
                opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    layer(x).float().square().sum().backward()
                layer.sync_replicated_grads()  # (the router's state then the same on every rank)

                def unmodified(of):
                    """``of(p)`` of the layer's experts' weights gathered by hand into the unmodified w1, w3, w2."""
                    w13, down = (_gathered(of(p), ctx) for p in (layer.w13, layer.w2))
                    if cls is TPMoE:  # rank r's hidden units of every expert: [E, dim, 2n], [E, n, dim]
                        got = {"w1": torch.cat([t[:, :, :n] for t in w13], 2),
                               "w3": torch.cat([t[:, :, n:] for t in w13], 2), "w2": torch.cat(down, 1)}
                    else:  # rank r's experts, whole
                        got = {"w1": torch.cat([t[:, :, :hidden] for t in w13]),
                               "w3": torch.cat([t[:, :, hidden:] for t in w13]), "w2": torch.cat(down)}
                    return {name: v.transpose(1, 2) for name, v in got.items()}  # (nn.Linear's [out, in])

                grads = full_grads(layer)  # the gradients in the same layout, by the unmodified module's names
                want = {**unmodified(lambda p: p.grad), "router.weight": layer.router.weight.grad}
                assert sorted(grads) == sorted(want), sorted(grads)
                assert all(torch.equal(grads[k], v) for k, v in want.items()), f"{cls.__name__}: full_grads differs"
                router = layer.router.weight.grad  # (a tensor no style sharded: returned as a copy all the same)
                assert grads["router.weight"].untyped_storage().data_ptr() != router.untyped_storage().data_ptr()
                kept = layer.w2.grad
                if ctx.rank == W - 1:  # one rank without a gradient: every rank raises before any gather
                    layer.w2.grad = None
                with pytest.raises(ValueError, match=r"different parameters: \['w2'\]"):
                    full_grads(layer)
                layer.w2.grad = kept
                opt.step()
                popt = into_unmodified(layer, opt, plain, f"{where}/{cls.__name__}")
                for k in ("step", "exp_avg", "exp_avg_sq"):
                    if k == "step":  # (a scalar: the same for every weight)
                        want = dict.fromkeys(("w1", "w3", "w2"), opt.state[layer.w13][k])
                    else:
                        want = unmodified(lambda p: opt.state[p][k])
                    want["router"] = opt.state[layer.router.weight][k]
                    got = {"w1": plain.w1, "w3": plain.w3, "w2": plain.w2, "router": plain.router.weight}
                    bad = [name for name, p in got.items() if not torch.equal(popt.state[p][k], want[name])]
                    assert not bad, f"{cls.__name__}: the unmodified module's {k} of {bad} differs from the layer's"

                fresh = cls(DIM, hidden, E, 2, ctx=ctx, dtype=torch.float32, fallback="never")
                back_into(fresh, plain, popt, layer, opt, f"{where}/{cls.__name__}-unmodified", cls.__name__)
            # TPMLP (its gate_up: two slices, of gate and of up) under torch.compile's wrapper, whose parameters'
            # names in state dicts hold ``_orig_mod.`` where torch's optimizer state dicts do not
            plain = nn.ModuleDict({"mlp": _MLP(hidden, 40)}).to(dev)
            mlp = TPMLP.from_full(plain.mlp.gate, plain.mlp.up, plain.mlp.down, ctx, dtype=torch.float32,
                                  fallback="never")
            model = nn.ModuleDict({"mlp": torch.compile(mlp, backend="eager")})
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                model["mlp"](x.view(4, 1, DIM)).float().square().sum().backward()

            def unmodified_mlp(of):
                """``of(p)`` of the MLP's weights gathered by hand into the unmodified gate, up and down."""
                gate_up, gate_up_bias, down = (_gathered(of(p), ctx) for p in (
                    mlp.gate_up.weight, mlp.gate_up.bias, mlp.down.weight))
                return {"gate.weight": torch.cat([t[:n] for t in gate_up]),
                        "up.weight": torch.cat([t[n:] for t in gate_up]),
                        "gate.bias": torch.cat([t[:n] for t in gate_up_bias]),
                        "up.bias": torch.cat([t[n:] for t in gate_up_bias]), "down.weight": torch.cat(down, 1)}

            # (names as the model's state_dict() has them, as full_state_dict's: under the compiled module's _orig_mod)
            grads, want = full_grads(model), unmodified_mlp(lambda p: p.grad)
            assert sorted(grads) == sorted(f"mlp._orig_mod.{k}" for k in want), sorted(grads)
            assert all(torch.equal(grads[f"mlp._orig_mod.{k}"], v) for k, v in want.items()), "TPMLP: full_grads"
            opt.step()
            popt = into_unmodified(model, opt, plain, f"{where}/mlp")
            for k in ("exp_avg", "exp_avg_sq"):
                want = unmodified_mlp(lambda p: opt.state[p][k])
                got = dict(plain.mlp.named_parameters())
                bad = [name for name, v in want.items() if not torch.equal(popt.state[got[name]][k], v)]
                assert not bad, f"TPMLP: the unmodified MLP's {k} of {bad} differs from the layer's"
            fresh = TPMLP(DIM, hidden, ctx=ctx, bias=True, dtype=torch.float32, fallback="never")
            fresh.down = RowParallelLinear(hidden, DIM, ctx=ctx, bias=False, dtype=torch.float32, fallback="never")
            back_into(nn.ModuleDict({"mlp": torch.compile(fresh, backend="eager")}), plain, popt, model, opt,
                      f"{where}/mlp-unmodified", "TPMLP")
        ctx.check()
        return True


def test_optimizer_state_loads_into_the_unmodified_module_and_back(pool):
    if pool.world == 4:
        pytest.skip("W = 2, 3")
    assert all(pool.run(_optimizer_interop))


def _from_full_beside_fsdp():
    """Tensor parallel within each half of a 2 x 2 mesh: first the halves alike (data parallel as under DDP), the
    checkpoint then written once and read back into both; then FSDP2 across the halves: each layer's shards split again
    by FSDP2, unevenly (3 rows of a column layer's shard as 2 and 1, 5 rows of a row layer's as 3 and 2). The checkpoint
    holds views of FSDP2's local tensors as the unmodified tensors' DTensors on a (tensor-parallel, FSDP2) mesh where a
    slice spans the dim FSDP2 splits, and gathered copies where it narrows it (TPMLP's gate and up rows)
    (refs.check_sharded_checkpoint); after an AdamW step it resumes bit for bit (refs.check_resume)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from refs import check_resume
    from triton_overlap.kernels.cached_launch import triton_interprets
    from triton_overlap.nn import TPMLP, ColumnParallelLinear, EPMoE, RowParallelLinear, TPMoE

    dev = "cpu" if triton_interprets() else "cuda"  # (the host backend where Triton interprets)
    mesh = init_device_mesh(dev, (2, 2), mesh_dim_names=("dp", "tp"))
    with to.Context(mesh["tp"].get_group(), timeout_s=120) as ctx:
        col, row = _linear(DIM, 6, 1), _linear(6, 5, 2)
        router = _linear(DIM, 4, 3, bias=False)
        w1, w3, w2 = _experts(4, 6, 4)
        f32 = {"dtype": torch.float32, "fallback": "never"}
        gate, up, down = _linear(DIM, 6, 5), _linear(DIM, 6, 6), _linear(6, DIM, 7, bias=False)
        model = nn.ModuleDict({"col": ColumnParallelLinear.from_full_weight(col, ctx, **f32),
                               "row": RowParallelLinear.from_full_weight(row, ctx, **f32),
                               "mlp": TPMLP.from_full(gate, up, down, ctx, **f32),
                               "moe": TPMoE.from_full(router, (w1, w3, w2), ctx, topk=2, **f32),
                               "ep": EPMoE.from_full(router, (w1, w3, w2), ctx, topk=2, **f32)})
        unmodified = {**{f"col.{k}": v for k, v in col.state_dict().items()},
                      **{f"row.{k}": v for k, v in row.state_dict().items()},
                      **{f"mlp.{name}.{k}": v for name, lin in (("gate", gate), ("up", up), ("down", down))
                         for k, v in lin.state_dict().items()},
                      **{f"{m}.{k}": v for m in ("moe", "ep") for k, v in (("router.weight", router.weight),
                                                                            ("w1", w1), ("w3", w3), ("w2", w2))}}
        unmodified = {k: v.detach().to(ctx.device) for k, v in unmodified.items()}
        check_sharded_checkpoint(model, unmodified)  # (the halves alike, as under DDP: DCP writes each slice once)
        for m in ("moe", "ep"):  # (a router's gradient is each rank's part: the ranks' routers would drift)
            model[m].router.weight.requires_grad_(False)
        for layer in model.values():
            fully_shard(layer, mesh=mesh["dp"])
        check_full_state_dict(model, unmodified)
        check_sharded_checkpoint(model, unmodified)
        x = _seeded(8, 2, DIM, seed=5)[ctx.rank * 4:][:4].to(ctx.device)  # [S/W, B, DIM]
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            h = model["row"](model["col"](x))
            loss = sum(y.float().square().sum() for y in (h, model["mlp"](x), model["moe"](x), model["ep"](x)))
        loss.backward()
        check_resume(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        ctx.check()
        return True


def test_from_full_layers_beside_fsdp(pool):
    if pool.world != 4:
        pytest.skip("a 2 x 2 mesh: W = 4")
    assert all(pool.run(_from_full_beside_fsdp))
