"""EPMoE, the expert-parallel MoE layer: output and every gradient (input, router, this rank's experts) against the
unsharded plain module of tests/test_nn_moe.py in float64, on every rank's own tokens; both paths of the op
(fallback "never": copy engines and flags, "always": the process group's all_to_all_single); experts without
tokens, a rank without tokens, top-1; float32 parameters under autocast; the down projection in stages
(``combine_stages``: DownCombine); two layers in flight together, eager and
inside torch.compile; what it refuses. And the property the combine's backward rests on: dispatching other rows
with the same ids returns them in the same order.

Rank s holds ``S + 2s`` positions of ``[S_s, B, dim]`` (none on rank ``empty``); the reference runs on every
rank's tokens, concatenated in rank order. Tolerances as tests/test_nn_moe.py's (‖out − ref‖ / ‖ref‖ against
float64): 2e-2 for the output, 3e-2 for the gradients; measured on the host backend: 4e-3 to 8e-3 for each, the
same on both paths. GPU cases (hundreds of tokens per rank, dim 1024) run where
TRITON_OVERLAP_TEST_BACKENDS names a GPU backend (``cuda-shared:2`` on one GPU) and skip without one."""
from dataclasses import dataclass

import pytest
import torch

import triton_overlap as to
from refs import check_grad_clipping, rand, rel_err
from test_nn_moe import TOL_GRAD, TOL_OUT, PlainMoE, expert_modules
from triton_overlap.nn import EPMoE, overlap_ops


@dataclass(frozen=True, kw_only=True)
class LayerCase:
    """Rank s: ``S + 2s`` positions of ``[S_s, B, dim]`` (0 on rank ``empty``); E experts (divisible by 2 and
    3), top-``topk``. ``expect_empty``: the routing must leave some expert without tokens."""
    S: int
    B: int
    dim: int
    hidden: int
    E: int
    topk: int
    renormalize: bool = True
    fallback: str = "never"
    mode: str = "bf16"
    empty: int | None = None
    expect_empty: bool = False
    stages: int | None = None  # EPMoE's combine_stages


HOST_CASES = {
    # dim, 2 * hidden multiples of 8: torch._grouped_mm on the CPU
    "bf16": LayerCase(S=5, B=2, dim=32, hidden=48, E=6, topk=2),
    "fallback": LayerCase(S=5, B=2, dim=32, hidden=48, E=6, topk=2, renormalize=False, fallback="always"),
    # 24 experts for a few tokens, rank 1 without tokens: experts (and ranks) that receive nothing
    "empty_experts": LayerCase(S=2, B=2, dim=32, hidden=48, E=24, topk=2, empty=1, expect_empty=True),
    # top-1 (the weight is the probability), widths that _grouped_mm does not take: a matmul per expert
    "top1": LayerCase(S=6, B=1, dim=36, hidden=20, E=6, topk=1, renormalize=False),
    "top1_fallback": LayerCase(S=6, B=1, dim=36, hidden=20, E=6, topk=1, renormalize=False, fallback="always"),
    "autocast": LayerCase(S=4, B=2, dim=32, hidden=48, E=12, topk=3, mode="autocast"),
    # the down projection in stages, each stage's partials sent as it ends; experts and a rank without tokens
    "staged": LayerCase(S=5, B=2, dim=32, hidden=48, E=12, topk=3, stages=3),
    "staged_empty": LayerCase(S=2, B=2, dim=32, hidden=48, E=24, topk=2, empty=1, expect_empty=True, stages=4),
    "staged_fallback": LayerCase(S=5, B=2, dim=32, hidden=48, E=6, topk=2, fallback="always", stages=2),
}
GPU_CASES = {
    "bf16": LayerCase(S=300, B=2, dim=1024, hidden=512, E=16, topk=4),
    "fallback": LayerCase(S=300, B=2, dim=1024, hidden=512, E=16, topk=4, fallback="always"),
    "empty_experts": LayerCase(S=3, B=2, dim=1024, hidden=512, E=96, topk=2, empty=1, expect_empty=True),
    "top1": LayerCase(S=500, B=1, dim=1020, hidden=360, E=6, topk=1, renormalize=False),  # a matmul per expert
    "staged": LayerCase(S=300, B=2, dim=1024, hidden=512, E=16, topk=4, stages=3),
}


def _tokens(case, s):
    return 0 if s == case.empty else case.S + 2 * s


def ep_moe_layer_case(case):
    """EPMoE against PlainMoE in float64: returns the errors and the path the op took."""
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        plain = PlainMoE(case.dim, case.hidden, case.E, case.topk, case.renormalize)
        sizes = [_tokens(case, s) for s in range(W)]
        x_all = torch.cat([rand((n, case.B, case.dim), torch.float32, "cpu", "x", s) for s, n in enumerate(sizes)])
        x_all = x_all.bfloat16().double()
        gy_all = torch.cat([rand((n, case.B, case.dim), torch.float32, "cpu", "gy", s) for s, n in enumerate(sizes)])
        ref = PlainMoE(case.dim, case.hidden, case.E, case.topk, case.renormalize).double()
        ref.load_state_dict(plain.state_dict())
        x_ref = x_all.clone().requires_grad_()
        y_ref = ref(x_ref.reshape(-1, case.dim)).reshape(x_all.shape)
        (y_ref * gy_all.double()).sum().backward()
        ids = ref.routing(x_all.reshape(-1, case.dim))[1]
        empty = case.E - int(torch.unique(ids).numel())
        assert empty > 0 or not case.expect_empty, "the case was meant to leave experts without tokens"

        dtype = torch.float32 if case.mode == "autocast" else torch.bfloat16
        moe = EPMoE.from_full(plain.router, (plain.w1, plain.w3, plain.w2), ctx, topk=case.topk,
                              renormalize=case.renormalize, dtype=dtype, fallback=case.fallback,
                              combine_stages=case.stages)
        lo = sum(sizes[:r])
        mine = slice(lo, lo + sizes[r])
        x = x_all[mine].to(dev, dtype).requires_grad_()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=case.mode == "autocast"):
            y = moe(x)
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        (y.float() * gy_all[mine].to(dev)).sum().backward()
        moe.sync_replicated_grads()
        ctx.check()

        first, end = moe.expert_range
        experts = slice(first, end)
        want = {"out": y_ref[mine].detach(), "grad_x": x_ref.grad[mine], "router": ref.router.weight.grad,
                "w13": torch.cat([ref.w1.grad[experts], ref.w3.grad[experts]], dim=1).transpose(1, 2),
                "w2": ref.w2.grad[experts].transpose(1, 2)}
        got = {"out": y.detach(), "grad_x": x.grad, "router": moe.router.weight.grad, "w13": moe.w13.grad,
               "w2": moe.w2.grad}
        if case.mode == "autocast":
            assert all(got[k].dtype == torch.float32 for k in ("grad_x", "router", "w13", "w2"))
        for k in want:
            assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        # (a rank without tokens has empty rows; experts without rows anywhere have zero gradients)
        errs = {k: rel_err(got[k], want[k]) for k in want if want[k].numel() and want[k].abs().sum() > 0}
        for k in want:
            if want[k].numel() and want[k].abs().sum() == 0:
                assert got[k].abs().sum() == 0, f"rank {r}: {k} should be zero"
        bad = {k: v for k, v in errs.items() if v > (TOL_OUT if k == "out" else TOL_GRAD)}
        assert not bad, f"rank {r}: {bad} (all: {errs})"

        def param_errors():  # (this rank's experts against the reference's, both clipped)
            want = {"router": ref.router.weight.grad, "w2": ref.w2.grad[experts].transpose(1, 2),
                    "w13": torch.cat([ref.w1.grad[experts], ref.w3.grad[experts]], dim=1).transpose(1, 2)}
            got = {"router": moe.router.weight.grad, "w13": moe.w13.grad, "w2": moe.w2.grad}
            return {k: rel_err(got[k], v) for k, v in want.items() if v.abs().sum() > 0}
        check_grad_clipping(moe, ref, param_errors, TOL_GRAD)
        return errs, moe.last_path, empty


@pytest.mark.parametrize("name", list(HOST_CASES))
def test_ep_moe_matches_plain_module(pool, name):
    cases = HOST_CASES if pool.backend == "host" else GPU_CASES
    if name not in cases:
        pytest.skip("no such case for this backend")
    case = cases[name]
    results = pool.run(ep_moe_layer_case, case)
    want = "fallback" if case.fallback == "always" else "overlap"
    assert all(path == want for _, path, _ in results), results


def _stacked_layers(compiled):
    """Two EPMoE layers one after the other (their dispatches in flight together on the layers' shared op, the
    backward combining them in the other order) against two plain modules; ``compiled``: inside torch.compile
    (the layer runs eagerly between graphs)."""
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        plains = [PlainMoE(32, 24, 4 * W, 2, True, seed=s) for s in (1, 2)]
        refs = [PlainMoE(32, 24, 4 * W, 2, True).double() for _ in plains]
        for ref, plain in zip(refs, plains):
            ref.load_state_dict(plain.state_dict())
        sizes = [5 + s for s in range(W)]
        x_all = torch.cat([rand((n, 32), torch.bfloat16, "cpu", "x2", s) for s, n in enumerate(sizes)]).double()
        gy_all = torch.cat([rand((n, 32), torch.float32, "cpu", "gy2", s) for s, n in enumerate(sizes)])
        x_ref = x_all.clone().requires_grad_()
        y_ref = refs[1](torch.tanh(refs[0](x_ref)))
        (y_ref * gy_all.double()).sum().backward()
        # the first GEMM started per source as the rows land (ops.ep_experts), against the unsharded modules
        layers = [EPMoE.from_full(p.router, (p.w1, p.w3, p.w2), ctx, topk=2, fallback="never", experts_gemm="overlap")
                  for p in plains]

        def model(x):
            return layers[1](torch.tanh(layers[0](x)))

        mine = slice(sum(sizes[:r]), sum(sizes[:r + 1]))
        x = x_all[mine].to(dev, torch.bfloat16).requires_grad_()
        y = (torch.compile(model) if compiled else model)(x)
        (y.float() * gy_all[mine].to(dev)).sum().backward()
        ctx.check()
        # the gate/up GEMM started per source (interpreted: the Triton kernel; on GPUs whichever kernel can run)
        assert layers[0].op.last_gemm in (("ag_grouped_gemm",) if ctx.interpreted
                                          else ("ag_grouped_hopper", "ag_grouped_gemm")), layers[0].op.last_gemm
        errs = {"out": rel_err(y.detach(), y_ref[mine].detach()), "grad_x": rel_err(x.grad, x_ref.grad[mine])}
        assert errs["out"] < TOL_OUT and errs["grad_x"] < TOL_GRAD, f"rank {r}: {errs}"
        return errs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_stacked_layers_match_plain_modules(pool, compiled):
    if pool.backend == "host" and pool.world != 2:
        pytest.skip("W = 2 on the host backend")
    pool.run(_stacked_layers, compiled)


def _same_order(T, dim, E, topk):
    """Two dispatches of different rows with the same ids and weights (what the combine's backward does) put every
    row at the same place: the same counts, offsets, sources, tokens and weights, and row i of the second holds the
    second input's row of the first's token i."""
    with to.Context(timeout_s=60) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.ExpertParallel(ctx, fallback="never")
        x = rand((T + r, dim), torch.bfloat16, dev, "x", r)
        g = rand((T + r, dim), torch.bfloat16, dev, "g", r)
        ids = torch.rand(T + r, E, generator=torch.Generator().manual_seed(r)).topk(topk, dim=1).indices.to(dev)
        w = torch.softmax(rand((T + r, topk), torch.float32, dev, "w", r), dim=1)
        d = op.dispatch(x, ids, w, num_experts=E)
        d2 = op.dispatch(g, ids, w, num_experts=E)
        for name in ("counts", "offsets", "source", "token", "weights", "slots", "positions"):
            assert torch.equal(getattr(d, name), getattr(d2, name)), name
        assert d.traffic == d2.traffic
        # every source's g, to look up each row's (source, token)
        everyone = [rand((T + s, dim), torch.bfloat16, dev, "g", s) for s in range(W)]
        want = torch.stack([everyone[s][t] for s, t in zip(d.source.tolist(), d.token.tolist())]) \
            if d.num_rows else d2.tokens
        assert torch.equal(d2.tokens, want)
        ctx.check()
        return d.num_rows


def test_dispatch_of_other_rows_keeps_the_order(pool):
    if pool.backend == "host" and pool.world != 3:
        pytest.skip("W = 3 on the host backend")
    assert sum(pool.run(_same_order, 7, 16, 6, 2)) > 0


def _refusals():
    with to.Context(timeout_s=30) as ctx:
        dev, W = ctx.device, ctx.world_size
        plain = PlainMoE(16, 8, 2 * W, 2, True)
        experts = (plain.w1, plain.w3, plain.w2)
        with pytest.raises(TypeError, match="fallbak"):
            EPMoE(16, 8, 2 * W, 2, ctx=ctx, fallbak="never")
        with pytest.raises(TypeError, match="renormalise"):
            EPMoE.from_full(plain.router, experts, ctx, topk=2, renormalise=True)
        with pytest.raises(ValueError, match="not divisible"):
            EPMoE(16, 8, 2 * W + 1, 2, ctx=ctx)
        with pytest.raises(ValueError, match="topk"):
            EPMoE(16, 8, 2 * W, 2 * W + 1, ctx=ctx)
        with pytest.raises(ValueError, match="fallback"):
            EPMoE(16, 8, 2 * W, 2, ctx=ctx, fallback="sometimes")
        for stages in (0, 1.5):
            with pytest.raises(ValueError, match="combine_stages must be None or an int >= 1"):
                EPMoE(16, 8, 2 * W, 2, ctx=ctx, combine_stages=stages)
        with pytest.raises(ValueError, match="experts must be"):
            EPMoE.from_full(plain.router, (plain.w1, plain.w1, plain.w2[:, :, :1]), ctx, topk=2)
        moe32 = EPMoE.from_full(plain.router, experts, ctx, topk=2, dtype=torch.float32)
        x = torch.randn(4, 16, device=dev)
        with pytest.raises(TypeError, match="bfloat16 or float16.*autocast"):
            moe32(x)
        moe = EPMoE.from_full(plain.router, experts, ctx, topk=2)
        with pytest.raises(TypeError, match="input is torch.float32"):
            moe(x)
        # this rank's experts, whole; as modules (Qwen3-MoE's names) the same as stacked tensors
        first, end = moe.expert_range
        assert (first, end) == (2 * ctx.rank, 2 * ctx.rank + 2)
        assert torch.equal(moe.w2, plain.w2[first:end].transpose(1, 2).bfloat16().to(dev))
        again = EPMoE.from_full(plain.router, expert_modules(plain), ctx, topk=2)
        assert torch.equal(again.w13, moe.w13) and torch.equal(again.w2, moe.w2)
        # after the refusals the layer runs
        y = moe(x.bfloat16())
        assert y.shape == x.shape and moe.last_path == "overlap"
        assert overlap_ops(moe) == [moe.op]  # (held as an attribute; no low-latency op without max_tokens_per_rank)
        ctx.check()
        return True


def test_ep_moe_refuses_what_it_cannot_run(pool):
    if pool.world != 2:
        pytest.skip("W = 2")
    assert all(pool.run(_refusals))


def test_grouped_mm_matches_a_matmul_per_expert():
    """Both paths of the experts' grouped GEMM (torch._grouped_mm where it takes the operands, else a loop), and
    their gradients, against float64, experts without rows included."""
    from triton_overlap.nn.ep_moe import GroupedMM, takes_grouped_mm
    g = torch.Generator().manual_seed(0)
    for K, N, dtype in ((32, 24, torch.bfloat16), (20, 12, torch.bfloat16), (32, 24, torch.float16)):
        counts = [3, 0, 5, 1]
        offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
        a = torch.randn(sum(counts), K, generator=g).to(dtype).requires_grad_()
        w = torch.randn(len(counts), K, N, generator=g).to(dtype).requires_grad_()
        gy = torch.randn(sum(counts), N, generator=g).to(dtype)
        assert takes_grouped_mm(a, w) == (dtype == torch.bfloat16 and K % 8 == 0 and N % 8 == 0)
        y = GroupedMM.apply(a, w, offsets)
        y.backward(gy)
        a64, w64 = a.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        experts = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        y64 = torch.einsum("rk,rkn->rn", a64, w64[experts])
        y64.backward(gy.double())
        errs = rel_err(y.detach(), y64.detach()), rel_err(a.grad, a64.grad), rel_err(w.grad, w64.grad)
        assert max(errs) < 1e-2, (K, N, dtype, errs)
        assert w.grad[1].abs().sum() == 0


@pytest.mark.parametrize("first", [0, 3], ids=["all_experts", "experts_3_to_5"])
def test_partial_experts_leaves_out_rows_it_never_computes(monkeypatch, first):
    """partial_experts (a decode block's share of the experts) against a loop over (token, choice) pairs in
    float64, with the grouped GEMM's rows past the last expert's filled with NaN, as memory it never wrote may hold,
    forward and backward: the output and every gradient equal the loop's and are finite; no token gives an empty
    output. ``first``: this rank's experts are ``first .. first + 3`` of 6 (3: the choices of experts 0-2 are
    another rank's)."""
    import triton_overlap.nn.ep_moe as ep_moe

    real = ep_moe.grouped_mm

    def unwritten_nan(a, w, offsets, bounds=None):
        out = real(a, w, offsets, bounds).clone()
        out[int(offsets[-1]):] = float("nan")
        return out

    monkeypatch.setattr(ep_moe, "grouped_mm", unwritten_nan)
    g = torch.Generator().manual_seed(1)
    T, k, dim, width, E = 5, 3, 8, 4, 3
    rows = torch.randn(T, dim, generator=g, dtype=torch.float64).requires_grad_()
    ids = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g, dtype=torch.float64).requires_grad_()
    w13 = torch.randn(E, dim, 2 * width, generator=g, dtype=torch.float64).requires_grad_()
    w2 = torch.randn(E, width, dim, generator=g, dtype=torch.float64).requires_grad_()
    gy = torch.randn(T, dim, generator=g, dtype=torch.float64)
    out = ep_moe.partial_experts(rows, ids, weights, w13, w2, first)
    (out * gy).sum().backward()
    got = [out.detach(), rows.grad, weights.grad, w13.grad, w2.grad]
    for p in (rows, weights, w13, w2):
        p.grad = None
    want = torch.zeros(T, dim, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j]) - first
            if 0 <= e < E:
                gate, up = (rows[t] @ w13[e]).split(width)
                want = want.index_add(0, torch.tensor([t]), (weights[t, j] * (torch.nn.functional.silu(gate) * up)
                                                             @ w2[e]).unsqueeze(0))
    (want * gy).sum().backward()
    for name, a, b in zip(("out", "rows", "weights", "w13", "w2"), got,
                          [want.detach(), rows.grad, weights.grad, w13.grad, w2.grad]):
        assert torch.isfinite(a).all() and rel_err(a, b) < 1e-12, name
    none = ep_moe.partial_experts(rows[:0], ids[:0], weights[:0], w13, w2, first)
    assert none.shape == (0, dim)
