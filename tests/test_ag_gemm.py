"""AllGather-GEMM against all_gather + matmul in float32: the op's specs (bf16/fp16 and fp8) and cases, which get
the contract's tests (tests/contract.py), then the op's own rules and kernels."""
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist

import contract
import triton_overlap as to
from contract import Call, Cases, Faults, GemmCase, OpSpec, Variants, gemm_weight, set_fields
from refs import (TOL, assert_own_fault, check_replays, late_chunk_faults, on_hopper, plain_gemm_worst, poison, rand,
                  rel_err)
from triton_overlap.ops.config import AllGatherGEMMConfig
from triton_overlap.plan import cdiv


@dataclass(frozen=True, kw_only=True)
class AGCase(GemmCase):
    """Each rank's [m_local, k] shard of A, gathered and multiplied by the rank's own weight, as GemmCase says.
    ``gathered``: the call also returns the gathered rows, which must equal every rank's shard. ``mode`` and
    ``consumer_first``: the call's config where set (None: the op's own; the mode is then push); ``gemm`` "gluon" or
    "triton" also checks, on compute capability 9.0, that the op ran that GEMM."""
    m_local: int
    gathered: bool = True
    mode: str | None = None
    consumer_first: bool | None = None


def _inputs(ctx, case, it):
    dtype = getattr(torch, case.dtype)
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    shards = [rand((case.m_local, case.k), dtype, dev, "a", it, s) for s in range(W)]
    w = gemm_weight(case, lambda shape, *seed: rand(shape, dtype, dev, *seed), "w", it, r)
    b = rand((case.n,), dtype, dev, "b", it, r) if case.bias else None
    full = torch.cat(shards)
    kwargs = dict(bias=b, **set_fields(return_gathered=case.gathered or None, m_per_chunk=case.m_per_chunk,
                                       num_streams=case.streams, mode=case.mode, tma=case.tma, gemm=case.gemm,
                                       consumer_first=case.consumer_first))
    out = torch.empty((case.m_local * W, case.n), dtype=dtype, device=dev)
    return Call((shards[r], w), kwargs, full.float() @ w.float() + (b.float() if case.bias else 0), out,
                {"gathered": full})


def _workspace(ctx, case, dtype):
    """This rank's workspace, once every rank is done with it. Pull mode: a peer reads our workspace's own rows
    until its call has finished. The op's next call waits for that (its first barrier); garbage written from
    outside the op must wait too, or a fast rank overwrites rows a slow peer is still pulling (seen once in CI,
    host, W = 2)."""
    ws = ctx.symmetric("ag_gemm.ws", (case.m_local * ctx.world_size, case.k), dtype)
    ctx.synchronize()
    dist.barrier(group=ctx.group)
    return ws.local


def _garbage(ctx, op, case, it):
    if it:  # stale garbage where peers write
        ws = _workspace(ctx, case, getattr(torch, case.dtype))
        ws.copy_(torch.randn_like(ws, dtype=torch.float32))


def _on_hopper(ctx) -> bool:
    return ctx.backend == "cuda" and torch.cuda.get_device_capability(ctx.device) == (9, 0)


def _check(ctx, op, case, call, result):
    if case.gemm is not None and _on_hopper(ctx):
        assert op.last_gemm == ("gemm_gather_hopper" if case.gemm == "gluon" else "gemm"), op.last_gemm
    if case.gathered:
        assert torch.equal(result[1].cpu(), call.expect["gathered"].cpu()), "gathered rows differ"


def _bad_inputs(ctx):
    dev, W = ctx.device, ctx.world_size
    bf = torch.bfloat16
    op = to.AllGatherGEMM(ctx, fallback="never", max_m=64 * W)
    a = rand((16, 32), bf, dev, "a")
    w = rand((32, 24), bf, dev, "w")
    bad = [
        ("inner dimensions", lambda: op(a, rand((31, 24), bf, dev, "w"))),
        ("different dtypes", lambda: op(a, w.half())),
        ("float16, bfloat16 or float8_e4m3fn", lambda: op(a.float(), w.float())),
        ("2-D", lambda: op(a[None], w)),
        ("max_m", lambda: op(rand((65, 32), bf, dev, "a"), w)),
        ("is on", lambda: op(a.to("meta"), w)),
        ("bias", lambda: op(a, w, rand((23,), bf, dev, "b"))),
        # ranks that disagree on the shard shape all get the error, none hangs
        ("ranks disagree", lambda: op(rand((16 + ctx.rank, 32), bf, dev, "a"), w)),
    ]
    return op, bad, Call((a, w), {}, torch.cat([a.float()] * W) @ w.float())


def _b2b(m_local, k, n):
    return AGCase(m_local=m_local, k=k, n=n, gathered=False)


#: a tiny shard: fallback="auto" takes the NCCL path
SMALL = AGCase(m_local=8, k=16, n=8, bias=True, gathered=False)


AG_GEMM = OpSpec(
    name="ag_gemm", module=__name__, op=to.AllGatherGEMM, functional=to.ag_gemm, inputs=_inputs, stale=_garbage,
    check=_check, bad_inputs=_bad_inputs,
    cases=Cases(
        host=(
            AGCase(m_local=37, k=48, n=40, bias=True, m_per_chunk=16, iters=2),
            AGCase(m_local=29, k=64, n=33, dtype="float16", transposed=True, m_per_chunk=7, streams=1, jitter=0.003,
                   iters=2),
            AGCase(m_local=64, k=40, n=24, jitter=0.003),
            AGCase(m_local=37, k=48, n=40, bias=True, transposed=True, m_per_chunk=16, jitter=0.003, iters=2,
                   mode="pull"),
            AGCase(m_local=29, k=64, n=33, dtype="float16", m_per_chunk=7, streams=1, jitter=0.02, iters=2,
                   mode="pull"),  # delays: slow pulls, fast peer
            # whole tiles of rows per rank: the descriptor (TMA) path, with W's transpose as B
            AGCase(m_local=64, k=48, n=40, dtype="float16", bias=True, transposed=True, m_per_chunk=32, jitter=0.003,
                   iters=2, mode="pull"),
            AGCase(m_local=64, k=48, n=40, bias=True, m_per_chunk=16, tma=True),  # descriptors for B stored [K, N]
        ),
        gpu=(
            AGCase(m_local=4091, k=1024, n=1536, bias=True, m_per_chunk=512, iters=3),
            AGCase(m_local=4091, k=512, n=1000, dtype="float16", transposed=True, m_per_chunk=1000, streams=1,
                   jitter=0.001, iters=3),
            AGCase(m_local=2048, k=4096, n=4096, transposed=True, iters=3),
            AGCase(m_local=128, k=256, n=512, bias=True, m_per_chunk=37, jitter=0.0005, iters=3),
            AGCase(m_local=4091, k=1024, n=1536, bias=True, transposed=True, m_per_chunk=512, jitter=0.0005, iters=3,
                   mode="pull"),
            # kernels.gemm with descriptors, B stored [K, N] (on Hopper the Gluon GEMM is the default: asked off)
            AGCase(m_local=4096, k=1024, n=1536, bias=True, m_per_chunk=512, iters=3, tma=True, gemm="triton"),
            # the Gluon GEMM (Hopper; kernels.gemm elsewhere): K and N off the tiles, chunks across tiles, both B
            # layouts
            AGCase(m_local=2048, k=1000, n=1000, bias=True, m_per_chunk=300, jitter=0.0005, iters=3, gemm="gluon"),
            AGCase(m_local=1024, k=520, n=776, dtype="float16", transposed=True, m_per_chunk=384, streams=1,
                   jitter=0.0005, iters=3, mode="pull", gemm="gluon"),
        )),
    large_cases={"odd_rows_4091_per_rank": AGCase(m_local=4091, k=32, n=24, m_per_chunk=1024)},
    back_to_back=Variants(
        host=_b2b(19, 32, 32), gpu=_b2b(1024, 1024, 1024), calls=100,
        ids={"producers_first": dict(consumer_first=False), "consumer_first": dict(consumer_first=True),
             "pull": dict(consumer_first=False, mode="pull"), "pull_consumer_first": dict(consumer_first=True,
                                                                                            mode="pull")},
        host_skips=dict.fromkeys(("consumer_first", "pull_consumer_first"), "launch order only matters on GPUs (the "
                                 "host backend runs kernels synchronously)")),
    falls_back=Cases(host=(SMALL,), gpu=(SMALL,)),
    replay=Variants(host=None, gpu=_b2b(1024, 512, 768), calls=50, ids={"push": {}, "pull": dict(mode="pull")}),
    # the fault bodies' call (test_faults, test_topology): 8 rows a rank (12 and 16 where ranks disagree)
    faults=Faults(case=AGCase(m_local=8, k=32, n=24, gathered=False), rows=lambda case, n: replace(case, m_local=n),
                  header=lambda case: f"ag_gemm {case.m_local} {case.k}"),
)


# ------------------------------------------------------------------------------------------------------- fp8
FP8 = torch.float8_e4m3fn


def _fp8(shape, device, *seed):
    """e4m3 values spread over its range (x 8), the same on every rank for the same seed."""
    return (rand(shape, torch.float32, "cpu", *seed) * 8).to(FP8).to(device)


@dataclass(frozen=True, kw_only=True)
class FP8Case:
    """As AGCase, with e4m3 shards and weights and the output in ``out_dtype``: (all_gather(a) @ w) * scale_a *
    scale_b (+ bias) against float32 on the dequantised inputs, the scales new every call; ``fallback``: the op's
    rule ("always": NCCL/Gloo + torch._scaled_mm, or our GEMM where _scaled_mm refuses the layout)."""
    m_local: int
    k: int
    n: int
    bias: bool = False
    transposed: bool = False
    out_dtype: str = "bfloat16"
    iters: int = 1
    fallback: str = "never"
    gathered: bool = True
    m_per_chunk: int | None = None
    tma: bool | None = None


def _fp8_inputs(ctx, case, it):
    out_dtype = getattr(torch, case.out_dtype)
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    shards = [_fp8((case.m_local, case.k), dev, "a8", it, s) for s in range(W)]
    w = gemm_weight(case, lambda shape, *seed: _fp8(shape, dev, *seed), "w8", it, r)
    b = rand((case.n,), out_dtype, dev, "b8", it, r) if case.bias else None
    sa = torch.tensor([0.25 * (it + 1)], device=dev)
    sb = rand((1,), torch.float32, dev, "sb", it, r).abs() / 64
    full = torch.cat(shards)
    kwargs = dict(bias=b, scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                  **set_fields(return_gathered=case.gathered or None, m_per_chunk=case.m_per_chunk, tma=case.tma))
    out = torch.empty((case.m_local * W, case.n), dtype=out_dtype, device=dev)
    ref = (full.float() @ w.float()) * sa * sb + (b.float() if case.bias else 0)
    return Call((shards[r], w), kwargs, ref, out, {"gathered": full})


def _fp8_garbage(ctx, op, case, it):
    if it and case.fallback == "never":  # stale bytes where peers write (NaN codes included)
        _workspace(ctx, case, FP8).view(torch.uint8).random_(0, 256)


def _fp8_check(ctx, op, case, call, result):
    assert contract.output(result).dtype == getattr(torch, case.out_dtype)
    if case.gathered:
        want = call.expect["gathered"]
        assert torch.equal(result[1].view(torch.uint8).cpu(), want.view(torch.uint8).cpu()), "gathered rows differ"


def _fp8_bad_inputs(ctx):
    dev, W = ctx.device, ctx.world_size
    op = to.AllGatherGEMM(ctx, fallback="never")
    a, w = _fp8((16, 32), dev, "a"), _fp8((32, 24), dev, "w")
    one = torch.ones(1, device=dev)
    bad = [
        ("need scale_a", lambda: op(a, w, scale_b=one)),
        ("need scale_b", lambda: op(a, w, scale_a=one, scale_b=one.double())),
        ("per-tensor", lambda: op(a, w, scale_a=torch.ones(2, device=dev), scale_b=one)),
        ("out_dtype must be float16 or bfloat16", lambda: op(a, w, scale_a=one, scale_b=one, out_dtype=torch.float32)),
        ("bias must be torch.float16", lambda: op(a, w, rand((24,), torch.bfloat16, dev, "b"), scale_a=one,
                                                  scale_b=one, out_dtype=torch.float16)),
        ("are for float8_e4m3fn", lambda: op(a.to(torch.bfloat16), w.to(torch.bfloat16), scale_a=one, scale_b=one)),
        ("float16, bfloat16 or float8_e4m3fn", lambda: op(a.to(torch.float8_e5m2), w.to(torch.float8_e5m2),
                                                          scale_a=one, scale_b=one)),
        # GEMM-RS takes no fp8
        ("float16 or bfloat16", lambda: to.GEMMReduceScatter(ctx, fallback="never")(_fp8((16 * W, 32), dev, "a"), w)),
        ("out must be torch.bfloat16", lambda: op(a, w, scale_a=one, scale_b=one,
                                                  out=torch.empty((16 * W, 24), dtype=FP8, device=dev))),
    ]
    good = Call((a, w), dict(scale_a=one, scale_b=one * 2), (torch.cat([a.float()] * W) @ w.float()) * 2)
    return op, bad, good


AG_GEMM_FP8 = OpSpec(
    name="ag_gemm_fp8", module=__name__, op=to.AllGatherGEMM, inputs=_fp8_inputs, stale=_fp8_garbage,
    check=_fp8_check, bad_inputs=_fp8_bad_inputs,
    cases=Cases(
        host=(
            FP8Case(m_local=37, k=48, n=40, bias=True, m_per_chunk=16, iters=2),  # pointers, a tile across two ranks
            FP8Case(m_local=64, k=64, n=48, transposed=True, m_per_chunk=32, out_dtype="float16",
                    iters=2),  # weight.t(): the gather descriptor path
            FP8Case(m_local=64, k=48, n=40, bias=True, m_per_chunk=16, tma=True),  # descriptors for B stored [K, N]
            FP8Case(m_local=32, k=64, n=48, bias=True, transposed=True, fallback="always"),  # + torch._scaled_mm
            FP8Case(m_local=29, k=40, n=24, out_dtype="float16", fallback="always"),  # + our GEMM (_scaled_mm refuses)
        ),
        gpu=(
            FP8Case(m_local=4096, k=1024, n=1536, bias=True, transposed=True, m_per_chunk=512, iters=3),  # descriptors
            FP8Case(m_local=4091, k=1024, n=1536, bias=True, m_per_chunk=512, iters=3),  # pointers, B [K, N]
            FP8Case(m_local=2048, k=4096, n=4096, transposed=True, out_dtype="float16", iters=3),
            FP8Case(m_local=4096, k=1024, n=1536, m_per_chunk=1024, tma=True, iters=2),  # descriptors, B [K, N]
            FP8Case(m_local=1024, k=512, n=768, bias=True, transposed=True, iters=2, fallback="always"),
            FP8Case(m_local=1000, k=520, n=760, bias=True, iters=2, fallback="always"),
        )),
    # in a CUDA graph the scales are read when the graph runs, so a replay follows new scale values
    replay=Variants(host=None, gpu=FP8Case(m_local=1024, k=512, n=768, transposed=True, gathered=False), calls=20),
)

# the contract's tests: test_ag_gemm_matches_reference, test_ag_gemm_odd_rows_4091_per_rank,
# test_ag_gemm_100_back_to_back_calls, test_ag_gemm_bad_input_raises_before_launch,
# test_ag_gemm_small_shapes_fall_back, test_ag_gemm_cuda_graph_replay, and test_ag_gemm_fp8_matches_reference,
# test_ag_gemm_fp8_bad_input_raises_before_launch, test_ag_gemm_fp8_cuda_graph_replay
globals().update(contract.tests(AG_GEMM))
globals().update(contract.tests(AG_GEMM_FP8))


# ------------------------------------------------------------------------------------------ the op's own rules

def test_eager_rule_thresholds():
    """The eager host-cost rule: GPU backends only, scaled by the number of peers, never while capturing."""
    from triton_overlap.ops.base import eager_host_bound

    T = to.AllGatherGEMM.EAGER_MIN_FLOP_PER_PEER
    assert T > 0 and to.GEMMReduceScatter.EAGER_MIN_FLOP_PER_PEER > 0
    assert eager_host_bound(False, 2, T * 0.99, T, capturing=False)
    assert not eager_host_bound(False, 2, T, T, capturing=False)
    assert eager_host_bound(False, 4, T * 2.99, T, capturing=False)
    assert not eager_host_bound(False, 4, T * 3, T, capturing=False)
    assert not eager_host_bound(False, 2, 1.0, T, capturing=True)
    assert not eager_host_bound(True, 2, 1.0, T, capturing=False)
    assert not eager_host_bound(False, 1, 1.0, T, capturing=False)


def _eager_rule(m_local, k, n):
    """Both GEMM ops with fallback="auto" (and no replay of their own graphs) on a GEMM far under the eager
    threshold: the first call of the shape overlapped (it prepares workspaces and kernels), later eager calls
    NCCL, the overlap again when captured in a CUDA graph; all correct."""
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        w = rand((k, n), torch.bfloat16, dev, "w")
        a = torch.empty((m_local, k), dtype=torch.bfloat16, device=dev)
        ag, rs = to.AllGatherGEMM(ctx, replay=False), to.GEMMReduceScatter(ctx, replay=False)  # test_replay: with
        out = torch.empty((m_local * W, n), dtype=torch.bfloat16, device=dev)

        def load_ag(i):
            a.copy_(rand((m_local, k), torch.bfloat16, dev, "a", i, r))
            return torch.cat([rand((m_local, k), torch.bfloat16, dev, "a", i, s) for s in range(W)]).float() @ w.float()

        ref = load_ag(-2)
        for want in ("overlap", "fallback"):
            poison(out)
            ag(a, w, out=out)
            assert ag.last_path == want
            assert rel_err(out, ref) < TOL[torch.bfloat16]
        check_replays(lambda: ag(a, w, out=out), out, 5, load_ag)
        assert ag.last_path == "overlap"
        big = torch.empty((m_local * W, k), dtype=torch.bfloat16, device=dev)
        # GEMM-RS's output wide enough that its tiles (at most 128 x 256) span more than one wave of the SMs: one
        # wave takes NCCL from the first call on (gemm_reduce_scatter.one_wave)
        n_rs = 256 * (ctx.num_compute_units() // (W * cdiv(m_local, 128)) + 1)
        w_rs = rand((k, n_rs), torch.bfloat16, dev, "w_rs")
        rs_out = torch.empty((m_local, n_rs), dtype=torch.bfloat16, device=dev)

        def load_rs(i):
            big.copy_(rand((m_local * W, k), torch.bfloat16, dev, "rs", i, r))
            parts = sum(rand((m_local * W, k), torch.bfloat16, dev, "rs", i, s).float() for s in range(W))
            return (parts @ w_rs.float())[r * m_local:(r + 1) * m_local]

        ref_rs = load_rs(-2)
        for want in ("overlap", "fallback"):
            rs(big, w_rs, out=poison(rs_out))
            assert rs.last_path == want
            assert rel_err(rs_out, ref_rs) < TOL[torch.bfloat16]
        check_replays(lambda: rs(big, w_rs, out=rs_out), rs_out, 5, load_rs)
        assert rs.last_path == "overlap"
        # with replay on the eager rule sends nothing to NCCL until the ranks agree that keys do not repeat (whether
        # a key has its graph differs between ranks, the path must not): a new key of a prepared shape overlaps,
        # eagerly (its layout's second eager call builds the launch that copies the shard, which graphs rebound to
        # other tensors take), then captured as its layout's reference (ops.replay rebinds layouts), then captured
        # as its own key, replayed from the next call
        rep = to.AllGatherGEMM(ctx, name="ag_gemm.rep")
        ref = load_ag(-3)
        rep(a, w, out=poison(out))
        assert rep.last_path == "overlap" and rel_err(out, ref) < TOL[torch.bfloat16]
        out2 = torch.empty_like(out)
        for want in ("overlap", "overlap", "overlap"):
            rep(a, w, out=poison(out2))
            assert rep.last_path == want
            assert rel_err(out2, ref) < TOL[torch.bfloat16]
        # (a capturing call replays the new graph without counting it)
        assert rep.replays.stats == {"replays": 0, "captures": 2, "dropped": 0, "rebound": 0}, rep.replays.stats
        rep(a, w, out=poison(out2))
        assert rep.replays.stats["replays"] == 1 and rel_err(out2, ref) < TOL[torch.bfloat16]
        ctx.check()
        return True


def test_eager_rule_on_gpu(pool):
    if pool.backend == "host":
        pytest.skip("the eager rule applies on GPUs only (test_eager_rule_thresholds covers its arithmetic)")
    assert all(pool.run(_eager_rule, 1024, 512, 768))


def test_chunk_rows_rule():
    """chunk_rows: about chunks_per_rank chunks of whole block_m tiles, fewer where min_chunk_bytes asks for bigger
    ones, at least one; m_per_chunk exact."""
    cfg = AllGatherGEMMConfig(block_m=128, chunks_per_rank=4, min_chunk_bytes=16 << 20)
    row = 4096 * 2  # bf16, K = 4096
    assert cfg.chunk_rows(8192) == 2048  # no row size given: 4 chunks
    assert cfg.chunk_rows(8192, row) == 2048  # 64 MiB shard: 4 chunks of 16 MiB
    assert cfg.chunk_rows(4096, row) == 2048  # 32 MiB: 2 chunks
    assert cfg.chunk_rows(1024, row) == 1024  # 8 MiB: one chunk
    assert cfg.chunk_rows(64, row) == 64  # fewer rows than a tile: one chunk of all of them
    assert AllGatherGEMMConfig(block_m=128, chunks_per_rank=4).chunk_rows(1024, row) == 256  # the rule off
    assert AllGatherGEMMConfig(block_m=128, m_per_chunk=100, min_chunk_bytes=16 << 20).chunk_rows(1024, row) == 100


def test_descriptor_rule():
    """GemmTiles.tma and desc_layout: when the GEMM loads tiles through descriptors, and how B is described."""
    from triton_overlap.kernels.gemm_operands import GemmTiles, desc_layout

    host, hip = "host", "hip"
    auto, on, off = GemmTiles(block_m=32), GemmTiles(block_m=32, tma=True), GemmTiles(block_m=32, tma=False)
    a = torch.zeros(64, 48, dtype=torch.bfloat16)
    ws = torch.zeros(128, 48, dtype=torch.bfloat16)
    kn = torch.zeros(48, 40, dtype=torch.bfloat16)
    nk = torch.zeros(40, 48, dtype=torch.bfloat16).t()
    assert desc_layout(host, auto, a, None, kn, 64, False) is None  # [K, N]: pointers unless tma=True
    assert desc_layout(host, on, a, None, kn, 64, False) == "kn"
    assert desc_layout(host, auto, a, None, nk, 64, False) == "nk"  # weight.t(): descriptors by default
    assert desc_layout(host, off, a, None, nk, 64, False) is None
    assert desc_layout(hip, on, a, None, nk, 64, False) is None  # not on AMD
    assert desc_layout(host, on, a, ws, nk, 64, True) == "nk"  # gather: whole tiles of rows per rank
    assert desc_layout(host, on, a[:48], ws[:96], nk, 48, True) is None  # 48 rows per rank: a tile spans two ranks
    odd = torch.zeros(64, 45, dtype=torch.bfloat16)  # 90-byte rows: no descriptor can step them
    assert desc_layout(host, on, odd, None, torch.zeros(45, 40, dtype=torch.bfloat16), 64, False) is None
    wide = torch.zeros(40, 50, dtype=torch.bfloat16)[:, :48].t()  # weight.t() with rows 100 bytes apart
    assert desc_layout(host, on, a, None, wide, 64, False) is None


def test_pull_gates_the_consumer():
    """Pull's opening copy within the GPU needs SMs, so the consumer starts after the producer's opening steps
    (the caller's stream waits for the first producer stream before the consumer); push lets the consumer start
    at once. The order of steps as the pipeline enqueues them, with recording stand-ins for streams and Context."""
    from types import SimpleNamespace

    from triton_overlap.plan import ChunkLayout, gather_schedule
    from triton_overlap.producers import gather, pipeline

    log = []

    class S:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    caller, first = S("caller"), S("first")
    ctx = SimpleNamespace(num_hosts=1, local_ranks=[0, 1], holds_for_link=False, backend="cuda", interpreted=False,
                          synchronous_launches=False, current_stream=lambda: caller, streams=lambda n: [first])
    for mode, consumer_first in [("push", True), ("push", False), ("pull", True), ("pull", False)]:
        g = gather.Gather(ctx, gather_schedule(ChunkLayout(2, 8, 4), 0, [(0, 1)], mode=mode), [], None)
        g.open = lambda ctx, stream: log.append("open")
        g.enqueue = lambda ctx, streams: log.append("copies")
        g.finish = lambda ctx: log.append("finish")
        log.clear()
        pipeline.run(ctx, g, lambda: log.append("consumer"), consumer_first=consumer_first)
        gated = log.index("caller waits first") < log.index("consumer")
        assert gated == (mode == "pull") == g.gate_consumer, (mode, consumer_first, log)
        assert log.index("open") < log.index("caller waits first") and log[-1] == "finish", log


def test_gluon_rule():
    """The Gluon GEMM is taken only when asked for or by default (with push), never with descriptors or TMA stores
    off, never on the host backend, never where a rank's rows are not whole 128-row tiles or for fp8."""
    from types import SimpleNamespace

    from triton_overlap.kernels import gemm_gather_hopper
    from triton_overlap.ops.all_gather_gemm import wants_gluon
    from triton_overlap.ops.base import with_tiles

    C = AllGatherGEMMConfig
    for cfg in (C(gemm="triton"), C(gemm="gluon", tma=False), C(gemm="gluon", tma_store=False)):
        assert not wants_gluon(cfg), cfg
    assert wants_gluon(C(gemm="gluon")) and wants_gluon(C(gemm="gluon", tma=True))
    assert wants_gluon(C()) and C().gemm == "auto"
    assert not wants_gluon(C(mode="pull")) and wants_gluon(C(mode="pull", gemm="gluon"))  # pull: asked for only
    assert wants_gluon(C(mode="pull"), "push")  # the call's mode (push across hosts) decides
    with pytest.raises(ValueError, match="gemm"):
        C(gemm="cublas")
    cfg = C(m_per_chunk=384)
    t = gemm_gather_hopper.TILES
    got = with_tiles(cfg, t)
    assert (got.block_m, got.block_n, got.block_k, got.num_stages) == (t.block_m, t.block_n, t.block_k, t.num_stages)
    assert got.m_per_chunk == 384 and with_tiles(cfg, t) is got  # made once per config
    a = torch.empty((1024, 64), dtype=torch.bfloat16)
    ws = torch.empty((2048, 64), dtype=torch.bfloat16)
    w = torch.empty((64, 256), dtype=torch.bfloat16)
    c = torch.empty((2048, 256), dtype=torch.bfloat16)
    assert gemm_gather_hopper.layout_for(SimpleNamespace(backend="host"), a, ws, w, c, 1024) is None
    cuda = SimpleNamespace(backend="cuda")
    assert gemm_gather_hopper.layout_for(cuda, a[:1000], ws[:2000], w, c[:2000], 1000) is None  # 1000-row ranks
    f8 = torch.float8_e4m3fn
    assert gemm_gather_hopper.layout_for(cuda, a.to(f8), ws.to(f8), w.to(f8), c, 1024) is None


def test_gather_a_planes():
    """A for the AllGather GEMMs' one descriptor (kernels.gemm_operands.gather_a): two planes, the shard and the
    workspace, where one descriptor spans both (our rows at gathered row - rank * m_local in the shard's plane; the
    workspace untouched); else the workspace alone, after the shard is copied into its own rows (here: the shard's
    row stride differs; on GPUs also shard and workspace too far apart, as torch's allocator and cudaMalloc can place
    them)."""
    from triton_overlap.kernels.gemm_operands import gather_a

    buf = torch.empty(3 * 1024 * 64, dtype=torch.bfloat16)
    a, ws = buf[:1024 * 64].view(1024, 64), buf[1024 * 64:].view(2048, 64)
    a.copy_(torch.randn(1024, 64))
    ws.fill_(float("nan"))
    base, shape, strides, planes = gather_a(a, ws, 2048, 1)
    assert (shape, strides, planes) == ([2, 2048, 64], [1024 * 64, 64, 1], (0, 1, 1024))
    assert base.data_ptr() == a.data_ptr() and ws.isnan().all()
    wide = torch.randn(1024, 72).to(torch.bfloat16)[:, :64]
    base, shape, strides, planes = gather_a(wide, ws, 2048, 1)
    assert (shape, strides, planes) == ([1, 2048, 64], [2048 * 64, 64, 1], (0, 0, 0))
    assert base.data_ptr() == ws.data_ptr()
    assert torch.equal(ws[1024:], wide) and ws[:1024].isnan().all()  # our rows only
    base, shape, strides, planes = gather_a(a, a, 1024, 0)  # one rank: the shard is the workspace
    assert (base.data_ptr(), shape, planes) == (a.data_ptr(), [1, 1024, 64], (0, 0, 0))


def _plain_gather_hopper():
    """kernels.gemm_gather_hopper.plain_gemm_hopper (AllGather-GEMM's consumer alone in benchmarks) against float32
    matmul (refs.plain_gemm_worst): B as [K, N] and as weight.t(), with and without bias, K and N not multiples of
    the tile, more tiles than programs, two K steps. "skip" where the kernel cannot run."""
    from triton_overlap.kernels import gemm_gather_hopper as gh

    with to.Context(timeout_s=120) as ctx:
        if (ctx.backend != "cuda" or torch.cuda.get_device_capability(ctx.device) != (9, 0)
                or not gh.gluon_available()):
            return "skip"
        return plain_gemm_worst(ctx, gh.plain_gemm_hopper, "plain_gemm_hopper",
                                ((384, 1000, 520, False, True), (4096, 512, 2056, True, False),
                                 (1024, 72, 4096, True, True)))


def _staged_case(case):
    """contract.matches_reference with no descriptor spanning the shard and the workspace (as when the two lie 2^40
    bytes apart or more): the GEMM (the Gluon one or kernels.gemm's descriptor path) reads this rank's rows from the
    workspace, copied there before the launch. Returns the worst error and how often a GEMM asked for the span."""
    from triton_overlap.kernels import gemm_operands

    calls = []
    spans = gemm_operands.pair_gap
    gemm_operands.pair_gap = lambda a, ws: calls.append(1)  # None: no span
    try:
        return contract.matches_reference(AG_GEMM, case), len(calls)
    finally:
        gemm_operands.pair_gap = spans


#: (host, GPU) case indices: descriptors with pull and with push (host); kernels.gemm's descriptors with push, the
#: Gluon GEMM with push and with pull (GPUs; kernels.gemm where the Gluon GEMM cannot run)
STAGED = ([5, 6], [5, 6, 7])


@pytest.mark.parametrize("case", range(3))
def test_shard_copied_into_workspace(pool, case):
    """Where one descriptor cannot span the shard and the workspace, the GEMM reads the shard from the workspace's
    own rows (both B layouts, push and pull, chunks across tiles) and matches the reference."""
    host = pool.backend == "host"
    picks = STAGED[0] if host else STAGED[1]
    if case >= len(picks):
        pytest.skip("no such case for this backend")
    for err, calls in pool.run(_staged_case, AG_GEMM.cases.on(pool)[picks[case]]):
        assert err < 1e-2
        assert calls > 0, "the descriptor path was not taken"


def test_plain_gluon_gemm(pool):
    """The Gluon GEMM alone, where it runs (compute capability 9.0 with Gluon); elsewhere skipped."""
    on_hopper(pool, "the Gluon GEMM", _plain_gather_hopper)


def _gluon_wait_times_out(timeout_s: float):
    """A peer's chunk that never lands: the Gluon GEMM's wait times out, and the fault names the rank, the op, the
    peer and the chunk (a simulated world of two, as rank 0, with rank 1's flags down; first with every flag up,
    so the kernel is built and the ranks in step before the fault). Every rank of the pool plays rank 0; a rank
    whose peer's fault came first reports that one (refs.late_chunk_faults). Returns "own" or "relayed"."""
    from triton_overlap.kernels import gemm_gather_hopper as gh
    from triton_overlap.plan import ChunkLayout

    with to.Context(timeout_s=timeout_s) as ctx:
        dev = ctx.device
        if torch.cuda.get_device_capability(dev) != (9, 0) or not gh.gluon_available():
            return "skip"
        m_local, k, n = 256, 128, 512
        a = rand((m_local, k), torch.bfloat16, dev, "late a")
        ws = torch.zeros(2 * m_local, k, dtype=torch.bfloat16, device=dev)
        w = rand((k, n), torch.bfloat16, dev, "late w")
        c = torch.empty(2 * m_local, n, dtype=torch.bfloat16, device=dev)
        layout = ChunkLayout(2, m_local, 128)  # two chunks per rank
        order = torch.arange(4, dtype=torch.int32, device=dev)
        flags = torch.ones(layout.num_chunks, dtype=torch.int32, device=dev)
        exits = torch.zeros(2, dtype=torch.int32, device=dev)
        b_layout = gh.layout_for(ctx, a, ws, w, c, m_local)
        assert b_layout == "kn"

        def launch(op):
            gh.launch_ag_gemm(ctx, b_layout, a, ws, w, c, None, layout, order, flags, exits, op=op, rank=0, world=2)

        def first_ok():
            assert rel_err(c[:m_local], a.float() @ w.float()) < TOL[torch.bfloat16]

        return late_chunk_faults(ctx, flags, "ag_gemm", "[01]", launch, first_ok)


def test_gluon_wait_times_out(pool):
    assert_own_fault(on_hopper(pool, "the Gluon GEMM", _gluon_wait_times_out, 5.0))
