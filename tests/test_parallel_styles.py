"""The parallel styles (triton_overlap.nn.parallel) in torch's parallelize_module: an unmodified Hugging Face Llama,
tensor + sequence parallel and for decode, against the same model unsharded in float64: logits and every gradient,
eager, compiled and under autocast with float32 parameters; OLMo-2 (q/k norms over all heads: ColwiseRMSNorm)
through hf_plan; and the layers' honest constructors and dtype rules."""
import copy

import pytest
import torch
from torch import nn

import triton_overlap as to
from harness import host_case_share
from refs import (check_full_grads, check_full_state_dict, check_grad_clipping, check_resume, check_sharded_checkpoint,
                  rel_err)

TOL_LOGITS, TOL_GRAD = 2e-2, 4e-2  # bf16 kernels against float64 on the same bf16-rounded weights


def _llama(W, dtype, kind="llama"):
    """A small random Llama (``kind`` "olmo2": OLMo-2, its q/k norms over all heads, norms after attention and
    MLP; "glm4": GLM-4, its MLP's gate and up one fused layer whose output it splits in two; "phi3": Phi-3, that
    and its q/k/v one fused layer sliced at offsets from its config) whose heads, KV heads and MLP split over W
    ranks; weights rounded to bf16 and the same on every rank."""
    import transformers

    name = {"olmo2": "Olmo2", "glm4": "Glm4", "phi3": "Phi3"}.get(kind, "Llama")
    Config, Model = getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")
    config = Config(vocab_size=96, hidden_size=16 * 2 * W, intermediate_size=24 * W, num_hidden_layers=2,
                    num_attention_heads=2 * W, num_key_value_heads=W, attn_implementation="sdpa", use_cache=False,
                    **({"pad_token_id": 0} if kind == "glm4" else {}),  # (defaults past this vocabulary)
                    **({"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2} if kind == "phi3" else {}))
    torch.manual_seed(0)
    model = Model(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((p if kind == "llama" else p + torch.randn_like(p) * 0.1).bfloat16().float())  # (norms: not 1)
    return model.to(dtype)


def _plan(ctx, fallback, sequence_parallel=True, shared=False):
    """The model's plan; ``shared``: q/k/v and gate/up as SharedInputColwise groups (one gather each)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from triton_overlap.nn import ColwiseParallel, GatherSequence, RowwiseParallel, ShardSequence, SharedInputColwise

    col = ColwiseParallel(ctx, fallback=fallback, sequence_parallel=sequence_parallel)
    row = RowwiseParallel(ctx, fallback=fallback, sequence_parallel=sequence_parallel)
    plan = {"model.layers.*.self_attn.[qkv]_proj": col, "model.layers.*.self_attn.o_proj": row,
            "model.layers.*.mlp.gate_proj": col, "model.layers.*.mlp.up_proj": col,
            "model.layers.*.mlp.down_proj": row}
    if shared:
        kw = dict(fallback=fallback, sequence_parallel=sequence_parallel)
        del plan["model.layers.*.self_attn.[qkv]_proj"], plan["model.layers.*.mlp.gate_proj"], \
            plan["model.layers.*.mlp.up_proj"]
        plan.update({"model.layers.*.self_attn": SharedInputColwise(ctx, ("q_proj", "k_proj", "v_proj"), **kw),
                     "model.layers.*.mlp": SharedInputColwise(ctx, ("gate_proj", "up_proj"), **kw)})
    if sequence_parallel:
        plan.update({"model.embed_tokens": ShardSequence(ctx), "model.layers.*.input_layernorm": SequenceParallel(),
                     "model.layers.*.post_attention_layernorm": SequenceParallel(),
                     "model.norm": GatherSequence(ctx)})
    return plan


def _grad_errors(model, reference, rank, world=None):
    """Every parameter's gradient against the reference's (a sharded weight against its rows or columns; a fused
    gate/up layer's against this rank's half of the gate's rows and of the up's, a fused q/k/v layer's against its
    rows of each)."""
    from torch.distributed.tensor import DTensor

    from triton_overlap.nn.parallel import shard_rows

    errs, ref = {}, dict(reference.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        full = ref[name.replace("._orig_mod", "")].grad  # (a compiled layer's parameters are under _orig_mod)
        if name.endswith("gate_up_proj.weight"):
            half, n = g.shape[0] // 2, full.shape[0] // 2
            full = torch.cat([full[rank * half:(rank + 1) * half], full[n + rank * half:n + (rank + 1) * half]])
        if name.endswith("qkv_proj.weight"):  # (Phi-3's: query heads' rows, then the key heads', the value heads')
            cfg = reference.config
            d = cfg.hidden_size // cfg.num_attention_heads
            sizes = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d)
            full = full[shard_rows(sizes, world, rank)]
        if g.shape != full.shape:
            dim = 0 if g.shape[0] != full.shape[0] else 1
            full = full.narrow(dim, rank * g.shape[dim], g.shape[dim])
        value = _key_bias_scale(reference, name.replace("._orig_mod", ""))
        errs[name] = rel_err(g, full) if value is None else \
            float((g.double() - full).norm() / value.narrow(0, rank * g.shape[0], g.shape[0]).norm())
    return errs


def _key_bias_scale(reference, name):
    """The value bias's gradient for a key bias (None for any other): softmax is nearly blind to a shift of the
    keys, so the key bias's gradient is about 0 but for rounding, measured against the value bias's instead
    (test_parallel_moe's rule; _grad_errors and refs.check_full_grads' ``scale``)."""
    return reference.get_parameter(name.replace("k_proj", "v_proj")).grad if name.endswith("k_proj.bias") else None


def _llama_case(B, mode, fallback, shared=False, kind="llama"):
    """``mode``: "bf16" (bf16 parameters), "autocast" (float32 parameters under autocast), "compiled" (bf16, the
    model under torch.compile), "compiled_layers" (each decoder layer compiled), "decode" (no sequence
    parallelism: local column layers, GEMM + AllReduce rows), "checkpointed" or "checkpointed_reentrant" (bf16, the
    model's own activation checkpointing on, its layers run again in backward: transformers'
    ``gradient_checkpointing_enable``); ``shared``: _plan's, or "hf": the plan hf_plan makes of the model's own;
    ``kind``: _llama's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import hf_plan, overlap_ops

    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        model = _llama(W, torch.float32 if mode == "autocast" else torch.bfloat16, kind).to(dev)
        reference = copy.deepcopy(model).double()
        plan = hf_plan(model, ctx, fallback=fallback, sequence_parallel=mode != "decode") if shared == "hf" \
            else _plan(ctx, fallback, mode != "decode", shared)
        unmodified = {k: v.clone() for k, v in model.state_dict().items()}
        parallelize_module(model, init_device_mesh(dev.type, (W,)), plan)
        check_full_state_dict(model, unmodified)
        if shared == "hf":  # (the plans of the models' own: every kind of record, sharded or gathered for DCP)
            check_sharded_checkpoint(model, unmodified)
        calls = []  # o_proj's forward calls: a checkpointed layer runs again in backward
        model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda *_: calls.append(1))
        if mode.startswith("checkpointed"):
            model.gradient_checkpointing_enable({"use_reentrant": mode.endswith("reentrant")})
            assert model.is_gradient_checkpointing
        run = torch.compile(model) if mode == "compiled" else model
        if mode == "compiled_layers":  # each decoder layer compiled, as torchtitan does
            for i, layer in enumerate(model.model.layers):
                model.model.layers[i] = torch.compile(layer)
        S = 3 if mode == "decode" else 4 * W
        tokens = torch.randint(0, 96, (B, S), generator=torch.Generator().manual_seed(1)).to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mode == "autocast"):
            logits = run(tokens).logits
        assert logits.shape == (B, S, 96)
        ref_logits = reference(tokens).logits
        logits.float().square().mean().backward()
        ref_logits.square().mean().backward()
        ctx.check()
        if not mode.startswith("compiled"):
            assert len(calls) == (2 if mode.startswith("checkpointed") else 1), (mode, len(calls))
        errs = {"logits": rel_err(logits, ref_logits), **_grad_errors(model, reference, ctx.rank, W)}
        bad = {k: f"{e:.2e}" for k, e in errs.items() if e > (TOL_LOGITS if k == "logits" else TOL_GRAD)}
        assert not bad, f"rank {ctx.rank}: {bad}"
        check_full_grads(model, reference, TOL_GRAD, lambda k: _key_bias_scale(reference, k))  # (name by name)
        check_grad_clipping(model, reference, lambda: _grad_errors(model, reference, ctx.rank, W), TOL_GRAD)
        o_proj = model.model.layers[0].self_attn.o_proj
        path = o_proj.last_path
        assert path == ("fallback" if fallback == "always" else "overlap"), path
        kinds = [type(op).__name__ for op in overlap_ops(model)]  # the ops the model's layers share
        assert kinds == (["GEMMAllReduce"] if mode == "decode" else ["AllGatherGEMM", "GEMMReduceScatter"]) + (
            ["AllReduce"] if kind == "olmo2" else []), kinds  # (OLMo-2's q/k norms sum their squares)
        if kind == "olmo2":
            assert type(model.model.layers[0].self_attn.q_norm.tp_style).__name__ == "ColwiseRMSNorm"
        if kind == "phi3":  # this rank's heads, read through the attention's own config
            attn = model.model.layers[0].self_attn
            assert type(attn.tp_style).__name__ == "FusedQKVParallel" and attn.config.num_attention_heads == 2
            assert attn.num_key_value_heads == 1 and model.config.num_attention_heads == 2 * W
        assert all(op.fallback == fallback for op in overlap_ops(model)) and o_proj.tp_ops[0] in overlap_ops(model)
        if mode == "autocast":  # float32 parameters keep float32 gradients
            assert o_proj.weight.dtype == torch.float32 and o_proj.weight.grad.dtype == torch.float32
        return max(errs.values())


LLAMA_CASES = [(2, "bf16", "never"), (1, "autocast", "never"), (2, "decode", "never"), (1, "bf16", "always"),
               (2, "bf16", "never", True), (1, "autocast", "never", True), (2, "decode", "never", True),
               (2, "bf16", "never", "hf"), (2, "decode", "never", "hf"), (2, "bf16", "never", "hf", "olmo2"),
               (1, "decode", "never", "hf", "olmo2"), (1, "bf16", "never", "hf", "glm4"),
               (2, "bf16", "never", "hf", "phi3"), (1, "decode", "never", "hf", "phi3"),
               (2, "checkpointed", "never", "hf"), (1, "checkpointed_reentrant", "never", "hf")]


@pytest.mark.parametrize("case", range(len(LLAMA_CASES)))
def test_llama_matches_unmodified_model(pool, case):
    pytest.importorskip("transformers")
    host_case_share(pool, case)
    pool.run(_llama_case, *LLAMA_CASES[case])


@pytest.mark.parametrize("what", ["compiled", "compiled_layers"])
def test_llama_compiled_matches_unmodified_model(pool, what):
    """The whole model compiled (the region's edges run eagerly: they are excluded from the graph), and each
    decoder layer compiled."""
    pytest.importorskip("transformers")
    if pool.world > 2:
        pytest.skip("torch.compile of the model at W = 2 only: each rank compiles it, a minute on the host")
    pool.run(_llama_case, 2, what, "never", what == "compiled_layers")  # (each layer: with SharedInputColwise)


def _beside_fsdp():
    """Tensor parallel within each half of a 2 x 2 mesh and FSDP2 (``fully_shard``) across the halves, as torchtitan
    composes them: a Context on each rank's ``mesh["tp"]`` group, hf_plan's plan on ``mesh["tp"]`` (the second
    half's mesh holds global ranks 2 and 3), each data-parallel half its own 2 sequences of the batch; the logits
    against the unmodified model's in float64 and every gradient (FSDP2 averages them over the halves) against the
    gradient of the whole batch's mean."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import hf_plan, param_groups

    from triton_overlap.kernels.cached_launch import triton_interprets

    dev = "cpu" if triton_interprets() else "cuda"  # (the host backend where Triton interprets)
    mesh = init_device_mesh(dev, (2, 2), mesh_dim_names=("dp", "tp"))
    with to.Context(mesh["tp"].get_group(), timeout_s=120) as ctx:
        assert ctx.world_size == 2 and ctx.device.type == dev
        model = _llama(2, torch.bfloat16).to(ctx.device)
        reference = copy.deepcopy(model).double()
        unmodified = {k: v.clone() for k, v in model.state_dict().items()}
        parallelize_module(model, mesh["tp"], hf_plan(model, ctx, fallback="never"))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        check_full_state_dict(model, unmodified)  # (FSDP2's shards of the tensor-parallel shards)
        check_sharded_checkpoint(model, unmodified)
        half = mesh["dp"].get_local_rank()
        tokens = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1)).to(ctx.device)
        logits = model(tokens[2 * half:2 * half + 2]).logits
        logits.float().square().mean().backward()
        ref_logits = reference(tokens).logits
        ref_logits.square().mean().backward()
        ctx.check()
        errs = {"logits": rel_err(logits, ref_logits[2 * half:2 * half + 2]),
                **_grad_errors(model, reference, ctx.rank, 2)}
        bad = {k: f"{e:.2e}" for k, e in errs.items() if e > (TOL_LOGITS if k == "logits" else TOL_GRAD)}
        assert not bad, f"rank {mesh.get_rank()}: {bad}"
        check_full_grads(model, reference, TOL_GRAD, lambda k: _key_bias_scale(reference, k))  # (over dp, then tp)
        # (the norm of FSDP2's shards over each half, then of the tensor-parallel shards over the halves' ranks)
        check_grad_clipping(model, reference, lambda: _grad_errors(model, reference, ctx.rank, 2), TOL_GRAD)
        check_resume(model, torch.optim.AdamW(param_groups(model), lr=1e-3))  # (FSDP2's shards of the TP shards)
        assert model.model.layers[0].self_attn.o_proj.last_path == "overlap"
        return max(errs.values())


def test_tensor_parallel_beside_fsdp(pool):
    pytest.importorskip("transformers")
    if pool.world != 4:
        pytest.skip("a 2 x 2 mesh: W = 4")
    if pool.backend == "cuda-shared":
        pytest.skip("FSDP2's collectives of CUDA tensors over gloo (ranks sharing a GPU) end the ranks with SIGSEGV")
    pool.run(_beside_fsdp)


def _shared_input(B):
    """Three column layers of one module reading one input (widths 4W, 2W, 2W; biases on two), as a
    SharedInputColwise group: outputs, every gradient and the input's against the module unsharded in float64,
    with the layers called in another order and one of them on another input; one AllGather-GEMM a call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import triton_overlap.nn.linear as linear
    from triton_overlap.nn import SharedInputColwise

    with to.Context(timeout_s=60) as ctx:
        W, dev, r = ctx.world_size, ctx.device, ctx.rank
        torch.manual_seed(0)
        mod = nn.Module()
        mod.q, mod.k, mod.v = nn.Linear(24, 8 * W), nn.Linear(24, 4 * W, bias=False), nn.Linear(24, 4 * W)
        with torch.no_grad():
            for p in mod.parameters():
                p.copy_(p.bfloat16().float())
        ref = copy.deepcopy(mod).to(dev).double()
        mod = mod.to(dev, torch.bfloat16)
        parallelize_module(mod, init_device_mesh(dev.type, (W,)),
                           {"": SharedInputColwise(ctx, ("q", "k", "v"), fallback="never")})
        g = torch.Generator().manual_seed(3)
        x_full, x2_full = (torch.randn(B, 5 * W, 24, generator=g).bfloat16().to(dev) for _ in range(2))
        x, x2 = (t[:, r * 5:(r + 1) * 5].clone().requires_grad_() for t in (x_full, x2_full))
        calls, ag_gemm = [], linear.custom_ops.ag_gemm
        linear.custom_ops.ag_gemm = lambda *a: calls.append(1) or ag_gemm(*a)
        try:
            k, q, v, v2 = mod.k(x), mod.q(x), mod.v(x), mod.v(x2)  # k first; v once more on another input
        finally:
            linear.custom_ops.ag_gemm = ag_gemm
        assert len(calls) == 2, calls  # one for q, k, v on x; one for v on x2
        xr, x2r = (t.double().requires_grad_() for t in (x_full, x2_full))
        outs = [(q, ref.q(xr), "q"), (k, ref.k(xr), "k"), (v, ref.v(xr), "v"), (v2, ref.v(x2r), "v2")]
        loss = ref_loss = 0
        for i, (y, yr, name) in enumerate(outs):
            n = y.shape[-1]
            want = yr[..., r * n:(r + 1) * n]
            assert y.shape == want.shape, (name, y.shape, want.shape)
            assert rel_err(y, want) < TOL_LOGITS, (name, rel_err(y, want))
            w = torch.randn(yr.shape, generator=torch.Generator().manual_seed(20 + i), dtype=torch.float64).to(dev)
            loss = loss + (y.double() * w[..., r * n:(r + 1) * n]).sum()
            ref_loss = ref_loss + (yr * w).sum()
        loss.backward()
        ref_loss.backward()
        ctx.check()
        errs = {"x": rel_err(x.grad, xr.grad[:, r * 5:(r + 1) * 5]),
                "x2": rel_err(x2.grad, x2r.grad[:, r * 5:(r + 1) * 5])}
        for name in ("q", "k", "v"):
            m, full = getattr(mod, name), getattr(ref, name)
            rows = m.weight.shape[0]
            errs[name] = rel_err(m.weight.grad, full.weight.grad[r * rows:(r + 1) * rows])
            if m.bias is not None:
                errs[name + ".bias"] = rel_err(m.bias.grad, full.bias.grad[r * rows:(r + 1) * rows])
        bad = {k: f"{e:.2e}" for k, e in errs.items() if e > TOL_GRAD}
        assert not bad, f"rank {r}: {bad}"
        kept = mod.q.tp_group.kept  # v's call on x2 left q's and k's outputs on x2 for their calls
        assert kept[0] is x2 and sorted(kept[2]) == [0, 1], kept
        pending = dict(kept[2])
        assert mod.q(x2) is pending[0] and mod.k(x2) is pending[1]
        assert mod.q.tp_group.kept is None  # nothing left behind once every layer took its output
        # the shards are consecutive rows of one tensor, read in place; a replaced weight is concatenated instead
        q_bytes = mod.q.weight.numel() * mod.q.weight.element_size()
        assert mod.k.weight.data_ptr() == mod.q.weight.data_ptr() + q_bytes
        with torch.no_grad():
            in_place = [mod.q(x), mod.k(x), mod.v(x)]
            mod.k.weight = nn.Parameter(mod.k.weight.detach().clone())
            copied = [mod.q(x), mod.k(x), mod.v(x)]
        assert all(torch.equal(a, b) for a, b in zip(in_place, copied))
        # a kept output is taken only by a call in the state it was computed in
        x3 = x.detach().clone()
        mod.q(x3)
        x3.mul_(2)  # in place between the group's calls: k computes afresh
        assert torch.equal(mod.k(x3), mod.k(x3.clone()))
        with torch.no_grad():
            mod.q(x)
        assert mod.k(x).requires_grad  # grad on now: not the output kept under no_grad
        with pytest.raises(ValueError, match="named twice"):
            SharedInputColwise(ctx, ("q", "q"))
        with pytest.raises(ValueError, match="already has a parallel style"):
            parallelize_module(mod, init_device_mesh(dev.type, (W,)), {"": SharedInputColwise(ctx, ("q",))})
        with pytest.raises(ValueError, match="different widths"):
            other = nn.Module()
            other.a, other.b = nn.Linear(8, 4 * W), nn.Linear(12, 4 * W)
            parallelize_module(other, init_device_mesh(dev.type, (W,)), {"": SharedInputColwise(ctx, ("a", "b"))})
        with pytest.raises(TypeError, match="sequence"):
            SharedInputColwise(ctx, "q")
        # a refused member leaves every layer of the module as it was
        with pytest.raises(ValueError, match="not divisible"):
            other = nn.Module()
            other.a, other.b = nn.Linear(8, 4 * W), nn.Linear(8, 4 * W + 1)
            parallelize_module(other, init_device_mesh(dev.type, (W,)), {"": SharedInputColwise(ctx, ("a", "b"))})
        assert not hasattr(other.a, "tp_style") and other.a.weight.shape == (4 * W, 8)
        with torch.inference_mode():  # inference tensors keep no version: the outputs are kept all the same
            xi = x.detach().clone()
            assert torch.equal(mod.k(xi), k.detach()) and torch.equal(mod.q(xi), q.detach())
        return True


def test_shared_input_joins_separate_storages_by_copy():
    """Weights in separate storages whose rows happen to lie back to back (as an allocator may place them after a
    ``.to()``) are concatenated, never read as one tensor past the first one's storage."""
    import numpy as np

    from triton_overlap.nn.parallel import _joined

    block = np.arange(3 * 4 * 6, dtype=np.float32).reshape(12, 6)
    weights = [nn.Parameter(torch.from_numpy(block[i * 4:(i + 1) * 4])) for i in range(3)]
    assert weights[1].data_ptr() == weights[0].data_ptr() + 4 * 6 * 4  # adjacent rows, three storages
    joined = _joined(weights)
    assert torch.equal(joined, torch.from_numpy(block))
    joined.sum().backward()
    assert all(torch.equal(w.grad, torch.ones(4, 6)) for w in weights)


@pytest.mark.parametrize("B", [1, 2])
def test_shared_input_colwise(pool, B):
    assert all(pool.run(_shared_input, B))


def _float32_without_autocast():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import ColumnParallelLinear, ColwiseParallel, RowwiseParallel

    with to.Context(timeout_s=60) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        torch.manual_seed(0)  # the same full layer on every rank
        full = nn.Linear(8 * W, 8 * W)
        layer = ColumnParallelLinear.from_full_weight(full, ctx)
        assert layer.weight.dtype == torch.float32
        with pytest.raises(TypeError, match="autocast"):
            layer(torch.randn(4, 8 * W, device=dev))
        xs = [torch.randn(4, 8 * W, generator=torch.Generator().manual_seed(10 + p)) for p in range(W)]
        with torch.autocast(dev.type, dtype=torch.bfloat16):  # the same layer runs under autocast
            y = layer(xs[r].to(dev))
        assert y.dtype == torch.bfloat16 and layer.last_path in ("overlap", "fallback")
        # every rank's rows times this rank's columns, as autocast's nn.Linear computes them: bf16 operands
        operands = [t.detach().bfloat16().float() for t in (torch.cat(xs), full.weight[r * 8:(r + 1) * 8],
                                                          full.bias[r * 8:(r + 1) * 8])]
        ref = torch.nn.functional.linear(*operands)
        assert y.shape == ref.shape and rel_err(y, ref) < 1e-2, (y.shape, rel_err(y, ref))
        bf = ColumnParallelLinear.from_full_weight(nn.Linear(8 * W, 8 * W), ctx, dtype=torch.bfloat16)
        with pytest.raises(TypeError, match="input is torch.float32"):
            bf(torch.randn(4, 8 * W, device=dev))
        mesh = init_device_mesh(dev.type, (W,))
        with pytest.raises(TypeError, match="applies to nn.Linear"):
            ColwiseParallel(ctx)._apply(nn.Embedding(4, 4), mesh)
        with pytest.raises(ValueError, match="not divisible"):
            parallelize_module(nn.Linear(4, 4 * W + 1), mesh, ColwiseParallel(ctx))
        with pytest.raises(ValueError, match="fallback"):
            RowwiseParallel(ctx, fallback="sometimes")
        with pytest.raises(ValueError, match="the device mesh is 2-D; these styles take a 1-D mesh"):
            parallelize_module(nn.Linear(4, 4 * W), init_device_mesh(dev.type, (1, W)), ColwiseParallel(ctx))
        from torch.distributed.device_mesh import DeviceMesh

        with pytest.raises(ValueError, match=r"ranks \[.*\] are not the Context's group's \[0, 1"):
            parallelize_module(nn.Linear(4, 4 * W), DeviceMesh(dev.type, list(range(W))[::-1]), ColwiseParallel(ctx))
        from triton_overlap.nn import ColwiseRMSNorm, GatherSequence, ShardSequence

        for style in (ShardSequence, GatherSequence):
            with pytest.raises(ValueError, match="sequence_dim must be 0 .* or 1 .*, got 2"):
                style(ctx, sequence_dim=2)
        norm = nn.RMSNorm(4 * W, eps=1e-6)
        parallelize_module(norm, mesh, ColwiseRMSNorm(ctx))
        assert tuple(norm.weight.shape) == (4,)
        with pytest.raises(ValueError, match="parallelized already"):
            parallelize_module(norm, mesh, ColwiseRMSNorm(ctx))
        with pytest.raises(TypeError, match=r"LayerNorm does not compute x \* rsqrt"):  # (centred: not an RMSNorm)
            parallelize_module(nn.LayerNorm(4 * W, bias=False), mesh, ColwiseRMSNorm(ctx))
        with pytest.raises(ValueError, match="width 7 is not divisible"):
            parallelize_module(nn.RMSNorm(7, eps=1e-6), mesh, ColwiseRMSNorm(ctx))
        from triton_overlap.nn import GatedDeltaNetParallel

        with pytest.raises(TypeError, match="Linear is not a gated delta-rule layer"):
            parallelize_module(nn.Linear(4, 4), mesh, GatedDeltaNetParallel(ctx))
        ctx.check()
        return True


def test_float32_needs_autocast_and_styles_check_their_input(pool):
    if pool.world > 2:
        pytest.skip("rules of one rank; W = 2 shows them")
    assert all(pool.run(_float32_without_autocast))


def _state_dict_refusals():
    """load_full_state_dict refuses, before it copies anything, a state dict with a tensor missing, one of another
    shape or one the model has no place for; ``strict=False`` skips those and loads the rest. load_sharded_state_dict
    refuses a full state dict and one with a tensor missing, before it copies anything."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import full_state_dict, hf_plan, load_full_state_dict, load_sharded_state_dict

    with to.Context(timeout_s=120) as ctx:
        W = ctx.world_size
        model = _llama(W, torch.bfloat16).to(ctx.device)
        parallelize_module(model, init_device_mesh(ctx.device.type, (W,)), hf_plan(model, ctx, fallback="never"))
        full = full_state_dict(model)
        q = "model.layers.0.self_attn.q_proj.weight"
        changed = {k: v + 1 if v.is_floating_point() else v for k, v in full.items()}
        cases = {"missing": ({k: v for k, v in changed.items() if k != q}, KeyError, "has no 'model.layers.0"),
                 "shape": ({**changed, q: changed[q][:-1]}, ValueError, "the unmodified model's is"),
                 "extra": ({**changed, "model.extra.weight": changed[q]}, KeyError, "no place for")}
        for name, (state, error, words) in cases.items():
            with pytest.raises(error, match=words):
                load_full_state_dict(model, state)
            now = full_state_dict(model)
            assert all(torch.equal(now[k], full[k]) for k in full), f"{name}: a tensor changed before the error"
        with pytest.raises(ValueError, match="a plain tensor where"):  # (a full state dict given for DCP's)
            load_sharded_state_dict(model, changed)
        with pytest.raises(KeyError, match="has no 'model.layers.0"):
            load_sharded_state_dict(model, cases["missing"][0])
        assert all(torch.equal(v, full[k]) for k, v in full_state_dict(model).items())
        load_full_state_dict(model, cases["missing"][0], strict=False)  # everything but q_proj's weight
        now = full_state_dict(model)
        assert torch.equal(now[q], full[q]) and all(torch.equal(now[k], changed[k]) for k in full if k != q)
        return True


def test_load_full_state_dict_refuses_what_does_not_fit(pool):
    pytest.importorskip("transformers")
    if pool.world == 4:
        pytest.skip("W = 2, 3 (the checks are the host's, whatever W)")
    assert all(pool.run(_state_dict_refusals))


def _multi_tensor_optimizers():
    """AdamW's foreach and fused steps over ``nn.param_groups`` of a styled Llama (float32 parameters under autocast;
    its shards plain tensors, its norms replicated DTensors: one list of both makes torch's multi-tensor kernels
    raise) against AdamW's loop over ``model.parameters()`` on an equal copy: two steps of each on the same
    tokens, the weights compared after each (gathered by full_state_dict). Returns the worst relative difference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import full_state_dict, param_groups

    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        base = _llama(W, torch.float32).to(dev)  # (float32 parameters under autocast: the steps' roundings agree)
        tokens = torch.randint(0, 96, (2, 4 * W), generator=torch.Generator().manual_seed(1)).to(dev)
        worst = 0.0
        for kind in ("foreach", "fused"):
            models = [copy.deepcopy(base) for _ in range(2)]
            for m in models:
                parallelize_module(m, init_device_mesh(dev.type, (W,)), _plan(ctx, "never", shared=True))
            groups = param_groups(models[0], weight_decay=0.1)
            assert [all(isinstance(p, DTensor) for p in g["params"]) for g in groups] == [False, True]
            assert all(g["weight_decay"] == 0.1 for g in groups)
            opts = [torch.optim.AdamW(groups, lr=1e-2, **{kind: True}),
                    torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.1, foreach=False)]
            for _ in range(2):
                for m, opt in zip(models, opts):
                    opt.zero_grad()
                    with torch.autocast(dev.type, dtype=torch.bfloat16):
                        loss = m(tokens).logits.float().square().mean()
                    loss.backward()
                    opt.step()
                got, want = full_state_dict(models[0]), full_state_dict(models[1])
                errs = {k: rel_err(got[k], want[k]) for k in want}
                # (the multi-tensor kernels round in another order than the loop: 1.4e-5 on one H100 after 3 steps)
                assert max(errs.values()) < 1e-4, (kind, max(errs.items(), key=lambda kv: kv[1]))
                worst = max(worst, *errs.values())
        ctx.check()
        return worst


def _grad_scaler():
    """float16 training with ``nn.GradScaler`` on a styled Llama (float32 parameters under float16 autocast, SGD's
    foreach step over ``nn.param_groups``): after ``unscale_`` every gradient against the unmodified model's in
    float64 (its loss unscaled); the step taken, the scale kept; then an inf in one shard's gradient on the last rank
    only: every rank skips the step (the weights unchanged bit for bit) and halves its scale. torch's GradScaler
    raises on the same model. Returns the worst gradient error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from triton_overlap.nn import GradScaler, full_state_dict, hf_plan, param_groups

    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        model = _llama(W, torch.float32).to(dev)
        reference = copy.deepcopy(model).double()
        parallelize_module(model, init_device_mesh(dev.type, (W,)), hf_plan(model, ctx, fallback="never"))
        tokens = torch.randint(0, 96, (2, 4 * W), generator=torch.Generator().manual_seed(1)).to(dev)
        opt = torch.optim.SGD(param_groups(model), lr=0.1, foreach=True)
        scaler = GradScaler(dev.type, init_scale=2.0 ** 10)

        def backward(scaler):
            opt.zero_grad()
            with torch.autocast(dev.type, dtype=torch.float16):
                logits = model(tokens).logits
            scaler.scale(logits.float().square().mean()).backward()

        backward(scaler)
        reference(tokens).logits.square().mean().backward()
        scaler.unscale_(opt)
        errs = _grad_errors(model, reference, ctx.rank, W)
        bad = {k: f"{e:.2e}" for k, e in errs.items() if e > TOL_GRAD}
        assert not bad, f"rank {ctx.rank}, after unscale_: {bad}"
        before = full_state_dict(model)
        scaler.step(opt)
        scaler.update()
        stepped = full_state_dict(model)
        assert scaler.get_scale() == 2.0 ** 10 and any(not torch.equal(stepped[k], before[k]) for k in before)
        backward(scaler)
        if ctx.rank == W - 1:  # an overflow in this rank's shard alone
            model.model.layers[0].self_attn.o_proj.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        now = full_state_dict(model)
        changed = [k for k in stepped if not torch.equal(now[k], stepped[k])]
        assert not changed and scaler.get_scale() == 2.0 ** 9, (ctx.rank, changed[:3], scaler.get_scale())
        backward(torch_scaler := torch.amp.GradScaler(dev.type, init_scale=2.0 ** 10))
        with pytest.raises(RuntimeError, match="DTensor"):
            torch_scaler.unscale_(opt)
        ctx.check()
        return max(errs.values())


def test_grad_scaler_steps_or_skips_on_every_rank(pool):
    pytest.importorskip("transformers")
    if pool.world == 4:
        pytest.skip("W = 2, 3")
    pool.run(_grad_scaler)


def _training_checkpoint():
    """A training run's DCP checkpoint, weights and optimizer state, and the run resumed from it: a styled Llama
    (float32 parameters under autocast; its shards saved as DTensor shards, Phi-3's fused q/k/v gathered) with AdamW
    and with Adafactor (its factored second moments of other shapes than the weights': stacked per rank), and a
    TPMLP (``from_full``: every rank's shards as rows) with AdamW, each take two steps, are saved
    (``sharded_state_dict``, ``sharded_optimizer_state_dict``) and take a third; a fresh copy with other weights and
    a fresh optimizer loads the checkpoint and takes the third step: the same weights as the first, within 1e-6."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from refs import shared_directory
    from triton_overlap.nn import (TPMLP, full_state_dict, hf_plan, load_sharded_optimizer_state_dict,
                                   load_sharded_state_dict, param_groups, sharded_optimizer_state_dict,
                                   sharded_state_dict)

    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        tokens = torch.randint(0, 96, (2, 4 * W), generator=torch.Generator().manual_seed(1)).to(dev)
        x = torch.randn(4 * W, 2, 32, generator=torch.Generator().manual_seed(2))[ctx.rank * 4:][:4].to(dev)

        def llama(seed):
            model = _llama(W, torch.float32, "phi3").to(dev)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).to(dev) * 0.01)
            parallelize_module(model, init_device_mesh(dev.type, (W,)), hf_plan(model, ctx, fallback="never"))
            return model, lambda: model(tokens).logits.float().square().mean()

        def mlp(seed):
            torch.manual_seed(seed)
            linears = [nn.Linear(32, 16 * W, bias=False), nn.Linear(32, 16 * W, bias=False),
                       nn.Linear(16 * W, 32, bias=False)]
            model = TPMLP.from_full(*linears, ctx, dtype=torch.float32, fallback="never")
            return model, lambda: model(x).float().square().mean()

        worst = 0.0
        with shared_directory() as where:
            for i, (make, optimizer) in enumerate(((llama, torch.optim.AdamW), (mlp, torch.optim.AdamW),
                                                   (llama, torch.optim.Adafactor), (mlp, torch.optim.Adafactor))):
                runs = []
                for seed in (3, 4):
                    model, loss = make(seed)
                    opt = optimizer(param_groups(model), lr=1e-2, weight_decay=0.1)
                    runs.append((model, loss, opt))

                def step(model, loss, opt):
                    opt.zero_grad()
                    with torch.autocast(dev.type, dtype=torch.bfloat16):
                        loss().backward()
                    opt.step()

                model, loss, opt = runs[0]
                for _ in range(2):
                    step(model, loss, opt)
                path = f"{where}/{i}"
                dcp.save({"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, opt)},
                         checkpoint_id=path)
                step(model, loss, opt)
                want = full_state_dict(model) if make is llama else model.state_dict()
                fresh, fresh_loss, fresh_opt = runs[1]
                with torch.autocast(dev.type, dtype=torch.bfloat16):  # (gradients present before the load: torch's
                    fresh_loss().backward()  # get_optimizer_state_dict would leave the fresh state empty)
                state = {"model": sharded_state_dict(fresh), "optim": sharded_optimizer_state_dict(fresh, fresh_opt)}
                dcp.load(state, checkpoint_id=path)
                load_sharded_state_dict(fresh, state["model"])
                load_sharded_optimizer_state_dict(fresh, fresh_opt, state["optim"])
                step(fresh, fresh_loss, fresh_opt)
                got = full_state_dict(fresh) if make is llama else fresh.state_dict()
                errs = {k: rel_err(got[k], want[k]) for k in want}
                assert max(errs.values()) <= 1e-6, (make.__name__, optimizer.__name__,
                                                    max(errs.items(), key=lambda kv: kv[1]))
                worst = max(worst, *errs.values())
        ctx.check()
        return worst


def test_training_resumes_from_a_dcp_checkpoint(pool):
    pytest.importorskip("transformers")
    if pool.world == 4:
        pytest.skip("W = 2, 3")
    pool.run(_training_checkpoint)


def test_multi_tensor_optimizers_take_param_groups(pool):
    pytest.importorskip("transformers")
    if pool.world != 2:
        pytest.skip("W = 2 (the groups are the same at any W)")
    pool.run(_multi_tensor_optimizers)


def test_from_full_rejects_unknown_keywords():
    """A misspelt keyword raises instead of leaving the layer on its default (checked before any Context use)."""
    from triton_overlap.nn import ColumnParallelLinear, RowParallelLinear, TPMLP

    lin = nn.Linear(8, 8)
    with pytest.raises(TypeError, match="fallbak"):
        ColumnParallelLinear.from_full_weight(lin, None, fallbak="never")
    with pytest.raises(TypeError, match="keep_gathered_input"):  # a column layer's keyword on a row layer
        RowParallelLinear.from_full_weight(lin, None, keep_gathered_input=False)
    with pytest.raises(TypeError, match="fallbak"):
        TPMLP.from_full(lin, lin, lin, None, fallbak="never")


def _decode_in_cuda_graph(steps):
    """A decode block (column layer, SiLU, row layer through GEMM + AllReduce; no sequence parallelism) styled by
    parallelize_module, captured once in a CUDA graph and replayed on new tokens: each replay's output against the
    unsharded block in float32, the output poisoned before every replay."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from refs import check_decode_replays
    from triton_overlap.nn import ColwiseParallel, RowwiseParallel

    with to.Context(timeout_s=30) as ctx:
        W, dev = ctx.world_size, ctx.device
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(256, 512 * W, bias=False), nn.SiLU(), nn.Linear(512 * W, 256, bias=False))
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(p.bfloat16().float())
        reference = copy.deepcopy(block).to(dev)
        block = block.to(dev, torch.bfloat16)
        parallelize_module(block, init_device_mesh(dev.type, (W,)), {
            "0": ColwiseParallel(ctx, sequence_parallel=False, fallback="never"),
            "2": RowwiseParallel(ctx, sequence_parallel=False, fallback="never")})
        x = torch.empty(4, 1, 256, device=dev, dtype=torch.bfloat16)  # batch 4, one token each
        check_decode_replays(block, reference, x, steps)
        ctx.check()
        assert block[2].last_path == "overlap"
        return True


def test_decode_styles_replay_in_cuda_graph(pool):
    if pool.backend == "host":
        pytest.skip("CUDA graphs need a GPU")
    assert all(pool.run(_decode_in_cuda_graph, 50))


def test_hf_plan_from_the_models_own():
    """hf_plan by concrete module name: the Llama plan of _plan (shared inputs, sequence parallel), a ColwiseParallel
    a layer without shared inputs, no edges for decode, Qwen3-MoE's sparse and dense layers side by side,
    DeepSeek-V3's latent attention; and what it refuses, before any change to the model (the styles only keep the
    Context, so none is needed here)."""
    transformers = pytest.importorskip("transformers")
    from torch.distributed.tensor.parallel import SequenceParallel
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, \
        Qwen3MoeForCausalLM

    from triton_overlap.nn import (ColwiseParallel, GatherSequence, MoEParallel, ReplicatedLatent, RowwiseParallel,
                                   ShardSequence, SharedInputColwise, hf_plan)
    from refs import with_latent_attention_plan
    from triton_overlap.nn.plans import MLA_STRATEGY, expert_keys

    small = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2)
    llama = LlamaForCausalLM(LlamaConfig(**small))
    kinds = lambda plan: {k: type(v).__name__ for k, v in plan.items()}  # noqa: E731
    want = {"model.embed_tokens": "ShardSequence", "model.norm": "GatherSequence"}
    for i in range(2):
        p = f"model.layers.{i}"
        want.update({f"{p}.self_attn": "SharedInputColwise", f"{p}.self_attn.o_proj": "RowwiseParallel",
                     f"{p}.mlp": "SharedInputColwise", f"{p}.mlp.down_proj": "RowwiseParallel",
                     f"{p}.input_layernorm": "SequenceParallel", f"{p}.post_attention_layernorm": "SequenceParallel"})
    plan = hf_plan(llama, None, fallback="never")
    assert kinds(plan) == want
    assert plan["model.layers.1.self_attn"].layers == ("q_proj", "k_proj", "v_proj")
    assert plan["model.layers.0.mlp"].layers == ("gate_proj", "up_proj")
    assert plan["model.layers.0.mlp"].colwise.fallback == "never"
    separate = kinds(hf_plan(llama, None, shared_inputs=False))
    assert separate["model.layers.0.self_attn.k_proj"] == "ColwiseParallel" and "model.layers.0.mlp" not in separate
    decode = hf_plan(llama, None, sequence_parallel=False)
    assert set(kinds(decode).values()) == {"SharedInputColwise", "RowwiseParallel"}
    assert not decode["model.layers.0.mlp.down_proj"].sequence_parallel
    assert kinds(hf_plan(llama.model, None)) == {k[len("model."):]: v for k, v in want.items()}  # the base model

    qwen = Qwen3MoeForCausalLM(Qwen3MoeConfig(**small, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=8, mlp_only_layers=[1]))
    plan = hf_plan(qwen, None)
    assert isinstance(plan["model.layers.0.mlp"], MoEParallel) and "model.layers.0.mlp.experts" not in plan
    assert not plan["model.layers.0.mlp"].expert_parallel
    assert hf_plan(qwen, None, expert_parallel=True)["model.layers.0.mlp"].expert_parallel
    with torch.device("meta"):  # a plan of a model too large to load: its router matched on a CPU probe
        meta = transformers.MixtralForCausalLM(transformers.MixtralConfig(**small, num_local_experts=4))
    assert isinstance(hf_plan(meta, None)["model.layers.1.mlp"], MoEParallel)
    assert isinstance(plan["model.layers.1.mlp"], SharedInputColwise)  # the dense layer
    norm = plan["model.layers.0.self_attn.q_norm"]  # per-head norms: SequenceParallel on the heads' dim
    assert isinstance(norm, SequenceParallel) and norm.sequence_sharding[0].dim == 2
    assert isinstance(plan["model.embed_tokens"], ShardSequence) and isinstance(plan["model.norm"], GatherSequence)
    assert all(isinstance(v, (ColwiseParallel, RowwiseParallel, SharedInputColwise, MoEParallel, SequenceParallel,
                              ShardSequence, GatherSequence)) for v in plan.values())

    if hasattr(transformers, "Glm4MoeConfig") and expert_keys(transformers.Glm4MoeConfig()):
        moe = dict(num_experts_per_tok=2, moe_intermediate_size=8, n_routed_experts=4, first_k_dense_replace=1)
        glm = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**small, **moe, head_dim=8, use_qk_norm=True))
        plan = hf_plan(glm, None)  # per-head q/k norms its plan leaves out, the DeepSeek-V3 router, shared experts
        assert isinstance(plan["model.layers.1.mlp"], MoEParallel) and not any("1.mlp." in k for k in plan)
        assert isinstance(plan["model.layers.0.mlp"], SharedInputColwise)  # the dense first layer
        norm = plan["model.layers.1.self_attn.k_norm"]
        assert isinstance(norm, SequenceParallel) and norm.sequence_sharding[0].dim == 2
        deepseek = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**small, **moe, n_group=2,
                                                                                    topk_group=1))
        if MLA_STRATEGY not in deepseek.config.base_model_tp_plan.values():  # before transformers 5.25, whose plan
            with pytest.raises(ValueError, match=r"self_attn\.(kv_a_proj_with_mqa|q_a_proj)"):  # marks it: refused
                hf_plan(deepseek, None)  # (its latent projections read this rank's tokens, in no style)
            with_latent_attention_plan(deepseek.config)
        plan, attn = hf_plan(deepseek, None), "model.layers.1.self_attn."  # latent attention
        kv, q = plan[attn + "kv_a_proj_with_mqa"], plan[attn + "q_a_proj"]
        assert isinstance(kv, ReplicatedLatent) and kv.partial_tail == deepseek.config.qk_rope_head_dim
        assert isinstance(q, ReplicatedLatent) and q.partial_tail == 0 and q.sequence_parallel
        assert not plan[attn + "q_b_proj"].sequence_parallel and not plan[attn + "kv_b_proj"].sequence_parallel
        assert attn + "kv_a_layernorm" not in plan  # it runs unstyled on the gathered latent
        deepseek.config.base_model_tp_plan = {**deepseek.config.base_model_tp_plan,
                                              "layers.*.self_attn.kv_b_proj": "rowwise"}
        with pytest.raises(ValueError, match=r"kv_b_proj reads the latent .* not 'colwise'"):
            hf_plan(deepseek, None)
    with pytest.raises(ValueError, match="base_model_tp_plan"):
        hf_plan(nn.Linear(4, 4), None)
    decode = hf_plan(qwen, None, sequence_parallel=False, expert_parallel=True)["model.layers.0.mlp"]
    assert not decode.sequence_parallel and decode.expert_parallel
    qwen2 = Qwen2MoeForCausalLM(Qwen2MoeConfig(**small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                               shared_expert_intermediate_size=16))
    # transformers 5.17 ships Qwen2-MoE's plans without its experts (5.24 has them): the router's weight is left out
    if expert_keys(qwen2.config):
        plan = hf_plan(qwen2, None)  # the block with its shared expert and the expert's gate: MoEParallel
        assert isinstance(plan["model.layers.0.mlp"], MoEParallel) and not any(".mlp." in k for k in plan)
    else:
        with pytest.raises(ValueError, match=r"mlp.gate .*leaves out"):
            hf_plan(qwen2, None)
    from transformers import ApertusConfig, ApertusForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

    with pytest.raises(ValueError, match=r"mlp.act_fn \(XIELUActivation\) has parameters \['alpha_p', 'alpha_n'\]"):
        hf_plan(ApertusForCausalLM(ApertusConfig(**small)), None)  # learned scalars on this rank's columns
    neox = small | {"num_key_value_heads": None}  # pp plan: embedding, dropout, layers, final norm
    plan = kinds(hf_plan(GPTNeoXForCausalLM(GPTNeoXConfig(**{k: v for k, v in neox.items() if v})), None))
    assert plan["gpt_neox.embed_in"] == "ShardSequence" and plan["gpt_neox.final_layer_norm"] == "GatherSequence"
    assert plan["gpt_neox.layers.1.attention.query_key_value"] == "ColwiseParallel"
    only_embedding = {"embed_tokens": "embedding_rowwise"}  # (GPT-OSS's plan)
    for tp, why in ((only_embedding, "names no column or row"),
                    ({**llama.config.base_model_tp_plan, "layers.*.self_attn.q_proj": "colwise_gather_output"},
                     "q_proj is 'colwise_gather_output'")):
        llama.config.base_model_tp_plan = tp
        with pytest.raises(ValueError, match=why):
            hf_plan(llama, None)
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"q_proj is 'colwise'.* output width 16 is not divisible by the world size 3"):
        hf_plan(LlamaForCausalLM(LlamaConfig(**small)), SimpleNamespace(world_size=3))
    mqa = small | {"num_key_value_heads": 1, "head_dim": 8}  # k/v 8 wide: divisible by 2, but one head
    with pytest.raises(ValueError, match=r"k_proj is 'colwise'.* its 1 heads \(of 8\) are not divisible by the world"):
        hf_plan(LlamaForCausalLM(LlamaConfig(**mqa)), SimpleNamespace(world_size=2))
    odd = LlamaForCausalLM(LlamaConfig(**small))  # column layers of one module reading inputs of two widths
    odd.model.layers[0].mlp.up_proj = nn.Linear(8, 16, bias=False)
    plan = kinds(hf_plan(odd, None))
    assert plan["model.layers.0.mlp.up_proj"] == plan["model.layers.0.mlp.gate_proj"] == "ColwiseParallel"
    assert plan["model.layers.1.mlp"] == "SharedInputColwise" and "model.layers.0.mlp" not in plan
    scaled = LlamaForCausalLM(LlamaConfig(**small))  # a learned scalar on the MLP, which reads this rank's columns
    scaled.model.layers[1].mlp.alpha = nn.Parameter(torch.ones(()))
    for sp in (True, False):  # (decode too: the MLP holds sharded layers)
        with pytest.raises(ValueError, match=r"layers.1.mlp \(LlamaMLP\) has parameters \['alpha'\]"):
            hf_plan(scaled, None, sequence_parallel=sp)
    scaled.config.base_model_tp_plan = {**LlamaConfig.base_model_tp_plan, "layers.*.mlp.alpha": "local"}
    with pytest.raises(ValueError, match="layers.1.mlp.alpha is 'local'"):  # a plan entry naming a parameter
        hf_plan(scaled, None)
    llama.config.base_model_tp_plan = {**LlamaConfig.base_model_tp_plan, "layers.*.mlp.down_proj": "local_rowwise"}
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj is 'local_rowwise'"):
        hf_plan(llama, None)
    try:  # Qwen3.5's linear attention: its heads split over the ranks, or refused, naming the layer
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    except ImportError:
        Qwen3_5ForCausalLM = None
    if Qwen3_5ForCausalLM is not None:
        qwen35 = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**small, layer_types=["linear_attention", "full_attention"],
                                                       linear_num_key_heads=2, linear_num_value_heads=4,
                                                       linear_key_head_dim=8, linear_value_head_dim=8))
        assert kinds(hf_plan(qwen35, None))["model.layers.0.linear_attn"] == "GatedDeltaNetParallel"
        with pytest.raises(ValueError, match=r"layers.0.linear_attn: .*2 key heads and 4 value heads must be "
                                             r"divisible by the world size 3"):
            hf_plan(qwen35, SimpleNamespace(world_size=3))
    from transformers import Olmo2Config, Olmo2ForCausalLM, OlmoeConfig, OlmoeForCausalLM

    olmo = Olmo2ForCausalLM(Olmo2Config(**small))  # q/k norms over all heads: ColwiseRMSNorm
    assert kinds(hf_plan(olmo, None))["model.layers.0.self_attn.q_norm"] == "ColwiseRMSNorm"
    olmo.model.layers[0].self_attn.k_norm = nn.RMSNorm(4, eps=1e-6)  # neither the whole width nor one head's
    with pytest.raises(ValueError, match=r"layers.0.self_attn.k_norm reads .*k_proj's output \(16 wide\) but its "
                                         r"weight has 4 elements"):
        hf_plan(olmo, None)
    olmo.model.layers[0].self_attn.k_norm = nn.RMSNorm(16, eps=1e-6, elementwise_affine=False)
    with pytest.raises(ValueError, match="k_norm reads .* and has no weight"):
        hf_plan(olmo, None)
    olmoe = OlmoeForCausalLM(OlmoeConfig(**small, num_experts=4, num_experts_per_tok=2, clip_qkv=8.0))
    plan = kinds(hf_plan(olmoe, None))  # q/k/v clamped in place: no shared views; edges found by their names
    assert plan["model.layers.0.self_attn.q_proj"] == "ColwiseParallel" and "model.layers.0.self_attn" not in plan
    assert plan["model.embed_tokens"] == "ShardSequence" and plan["model.norm"] == "GatherSequence"
    from transformers import Glm4Config, Glm4ForCausalLM

    glm = Glm4ForCausalLM(Glm4Config(**small, pad_token_id=0))  # gate/up fused, its output split in two
    plan = hf_plan(glm, None)
    assert plan["model.layers.0.mlp.gate_up_proj"].chunks == 2
    assert kinds(plan)["model.layers.0.mlp.down_proj"] == "RowwiseParallel"
    mlp = glm.model.layers[1].mlp  # an MLP whose hidden columns depend on each other (normalized): refused

    def normed(m, x):
        gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
        h = up * m.activation_fn(gate)
        return m.down_proj(h / h.norm(dim=-1, keepdim=True))

    mlp.__class__ = type("NormedMLP", (type(mlp),), {"forward": normed})
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj is 'colwise_gather_output'"):
        hf_plan(glm, None)
    from transformers import Phi3Config, Phi3ForCausalLM

    from triton_overlap.nn.parallel_attention import LocalHeadsConfig

    phi = Phi3ForCausalLM(Phi3Config(**small, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    plan = kinds(hf_plan(phi, None))  # q/k/v fused and sliced at offsets from the config; gate/up fused
    assert plan["model.layers.0.self_attn"] == "FusedQKVParallel" and "model.layers.0.self_attn.qkv_proj" not in plan
    assert plan["model.layers.0.mlp.gate_up_proj"] == "ColwiseParallel"
    with pytest.raises(ValueError, match=r"layers.0.self_attn: .*2 query and 2 key/value heads are not divisible by "
                                         r"the world size 3"):
        hf_plan(phi, SimpleNamespace(world_size=3))
    phi.model.layers[1].self_attn.scale = nn.Parameter(torch.ones(2))  # a parameter the style would not split
    with pytest.raises(TypeError, match=r"layers.1.self_attn: .*parameters of its own \['scale'\]"):
        hf_plan(phi, None)
    view = LocalHeadsConfig(phi.config, 1, 1)  # this rank's head counts, the rest read from the model's config
    assert view.num_attention_heads == 1 and view.hidden_size == 16 and copy.deepcopy(view).num_key_value_heads == 1
    two = SimpleNamespace(world_size=2)  # a Context of two ranks and a 1-D mesh over them, for the style's checks
    mesh = SimpleNamespace(mesh=torch.arange(2), ndim=1)
    for sizes in ((8, 4), (9, 7)):
        with pytest.raises(ValueError, match=rf"chunks \({sizes[0]}, {sizes[1]}\) must sum to out_features = 16, "
                                             r"each divisible by the world size 2"):
            ColwiseParallel(two, chunks=sizes)._check(nn.Linear(4, 16), mesh)
    ColwiseParallel(two, chunks=(8, 4, 4))._check(nn.Linear(4, 16), mesh)
    with pytest.raises(ValueError, match="positive int or a tuple"):
        ColwiseParallel(None, chunks=(8, 0))
    llama.model.layers[1].mlp.tp_style = object()  # (what a style leaves on a module it applied to)
    with pytest.raises(ValueError, match=r"parallelized already \(model.layers.1.mlp has a parallel style\)"):
        hf_plan(llama, None)
    del llama.model.layers[1].mlp.tp_style
    assert isinstance(llama.model.layers[0].mlp.down_proj, nn.Linear) and not hasattr(llama.model.layers[0].mlp,
                                                                                       "tp_style")
