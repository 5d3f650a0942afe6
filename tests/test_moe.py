"""Tensor-parallel MoE ops against float64 torch: AllGather + grouped GEMM (``ag_moe_gemm``) and grouped GEMM + top-k
combine + ReduceScatter (``moe_gemm_rs``), each an OpSpec with its cases (tests/contract.py), then the sorted layout
from one into the other, the ranks' disagreement on routing and the kernel's timeout (the routing tables:
test_moe_routing.py).

Inputs are bf16 (fp16 in a case) and the references float64 on the same rounded inputs. Tolerances
(‖out − ref‖ / ‖ref‖): ag_moe_gemm 1e-2 for bf16, 2e-3 for fp16 (one rounding of a float32 accumulation);
moe_gemm_rs 2e-2 for bf16, 4e-3 for fp16 (three roundings: each product, each rank's combined partial, the sum).
Outputs are filled with NaN before each call and the receive/staging buffers with garbage; rows per rank are odd
(13, 7) so no tile or chunk boundary lines up with a rank's rows."""
import zlib
from dataclasses import dataclass, replace

import pytest
import torch

import contract
import triton_overlap as to
from contract import Call, Cases, Faults, OpSpec, Variants, set_fields
from refs import assert_own_fault, late_chunk_faults, rand, rel_err

RS_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


@dataclass(frozen=True, kw_only=True)
class MoECase:
    """``m_local`` tokens per rank of width ``k``; ``experts`` experts of output width ``n`` (``transposed``: each
    expert's weight the transpose of an [n, k] tensor); each token's ``topk`` choices by ``routing``: "random"
    (distinct experts where topk <= experts), "one" (every choice the last expert), "even" (even experts only: the
    odd ones get no rows), "edges" (top-1, expert e the first EDGE_ROWS[e] tokens of a shuffle, the last expert the
    rest). ``iters`` calls, producers delayed up to ``jitter`` s; ``m_per_chunk``, ``streams``: the call's chunking;
    ``fallback`` the op's rule; ``check_routing`` the op's; ``send_rows`` the config's (True: AllGather-MoE's ranks
    send their rows sorted by expert; None: the default)."""
    m_local: int
    k: int
    n: int
    experts: int = 4
    topk: int = 2
    routing: str = "random"
    dtype: str = "bfloat16"
    transposed: bool = False
    iters: int = 1
    jitter: float = 0.0
    m_per_chunk: int | None = None
    streams: int | None = None
    fallback: str = "never"
    check_routing: bool = True
    send_rows: bool | None = None


#: the "edges" routing's rows per expert: a tile of 128 rows that ends at each side of 64 and 128 rows, one row,
#: and two tiles
EDGE_ROWS = (1, 63, 64, 65, 127, 128, 129, 192, 193)


def _ids(case, tokens, dev, *seed):
    g = torch.Generator().manual_seed(zlib.crc32(repr(("ids",) + seed).encode()))  # the same on every rank
    E = case.experts
    if case.routing == "edges":
        counts = list(EDGE_ROWS[:E - 1]) + [tokens - sum(EDGE_ROWS[:E - 1])]
        assert case.topk == 1 and counts[-1] >= 0, case
        ids = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))[torch.randperm(tokens, generator=g)]
        ids = ids.view(tokens, 1)
    elif case.routing == "one":
        ids = torch.full((tokens, case.topk), E - 1, dtype=torch.int64)
    elif case.routing == "even":
        ids = 2 * torch.randint(0, (E + 1) // 2, (tokens, case.topk), generator=g)
    elif case.topk <= E:
        ids = torch.rand(tokens, E, generator=g).topk(case.topk, dim=1).indices
    else:
        ids = torch.randint(0, E, (tokens, case.topk), generator=g)
    return ids.to(dev)


def _weight(case, dtype, dev, *seed):
    if case.transposed:
        return rand((case.experts, case.n, case.k), dtype, dev, *seed).transpose(1, 2)
    return rand((case.experts, case.k, case.n), dtype, dev, *seed)


def _make(op_class):
    return lambda ctx, case, fallback: op_class(ctx, fallback=fallback, check_routing=case.check_routing)


def _overrides(case):
    return set_fields(m_per_chunk=case.m_per_chunk, num_streams=case.streams, send_rows=case.send_rows)


# ------------------------------------------------------------------------------------------ AllGather + MoE GEMM
def _per_pair(a, w, ids):
    """float64 [T, topk, N]: ``a[t, j] @ w[ids[t, j]]`` (``a`` [T, K] is every pair's token, or [T, topk, K]), one
    matmul per expert: indexing ``w`` by ``ids`` would hold a [T, topk, K, N] copy in float64."""
    a = a.double()
    a = a.unsqueeze(1).expand(-1, ids.shape[1], -1) if a.dim() == 2 else a
    out = torch.zeros(*ids.shape, w.shape[2], dtype=torch.float64, device=a.device)
    for e in torch.unique(ids).tolist():
        hit = ids == e
        out[hit] = a[hit] @ w[e].double()
    return out


def _ag_inputs(ctx, case, it):
    dtype = getattr(torch, case.dtype)
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    shards = [rand((case.m_local, case.k), dtype, dev, "x", it, s) for s in range(W)]
    w = _weight(case, dtype, dev, "w", it, r)  # this rank's column shard of every expert
    ids = _ids(case, case.m_local * W, dev, it, case.experts)
    x_all = torch.cat(shards).double()
    ref = _per_pair(x_all, w, ids)
    out = torch.empty((case.m_local * W, case.topk, case.n), dtype=dtype, device=dev)
    return Call((shards[r], w, ids), _overrides(case), ref, out)


def _ag_garbage(ctx, op, case, it):
    for buf in op.buffers().values():  # NaN where peers' rows land: a row read before its chunk shows
        buf.fill_(float("nan"))


def _ag_bad_inputs(ctx):
    dev, W, r = ctx.device, ctx.world_size, ctx.rank
    bf = torch.bfloat16
    op = to.AllGatherMoEGEMM(ctx, fallback="never")
    x = rand((7, 32), bf, dev, "x")
    w = rand((4, 32, 24), bf, dev, "w")
    ids = torch.randint(0, 4, (7 * W, 2), generator=torch.Generator().manual_seed(5)).to(dev)
    other = ids.clone()
    other[3, 1] = (other[3, 1] + 1) % 4
    bad = [
        ("inner dimensions", lambda: op(x, rand((4, 31, 24), bf, dev, "w"), ids)),
        ("different dtypes", lambda: op(x, w.half(), ids)),
        ("float16 or bfloat16", lambda: op(x.float(), w.float(), ids)),
        ("3-D", lambda: op(x, w[0], ids)),
        ("int32 or int64", lambda: op(x, w, ids.float())),
        (r"\[T, topk\] with T = ", lambda: op(x, w, ids[1:])),
        ("is on", lambda: op(x.to("meta"), w, ids)),
        ("out must be", lambda: op(x, w, ids, out=torch.empty(7 * W, 2, 25, dtype=bf, device=dev))),
        # ids out of range on every rank, or on one rank only: every rank gets the error naming where
        (r"must lie in \[0, 4\).*ids from -1", lambda: op(x, w, torch.where(ids == 2, -1, ids))),
        (r"must lie in \[0, 4\).*rank 0 has ids from \d+ to 4", lambda: op(x, w, ids + (r == 0))),
        # one rank's routing differs: named, on every rank
        (f"ranks disagree on topk_ids.*ranks {W - 1} differ from rank 0",
         lambda: op(x, w, other if r == W - 1 else ids)),
        # shapes no rank has passed before (a rank that had agreed on its shape would not ask again)
        ("ranks disagree", lambda: op(rand((20 + r, 32), bf, dev, "x"), w,
                                      torch.zeros((20 + r) * W, 2, dtype=torch.int64, device=dev))),
        # what goes on the wire (rows sorted by expert on rank 0 only), at a shape no rank has agreed on
        ("ranks disagree.*rows", lambda: op(rand((9, 32), bf, dev, "x"), w,
                                            torch.zeros(9 * W, 2, dtype=torch.int64, device=dev),
                                            send_rows=r == 0)),
    ]
    ref = _per_pair(torch.cat([x] * W), w, ids)
    return op, bad, Call((x, w, ids), {}, ref)


# the GPU cases, the same shapes for both ops: odd rows per rank, one expert (B transposed), empty experts, E = 256,
# every choice on one expert (fp16), and K not a whole number of 64-deep steps (on Hopper AllGather-MoE's Triton
# kernel; the others take its Gluon kernel there); the first two with rows sent sorted by expert (read by TMA); the
# last with experts whose rows end a 128-row tile at each side of its half and its end
GPU_CASES = (
    MoECase(m_local=1021, k=1024, n=768, experts=8, topk=2, m_per_chunk=256, send_rows=True),
    MoECase(m_local=512, k=512, n=256, experts=1, topk=1, transposed=True, send_rows=True),
    MoECase(m_local=777, k=768, n=512, experts=64, topk=8, routing="even"),
    MoECase(m_local=600, k=512, n=384, experts=256, topk=4, m_per_chunk=160),
    MoECase(m_local=300, k=256, n=256, experts=5, topk=2, routing="one", dtype="float16"),
    MoECase(m_local=257, k=328, n=200, experts=16, topk=4, transposed=True),
    MoECase(m_local=500, k=256, n=320, experts=10, topk=1, routing="edges"),
)
FALLS_BACK = Cases(host=(MoECase(m_local=7, k=32, n=24),), gpu=(MoECase(m_local=16, k=64, n=32),))
BACK_TO_BACK = Variants(host=MoECase(m_local=7, k=32, n=16, experts=3),
                        gpu=MoECase(m_local=256, k=256, n=128, experts=8), calls=40)


AG_MOE = OpSpec(
    name="ag_moe_gemm", module=__name__, op=to.AllGatherMoEGEMM, make=_make(to.AllGatherMoEGEMM),
    functional=to.ag_moe_gemm, inputs=_ag_inputs, stale=_ag_garbage, bad_inputs=_ag_bad_inputs,
    cases=Cases(host=(
        MoECase(m_local=13, k=40, n=24, experts=4, topk=2, m_per_chunk=5, iters=3, jitter=0.01),
        MoECase(m_local=7, k=32, n=40, experts=1, topk=1, transposed=True),  # one expert, top-1, B transposed
        MoECase(m_local=13, k=32, n=24, experts=6, topk=3, routing="even", m_per_chunk=4, streams=1),  # empty
        MoECase(m_local=9, k=24, n=16, experts=5, topk=2, routing="one", dtype="float16", jitter=0.003),  # all on 1
        MoECase(m_local=5, k=16, n=24, experts=8, topk=8, m_per_chunk=2),  # top-8, 8 experts
        MoECase(m_local=11, k=32, n=16, experts=256, topk=4, m_per_chunk=3),  # E = 256: mostly empty experts
        # rows sent sorted by expert: empty experts, tiles across chunks, calls back to back
        MoECase(m_local=13, k=32, n=24, experts=6, topk=3, routing="even", m_per_chunk=4, iters=2, jitter=0.005,
                send_rows=True),
    ), gpu=GPU_CASES),
    falls_back=FALLS_BACK,
    back_to_back=BACK_TO_BACK,
    faults=Faults(case=MoECase(m_local=8, k=32, n=24, check_routing=False),
                  rows=lambda case, n: replace(case, m_local=n),
                  header=lambda case: f"ag_moe_gemm {case.m_local} {case.k}"),
)
globals().update(contract.tests(AG_MOE))


# -------------------------------------------------------------------------- MoE GEMM + combine + ReduceScatter
def _rs_inputs(ctx, case, it):
    dtype = getattr(torch, case.dtype)
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    T = case.m_local * W
    ids = _ids(case, T, dev, it, case.experts, "rs")
    weights = torch.softmax(rand((T, case.topk), torch.float32, dev, "g", it), dim=1)
    total = torch.zeros(T, case.n, dtype=torch.float64, device=dev)
    mine = None
    for s in range(W):  # every rank's h and w slices, and their sum
        h = rand((T, case.topk, case.k), dtype, dev, "h", it, s)
        w = _weight(case, dtype, dev, "w2", it, s)
        total += (_per_pair(h, w, ids) * weights.double().unsqueeze(-1)).sum(1)
        if s == r:
            mine = (h, w)
    ref = total[r * case.m_local:(r + 1) * case.m_local]
    out = torch.empty((case.m_local, case.n), dtype=dtype, device=dev)
    return Call((*mine, ids, weights), _overrides(case), ref, out)


def _rs_garbage(ctx, op, case, it):
    for buf in op.buffers().values():  # stale garbage in the receive slots and the staging buffer
        buf.copy_(torch.randn_like(buf, dtype=torch.float32))


def _rs_bad_inputs(ctx):
    dev, W, r = ctx.device, ctx.world_size, ctx.rank
    bf = torch.bfloat16
    op = to.MoEGEMMReduceScatter(ctx, fallback="never")
    T = 5 * W
    h = rand((T, 2, 32), bf, dev, "h")
    w = rand((3, 32, 24), bf, dev, "w")
    ids = torch.randint(0, 3, (T, 2), generator=torch.Generator().manual_seed(6)).to(dev)
    g = torch.full((T, 2), 0.5, device=dev)
    other = ids.clone()
    other[0, 0] = (other[0, 0] + 1) % 3
    pairs = torch.arange(T * 2, device=dev)
    bad = [
        ("inner dimensions", lambda: op(h, rand((3, 31, 24), bf, dev, "w"), ids, g)),
        ("not divisible", lambda: op(h[1:], w, ids[1:], g[1:])),
        (r"h must be \[", lambda: op(h[:, :1], w, ids, g)),
        ("topk_weights must be", lambda: op(h, w, ids, g[:, :1])),
        ("topk_weights must be", lambda: op(h, w, ids, ids)),
        (r"must lie in \[0, 3\).*ids from \d+ to 3", lambda: op(h, w, torch.where(ids == 1, 3, ids), g)),
        (r"must lie in \[0, 3\).*ids from -2", lambda: op(h, w, ids - 2, g)),
        ("ranks disagree on topk_ids.*ranks 1 differ", lambda: op(h, w, other if r == 1 else ids, g)),
        ("ranks disagree", lambda: op(h, rand((3, 32, 25 + r), bf, dev, "w"), ids, g)),  # shapes new to all
        # a sorted layout that is not this call's: other sizes, or not integer tensors
        ("routing is for", lambda: op(h.reshape(T * 2, 32), w, ids, g, routing=to.MoERouting(
            pairs[:-1], pairs[:-1], torch.zeros(4, dtype=torch.int32, device=dev), 3, 2))),
        ("integer tensors", lambda: op(h.reshape(T * 2, 32), w, ids, g, routing=to.MoERouting(
            pairs.float(), pairs, torch.zeros(4, dtype=torch.int32, device=dev), 3, 2))),
    ]
    ref = (_per_pair(h, w, ids) * g.double().unsqueeze(-1)).sum(1)[r * 5:(r + 1) * 5] * W
    return op, bad, Call((h, w, ids, g), {}, ref)


RS_MOE = OpSpec(
    name="moe_gemm_rs", module=__name__, op=to.MoEGEMMReduceScatter, make=_make(to.MoEGEMMReduceScatter),
    functional=to.moe_gemm_rs, inputs=_rs_inputs, stale=_rs_garbage, bad_inputs=_rs_bad_inputs, tol=RS_TOL,
    cases=Cases(host=(
        MoECase(m_local=13, k=40, n=24, experts=4, topk=2, m_per_chunk=5, iters=2, jitter=0.003),
        MoECase(m_local=7, k=32, n=40, experts=1, topk=1, transposed=True),
        MoECase(m_local=13, k=32, n=24, experts=6, topk=3, routing="even", m_per_chunk=4, streams=1),
        MoECase(m_local=9, k=24, n=16, experts=5, topk=2, routing="one", dtype="float16", jitter=0.003),
        MoECase(m_local=5, k=16, n=24, experts=8, topk=8, m_per_chunk=2),
        MoECase(m_local=11, k=32, n=16, experts=256, topk=4, m_per_chunk=3),
    ), gpu=GPU_CASES),
    falls_back=FALLS_BACK,
    back_to_back=BACK_TO_BACK,
    faults=Faults(case=MoECase(m_local=8, k=32, n=24, check_routing=False),
                  rows=lambda case, n: replace(case, m_local=n),
                  header=lambda case: "moe_gemm_rs"),
)
globals().update(contract.tests(RS_MOE))


# --------------------------------------------------------------------------- the sorted layout into the second op
def _sorted_pipeline(case):
    """ag_moe_gemm(sorted_output=True) into moe_gemm_rs(routing=...), the MoE MLP's two GEMMs without a scatter
    between them: the sorted rows are the token-major ones permuted by the routing, expert offsets right, the
    second op's result the float64 sum of every rank's partial. Returns (the worst relative error, the second op's
    grouped GEMM, whether the layout had rank runs, whether the GPU runs the Gluon kernels)."""
    from refs import poison, rel_err
    from triton_overlap.kernels.capability import gluon_available, is_hopper

    with to.Context(timeout_s=120) as ctx:
        r, dev = ctx.rank, ctx.device
        call = _ag_inputs(ctx, case, 0)
        x, w1, ids = call.args
        ag = to.AllGatherMoEGEMM(ctx, fallback=case.fallback)
        y = poison(torch.empty(ids.numel(), case.n, dtype=torch.bfloat16, device=dev))
        got, routing = ag(x, w1, ids, sorted_output=True, out=y, **_overrides(case))
        ctx.check()
        assert got.data_ptr() == y.data_ptr()
        ref = call.ref.reshape(-1, case.n)
        err = rel_err(got[routing.position.long()], ref)
        assert err < 1e-2, err
        assert torch.equal(routing.order[routing.position.long()].cpu(), torch.arange(ids.numel()))
        experts = ids.reshape(-1)[routing.order]
        assert torch.equal(torch.bincount(experts, minlength=case.experts).cumsum(0).cpu(),
                           routing.offsets[1:].long().cpu())
        assert bool((experts[1:] >= experts[:-1]).all())
        # the second GEMM on the sorted rows (K of w2 = n here), each rank's own w2
        w2 = rand((case.experts, case.n, 24), torch.bfloat16, dev, "w2s", r)
        g = torch.softmax(rand(tuple(ids.shape), torch.float32, dev, "gs"), dim=1)
        rs = to.MoEGEMMReduceScatter(ctx, fallback=case.fallback)
        out = poison(torch.empty(case.m_local, 24, dtype=torch.bfloat16, device=dev))
        rs(got, w2, ids, g, routing=routing, out=out)
        ctx.check()
        hs = got[routing.position.long()].view(ids.shape[0], ids.shape[1], case.n).double()
        mine = (_per_pair(hs, w2, ids) * g.double().unsqueeze(-1)).sum(1)
        total = torch.stack(ctx.gather_object(mine.cpu())).sum(0)[r * case.m_local:(r + 1) * case.m_local]
        err2 = rel_err(out, total)
        assert err2 < RS_TOL[torch.bfloat16], err2
        if routing.rank_runs and case.fallback == "never":
            # what lets moe_gemm_rs read h by TMA: each of its tiles' rows are consecutive sorted rows
            (src, _), table = rs.route(rs.schedule(ids.shape[0], 24, got.dtype, {}), ids, case.experts, routing)
            src = src.long().cpu()
            for _, first, end in table.tolist():
                assert torch.equal(src[first:end] - src[first], torch.arange(end - first)), (first, end)
        return max(err, err2), rs.last_gemm, routing.rank_runs, is_hopper(ctx) and gluon_available()


@pytest.mark.parametrize("fallback", ["never", "always"])
def test_sorted_layout_feeds_moe_gemm_rs(pool, fallback):
    pool.run(_sorted_pipeline, MoECase(m_local=13, k=32, n=24, experts=5, topk=2, m_per_chunk=4, fallback=fallback))


def test_sorted_layout_read_by_tma(pool):
    """On Hopper, moe_gemm_rs on a sorted layout with rank runs (one copy stream: the default) at a K the Gluon
    kernel takes: its grouped GEMM reads each tile's rows of h by TMA, checked against float64 as above (elsewhere
    the same call on the other kernels)."""
    if pool.backend == "host":
        pytest.skip("the Gluon grouped GEMM runs on Hopper only; the host backend checks the layout's runs")
    results = pool.run(_sorted_pipeline, MoECase(m_local=130, k=64, n=256, experts=4, topk=2, streams=1))
    assert all(runs and (gemm == "rs_grouped_hopper") == hopper for _, gemm, runs, hopper in results), results


def _rank_runs_agree(case):
    """AllGatherMoEGEMM.keeps_rank_runs, from the shapes alone, says what the MoERouting of a call without
    overrides says; returns it."""
    with to.Context(timeout_s=120) as ctx:
        x, w, ids = _ag_inputs(ctx, case, 0).args
        ag = to.AllGatherMoEGEMM(ctx, fallback="never", check_routing=False)
        _, routing = ag(x, w, ids, sorted_output=True)
        ctx.check()
        assert ag.keeps_rank_runs(case.m_local, case.k, case.n, case.experts, case.topk, x.dtype) \
            is routing.rank_runs
        return routing.rank_runs


def test_keeps_rank_runs_agrees_with_the_call(pool):
    """With one peer every layout has rank runs; with two or more, the host defaults' copy stream per peer
    interleaves their chunks (40 rows a rank: two chunks), and it has none."""
    runs = pool.run(_rank_runs_agree, MoECase(m_local=40, k=32, n=24, experts=5, topk=2))
    assert runs == [pool.world == 2] * pool.world or pool.backend != "host", runs


def _no_tokens(fallback):
    """No rank has a token: both ops return empty results (sorted too, with an empty layout) and launch nothing; a
    rank with tokens beside ranks without is refused on every rank; the ops run on after."""
    with to.Context(timeout_s=60) as ctx:
        dev, W, r, bf = ctx.device, ctx.world_size, ctx.rank, torch.bfloat16
        ag, rs = to.AllGatherMoEGEMM(ctx, fallback=fallback), to.MoEGEMMReduceScatter(ctx, fallback=fallback)
        w1, w2 = rand((5, 32, 24), bf, dev, "w1"), rand((5, 24, 16), bf, dev, "w2")
        ids = torch.empty(0, 2, dtype=torch.int64, device=dev)
        weights = torch.empty(0, 2, device=dev)
        y = ag(torch.empty(0, 32, dtype=bf, device=dev), w1, ids)
        rows, routing = ag(torch.empty(0, 32, dtype=bf, device=dev), w1, ids, sorted_output=True)
        assert y.shape == (0, 2, 24) and rows.shape == (0, 24) and routing.offsets.tolist() == [0] * 6
        out = rs(rows, w2, ids, weights, routing=routing)
        assert out.shape == (0, 16) and rs(y, w2, ids, weights).shape == (0, 16)
        some, got = 3 * (r == W - 1), None
        try:
            ag(torch.zeros(some, 32, dtype=bf, device=dev), w1, torch.zeros(some * W, 2, dtype=torch.int64,
                                                                              device=dev))
        except ValueError as e:
            got = str(e)
        # the ranks without tokens had agreed on their shape: they skip to the routing's agreement, the rank with
        # tokens asks for one on its shape, and each finds the other at another exchange of the call
        assert got is not None and "the ranks' calls differ" in got, got
        x = rand((3, 32), bf, dev, "x")
        ids = torch.randint(0, 5, (3 * W, 2), generator=torch.Generator().manual_seed(1)).to(dev)
        err = rel_err(ag(x, w1, ids), _per_pair(torch.cat([x] * W), w1, ids))
        ctx.check()
        return err


@pytest.mark.parametrize("fallback", ["never", "auto"])
def test_no_tokens(pool, fallback):
    if pool.world > 3:
        pytest.skip("W = 2 and 3")
    assert max(pool.run(_no_tokens, fallback)) < 2e-2


@pytest.mark.parametrize("name,case", [("ag_moe_gemm", 0), ("ag_moe_gemm", 5), ("moe_gemm_rs", 0),
                                       ("moe_gemm_rs", 2)])
def test_cases_at_every_world_size(pool, name, case):
    """Cases of each op at W = 3 and 4 too, whatever harness.host_case_share leaves out there (W = 2 runs them in
    the contract's tests): chunks of three and four ranks, arrival orders over three peers. (The host backend's W = 4
    runs the MoE ops as two hosts of two in test_topology only: tests/conftest.py HOST_W4.)"""
    if pool.world == 2:
        pytest.skip("W = 2: the contract's test_<op>_matches_reference runs the case")
    spec = contract.SPECS[name]
    worst = pool.run(contract.matches_reference, spec, spec.cases.on(pool)[case])
    assert max(worst) < max(spec.tol.values()), worst


# ----------------------------------------------------------------------------------------- rules and tables
def test_rank_runs():
    """The sorted layout has rank runs (MoERouting.rank_runs) when the peers' chunks arrive rank by rank, each
    rank's in order: with one copy stream within a host, not with several streams over three peers."""
    from triton_overlap.ops.all_gather_moe import rank_runs
    from triton_overlap.plan import ChunkLayout, arrival_times

    layout = ChunkLayout(4, 8, 4)  # two chunks a rank
    assert rank_runs(layout, [2, 3, 4, 5, 6, 7])
    assert not rank_runs(layout, [2, 4, 3, 5, 6, 7])
    assert not rank_runs(layout, [3, 2, 4, 5, 6, 7])
    for streams, runs in ((1, True), (3, False)):
        when = arrival_times(layout, 0, [(0, 1, 2, 3)], streams)
        assert rank_runs(layout, sorted(when, key=lambda c: (when[c], c))) is runs
    assert rank_runs(ChunkLayout(2, 8, 2), [4, 5, 6, 7])  # one peer


def test_fallback_rule():
    """"auto" takes the torch path on one rank and below a MiB of shard (AllGather) or of each rank's output
    (ReduceScatter), the overlap above; "always" and "never" as they say."""
    from refs import OfflineContext

    x_small, x_large = torch.empty(64, 1024, dtype=torch.bfloat16), torch.empty(1024, 1024, dtype=torch.bfloat16)
    for world, rule, small, large in ((1, "auto", True, True), (2, "auto", True, False), (2, "always", True, True),
                                      (2, "never", False, False)):
        ctx = OfflineContext(world_size=world)
        ag = to.AllGatherMoEGEMM(ctx, fallback=rule)
        assert (ag._use_fallback(x_small), ag._use_fallback(x_large)) == (small, large), (world, rule)
        rs = to.MoEGEMMReduceScatter(ctx, fallback=rule)
        assert (rs._use_fallback(64, 1024, 2), rs._use_fallback(1024, 1024, 2)) == (small, large), (world, rule)


def _kernel_choice(_):
    """The grouped GEMM each MoE call ran (op.last_gemm), each result checked against float64: on Hopper the Gluon
    kernels where K is a whole number of their steps (64 deep; 32 where AllGather-MoE gathers rows; 200 is neither),
    AllGather-MoE's reading rows by TMA where they are sent sorted (``send_rows``), the Triton kernels otherwise and
    where the config asks for them; elsewhere always the Triton kernels, rows sent sorted or not."""
    from refs import rel_err
    from triton_overlap.kernels.capability import gluon_available, is_hopper

    with to.Context(timeout_s=120) as ctx:
        big = ctx.backend == "cuda"
        hopper = is_hopper(ctx) and gluon_available()
        for spec, make, kernel, tol in ((AG_MOE, to.AllGatherMoEGEMM, "ag_grouped", 1e-2),
                                        (RS_MOE, to.MoEGEMMReduceScatter, "rs_grouped", RS_TOL[torch.bfloat16])):
            op = make(ctx, fallback="never")
            seen = []
            calls = ((256, "auto", False), (200, "auto", False), (256, "triton", True), (256, "auto", True))
            for k, gemm, rows in calls if big else ((32, "auto", False), (32, "auto", True)):
                case = MoECase(m_local=130 if big else 7, k=k, n=96 if big else 24, experts=4, topk=2)
                call = spec.inputs(ctx, case, 0)
                got = op(*call.args, gemm=gemm, send_rows=rows)
                ctx.check()
                assert rel_err(got, call.ref) < tol
                seen.append(op.last_gemm)
            by_tma = "+rows" if kernel == "ag_grouped" else ""
            want = [f"{kernel}_hopper" if hopper else f"{kernel}_gemm", f"{kernel}_gemm", f"{kernel}_gemm",
                    f"{kernel}_hopper{by_tma}" if hopper else f"{kernel}_gemm"] if big else [f"{kernel}_gemm"] * 2
            assert seen == want, (seen, want)
            with pytest.raises(ValueError, match="MoEGEMMConfig.gemm must be one of"):
                op(*call.args, gemm="cutlass")


def test_moe_kernel_choice(pool):
    pool.run(_kernel_choice, None)


def _graph_replays(case):
    """Both ops captured in one CUDA graph each (the routing tables and the kernels' scratch then live in the
    graph's own memory pool, fresh segments where a read past a buffer's edge faults), replayed with new inputs
    copied into the captured ones: every replay against float64; AllGather-MoE also with rows sent sorted."""
    from refs import poison, rel_err
    from triton_overlap.timing import capture

    with to.Context(timeout_s=120) as ctx:
        for spec, make, tol, kw in ((AG_MOE, to.AllGatherMoEGEMM, 1e-2, {}),
                                    (AG_MOE, to.AllGatherMoEGEMM, 1e-2, {"send_rows": True}),
                                    (RS_MOE, to.MoEGEMMReduceScatter, RS_TOL[torch.bfloat16], {})):
            op = make(ctx, fallback="never", check_routing=False)
            static = spec.inputs(ctx, case, 0)
            args = [a.clone() for a in static.args]
            out = {}
            graph = capture(lambda: out.update(y=op(*args, **kw)))
            for it in range(1, 4):
                call = spec.inputs(ctx, case, it)
                for a, b in zip(args, call.args):
                    a.copy_(b)
                poison(out["y"])
                graph.replay()
                torch.cuda.synchronize()
                ctx.check()
                assert rel_err(out["y"], call.ref) < tol, (spec.name, it)


def test_moe_graph_replays(pool):
    if pool.backend == "host":
        pytest.skip("CUDA graphs need a GPU")
    pool.run(_graph_replays, MoECase(m_local=384, k=256, n=320, experts=8, topk=4))


def _eager_replays(case):
    """Eager calls that repeat their tensors, new tokens and a new routing copied in, replay the op's own graph
    (ops.replay, with check_routing off): every call against float64; one capture, then replays. The sorted
    layout's routing is copied out of the graph: equal to an op's that does not replay, and a routing returned
    earlier keeps its values through later replays; the gathered tokens of a replayed call are this call's;
    MoE-ReduceScatter on that layout (TPMoE's path), replayed, equal to an op's that does not replay. With
    check_routing on (a host read per call) nothing is captured. ``case.send_rows``: every AllGather-MoE call's."""
    from refs import poison, rel_err

    with to.Context(timeout_s=120) as ctx:
        iters = 5
        plain = to.AllGatherMoEGEMM(ctx, fallback="never", check_routing=False, replay=False, name="t.plain")
        x, w, ids = (a.clone() for a in AG_MOE.inputs(ctx, case, 0).args)
        ov = set_fields(send_rows=case.send_rows)
        plain(x, w, ids, sorted_output=True, **ov)  # its buffers allocated before the loop: no graph dropped in it
        for spec, make, tol in ((AG_MOE, to.AllGatherMoEGEMM, 1e-2),
                                (RS_MOE, to.MoEGEMMReduceScatter, RS_TOL[torch.bfloat16])):
            op = make(ctx, fallback="never", check_routing=False)
            checked = make(ctx, fallback="never", name=f"t.checked.{spec.name}")
            first = spec.inputs(ctx, case, 0)
            args, out = [a.clone() for a in first.args], first.out
            checked(*args, out=out, **ov)  # (its buffers, before the loop)
            for it in range(iters):
                call = spec.inputs(ctx, case, it)
                for a, b in zip(args, call.args):
                    a.copy_(b)
                assert op(*args, out=poison(out), **ov) is out
                ctx.check()
                assert rel_err(out, call.ref) < tol, (spec.name, it)
                checked(*args, out=poison(out), **ov)
                assert rel_err(out, call.ref) < tol, (spec.name, "checked", it)
            assert op.replays.stats == {"replays": iters - 2, "captures": 1, "dropped": 0, "rebound": 0}, \
                op.replays.stats
            assert checked.replays.stats["captures"] == 0
        op = to.AllGatherMoEGEMM(ctx, fallback="never", check_routing=False, name="t.sorted")
        rs = to.MoEGEMMReduceScatter(ctx, fallback="never", check_routing=False, name="t.sorted_rs")
        rs_plain = to.MoEGEMMReduceScatter(ctx, fallback="never", check_routing=False, replay=False,
                                           name="t.sorted_rs_plain")
        dev, T = ctx.device, ids.shape[0]
        y = torch.empty(ids.numel(), case.n, dtype=torch.bfloat16, device=dev)
        w2 = rand((case.experts, case.n, 24), torch.bfloat16, dev, "w2s", ctx.rank)
        g = torch.softmax(rand(tuple(ids.shape), torch.float32, dev, "gs"), dim=1)
        fixed = None  # one routing's tensors at fixed addresses, so that moe_gemm_rs's key repeats
        z, z_plain = (torch.empty(T // ctx.world_size, 24, dtype=torch.bfloat16, device=dev) for _ in range(2))
        h0, r0 = plain(x, w, ids, sorted_output=True, **ov)
        rs(h0, w2, ids, g, routing=r0)  # (their buffers, before the loop)
        rs_plain(h0, w2, ids, g, routing=r0)
        kept = []
        for it in range(iters):
            call = AG_MOE.inputs(ctx, case, it)
            for a, b in zip((x, w, ids), call.args):
                a.copy_(b)
            got, routing, gathered = op(x, w, ids, sorted_output=True, return_gathered=True, out=poison(y), **ov)
            want, want_routing = plain(x, w, ids, sorted_output=True, **ov)
            ctx.check()
            assert torch.equal(got.cpu(), want.cpu()), it
            assert torch.equal(gathered.cpu(), torch.cat(ctx.gather_object(x.cpu())).to(gathered.dtype)), it
            for f in ("order", "position", "offsets"):
                assert torch.equal(getattr(routing, f).cpu(), getattr(want_routing, f).cpu()), (it, f)
            kept.append((routing, want_routing))
            if fixed is None:
                fixed = replace(routing, order=routing.order.clone(), position=routing.position.clone(),
                                offsets=routing.offsets.clone())
            for f in ("order", "position", "offsets"):
                getattr(fixed, f).copy_(getattr(routing, f))
            rs(got, w2, ids, g, routing=fixed, out=poison(z))
            rs_plain(got, w2, ids, g, routing=fixed, out=poison(z_plain))
            ctx.check()
            assert torch.equal(z.cpu(), z_plain.cpu()), ("rs on the sorted layout", it)
        for it, (routing, want_routing) in enumerate(kept):
            for f in ("order", "position", "offsets"):
                assert torch.equal(getattr(routing, f).cpu(), getattr(want_routing, f).cpu()), ("kept", it, f)
        assert op.replays.stats["captures"] == 1 and op.replays.stats["replays"] == iters - 2, op.replays.stats
        assert rs.replays.stats["captures"] == 1 and rs.replays.stats["replays"] >= iters - 3, rs.replays.stats


@pytest.mark.parametrize("send_rows", [None, True], ids=["default", "rows_sent"])
def test_moe_eager_replays(pool, send_rows):
    if pool.backend == "host":
        pytest.skip("CUDA graphs need a GPU")
    pool.run(_eager_replays, MoECase(m_local=384, k=256, n=320, experts=8, topk=4, send_rows=send_rows))


def _staging(_):
    """kernels.grouped_gemm.stage_rows as AllGather-MoE runs it where rows are sent sorted: every row whose arrival
    position is 0 (this rank's) becomes its token's row of this rank's shard, every other row is left as it was; K
    not a whole number of the kernel's column blocks, rows not a whole number of its row blocks."""
    from triton_overlap.kernels.grouped_gemm import stage_rows

    with to.Context(timeout_s=120) as ctx:
        m_local, K, topk, r, W, dev = 37, 300, 3, ctx.rank, ctx.world_size, ctx.device
        g = torch.Generator().manual_seed(7)
        x = torch.randn(m_local, K, generator=g).to(torch.bfloat16).to(dev)
        tokens = torch.arange(m_local * W).repeat(topk)  # every (token, choice) pair, in a shuffled order
        tokens = tokens[torch.randperm(tokens.numel(), generator=g)].to(torch.int32).to(dev)
        pos = torch.where(tokens // m_local == r, 0, 1 + tokens // m_local).to(torch.int32)
        staged = torch.full((tokens.numel(), K), float("nan"), dtype=torch.bfloat16, device=dev)
        stage_rows(ctx, x, staged, tokens, pos, m_local, r)
        ctx.after_launch()
        own = pos == 0
        assert int(own.sum()) == m_local * topk
        assert torch.equal(staged[own], x[(tokens[own] - r * m_local).long()])
        assert bool(staged[~own].isnan().all())


def test_stage_own_rows(pool):
    if pool.world != 2:
        pytest.skip("a kernel of each rank alone: W = 2 has a rank past 0")
    pool.run(_staging, None)


def test_config_rejects_odd_tiles():
    with pytest.raises(ValueError, match="block_c"):
        to.MoEGEMMConfig(block_c=24)
    with pytest.raises(ValueError, match="tile_lag"):
        to.MoEGEMMConfig(tile_lag=-0.5)
    with pytest.raises(ValueError, match="send_rows"):
        to.MoEGEMMConfig(send_rows="yes")


def test_rows_sent_where_read_by_tma():
    """AllGather-MoE's ranks send rows sorted by expert by default only where its grouped GEMM reads them by TMA
    and the weight shard has at least ROWS_MIN_N columns (docs/decisions.md); ``send_rows`` decides otherwise."""
    from triton_overlap.ops.moe_config import ROWS_MIN_N

    auto = to.MoEGEMMConfig()
    assert [auto.sends_rows(n, True) for n in (ROWS_MIN_N - 1, ROWS_MIN_N, 1 << 20)] == [False, True, True]
    assert not any(auto.sends_rows(n, False) for n in (1, ROWS_MIN_N, 1 << 20))
    assert to.MoEGEMMConfig(send_rows=True).sends_rows(1, False)
    assert not to.MoEGEMMConfig(send_rows=False).sends_rows(1 << 20, True)


def _rows_against_tokens(case):
    """The same calls with tokens sent and with rows sent sorted by expert (token-major and sorted outputs, the
    gathered tokens, the routing): equal, and the sorted layout keeps each rank's rows of an expert together."""
    with to.Context(timeout_s=120) as ctx:
        op = to.AllGatherMoEGEMM(ctx, fallback="never", check_routing=False, name="t.rows")
        for it in range(2):
            x, w, ids = AG_MOE.inputs(ctx, case, it).args
            base = dict(m_per_chunk=case.m_per_chunk)
            tok = op(x, w, ids, **base)
            rows = op(x, w, ids, send_rows=True, **base)
            assert torch.equal(rows.cpu(), tok.cpu()), it
            y_t, r_t, g_t = op(x, w, ids, sorted_output=True, return_gathered=True, **base)
            y_r, r_r, g_r = op(x, w, ids, sorted_output=True, return_gathered=True, send_rows=True, **base)
            ctx.check()
            assert torch.equal(g_r.cpu(), torch.cat(ctx.gather_object(x.cpu()))), it
            assert torch.equal(g_t.cpu(), g_r.cpu()) and r_r.rank_runs, it
            for f in ("order", "position", "offsets"):
                assert torch.equal(getattr(r_r, f).cpu(), getattr(r_t, f).cpu()) or not r_t.rank_runs, (it, f)
            assert torch.equal(y_r.cpu()[r_r.position.cpu().long()], y_t.cpu()[r_t.position.cpu().long()]), it


def test_rows_sent_against_tokens(pool):
    pool.run(_rows_against_tokens, MoECase(m_local=11, k=32, n=24, experts=5, topk=3, m_per_chunk=4))


def test_tile_lag():
    """AllGather-MoE's lanes (MoEGEMMConfig.lag_tiles): W * share * slots / chunks slots between two chunks'
    expected arrivals, so that this rank's ~1/W of them fill the share; by arrival (-1) where no chunk arrives or
    the lanes would cover the table; expert order (0) for tile_lag 0; the estimate grows with the link's share
    (more ranks, narrower experts, fewer choices)."""
    from triton_overlap.ops.moe_config import lag_estimate

    cfg = lambda lag: to.MoEGEMMConfig(tile_lag=lag)  # noqa: E731
    assert cfg(0.1).lag_tiles(600, 1, 2, 8, 2048, 2) == 120 and cfg(0.1).lag_tiles(600, 3, 4, 8, 2048, 2) == 80
    assert cfg(0.0).lag_tiles(600, 1, 2, 8, 2048, 2) == 0
    assert cfg(0.5).lag_tiles(600, 1, 2, 8, 2048, 2) == -1 and cfg(float("inf")).lag_tiles(600, 1, 2, 8, 2048, 2) == -1
    assert all(cfg(lag).lag_tiles(600, 0, 1, 8, 2048, 2) == -1 for lag in (None, 0.0, 0.1))
    est = lag_estimate(2, 8, 2048, 2)
    assert 0 < est < lag_estimate(4, 8, 2048, 2) and est < lag_estimate(2, 8, 768, 2) < lag_estimate(2, 2, 768, 2)
    assert cfg(None).lag_tiles(600, 1, 2, 8, 2048, 2) == cfg(est).lag_tiles(600, 1, 2, 8, 2048, 2) > 0


# ------------------------------------------------------------------------------------------------------ faults
@pytest.mark.parametrize("spec", ["ag_moe_gemm", "moe_gemm_rs"])
@pytest.mark.parametrize("repeated", [False, True], ids=["first_call", "repeated_call"])
def test_peer_absent(pool, spec, repeated):
    """contract.peer_absent: rank 1 never makes the call; the others' agreement (first call) or the call's barrier
    (repeated) times out naming rank 1, the Context refuses calls until reset(), then calls are right again."""
    if pool.world != 2:
        pytest.skip("W = 2")
    pool.run(contract.peer_absent, contract.SPECS[spec], repeated, contract.timeout_for(pool))


def _ag_chunk_never_lands(timeout_s: float):
    """A peer's chunk that never lands: the grouped GEMM's wait times out naming the rank, the op, the peer and
    the chunk (a simulated world of two, as rank 0, with rank 1's flags down)."""
    from triton_overlap.kernels.grouped_gemm import launch_ag_grouped
    from triton_overlap.ops.all_gather_moe import AllGatherMoESchedule
    from triton_overlap.ops.moe_routing import arrival_segments
    from triton_overlap.plan import ChunkLayout

    with to.Context(timeout_s=timeout_s) as ctx:
        dev, m_local, K, N, E = ctx.device, 8, 32, 16, 3
        layout = ChunkLayout(2, m_local, 4)
        cfg = to.MoEGEMMConfig.defaults(ctx)
        x = rand((m_local, K), torch.bfloat16, dev, "x0")
        ws = torch.zeros(2 * m_local, K, dtype=torch.bfloat16, device=dev)
        w = rand((E, K, N), torch.bfloat16, dev, "w")
        ids = torch.arange(2 * m_local * 2, device=dev).view(-1, 2) % E
        cpr = layout.chunks_per_rank
        arriving = list(range(cpr, 2 * cpr))
        sched = AllGatherMoESchedule(cfg, None, layout, arrival_segments(layout, 0, arriving, dev),
                                     torch.tensor([0] + arriving, dtype=torch.int32, device=dev))
        _, routes, table = to.AllGatherMoEGEMM.route(sched, ids, E, False)
        out = torch.empty(ids.numel(), N, dtype=torch.bfloat16, device=dev)
        flags = torch.ones(layout.num_chunks, dtype=torch.int32, device=dev)
        ref = _per_pair(torch.cat([x, ws[m_local:]]), w, ids).reshape(-1, N)

        def first_ok():
            assert (out.double() - ref).abs().max() < 0.1

        return late_chunk_faults(ctx, flags, "ag_moe_gemm", "[01]", lambda op: launch_ag_grouped(
            ctx, cfg, x, ws, w, out, routes, table, flags, layout, op=op, rank=0), first_ok)


def test_ag_moe_wait_times_out(pool):
    if pool.backend == "host" and pool.world != 2:
        pytest.skip("a simulated world: run once on the host backend, at W = 2")
    assert_own_fault(pool.run(_ag_chunk_never_lands, contract.timeout_for(pool)))
