"""Expert-parallel dispatch and combine in low-latency mode (ExpertParallelLowLatency, ``ep_dispatch(...,
max_tokens_per_rank=...)``) against float64 torch and against the normal mode.

The inputs, the expected dispatch and the float64 reference are test_expert_parallel's (every rank rebuilds every
rank's tokens). Dispatch is checked exactly on the first ``offsets[-1]`` rows of the fixed-size layout (rows,
counts, offsets, source, token, weight; for fp8 rows their bytes and scales), and the combine within
test_expert_parallel's tolerances and to the bit against the normal mode's combine of the same experts' outputs.
One op serves calls of changing routings, token counts (0 included), widths, dtypes and topk, so calls alternate
between the two halves of its buffers while those grow; receive buffers (between two barriers: a call has none of
its own) and outputs are poisoned before every call.

Faults: more tokens than max_tokens_per_rank (ValueError naming the rank, before any launch), ids outside [0, E) on
one rank (seen on the device: every rank's Context faults naming that rank), a rank that never calls (the bounded
wait names the rank, the op and the silent source), ranks combining different dispatches (a fault, not a sum of the
wrong partials; combining two dispatches in the other order is right); reset() restores the Context. On a GPU backend
(``cuda-shared:2`` on one GPU): dispatch → experts → combine captured in one CUDA graph and replayed 1,000 times
with new tokens and routing written into its inputs before each replay, every output checked.
"""
import re
import time

import pytest
import torch

import triton_overlap as to
from contract import SLACK_S, timed_all_but_rank_1, timeout_for
from refs import poison, rand, rel_err
from test_expert_parallel import (TOL, EPCase, _at, _expected, _expert_weights, _inputs, _reference_out, _run_experts,
                                  _tokens)

HOST_CASES = (
    EPCase(tokens=13, hidden=40, experts=8, topk=2, iters=3),
    EPCase(tokens=9, hidden=32, experts=12, topk=3, routing="even", empty=1, n=24, dtype="float16"),
    EPCase(tokens=5, hidden=16, experts=8, topk=8, routing="one", n=8),
    EPCase(tokens=5, hidden=16, experts=256, topk=4, n=8),
    EPCase(tokens=11, hidden=16, experts=8, topk=2, routing="first", empty=0),
)
GPU_CASES = (
    EPCase(tokens=128, hidden=7168, experts=256, topk=8, n=2048, iters=3),
    EPCase(tokens=1, hidden=2048, experts=128, topk=8, n=768, iters=2),
    EPCase(tokens=29, hidden=4096, experts=16, topk=2, routing="first", empty=0, dtype="float16"),
    EPCase(tokens=64, hidden=1024, experts=8, topk=8, routing="one", n=512),
)


def _cap(case, W):
    return max(_tokens(case, s) for s in range(W)) + 2


def _poison(op):
    """Poison the op's receive buffers between two barriers: with no barrier in a call, a peer may otherwise already
    be storing its next call's rows there."""
    ctx = op.ctx
    ctx.synchronize()
    torch.distributed.barrier(group=ctx.group)
    for buf in op.buffers().values():
        poison(buf)
    ctx.synchronize()
    torch.distributed.barrier(group=ctx.group)


def _check_dispatch(d, case, W, r, it):
    tokens, counts, offsets, source, token, weights = _expected(case, W, r, it, d.tokens.device)
    n = int(offsets[-1])
    assert d.num_rows == W * d.capacity * case.topk and d.tokens.shape[1] == case.hidden
    assert torch.equal(d.offsets.long(), offsets) and torch.equal(d.counts.long(), counts), (d.offsets, offsets)
    assert torch.equal(d.tokens[:n].view(torch.uint8), tokens.view(torch.uint8)), f"rank {r}: tokens"
    assert torch.equal(d.source[:n].long(), source) and torch.equal(d.token[:n].long(), token)
    assert torch.equal(d.weights[:n], weights), f"rank {r}: weights"
    return n


def _round_trip(op, normal, ctx, case, it, experts, cap):
    """One low-latency dispatch → experts → combine, checked against the definition, the float64 reference and
    the normal mode's combine (to the bit)."""
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    x, ids, w = _inputs(case, W, r, it, dev)
    _poison(op)
    d = op.dispatch(x, ids, w, num_experts=case.experts)
    ctx.check()
    assert op.last_path == "overlap" and d.capacity == cap
    n = _check_dispatch(d, case, W, r, it)
    y = poison(torch.empty(d.num_rows, experts.shape[2], dtype=x.dtype, device=dev))
    y[:n] = _run_experts(d.tokens[:n], d.offsets, experts, r, case.experts // W)
    _poison(op)
    out = op.combine(y, d, out=poison(torch.empty(x.shape[0], y.shape[1], dtype=y.dtype, device=dev)))
    ctx.check()
    plain = normal.dispatch(x, ids, w, num_experts=case.experts)
    assert torch.equal(out, normal.combine(y[:n], plain)), f"rank {r}: not the normal mode's bits"
    ref = _reference_out(case, W, r, it, experts, dev)
    if ref.numel():
        assert rel_err(out, ref) < TOL[out.dtype], f"rank {r} iter {it}: {rel_err(out, ref):.2e}"


def _matches_reference(cases):
    with to.Context(timeout_s=120) as ctx:
        W = ctx.world_size
        cases = [_at(c, W) for c in cases]
        cap = max(_cap(c, W) for c in cases)
        op = to.ExpertParallelLowLatency(ctx, cap, fallback="never")
        normal = to.ExpertParallel(ctx, fallback="never")
        for i, case in enumerate(cases):
            experts = _expert_weights(case, ctx.device)
            for it in range(case.iters):
                _round_trip(op, normal, ctx, case, 10 * i + it, experts, cap)
        # the functional form: the op kept for this capacity, and ep_combine finds it from the handle
        case = cases[0]
        x, ids, w = _inputs(case, W, ctx.rank, 0, ctx.device)
        d = to.ep_dispatch(x, ids, w, num_experts=case.experts, ctx=ctx, max_tokens_per_rank=cap)
        assert isinstance(d, to.LowLatencyHandle)
        y = torch.zeros(d.num_rows, case.hidden, dtype=x.dtype, device=ctx.device)
        n = int(d.offsets[-1])
        y[:n] = d.tokens[:n]
        got = to.ep_combine(y, d, ctx=ctx)
        want = normal.combine(y[:n], normal.dispatch(x, ids, w, num_experts=case.experts))
        assert torch.equal(got, want)
        ctx.check()
        return True


def test_ep_low_latency_matches_reference(pool):
    """Every case in turn on one op (the buffers' halves alternate and grow), at every world size."""
    cases = HOST_CASES if pool.backend == "host" else GPU_CASES
    assert all(pool.run(_matches_reference, cases))


def _fp8(case):
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        case = _at(case, W)
        op = to.ExpertParallelLowLatency(ctx, _cap(case, W), fallback="never")
        groups = -(-case.hidden // 128)
        for it in range(2):
            x, ids, w = _inputs(case, W, r, it, dev)
            scales = rand((x.shape[0], groups), torch.float32, dev, "scales", it, r)
            _poison(op)
            d = op.dispatch(x.to(torch.float8_e4m3fn), ids, w, num_experts=case.experts, scales=scales)
            ctx.check()
            tokens, counts, offsets, source, token, weights = _expected(case, W, r, it, dev)
            n = int(offsets[-1])
            every = [rand((_tokens(case, s), groups), torch.float32, dev, "scales", it, s) for s in range(W)]
            want = (torch.stack([every[s][t] for s, t in zip(source.tolist(), token.tolist())]) if n
                    else torch.empty(0, groups, device=dev))
            assert d.tokens.dtype == torch.float8_e4m3fn
            assert torch.equal(d.tokens[:n].view(torch.uint8), tokens.to(torch.float8_e4m3fn).view(torch.uint8))
            assert torch.equal(d.scales[:n], want) and torch.equal(d.offsets.long(), offsets)
        return True


def test_ep_low_latency_fp8_rows_and_scales(pool):
    case = (EPCase(tokens=9, hidden=40, experts=4 * pool.world, topk=3, empty=1) if pool.backend == "host"
            else EPCase(tokens=128, hidden=7168, experts=8 * pool.world, topk=8))
    assert all(pool.run(_fp8, case))


# ---------------------------------------------------------------------------------------------------- faults
def _faults(T: float):
    with to.Context(timeout_s=T) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        case = EPCase(tokens=6, hidden=16, experts=2 * W, topk=2)
        cap = _cap(case, W)
        op = to.ExpertParallelLowLatency(ctx, cap, fallback="never")
        normal = to.ExpertParallel(ctx, fallback="never")
        experts = _expert_weights(case, dev)
        _round_trip(op, normal, ctx, case, 0, experts, cap)
        x, ids, w = _inputs(case, W, r, 1, dev)
        big = rand((cap + 1, case.hidden), torch.bfloat16, dev, "x")
        big_ids = torch.zeros(cap + 1, 2, dtype=torch.int64, device=dev)
        with pytest.raises(ValueError, match=rf"rank {r} has {cap + 1} tokens, more than max_tokens_per_rank = {cap}"):
            op.dispatch(big, big_ids, torch.ones(cap + 1, 2, device=dev), num_experts=case.experts)
        with pytest.raises(ValueError, match="max_tokens_per_rank must be a positive int"):
            to.ExpertParallelLowLatency(ctx, 0)
        # ids out of range on the last rank: seen on the device, every rank's Context faults naming that rank
        bad = ids.clone()
        if r == W - 1:
            bad[0, 0] = case.experts
        with pytest.raises(to.ContextError, match=rf"rank {W - 1} passed expert ids from \d+ to {case.experts}; "
                                                   rf"topk_ids must lie in \[0, {case.experts}\)"):
            op.dispatch(x, bad, w, num_experts=case.experts)
            ctx.synchronize()
            ctx.check()
        ctx.reset()
        _round_trip(op, normal, ctx, case, 2, experts, cap)
        # a rank that never calls: the others' bounded waits name it
        elapsed = None
        if r == 1:
            time.sleep(T + 1)
        else:
            t0 = time.monotonic()
            with pytest.raises(to.ContextError) as info:
                op.dispatch(x, ids, w, num_experts=case.experts)
                ctx.synchronize()
                ctx.check()
            elapsed = time.monotonic() - t0
            msg = str(info.value)
            own = rf"rank {r}: ep_dispatch \(call \d+\) timed out .*waiting for chunk 1 of rank 1"
            relayed = rf"rank {r}: rank \d+ faulted: .*ep_dispatch .*waiting for chunk 1 of rank 1"
            assert re.search(own, msg) or re.search(relayed, msg), msg
            assert elapsed <= T + SLACK_S, elapsed
        ctx.reset()
        _round_trip(op, normal, ctx, case, 3, experts, cap)
        return elapsed


def test_ep_low_latency_faults(pool):
    if pool.backend == "host" and pool.world > 2:
        pytest.skip("W = 2 on the host backend (CI time)")
    times = pool.run(_faults, timeout_for(pool))
    timed_all_but_rank_1(times)


def _other_dispatch(T: float):
    """Two dispatches, then their combines in the other order (right); then rank 0 combines one dispatch while the
    others combine the other: the combine's header names the dispatch, so every rank's Context faults instead of
    summing the wrong partials; reset() restores it."""
    with to.Context(timeout_s=T) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        case = EPCase(tokens=6, hidden=16, experts=2 * W, topk=2)
        cap = _cap(case, W)
        op = to.ExpertParallelLowLatency(ctx, cap, fallback="never")
        experts = _expert_weights(case, dev)
        handles = []
        for it in (0, 1):
            x, ids, w = _inputs(case, W, r, it, dev)
            d = op.dispatch(x, ids, w, num_experts=case.experts)
            n = int(d.offsets[-1])
            y = torch.zeros(d.num_rows, case.hidden, dtype=x.dtype, device=dev)
            y[:n] = _run_experts(d.tokens[:n], d.offsets, experts, r, case.experts // W)
            handles.append((it, d, y))
        for it, d, y in reversed(handles):
            ref = _reference_out(case, W, r, it, experts, dev)
            assert rel_err(op.combine(y, d), ref) < TOL[torch.bfloat16]
        ctx.check()
        it, d, y = handles[0] if r == 0 else handles[1]
        with pytest.raises(to.ContextError, match="ranks must combine the same dispatch|faulted"):
            op.combine(y, d)
            ctx.synchronize()
            ctx.check()
        ctx.reset()
        _round_trip(op, to.ExpertParallel(ctx, fallback="never"), ctx, case, 2, experts, cap)
        return True


def test_ep_low_latency_combine_of_another_dispatch_faults(pool):
    assert all(pool.run(_other_dispatch, timeout_for(pool)))


# ------------------------------------------------------------------------------------------------ CUDA graphs
def _graph_replays(case, replays: int):
    """dispatch → experts (each row of local expert i times i + 1, which needs the device offsets) → combine, in one
    CUDA graph, replayed with new tokens, weights and routing written into its inputs before each replay."""
    with to.Context(timeout_s=60) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        case = _at(case, W)
        E, k, H, el = case.experts, case.topk, case.hidden, case.experts // W
        T = case.tokens
        op = to.ExpertParallelLowLatency(ctx, T, fallback="never")
        x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        ids = torch.empty(T, k, dtype=torch.int64, device=dev)
        w = torch.empty(T, k, dtype=torch.float32, device=dev)

        def inputs(i, s):
            g = torch.Generator(device=dev).manual_seed(1000 * i + s)
            xs = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
            ids_s = torch.rand(T, E, generator=g, device=dev).topk(k, dim=1).indices
            return xs, ids_s, torch.softmax(torch.randn(T, k, generator=g, device=dev), dim=1)

        def step():
            d = op.dispatch(x, ids, w, num_experts=E)
            rows = torch.arange(d.num_rows, device=dev)
            expert = torch.searchsorted(d.offsets[1:].long(), rows, right=True).clamp(max=el - 1)
            y = (d.tokens.float() * (expert + 1)[:, None]).to(torch.bfloat16)
            return op.combine(y, d)

        def load(i):
            xs, ids_s, ws = inputs(i, r)
            x.copy_(xs), ids.copy_(ids_s), w.copy_(ws)
            return xs, ids_s, ws

        load(0)
        step()  # the eager call: buffers, agreement, kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        worst = 0.0
        for i in range(1, replays + 1):
            xs, ids_s, ws = load(i)
            poison(out)
            graph.replay()
            scale = (ids_s % el + 1).double()  # local expert index + 1 of each choice
            ref = xs.double() * (ws.double() * scale).sum(1, keepdim=True)
            err = rel_err(out, ref)
            worst = max(worst, err)
            assert err < TOL[torch.bfloat16], f"rank {r} replay {i}: {err:.2e}"
        torch.cuda.synchronize()
        ctx.check()
        return worst


def test_ep_low_latency_cuda_graph_replays(pool):
    if pool.backend == "host":
        pytest.skip("CUDA graphs: GPU backends only")
    case = EPCase(tokens=128, hidden=2048, experts=64, topk=8)
    assert all(e < TOL[torch.bfloat16] for e in pool.run(_graph_replays, case, 1000))


# ----------------------------------------------------------------------------------------------- EPMoE decode
def _layer_decode(dim: int, replays: int):
    """EPMoE with max_tokens_per_rank: a forward without autograd takes the low-latency mode and returns what the
    normal mode's layer returns (the same parameters); with autograd, or more tokens than the capacity, the normal
    mode. On GPUs the decode forward is also captured in a CUDA graph and replayed on new tokens."""
    from test_nn_moe import TOL_OUT, PlainMoE
    from triton_overlap.nn import EPMoE

    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        cap = 8 if ctx.backend == "host" else 64
        full = PlainMoE(dim, dim, 4 * W, 2, True)  # the same on every rank
        parts = (full.router, (full.w1, full.w3, full.w2), ctx)
        layer = EPMoE.from_full(*parts, topk=2, fallback="never", max_tokens_per_rank=cap)
        plain = EPMoE.from_full(*parts, topk=2, fallback="never")
        ref = PlainMoE(dim, dim, 4 * W, 2, True).double()  # float64, on the host
        ref.load_state_dict(full.state_dict())
        x = rand((cap - r, dim), torch.bfloat16, dev, "layer x", r)
        with torch.no_grad():
            got, want = layer(x), plain(x)
            assert layer.decodes() and layer.last_path == "overlap" and layer._last is layer.decode_op
            assert rel_err(got, want.double()) < 1e-2, rel_err(got, want.double())
            err = rel_err(got, ref(x.double().cpu()))
            assert err < TOL_OUT, err
            big = rand((cap + 1, dim), torch.bfloat16, dev, "layer big", r)
            with pytest.raises(ValueError, match="more than max_tokens_per_rank"):
                layer(big)
            layer.low_latency = False  # a prefill: the normal mode, on every rank
            assert not layer.decodes() and torch.equal(layer(big), plain(big))
            layer.low_latency = True
        assert not layer.decodes()  # autograd on: the normal mode, differentiable
        layer(x).sum().backward()
        assert layer.w13.grad is not None
        if ctx.backend == "host":
            return True
        static = x.clone()
        with torch.no_grad():
            layer(static)
            torch.cuda.synchronize()
            torch.distributed.barrier(group=ctx.group)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer(static)
            for i in range(replays):
                static.copy_(rand((cap - r, dim), torch.bfloat16, dev, "layer replay", i, r))
                poison(out)
                graph.replay()
                err = rel_err(out, ref(static.double().cpu()))
                assert err < TOL_OUT, f"replay {i}: {err:.2e}"
        ctx.check()
        return True


def test_ep_low_latency_in_epmoe(pool):
    assert all(pool.run(_layer_decode, 16 if pool.backend == "host" else 1024, 20))

