"""Expert-parallel dispatch and combine (``ep_dispatch`` / ``ep_combine``, ExpertParallel) against float64 torch.

Every rank rebuilds every rank's tokens, ids and weights (``refs.rand``, seeded by name), so each can compute what it
must receive and what its combine must return. Dispatch is checked exactly: the received rows (copies of the
senders' rows), the counts and offsets per local expert, and each row's source rank, source token and weight, in
expert order and within an expert in (source, token, choice) order. Then the experts run in torch (one matmul per
local expert, in the input dtype) and combine must return, on each token's rank, ``Σ_j w[t, j] · x[t] @ W[id(t, j)]``
computed in float64 on the same rounded inputs: ‖out − ref‖ / ‖ref‖ under 2e-2 for bf16 and 4e-3 for fp16 (three
roundings: the expert's output, the owner's partial, the sum).

Ranks hold different numbers of tokens (``tokens + 3 * rank``); routings cover a rank with no tokens, ranks that
receive nothing or send nothing to their peers, experts with no rows, every choice on one expert (a token expanded
topk times on one rank), topk 1 and 8 and E = 256 with few tokens. Receive buffers and outputs are filled with
NaN (integer buffers with random values) before every call, and producers are delayed at random in some cases.
Also: the functional forms and fallback="always" (the process group's all_to_all_single) return the same bits; two
dispatches in flight combined in the other order, with a receive buffer that grows; bad input (ValueError on every
rank, the Context usable after); a peer that never sends its counts or its rows (the bounded wait names the rank,
the op, the peer and its block; reset() restores the Context), or never raises a combine's flags (alike); ranks
that combine different dispatches (a mismatch at the combine's barrier); the combine computing the experts' down
projection in stages (``expert_weight``, ExpertParallelConfig.combine_stages). GPU cases (hundreds of tokens per
rank, H 1024 to 4096) run where TRITON_OVERLAP_TEST_BACKENDS names a GPU backend (``cuda-shared:2`` on one GPU)
and skip without one.
"""
import time
import zlib
from dataclasses import dataclass, replace

import pytest
import torch

import triton_overlap as to
from triton_overlap.ops.ep_combine import stage_cuts
from contract import SLACK_S, EARLIEST, timed_all_but_rank_1, timeout_for
from harness import host_case_share
from refs import OfflineContext, poison, rand, rel_err

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


@dataclass(frozen=True, kw_only=True)
class EPCase:
    """Rank s holds ``tokens + 3 * s`` tokens of width ``hidden`` (none on rank ``empty``); ``experts`` experts of
    output width ``n`` (0: ``hidden``); each token's ``topk`` choices by ``routing``: "random" (distinct experts
    where topk <= E), "one" (every choice the last expert), "even" (even experts only: odd ones get no rows), "first"
    (rank 0's experts only: the others receive nothing), "own" (each rank's own experts: nothing goes to a peer).
    ``iters`` calls with new inputs, producers delayed up to ``jitter`` s."""
    tokens: int
    hidden: int
    experts: int
    topk: int
    routing: str = "random"
    empty: int | None = None
    dtype: str = "bfloat16"
    n: int = 0
    iters: int = 1
    jitter: float = 0.0
    fallback: str = "never"
    experts_gemm: str = "overlap"


def _at(case, W):
    """``case`` at world size W: E rounded down to a multiple of W (rank r owns E / W experts)."""
    return replace(case, experts=max(W, case.experts - case.experts % W))


def _tokens(case, s):
    return 0 if case.empty is not None and s == case.empty else case.tokens + 3 * s


def _ids(case, T, W, s, it):
    g = torch.Generator().manual_seed(zlib.crc32(repr(("ids", case.routing, it, s)).encode()))
    E, k, el = case.experts, case.topk, case.experts // W
    if case.routing == "one":
        return torch.full((T, k), E - 1, dtype=torch.int64)
    if case.routing == "even":
        return 2 * torch.randint(0, (E + 1) // 2, (T, k), generator=g)
    if case.routing == "first":
        return torch.randint(0, el, (T, k), generator=g)
    if case.routing == "own":
        return s * el + torch.randint(0, el, (T, k), generator=g)
    if k <= E:
        return torch.rand(T, E, generator=g).topk(k, dim=1).indices
    return torch.randint(0, E, (T, k), generator=g)


def _inputs(case, W, s, it, dev):
    """Rank s's (x, topk_ids, topk_weights) of call ``it``; ids alternate between int64 and int32."""
    T = _tokens(case, s)
    x = rand((T, case.hidden), getattr(torch, case.dtype), dev, "x", it, s)
    ids = _ids(case, T, W, s, it).to(dev, torch.int32 if it % 2 else torch.int64)
    weights = torch.softmax(rand((T, case.topk), torch.float32, dev, "w", it, s), dim=1)
    return x, ids, weights


def _expert_weights(case, dev):
    """[E, H, N]: each expert's matrix (the same on every rank)."""
    return rand((case.experts, case.hidden, case.n or case.hidden), getattr(torch, case.dtype), dev, "experts")


def _expected(case, W, r, it, dev):
    """What rank r must receive: (tokens, counts, offsets, source, token, weights), by the definition."""
    el = case.experts // W
    parts = []
    for s in range(W):
        x, ids, w = _inputs(case, W, s, it, dev)
        ids = ids.long()
        t, j = ((ids // el) == r).nonzero(as_tuple=True)  # (t, j) in row-major order
        e = ids[t, j] - r * el
        parts.append((e, torch.full_like(t, s), t, x[t], w[t, j]))
    e, src, tok, rows, wts = (torch.cat(p) for p in zip(*parts))
    order = torch.sort(e, stable=True).indices
    counts = torch.bincount(e, minlength=el)
    offsets = torch.zeros(el + 1, dtype=torch.int64, device=counts.device)
    offsets[1:] = counts.cumsum(0)
    return rows[order], counts, offsets, src[order], tok[order], wts[order]


def _reference_out(case, W, r, it, experts, dev):
    """float64 [T_r, N]: Σ_j w[t, j] · x[t] @ W[ids[t, j]] for rank r's tokens."""
    x, ids, w = _inputs(case, W, r, it, dev)
    ids = ids.long()
    out = torch.zeros(x.shape[0], experts.shape[2], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        hit = ids == e
        t = hit.nonzero(as_tuple=True)[0]
        out.index_add_(0, t, (x[t].double() @ experts[e].double()) * w[hit].double()[:, None])
    return out


def _run_experts(tokens, offsets, experts, r, el):
    """The experts in torch, in the input dtype: one matmul per local expert over its rows."""
    y = torch.empty(tokens.shape[0], experts.shape[2], dtype=tokens.dtype, device=tokens.device)
    bounds = offsets.tolist()
    for e in range(el):
        if bounds[e + 1] > bounds[e]:
            y[bounds[e]:bounds[e + 1]] = tokens[bounds[e]:bounds[e + 1]] @ experts[r * el + e]
    return y


def _poison_buffers(op):
    for buf in op.buffers().values():
        poison(buf)


def _check_dispatch(d, case, W, r, it):
    tokens, counts, offsets, source, token, weights = _expected(case, W, r, it, d.tokens.device)
    assert d.tokens.dtype == tokens.dtype and torch.equal(d.tokens.cpu(), tokens.cpu()), f"rank {r}: tokens"
    assert d.counts.dtype == torch.int32 and torch.equal(d.counts.long().cpu(), counts.cpu()), (d.counts, counts)
    assert d.offsets.dtype == torch.int32 and torch.equal(d.offsets.long().cpu(), offsets.cpu()), (d.offsets, offsets)
    assert torch.equal(d.source.long().cpu(), source.cpu()) and torch.equal(d.token.long().cpu(), token.cpu())
    assert torch.equal(d.weights.cpu(), weights.cpu()), f"rank {r}: weights"
    unique = torch.unique(torch.stack([source, token]), dim=1).shape[1] if token.numel() else 0
    assert d.num_tokens == _tokens(case, r) and sum(d.received) == unique, (d.received, unique)


def _round_trip(op, ctx, case, it, experts):
    """One dispatch → experts → combine on ``op`` (buffers and output poisoned first), checked; returns the
    combine's relative error and the handle."""
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    x, ids, w = _inputs(case, W, r, it, dev)
    _poison_buffers(op)
    el = case.experts // W
    d = op.dispatch(x, ids, w, num_experts=case.experts, expert_weight=experts[r * el:(r + 1) * el])
    ctx.check()
    _check_dispatch(d, case, W, r, it)
    y = _run_experts(d.tokens, d.offsets, experts, r, el)
    # the experts' product that the dispatch computed, overlapped with the rows' arrival where the op overlaps
    assert d.projected.shape == y.shape and d.projected.dtype == y.dtype
    if y.numel():
        err = rel_err(d.projected, y.double())
        assert err < TOL[y.dtype] / 2, f"rank {r} iter {it}: projected rel err {err:.2e}"
    if op.last_path == "fallback" or op.cfg.experts_gemm == "after" or ctx.num_hosts > 1:  # (ops.ep_hosts)
        assert op.last_gemm == "torch", op.last_gemm
    elif ctx.interpreted:  # the overlapped GEMM, on every call (Gluon does not run in the interpreter)
        assert op.last_gemm == ("ag_grouped_gemm" if y.shape[0] else "none"), op.last_gemm
    else:
        assert op.last_gemm in ("ag_grouped_hopper", "ag_grouped_gemm", "none"), op.last_gemm
    _poison_buffers(op)
    out = poison(torch.empty(x.shape[0], y.shape[1], dtype=y.dtype, device=dev))
    got = op.combine(y, d, out=out)
    ctx.check()
    assert got.data_ptr() == out.data_ptr()
    ref = _reference_out(case, W, r, it, experts, dev)
    if ref.numel() == 0:
        return 0.0, d
    err = rel_err(out, ref)
    assert err < TOL[out.dtype], f"rank {r} iter {it}: combine rel err {err:.2e}"
    return err, d


# ------------------------------------------------------------------------------------------------------ cases
HOST_CASES = (
    EPCase(tokens=13, hidden=40, experts=8, topk=2, iters=2, jitter=0.005),  # uneven ranks, producer delays
    EPCase(tokens=9, hidden=32, experts=12, topk=3, routing="even", empty=1, n=24, dtype="float16"),
    EPCase(tokens=7, hidden=24, experts=4, topk=1, routing="one"),  # top-1, everything to the last rank's expert
    EPCase(tokens=5, hidden=16, experts=8, topk=8, routing="one", n=8),  # one expert, each token expanded 8 times
    EPCase(tokens=6, hidden=16, experts=16, topk=8),  # top-8 of 16 distinct
    EPCase(tokens=5, hidden=16, experts=256, topk=4, n=8),  # E = 256, few tokens: most experts get no rows
    EPCase(tokens=11, hidden=16, experts=8, topk=2, routing="first", empty=0),  # only rank 0 receives
    EPCase(tokens=8, hidden=16, experts=8, topk=3, routing="own", experts_gemm="after"),  # nothing goes to a peer
)
# GPU shapes: hundreds of tokens per rank, H 1024-4096
GPU_CASES = (
    EPCase(tokens=509, hidden=1024, experts=8, topk=2, iters=3),
    EPCase(tokens=300, hidden=2048, experts=64, topk=8, routing="even", empty=1, n=512),
    EPCase(tokens=256, hidden=4096, experts=256, topk=8, n=64, dtype="float16"),
    EPCase(tokens=700, hidden=1024, experts=16, topk=1, routing="one", n=768, experts_gemm="after"),
    EPCase(tokens=384, hidden=2048, experts=32, topk=4, routing="first", empty=0, n=1024, jitter=0.001),
)


def _cases(pool):
    return HOST_CASES if pool.backend == "host" else GPU_CASES


def ep_matches_reference(case):
    with to.Context(timeout_s=120) as ctx:
        case = _at(case, ctx.world_size)
        ctx.set_producer_jitter(case.jitter)
        op = to.ExpertParallel(ctx, to.ExpertParallelConfig(experts_gemm=case.experts_gemm), fallback=case.fallback)
        experts = _expert_weights(case, ctx.device)
        worst = 0.0
        for it in range(case.iters):
            err, _ = _round_trip(op, ctx, case, it, experts)
            worst = max(worst, err)
        assert op.last_path == ("fallback" if case.fallback == "always" else "overlap"), op.last_path
        return worst


@pytest.mark.parametrize("case", range(max(len(HOST_CASES), len(GPU_CASES))))
def test_ep_matches_reference(pool, case):
    """Dispatch exact, and dispatch → experts in torch → combine against float64, at every world size."""
    cases = _cases(pool)
    if case >= len(cases):
        pytest.skip("no such case for this backend")
    host_case_share(pool, case)
    pool.run(ep_matches_reference, cases[case])


def _functional_and_fallback(case):
    """The functional forms (one op per Context, W > 1 under "auto": the overlap) and fallback="always" (the process
    group's all_to_all_single) return the same tensors, to the bit."""
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        case = _at(case, W)
        experts = _expert_weights(case, dev)
        x, ids, w = _inputs(case, W, r, 0, dev)
        d = to.ep_dispatch(x, ids, w, num_experts=case.experts, ctx=ctx)
        assert to.ExpertParallel.shared(ctx).last_path == "overlap"
        y = _run_experts(d.tokens, d.offsets, experts, r, case.experts // W)
        out = to.ep_combine(y, d, ctx=ctx)
        plain = to.ExpertParallel(ctx, fallback="always")
        d2 = plain.dispatch(x, ids, w, num_experts=case.experts)
        assert plain.last_path == "fallback"
        _check_dispatch(d2, case, W, r, 0)
        for name in ("tokens", "counts", "offsets", "source", "token", "weights"):
            assert torch.equal(getattr(d, name), getattr(d2, name)), name
        out2 = plain.combine(y, d2)
        assert plain.last_path == "fallback"
        assert torch.equal(out, out2)
        # a handle is the data it holds: the overlap combines the fallback's dispatch, and the other way round
        assert torch.equal(to.ep_combine(y, d2, ctx=ctx), out) and torch.equal(plain.combine(y, d), out)
        ctx.check()
        assert rel_err(out, _reference_out(case, W, r, 0, experts, dev)) < TOL[out.dtype]
        return True


def test_ep_fallback_returns_the_same_tensors(pool):
    case = (EPCase(tokens=13, hidden=24, experts=6 * pool.world, topk=3, empty=1) if pool.backend == "host"
            else EPCase(tokens=300, hidden=1024, experts=8 * pool.world, topk=4, empty=1))
    assert all(pool.run(_functional_and_fallback, case))


def _staged_down_projection(case):
    """combine(h, d, expert_weight=w) with the down projection in 1, 2, 3 and 64 stages (more than the experts:
    as many as have rows): the parts are the projection, and the output is the combine of their concatenation to
    the bit, with buffers and output poisoned first; on the fallback as well."""
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        case = _at(case, W)
        el, dtype = case.experts // W, getattr(torch, case.dtype)
        down = rand((case.experts, case.n or case.hidden, 16), dtype, dev, "down")
        x, ids, w = _inputs(case, W, r, 0, dev)
        op = to.ExpertParallel(ctx, fallback=case.fallback)
        d = op.dispatch(x, ids, w, num_experts=case.experts)
        h = rand((d.num_rows, down.shape[1]), dtype, dev, "h", r)
        y = _run_experts(h, d.offsets, down, r, el)
        plain = op.combine(y, d)
        worst = 0.0
        for stages in (1, 2, 3, 64):
            staged = to.ExpertParallel(ctx, to.ExpertParallelConfig(combine_stages=stages), fallback=case.fallback)
            _poison_buffers(staged)
            out = poison(torch.empty(x.shape[0], 16, dtype=dtype, device=dev))
            got, parts = staged.combine(h, d, out=out, expert_weight=down[r * el:(r + 1) * el])
            ctx.check()
            assert got.data_ptr() == out.data_ptr() and staged.last_path == op.last_path
            projected = torch.cat(parts) if parts else y[:0]
            cuts = stage_cuts(d.counts.tolist(), stages) if op.last_path == "overlap" else [0] * bool(y.shape[0])
            assert projected.shape == y.shape and len(parts) == len(cuts), (projected.shape, len(parts), cuts)
            if y.numel():
                worst = max(worst, rel_err(projected, y.double()))
            assert torch.equal(out, op.combine(projected, d)), f"rank {r}, {stages} stages"
            if plain.numel():
                worst = max(worst, rel_err(out, plain.double()))
        # the functional form (the shared op: one stage)
        got, parts = to.ep_combine(h, d, ctx=ctx, expert_weight=down[r * el:(r + 1) * el])
        assert torch.equal(got, op.combine(torch.cat(parts) if parts else y[:0], d))
        assert worst < TOL[dtype], worst
        return worst


def test_stage_cuts():
    """Consecutive experts, cut where the rows' running sum first reaches each even share; no stage without rows."""
    assert stage_cuts([3, 0, 5, 2, 0], 2) == [(0, 3, 0, 8), (3, 4, 8, 10)]
    assert stage_cuts([4, 4, 4, 4], 4) == [(0, 1, 0, 4), (1, 2, 4, 8), (2, 3, 8, 12), (3, 4, 12, 16)]
    assert stage_cuts([1, 99], 2) == [(0, 2, 0, 100)]
    assert stage_cuts([0, 0, 7], 3) == [(0, 3, 0, 7)] and stage_cuts([0, 0], 2) == []
    assert stage_cuts([2, 2, 2], 1) == [(0, 3, 0, 6)]


@pytest.mark.parametrize("case", [0, 1, 2, 5], ids=["uneven", "even-empty-fp16", "one", "E256"])
def test_ep_down_projection_in_stages(pool, case):
    host_case_share(pool, case)
    cases = _cases(pool)
    case = cases[case % len(cases)]
    pool.run(_staged_down_projection, case)
    if case.fallback == "never":
        pool.run(_staged_down_projection, replace(case, fallback="always"))


def _fp8_dispatch(case):
    """fp8 rows with per-token-group scales, on the overlap and on all_to_all_single: the received rows are the
    senders' bytes and each row's scales come with it, in the layout of a 16-bit dispatch of the same routing."""
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        case = _at(case, W)
        groups = -(-case.hidden // 128)
        for fallback in ("never", "always"):
            op = to.ExpertParallel(ctx, fallback=fallback)
            for it in (0, 1, 1):  # (the same routing twice: the second call fits the buffers the first grew)
                x, ids, w = _inputs(case, W, r, it, dev)
                scales = rand((x.shape[0], groups), torch.float32, dev, "scales", it, r)
                _poison_buffers(op)
                d = op.dispatch(x.to(torch.float8_e4m3fn), ids, w, num_experts=case.experts, scales=scales)
                ctx.check()
                assert op.last_path == ("fallback" if fallback == "always" else "overlap")
                tokens, counts, offsets, source, token, weights = _expected(case, W, r, it, dev)
                every = [rand((_tokens(case, s), groups), torch.float32, dev, "scales", it, s) for s in range(W)]
                want = (torch.stack([every[s][t] for s, t in zip(source.tolist(), token.tolist())])
                        if token.numel() else torch.empty(0, groups, device=dev))
                assert d.tokens.dtype == torch.float8_e4m3fn
                assert torch.equal(d.tokens.view(torch.uint8), tokens.to(torch.float8_e4m3fn).view(torch.uint8))
                assert d.scales.dtype == torch.float32 and torch.equal(d.scales, want), f"rank {r}: scales"
                assert torch.equal(d.counts.long(), counts) and torch.equal(d.offsets.long(), offsets)
                assert torch.equal(d.source.long(), source) and torch.equal(d.token.long(), token)
                assert torch.equal(d.weights, weights)
            assert op.last_exchange == (None if fallback == "always" else "stores"), op.last_exchange
            # 16-bit rows in the buffers the fp8 bytes used (half the rows fit), twice: no scales, the same layout
            for _ in range(2):
                plain = op.dispatch(x, ids, w, num_experts=case.experts)
                ctx.check()
                assert plain.scales is None
                _check_dispatch(plain, case, W, r, 1)
        return True


def test_ep_fp8_dispatch_moves_rows_and_scales(pool):
    case = (EPCase(tokens=9, hidden=40, experts=4 * pool.world, topk=3, empty=1) if pool.backend == "host"
            else EPCase(tokens=300, hidden=2048, experts=8 * pool.world, topk=4, empty=1))
    assert all(pool.run(_fp8_dispatch, case))


def _interleaved(case, rounds):
    """Two dispatches in flight (a small one, then one that grows every receive buffer), combined in the other
    order; then ``rounds`` round trips whose token counts and routings change every call, with producer delays."""
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        ctx.set_producer_jitter(0.002 if ctx.backend == "host" else 0.0)
        op = to.ExpertParallel(ctx, fallback="never")
        small, large = case, replace(case, tokens=case.tokens * 9, routing="first")
        experts = _expert_weights(case, dev)
        handles, sizes = [], []
        for c, it in ((small, 0), (large, 1)):
            x, ids, w = _inputs(c, W, r, it, dev)
            d = op.dispatch(x, ids, w, num_experts=c.experts)
            _check_dispatch(d, c, W, r, it)
            handles.append((c, it, d, x.shape[0]))
            sizes.append(ctx.symmetric_nbytes(f"{op.name}.rows"))
        assert sizes[1] > sizes[0], sizes  # the large call grew the receive buffer (on every rank: it is symmetric)
        grown = {name: buf.numel() for name, buf in op.buffers().items()}
        for c, it, d, T in reversed(handles):
            y = _run_experts(d.tokens, d.offsets, experts, r, c.experts // W)
            _poison_buffers(op)
            out = op.combine(y, d)
            assert out.shape[0] == T
            assert rel_err(out, _reference_out(c, W, r, it, experts, dev)) < TOL[out.dtype]
        routings = ("random", "one", "even", "own", "first")
        exchanges = set()
        for i in range(rounds):
            c = replace(case, tokens=[3, case.tokens * 5, 1, case.tokens][i % 4], routing=routings[i % 5],
                        empty=i % W if i % 3 == 2 else None)
            _round_trip(op, ctx, c, 10 + i, experts)
            exchanges.add(op.last_exchange)
        huge = replace(case, tokens=case.tokens * 40)  # more rows than the buffers hold: they grow, by copies
        _round_trip(op, ctx, huge, 99, experts)
        exchanges.add(op.last_exchange)
        _round_trip(op, ctx, huge, 99, experts)  # and the same call again fits them
        assert exchanges == {"stores", "copies"} and op.last_exchange == "stores", (exchanges, op.last_exchange)
        ctx.check()
        assert all(op.buffers()[name].numel() >= n for name, n in grown.items())
        return True


def test_ep_calls_interleave_and_buffers_grow(pool):
    if pool.backend == "host" and pool.world == 3:
        pytest.skip("the host backend at W = 2 (CI time); GPU worlds at every W")
    case = (EPCase(tokens=5, hidden=16, experts=2 * pool.world, topk=2) if pool.backend == "host"
            else EPCase(tokens=64, hidden=1024, experts=4 * pool.world, topk=2))
    assert all(pool.run(_interleaved, case, 6 if pool.backend == "host" else 20))


# ------------------------------------------------------------------------------------------------- bad input
def _with_id(ids, bad):
    ids = ids.clone()
    ids[0, 0] = bad
    return ids


def _bad_inputs():
    """Each bad call raises ValueError naming what is wrong on every rank, before any row moves; the op still
    works after."""
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.ExpertParallel(ctx, fallback="never")
        case = EPCase(tokens=6, hidden=16, experts=2 * W, topk=2)
        x, ids, w = _inputs(case, W, r, 0, dev)
        E = case.experts
        bad = [
            ("not divisible by the world size", lambda: op.dispatch(x, ids, w, num_experts=2 * W + 1)),
            ("positive int", lambda: op.dispatch(x, ids, w, num_experts=0)),
            ("x must be 2-D", lambda: op.dispatch(x[None], ids, w, num_experts=E)),
            ("float16, bfloat16 or float8_e4m3fn", lambda: op.dispatch(x.float(), ids, w, num_experts=E)),
            ("float8_e4m3fn x needs scales", lambda: op.dispatch(x.to(torch.float8_e4m3fn), ids, w, num_experts=E)),
            (r"needs scales, float32 \[T_local, G\]",
             lambda: op.dispatch(x.to(torch.float8_e4m3fn), ids, w, num_experts=E, scales=w[1:])),
            ("scales are for float8_e4m3fn x", lambda: op.dispatch(x, ids, w, num_experts=E, scales=w)),
            ("int32 or int64", lambda: op.dispatch(x, ids.float(), w, num_experts=E)),
            (r"topk_ids must be \[T_local, topk\]", lambda: op.dispatch(x, ids[1:], w[1:], num_experts=E)),
            ("topk_weights must be float32", lambda: op.dispatch(x, ids, w.bfloat16(), num_experts=E)),
            ("topk_weights must be float32", lambda: op.dispatch(x, ids, w[:, :1], num_experts=E)),
            ("is on meta", lambda: op.dispatch(x.to("meta"), ids, w, num_experts=E)),
            # ids out of range on one rank only: every rank gets the error naming that rank
            (rf"must lie in \[0, {E}\).*rank 0 has ids from \d+ to {E}\b",
             lambda: op.dispatch(x, _with_id(ids, E) if r == 0 else ids, w, num_experts=E)),
            (rf"must lie in \[0, {E}\).*rank {W - 1} has ids from -3 to",
             lambda: op.dispatch(x, _with_id(ids, -3) if r == W - 1 else ids, w, num_experts=E)),
            # shapes the ranks disagree on, new to every rank (a rank that had agreed on its shape would not ask
            # again): every rank gets it
            ("ranks disagree", lambda: op.dispatch(rand((len(x), 20 + r), torch.bfloat16, dev, "x"), ids, w,
                                                   num_experts=E)),
            ("ranks disagree", lambda: op.dispatch(x, torch.zeros(len(x), 3 + r, dtype=torch.int64, device=dev),
                                                   torch.ones(len(x), 3 + r, device=dev), num_experts=E)),
        ]
        for message, call in bad:
            with pytest.raises(ValueError, match=message):
                call()
        experts = _expert_weights(case, dev)
        err, d = _round_trip(op, ctx, case, 0, experts)  # still usable
        # ids out of range once the receive buffers exist (the rows would be stored before the host reads the
        # counts): the kernel stores nothing, every rank raises, and the next call is right
        with pytest.raises(ValueError, match=rf"rank {W - 1} has ids from \d+ to {E + 5}\b"):
            op.dispatch(x, _with_id(ids, E + 5) if r == W - 1 else ids, w, num_experts=E)
        err, d = _round_trip(op, ctx, case, 1, experts)
        assert op.last_exchange == "stores", op.last_exchange
        err, d = _round_trip(op, ctx, case, 0, experts)
        y = _run_experts(d.tokens, d.offsets, experts, r, E // W)
        for message, call in [
            ("EPHandle", lambda: op.combine(y, "d")),
            (r"y must be \[R, N\]", lambda: op.combine(y[:-1] if y.shape[0] else y[:, :0], d)),
            ("y must be float16", lambda: op.combine(y.float(), d)),
            ("out must be", lambda: op.combine(y, d, out=torch.empty(1, 3, device=dev))),
        ]:
            with pytest.raises(ValueError, match=message):
                call()
        assert rel_err(op.combine(y, d), _reference_out(case, W, r, 0, experts, dev)) < TOL[torch.bfloat16]
        ctx.check()
        return True


def test_ep_bad_input_raises_before_launch(pool):
    assert all(pool.run(_bad_inputs))


# ---------------------------------------------------------------------------------------------------- faults
def ep_silent_peer(what: str, T: float):
    """Rank 1 makes the call but never sends its ``what`` (a dispatch's "counts" or "rows", a combine's "partials")
    to anyone (between hosts it makes no exchange at all, so it receives nothing either): every other rank's bounded
    wait gives up naming the rank, the op, rank 1 and its block (or reports the first such fault, relayed), rank 1
    learns of it too (or times out itself), calls are refused until reset(), and then they are right again."""
    from triton_overlap.producers import exchange

    with to.Context(timeout_s=T) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        case = EPCase(tokens=6, hidden=16, experts=2 * W, topk=2)
        op = to.ExpertParallel(ctx, fallback="never")
        experts = _expert_weights(case, dev)
        _round_trip(op, ctx, case, 0, experts)  # shapes agreed, kernels built, ranks in step
        x, ids, w = _inputs(case, W, r, 1, dev)
        kind, call = "ep_dispatch", lambda: op.dispatch(x, ids, w, num_experts=case.experts)
        if what == "partials":
            d = call()
            y = _run_experts(d.tokens, d.offsets, experts, r, case.experts // W)
            kind, call = "ep_combine", lambda: op.combine(y, d)
        original = exchange.AllToAll.enqueue
        flags = {"counts": (".count_flags",), "rows": (".row_flags", ".push_flags"),  # (rows: either path)
                 "partials": (".partial_flags",)}[what]

        raise_flags, between_hosts = exchange.raise_flags, exchange.between_hosts

        def silent(self, ctx, streams):
            if not self.flags.name.endswith(flags):
                original(self, ctx, streams)

        def silent_stores(ctx, f):  # (flags after a kernel's stores)
            if not f.name.endswith(flags):
                raise_flags(ctx, f)

        def silent_link(ctx, stream, remote, f, *a):  # (a combine's partials between hosts)
            if not f.name.endswith(flags):
                between_hosts(ctx, stream, remote, f, *a)

        elapsed = None
        if r == 1:
            exchange.AllToAll.enqueue, exchange.raise_flags, exchange.between_hosts = silent, silent_stores, silent_link
            try:
                try:
                    call()
                except to.ContextError:
                    pass  # its own wait met a peer's relayed fault
                deadline = time.monotonic() + T + SLACK_S
                with pytest.raises(to.ContextError, match=rf"rank 1: .*{kind}"):  # the peers' fault reaches it too
                    while time.monotonic() < deadline:
                        ctx.check()
                        time.sleep(0.02)
            finally:
                exchange.AllToAll.enqueue, exchange.raise_flags, exchange.between_hosts = (original, raise_flags,
                                                                                           between_hosts)
        else:
            t0 = time.monotonic()
            with pytest.raises(to.ContextError) as info:
                call()
                ctx.check()
            msg, elapsed = str(info.value), time.monotonic() - t0
            own = rf"rank {r}: {kind} {what} \(call \d+\) timed out .*waiting for chunk 1 of rank 1"
            relayed = rf"rank {r}: rank \d+ faulted: .*{kind} {what}.*rank 1"
            import re
            assert re.search(own, msg) or re.search(relayed, msg), msg
            assert f"timeout_s={T:g}" in msg or "faulted" in msg, msg
            assert elapsed <= T + SLACK_S, elapsed
            if re.search(own, msg):
                assert elapsed >= T * EARLIEST, elapsed
            with pytest.raises(to.ContextError, match="reset"):
                op.dispatch(x, ids, w, num_experts=case.experts)
        ctx.reset()
        for it in (2, 3):
            _round_trip(op, ctx, case, it, experts)
        return elapsed


@pytest.mark.parametrize("what", ["counts", "rows", "partials"])
def test_ep_silent_peer_faults(pool, what):
    if pool.backend == "host" and pool.world == 3 and what == "partials":
        pytest.skip("a combine's on the host backend at W = 2 (W = 4: tests/conftest.py HOST_W4)")
    times = pool.run(ep_silent_peer, what, timeout_for(pool))
    timed_all_but_rank_1(times)


def _host_error_mid_dispatch(case):
    """An error raised on the host after a dispatch's rows were stored and its flags raised (here the experts' GEMM,
    started per source, fails to launch, as an out-of-memory or a kernel that does not compile would): the dispatch
    raises it, the Context then refuses calls until reset() (its raised flags would otherwise let the next call's
    waits pass before that call's rows land), and after reset() calls are right again."""
    import triton_overlap.ops.expert_parallel as epm

    with to.Context(timeout_s=60) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.ExpertParallel(ctx, to.ExpertParallelConfig(experts_gemm="overlap"), fallback="never")
        experts = _expert_weights(case, dev)
        for it in (0, 1):  # the second call finds the receive buffers: its rows go by the kernel's stores
            _round_trip(op, ctx, case, it, experts)
        assert op.last_exchange == "stores", op.last_exchange
        original = epm.projection

        def failing(*a, **kw):
            project, out = original(*a, **kw)

            def launch(*_):
                raise RuntimeError("injected: the experts' GEMM did not launch")
            return launch, out

        el = case.experts // W
        x, ids, w = _inputs(case, W, r, 2, dev)
        epm.projection = failing
        try:
            with pytest.raises(RuntimeError, match="injected"):
                op.dispatch(x, ids, w, num_experts=case.experts, expert_weight=experts[r * el:(r + 1) * el])
        finally:
            epm.projection = original
        with pytest.raises(to.ContextError, match=f"rank {r}: ep_dispatch stopped on the host mid-call"):
            op.dispatch(x, ids, w, num_experts=case.experts)
        ctx.synchronize()
        ctx.reset()
        for it in (3, 4):
            _round_trip(op, ctx, case, it, experts)


def test_ep_host_error_mid_dispatch_faults_until_reset(pool):
    if pool.backend == "host" and pool.world > 2:
        pytest.skip("W = 2 on the host backend")
    pool.run(_host_error_mid_dispatch, EPCase(tokens=6, hidden=16, experts=2 * pool.world, topk=2))


def _combine_other_dispatch(T: float):
    """Rank 0 combines one dispatch while the others combine another: the combine's barrier finds the headers
    differ (ContextError on every rank naming ep_combine), and reset() makes the Context usable."""
    with to.Context(timeout_s=T) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        case = EPCase(tokens=6, hidden=16, experts=2 * W, topk=2)
        op = to.ExpertParallel(ctx, fallback="never")
        experts = _expert_weights(case, dev)
        handles = []
        for it in (0, 1):
            x, ids, w = _inputs(case, W, r, it, dev)
            handles.append(op.dispatch(x, ids, w, num_experts=case.experts))
        d0, d1 = handles
        y0 = _run_experts(d0.tokens, d0.offsets, experts, r, case.experts // W)
        op.combine(y0, d0)  # the combine buffers are large enough for either
        d = d0 if r == 0 else d1
        y = _run_experts(d.tokens, d.offsets, experts, r, case.experts // W)
        with pytest.raises(to.ContextError) as info:
            op.combine(y, d)
            ctx.check()
        assert "ep_combine" in str(info.value), str(info.value)
        ctx.reset()
        _round_trip(op, ctx, case, 2, experts)
        return True


def test_ep_combine_of_another_dispatch_faults(pool):
    assert all(pool.run(_combine_other_dispatch, timeout_for(pool)))


# ------------------------------------------------------------------------------------------------------ rules
def test_ep_rules():
    """The fallback rule (W = 1 under "auto" and "always" take the process group's path), the receive buffers'
    capacities, the copy streams' peers and the counts arithmetic (offsets are prefixes of the counts)."""
    from triton_overlap.ops.ep_routing import Traffic, capacity
    from triton_overlap.producers.exchange import deal

    for world, rule, fallback in ((1, "auto", True), (2, "auto", False), (4, "always", True), (1, "never", False)):
        assert to.ExpertParallel(OfflineContext(world_size=world), fallback=rule)._use_fallback() == fallback
    for rows in (0, 1, 64, 65, 100, 1000, 4097, 123457):
        cap = capacity(rows)
        assert cap >= max(rows, 64) and cap <= max(rows, 64) * 9 // 8 + 8, (rows, cap)
    assert len({capacity(n) for n in range(64, 128)}) <= 9
    assert deal(1, 4, None) == ((2,), (3,), (0,)) and deal(1, 4, 2) == ((2, 0), (3,)) and deal(0, 1, None) == ()
    # 3 ranks, E = 6: rank s's record [T, lo, hi, rows to 0, 1, 2, pairs per expert 0..5]
    table = [[4, 0, 5, 2, 1, 3, 1, 1, 0, 2, 3, 1],
             [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
             [5, 0, 7, 5, 0, 2, 4, 2, 0, 0, 1, 2]]
    t = Traffic.read(table, 3, 6)
    assert t.received(0) == (2, 0, 5) and t.recv_offset(2, 0) == 2 and t.send_offset(0, 2) == 3
    assert t.expanded(0) == 1 + 1 + 4 + 2 and t.most_received() == 7 and t.most_sent() == 7
    assert t.out_of_range() == [(2, 0, 7)]
    with pytest.raises(ValueError, match="experts_gemm"):
        to.ExpertParallelConfig(experts_gemm="sometimes")


def _gemm_plan():
    """The overlapped GEMM's plan (kernels.ep_experts) from a counts table of 3 ranks and E = 6 (test_ep_rules'):
    rank 0's experts 0 and 1 get 1 + 0 + 4 and 1 + 0 + 2 rows from sources 0, 1, 2; tiles of 2 rows."""
    from triton_overlap.ops.ep_experts import experts_plan
    from triton_overlap.ops.ep_routing import Traffic

    with to.Context(timeout_s=30) as ctx:
        table = [[4, 0, 5, 2, 1, 3, 1, 1, 0, 2, 3, 1], [0] * 12, [5, 0, 7, 5, 0, 2, 4, 2, 0, 0, 1, 2]]
        pos, chunk_at, tiles, R = experts_plan(Traffic.read(table, 3, 6), 0, 2,
                                               torch.tensor(table, dtype=torch.int32, device=ctx.device))
        assert R == 8 and pos.tolist() == [1, 3, 3, 3, 3, 1, 3, 3] and chunk_at.tolist() == [0, 0, 1, 2]
        assert tiles.tolist() == [[0, 0, 2], [0, 2, 4], [0, 4, 5], [1, 5, 7], [1, 7, 8]], tiles.tolist()
        return True


def test_ep_gemm_plan(pool):
    assert all(pool.run(_gemm_plan))
