"""The model benchmark compares equal work: benchmarks/llama.py's decoder stack, parallelized by torch's
tensor + sequence parallel plan and by this project's, gives the single-process model's output and every
gradient (training), and the same decode step under every decode plan."""
import os
import sys

import pytest
import torch

import triton_overlap as to
from refs import rel_err

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import llama  # noqa: E402

B, N_LAYERS = 2, 2
#: torch's plan in float32 differs from the single process only in the order of its sums; ours run in bf16 (the
#: kernels take 16-bit operands) against the float32 model on the same bf16-rounded weights: one bf16 rounding per
#: op, through two layers (observed ~4e-3 on outputs, ~1e-2 on gradients)
TOL_FLOAT32 = 1e-4
TOL_OUT, TOL_GRAD = 2e-2, 4e-2


def _full(p, ref, W):
    """The whole of parameter (or gradient) ``p`` as the unsharded model holds it: a DTensor's full tensor, a
    replicated tensor as it is, a plain shard gathered along the dimension it is split on."""
    if hasattr(p, "full_tensor"):
        return p.full_tensor()
    if p.shape == ref.shape:
        return p
    d = next(i for i, (a, b) in enumerate(zip(p.shape, ref.shape)) if a * W == b)
    parts = [torch.empty_like(p) for _ in range(W)]
    torch.distributed.all_gather(parts, p.contiguous())
    return torch.cat(parts, dim=d)


def _paths(model) -> set:
    """The paths the model's overlapped layers took ("overlap", "fallback", "local"), as they report them."""
    return {m.last_path for m in model.modules() if getattr(m, "last_path", None) is not None}


#: the paths each plan must take: fallback="never" runs the overlapped kernels, "always" never does
PATHS = {"torch": set(), "torch_fused": set(), "ours": {"overlap"}, "ours_unshared": {"overlap"},
         "ours_fused": {"overlap"}, "ours_fallback": {"fallback"},
         "ours_norm": set()}  # (ours_norm: the row layers' products go to the norm op)


def _fused_grads(ref, W) -> dict:
    """The unsharded model's gradients, with those of the fused projections (llama.fuse_projections) laid out as
    the fused model for W ranks holds them."""
    grads = {name: p.grad for name, p in ref.named_parameters()}
    for i, layer in enumerate(ref.layers):
        att, ff = layer.attention, layer.feed_forward
        grads[f"layers.{i}.attention.wqkv.weight"] = llama._interleave([att.wq.weight.grad, att.wk.weight.grad,
                                                                         att.wv.weight.grad], W)
        grads[f"layers.{i}.feed_forward.w13.weight"] = llama._interleave([ff.w1.weight.grad, ff.w3.weight.grad], W)
    return grads


def _reference(S, dev):
    """The unsharded float32 model (weights rounded to bf16, so that the bf16 copies hold the same values), its
    output and gradients for one step on tokens and an output gradient every rank draws alike."""
    ref = llama.build("tiny", N_LAYERS, dtype=torch.bfloat16, device=dev, max_seq=S).float()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, ref.shape.vocab, (B, S), generator=g).to(dev)
    gy = torch.randn(B, S, ref.shape.dim, generator=g).to(dev)
    out = ref(tokens)
    (out * gy).sum().backward()
    return ref, tokens, gy, out.detach()


def _training(plan_name):
    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        S = 16 * W
        ref, tokens, gy, out_ref = _reference(S, dev)
        dtype = torch.float32 if plan_name.startswith("torch") else torch.bfloat16
        fuse_for = W if plan_name.endswith("fused") else 0
        model = llama.build("tiny", N_LAYERS, dtype=torch.bfloat16, device=dev, max_seq=S, fuse_for=fuse_for)
        model.to(dtype)
        plan = {"torch": llama.tp_plan_torch, "torch_fused": llama.tp_plan_torch,
                "ours": lambda: llama.tp_plan_ours(ctx, fallback="never"),
                "ours_unshared": lambda: llama.tp_plan_ours(ctx, fallback="never", shared=False),
                "ours_fused": lambda: llama.tp_plan_ours(ctx, fallback="never", fused=True),
                "ours_fallback": lambda: llama.tp_plan_ours(ctx, fallback="always")}[plan_name]()
        llama.parallelize(model, llama.mesh_of(ctx), plan)
        out = model(tokens)
        assert not hasattr(out, "full_tensor") and out.shape == out_ref.shape, (type(out), out.shape)
        paths = _paths(model)
        (out.float() * gy).sum().backward()
        ctx.check()
        assert paths == PATHS[plan_name], paths
        errs = {"out": rel_err(out.detach(), out_ref)}
        ref_grads = _fused_grads(ref, W)
        for name, p in model.named_parameters():
            assert p.grad is not None, f"{name}: no gradient"
            errs[name] = rel_err(_full(p.grad, ref_grads[name], W), ref_grads[name])
        tol_out, tol_grad = (TOL_FLOAT32, TOL_FLOAT32) if dtype == torch.float32 else (TOL_OUT, TOL_GRAD)
        bad = {k: v for k, v in errs.items() if v > (tol_out if k == "out" else tol_grad)}
        assert not bad, f"rank {ctx.rank}: {bad}"
        want = {name for name, _ in llama.build("tiny", N_LAYERS, max_seq=S, fuse_for=fuse_for).named_parameters()}
        assert set(errs) == {"out", *want}, "the parallel model's parameters are not the unsharded model's"
        return errs


@pytest.mark.parametrize("plan_name", ["torch", "torch_fused", "ours", "ours_unshared", "ours_fused", "ours_fallback"])
def test_training_step_matches_single_process(pool, plan_name):
    """Plan (b) (torch) and plan (c) (ours: overlap forced, the projections as SharedInputColwise groups, or
    ``ours_unshared`` a ColwiseParallel each, and fallback="always") against the unsharded model; *_fused: the same
    weights with fused projections (llama.fuse_projections)."""
    if pool.world != 2:
        pytest.skip("W = 2 (the tiny shape's 2 KV heads shard over 2 ranks)")
    if plan_name.startswith("torch") and pool.backend == "cuda-shared":
        pytest.skip("torch's training plan (its reduce-scatter and all-gather of CUDA tensors) over gloo, the "
                    "process group of ranks sharing one GPU, ends the ranks with SIGSEGV; it runs over NCCL (cuda:W)")
    errs = pool.run(_training, plan_name)
    assert errs[0]["out"] == errs[1]["out"], "ranks disagree on the replicated output"


def _decode(plan_name):
    """Two decode steps (positions 5 and 6, a cache of 8) under a decode plan against the unsharded model."""
    with to.Context(timeout_s=120) as ctx:
        dev, T = ctx.device, 8
        ref = llama.build("tiny", N_LAYERS, dtype=torch.bfloat16, device=dev, max_seq=T).float()
        dtype = torch.float32 if plan_name == "torch" else torch.bfloat16
        fuse_for = ctx.world_size if plan_name.endswith("_fused") else 0
        model = llama.build("tiny", N_LAYERS, dtype=torch.bfloat16, device=dev, max_seq=T,
                            fuse_for=fuse_for).to(dtype)
        plan = {"torch": llama.decode_plan_torch,
                "ours": lambda: llama.decode_plan_ours(ctx, fallback="never"),
                "ours_norm": lambda: llama.decode_plan_ours(ctx, fallback="never"),
                "ours_norm_fused": lambda: llama.decode_plan_ours(ctx, fallback="never"),
                "ours_fallback": lambda: llama.decode_plan_ours(ctx, fallback="always")}[plan_name]()
        norm_op = to.AllReduceRMSNorm(ctx, fallback="never")
        llama.parallelize(model, llama.mesh_of(ctx), plan)
        ref.setup_cache(B, T)
        model.setup_cache(B, T)
        g = torch.Generator().manual_seed(6)
        errs = []
        with torch.no_grad():
            for pos in (5, 6):
                tokens = torch.randint(0, ref.shape.vocab, (B, 1), generator=g).to(dev)
                input_pos = torch.tensor([pos], device=dev)
                out = (llama.decode_fused_norm(model, tokens, input_pos, norm_op)
                       if plan_name.startswith("ours_norm") else model(tokens, input_pos))
                errs.append(rel_err(out, ref(tokens, input_pos)))
        ctx.check()
        if plan_name.startswith("ours_norm"):
            assert norm_op.last_path == "overlap", norm_op.last_path
        # column layers: a local matmul
        want = PATHS[plan_name.removesuffix("_fused")] | ({"local"} if plan_name != "torch" else set())
        assert _paths(model) == want, _paths(model)
        tol = TOL_FLOAT32 if dtype == torch.float32 else TOL_OUT
        assert max(errs) < tol, f"rank {ctx.rank}: {errs}"
        return errs


@pytest.mark.parametrize("plan_name", ["torch", "ours", "ours_norm", "ours_fallback", "ours_norm_fused"])
def test_decode_step_matches_single_process(pool, plan_name):
    """Each decode plan's step against the unsharded model; ours_norm: ours with each AllReduce, residual add and
    next RMSNorm fused (llama.decode_fused_norm); ours_norm_fused: the same with fused projections (one wqkv, one
    w13, llama.fuse_projections)."""
    if pool.world != 2:
        pytest.skip("W = 2 (the tiny shape's 2 KV heads shard over 2 ranks)")
    pool.run(_decode, plan_name)
