"""ParallelTransformerBlock (CP attention + TP MLP) against the same block on the full sequence in float32;
torch.compile traces it (forward and backward) in one graph."""
import pytest
import torch
from torch import nn

import triton_overlap as to
from triton_overlap.nn import TPMLP, ParallelTransformerBlock, overlap_ops
from refs import attention, attention_docs, rel_err

TOL_OUT, TOL_GRAD = 2e-2, 3e-2  # a bf16 block against float32 on the same (bf16-rounded) weights and inputs


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _build(ctx, dim, heads, kv_heads, hidden):
    torch.manual_seed(0)  # the replicated parameters are the same on every rank
    block = ParallelTransformerBlock(dim, heads, kv_heads, hidden, ctx=ctx, fallback="never")
    with torch.no_grad():
        for p in block.replicated_parameters():
            p.copy_(p + 0.05 * torch.randn_like(p))  # norms away from 1
    lins = []
    for i, o, seed in ((dim, hidden, 3), (dim, hidden, 4), (hidden, dim, 5)):
        torch.manual_seed(seed)
        lin = nn.Linear(i, o, bias=False)
        with torch.no_grad():
            lin.weight.copy_(lin.weight.bfloat16().float())
        lins.append(lin)
    block.mlp = TPMLP.from_full(*lins, ctx, dtype=torch.bfloat16, fallback="never")
    kinds = [type(op).__name__ for op in overlap_ops(block)]  # the attention, then the MLP's two ops
    assert kinds == ["ContextParallelAttention", "AllGatherGEMM", "GEMMReduceScatter"], kinds
    return block, lins


def _reference(block, lins, x, cu=None):
    """The block on the full sequence, float32, plain torch (``cu``: packed documents' bounds)."""
    B, S, dim = x.shape
    hq, hk, d = block.n_heads, block.n_kv_heads, block.head_dim
    f = lambda t: t.detach().float().cpu().requires_grad_()  # noqa: E731
    w = {"n1": f(block.norm1.weight), "qkv": f(block.qkv.weight), "proj": f(block.proj.weight),
         "n2": f(block.norm2.weight)}
    gate, up, down = lins
    q, k, v = (_rms(x, w["n1"]) @ w["qkv"].t()).split([hq * d, hk * d, hk * d], dim=-1)
    qkv = (q.reshape(B, S, hq, d), k.reshape(B, S, hk, d), v.reshape(B, S, hk, d))
    if cu is None:
        o, _ = attention(*qkv, block.causal, d ** -0.5)
    else:
        o, _ = attention_docs(*qkv, cu, block.causal, d ** -0.5)
    x = x + o.reshape(B, S, dim) @ w["proj"].t()
    h = _rms(x, w["n2"])
    return x + down(nn.functional.silu(gate(h)) * up(h)), w


def _block_case(B, S, dim, heads, kv_heads, hidden, packed=False):
    """``packed``: three documents (about 5/12, 2/12 and 5/12 of the sequence) packed into one (B = 1)."""
    with to.Context(timeout_s=120) as ctx:
        dev = ctx.device
        cu = None
        if packed:
            n = S // (2 * ctx.world_size)  # units of 2W tokens
            cu = [2 * ctx.world_size * u for u in (0, 5 * n // 12, 7 * n // 12, n)]
        block, lins = _build(ctx, dim, heads, kv_heads, hidden)
        g = torch.Generator().manual_seed(9)
        x_full = torch.randn(B, S, dim, generator=g).bfloat16().float().requires_grad_()
        gy = torch.randn(B, S, dim, generator=g)
        y_ref, w = _reference(block, lins, x_full, cu)
        (y_ref * gy).sum().backward()

        x = to.zigzag.shard(x_full.detach(), ctx, cu_seqlens=cu).to(dev, torch.bfloat16).requires_grad_()
        y = block(x, cu_seqlens=cu)
        (y.float() * to.zigzag.shard(gy, ctx, cu_seqlens=cu).to(dev)).sum().backward()
        block.sync_replicated_grads()
        ctx.check()
        errs = {"out": rel_err(to.zigzag.unshard(y.detach(), ctx, cu_seqlens=cu), y_ref.detach()),
                "grad_x": rel_err(to.zigzag.unshard(x.grad, ctx, cu_seqlens=cu), x_full.grad),
                "grad_norm1": rel_err(block.norm1.weight.grad, w["n1"].grad),
                "grad_qkv": rel_err(block.qkv.weight.grad, w["qkv"].grad),
                "grad_proj": rel_err(block.proj.weight.grad, w["proj"].grad),
                "grad_norm2": rel_err(block.norm2.weight.grad, w["n2"].grad)}
        bad = {k: v for k, v in errs.items() if v > (TOL_OUT if k == "out" else TOL_GRAD)}
        assert not bad, f"rank {ctx.rank}: {bad} (all: {errs})"
        return errs


@pytest.mark.parametrize("packed", [False, True])
def test_block_matches_full_sequence(pool, packed):
    if pool.backend == "host":
        shape = (1, 96, 128, 2, 1, 96)
    else:
        shape = (1, 4096, 1024, 8, 2, 2816) if packed else (2, 2048, 1024, 8, 2, 2816)
    pool.run(_block_case, *shape, packed)


def _compiled_case(B, S, dim, heads, kv_heads, hidden, backend, packed=False):
    """``packed``: B = 1 and two documents, the boundaries passed as a CPU tensor; a second set of boundaries
    of the same length then runs the compiled block without a recompile, and matches eager."""
    with to.Context(timeout_s=120) as ctx:
        dev = ctx.device
        unit = 2 * ctx.world_size
        cu = [0, unit * (S // unit // 3), S] if packed else None
        block, _ = _build(ctx, dim, heads, kv_heads, hidden)
        g = torch.Generator().manual_seed(9)
        x_full = torch.randn(B, S, dim, generator=g).bfloat16()
        gy = to.zigzag.shard(torch.randn(B, S, dim, generator=g), ctx, cu_seqlens=cu).to(dev)
        results = []
        compiled = torch.compile(block, backend=backend, fullgraph=True)  # fullgraph: a break is an error
        for fn in (block, compiled):
            x = to.zigzag.shard(x_full, ctx, cu_seqlens=cu).to(dev).requires_grad_()
            block.zero_grad(set_to_none=True)
            y = fn(x, cu_seqlens=None if cu is None else torch.tensor(cu))  # a tensor: no guard on its values
            (y.float() * gy).sum().backward()
            results.append((y.detach().float(), x.grad.float(), block.qkv.weight.grad.float(),
                            block.mlp.down.weight.grad.float()))
        ctx.check()
        errs = [rel_err(a, b) for a, b in zip(results[1], results[0])]
        assert max(errs) < 1e-2, f"compiled vs eager: {errs}"
        if packed:
            cu2 = [0, unit * (2 * S // unit // 3), S]
            x2 = to.zigzag.shard(x_full, ctx, cu_seqlens=cu2).to(dev).requires_grad_()  # as the first call had it
            with torch._dynamo.config.patch(error_on_recompile=True):  # new values, no new graph
                y2 = compiled(x2, cu_seqlens=torch.tensor(cu2))
            want = block(x2, cu_seqlens=cu2)
            ctx.check()
            errs.append(rel_err(y2.detach(), want.detach()))
            assert errs[-1] < 1e-2, f"compiled vs eager, second boundaries: {errs[-1]}"
        return errs


@pytest.mark.parametrize("packed", [False, True])
def test_block_compiles_in_one_graph(pool, packed):
    if pool.backend == "host" and pool.world != 2:
        pytest.skip("compiled once on the host backend, at W = 2")
    backend = "aot_eager" if pool.backend == "host" else "inductor"
    shape = (1, 96, 128, 2, 1, 96) if pool.backend == "host" else ((1, 4096, 1024, 8, 2, 2816) if packed else
                                                                   (2, 2048, 1024, 8, 2, 2816))
    pool.run(_compiled_case, *shape, backend, packed)
