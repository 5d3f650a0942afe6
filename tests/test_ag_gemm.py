"""AllGather-GEMM against all_gather + matmul in float32."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

import triton_overlap as to
from harness import host_case_share, stress_rounds
from refs import (TOL, assert_own_fault, check_replays, late_chunk_faults, on_hopper, plain_gemm_worst, poison, rand,
                  rel_err)
from triton_overlap.ops.config import AllGatherGEMMConfig
from triton_overlap.plan import cdiv


#: a case's ``gluon`` (True, False, None) as the config's ``gemm``
GEMM_CHOICE = {True: "gluon", False: "triton", None: "auto"}


def _case(m_local, k, n, dtype_name, bias, transposed, m_per_chunk, streams, jitter, iters, mode="push", tma=None,
          gluon=None):
    """``gluon`` True or False: the case asks for the Hopper GEMM in Gluon or for kernels.gemm, and checks on
    compute capability 9.0 that the op ran it."""
    dtype = getattr(torch, dtype_name)
    with to.Context(timeout_s=120) as ctx:
        ctx.set_producer_jitter(jitter)
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.AllGatherGEMM(ctx, fallback="never")
        errs = []
        for it in range(iters):
            shards = [rand((m_local, k), dtype, dev, "a", it, s) for s in range(W)]
            w = rand((n, k) if transposed else (k, n), dtype, dev, "w", it, r)
            w = w.t() if transposed else w
            b = rand((n,), dtype, dev, "b", it, r) if bias else None
            ws = ctx.symmetric("ag_gemm.ws", (m_local * W, k), dtype) if it else None
            if ws is not None:
                # Pull mode: a peer reads our workspace's own rows until its call has finished. The op's next
                # call waits for that (its first barrier); garbage written from outside the op must wait too,
                # or a fast rank overwrites rows a slow peer is still pulling (seen once in CI, host, W = 2).
                ctx.synchronize()
                dist.barrier(group=ctx.group)
                ws.local.copy_(torch.randn_like(ws.local, dtype=torch.float32))  # stale garbage where peers write
            out = poison(torch.empty((m_local * W, n), dtype=dtype, device=dev))
            got, gathered = op(shards[r], w, b, out=out, return_gathered=True, m_per_chunk=m_per_chunk,
                               num_streams=streams, mode=mode, tma=tma, gemm=GEMM_CHOICE[gluon])
            ctx.check()
            if gluon is not None and ctx.backend == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0):
                assert op.last_gemm == ("gemm_gather_hopper" if gluon else "gemm"), op.last_gemm
            assert got.data_ptr() == out.data_ptr()
            full = torch.cat(shards).float()
            ref = full @ w.float() + (b.float() if bias else 0)
            errs.append(rel_err(got, ref))
            assert errs[-1] < TOL[dtype], f"rank {r} iter {it}: rel err {errs[-1]:.2e}"
            assert torch.equal(gathered.cpu(), torch.cat(shards).cpu()), "gathered rows differ"
        assert op.last_path == "overlap"
        return max(errs)


HOST_CASES = [
    # m_local, k, n, dtype, bias, transposed, m_per_chunk, streams, jitter, iters, mode[, tma[, gluon]]
    (37, 48, 40, "bfloat16", True, False, 16, None, 0.0, 2, "push"),
    (29, 64, 33, "float16", False, True, 7, 1, 0.003, 2, "push"),
    (64, 40, 24, "bfloat16", False, False, None, None, 0.003, 1, "push"),
    (37, 48, 40, "bfloat16", True, True, 16, None, 0.003, 2, "pull"),
    (29, 64, 33, "float16", False, False, 7, 1, 0.02, 2, "pull"),  # delays: slow pulls, fast peer
    # whole tiles of rows per rank: the descriptor (TMA) path, with W's transpose as B
    (64, 48, 40, "float16", True, True, 32, None, 0.003, 2, "pull"),
    (64, 48, 40, "bfloat16", True, False, 16, None, 0.0, 1, "push", True),  # descriptors for B stored [K, N]
]
GPU_CASES = [
    (4091, 1024, 1536, "bfloat16", True, False, 512, None, 0.0, 3, "push"),
    (4091, 512, 1000, "float16", False, True, 1000, 1, 0.001, 3, "push"),
    (2048, 4096, 4096, "bfloat16", False, True, None, None, 0.0, 3, "push"),
    (128, 256, 512, "bfloat16", True, False, 37, None, 0.0005, 3, "push"),
    (4091, 1024, 1536, "bfloat16", True, True, 512, None, 0.0005, 3, "pull"),
    # kernels.gemm with descriptors, B stored [K, N] (on Hopper the Gluon GEMM is the default: asked off)
    (4096, 1024, 1536, "bfloat16", True, False, 512, None, 0.0, 3, "push", True, False),
    # the Gluon GEMM (Hopper; kernels.gemm elsewhere): K and N off the tiles, chunks across tiles, both B layouts
    (2048, 1000, 1000, "bfloat16", True, False, 300, None, 0.0005, 3, "push", None, True),
    (1024, 520, 776, "float16", False, True, 384, 1, 0.0005, 3, "pull", None, True),
]


@pytest.mark.parametrize("case", range(max(len(HOST_CASES), len(GPU_CASES))))
def test_ag_gemm_matches_reference(pool, case):
    cases = HOST_CASES if pool.backend == "host" else GPU_CASES
    if case >= len(cases):
        pytest.skip("no such case for this backend")
    host_case_share(pool, case)
    errs = pool.run(_case, *cases[case])
    assert max(errs) < 1e-2


FP8 = torch.float8_e4m3fn


def _fp8(shape, device, *seed):
    """e4m3 values spread over its range (x 8), the same on every rank for the same seed."""
    return (rand(shape, torch.float32, "cpu", *seed) * 8).to(FP8).to(device)


def _fp8_case(m_local, k, n, bias, transposed, m_per_chunk, out_dtype_name, tma, iters, fallback="never"):
    """fp8 AllGather-GEMM: (all_gather(a) @ w) * scale_a * scale_b (+ bias) against float32 on the dequantised
    inputs; the scales change every call, the workspace holds random bytes, the output starts as NaN."""
    out_dtype = getattr(torch, out_dtype_name)
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.AllGatherGEMM(ctx, fallback=fallback)
        errs = []
        for it in range(iters):
            shards = [_fp8((m_local, k), dev, "a8", it, s) for s in range(W)]
            w = _fp8((n, k) if transposed else (k, n), dev, "w8", it, r)
            w = w.t() if transposed else w
            b = rand((n,), out_dtype, dev, "b8", it, r) if bias else None
            sa = torch.tensor([0.25 * (it + 1)], device=dev)
            sb = rand((1,), torch.float32, dev, "sb", it, r).abs() / 64
            if it and fallback == "never":
                ws = ctx.symmetric("ag_gemm.ws", (m_local * W, k), FP8)
                ctx.synchronize()
                dist.barrier(group=ctx.group)
                ws.local.view(torch.uint8).random_(0, 256)  # stale bytes where peers write (NaN codes included)
            out = poison(torch.empty((m_local * W, n), dtype=out_dtype, device=dev))
            got, gathered = op(shards[r], w, b, out=out, return_gathered=True, scale_a=sa, scale_b=sb,
                               out_dtype=out_dtype, m_per_chunk=m_per_chunk, tma=tma)
            ctx.check()
            assert got.data_ptr() == out.data_ptr() and got.dtype == out_dtype
            full = torch.cat(shards).float()
            ref = (full @ w.float()) * sa * sb + (b.float() if bias else 0)
            errs.append(rel_err(got, ref))
            assert errs[-1] < TOL[out_dtype], f"rank {r} iter {it}: rel err {errs[-1]:.2e}"
            assert torch.equal(gathered.view(torch.uint8).cpu(), torch.cat(shards).view(torch.uint8).cpu())
        assert op.last_path == ("fallback" if fallback == "always" else "overlap")
        return max(errs)


FP8_HOST_CASES = [
    # m_local, k, n, bias, transposed, m_per_chunk, out_dtype, tma, iters[, fallback]
    (37, 48, 40, True, False, 16, "bfloat16", None, 2),  # pointers, odd rows, a tile across two ranks
    (64, 64, 48, False, True, 32, "float16", None, 2),  # weight.t(): the gather descriptor path
    (64, 48, 40, True, False, 16, "bfloat16", True, 1),  # descriptors for B stored [K, N]
    (32, 64, 48, True, True, None, "bfloat16", None, 1, "always"),  # NCCL/Gloo + torch._scaled_mm
    (29, 40, 24, False, False, None, "float16", None, 1, "always"),  # NCCL/Gloo + our GEMM (layout _scaled_mm refuses)
]
FP8_GPU_CASES = [
    (4096, 1024, 1536, True, True, 512, "bfloat16", None, 3),  # descriptors
    (4091, 1024, 1536, True, False, 512, "bfloat16", None, 3),  # pointers, B [K, N]
    (2048, 4096, 4096, False, True, None, "float16", None, 3),
    (4096, 1024, 1536, False, False, 1024, "bfloat16", True, 2),  # descriptors, B [K, N]
    (1024, 512, 768, True, True, None, "bfloat16", None, 2, "always"),
    (1000, 520, 760, True, False, None, "bfloat16", None, 2, "always"),
]


@pytest.mark.parametrize("case", range(max(len(FP8_HOST_CASES), len(FP8_GPU_CASES))))
def test_ag_gemm_fp8_matches_reference(pool, case):
    cases = FP8_HOST_CASES if pool.backend == "host" else FP8_GPU_CASES
    if case >= len(cases):
        pytest.skip("no such case for this backend")
    host_case_share(pool, case)
    assert max(pool.run(_fp8_case, *cases[case])) < 1e-2


def _fp8_bad_inputs():
    with to.Context(timeout_s=30) as ctx:
        dev, W = ctx.device, ctx.world_size
        op = to.AllGatherGEMM(ctx, fallback="never")
        a, w = _fp8((16, 32), dev, "a"), _fp8((32, 24), dev, "w")
        one = torch.ones(1, device=dev)
        bad = {
            "need scale_a": dict(scale_b=one),
            "need scale_b": dict(scale_a=one, scale_b=one.double()),
            "per-tensor": dict(scale_a=torch.ones(2, device=dev), scale_b=one),
            "out_dtype must be float16 or bfloat16": dict(scale_a=one, scale_b=one, out_dtype=torch.float32),
        }
        for msg, kw in bad.items():
            with pytest.raises(ValueError, match=msg):
                op(a, w, **kw)
        with pytest.raises(ValueError, match="bias must be torch.float16"):
            op(a, w, rand((24,), torch.bfloat16, dev, "b"), scale_a=one, scale_b=one, out_dtype=torch.float16)
        with pytest.raises(ValueError, match="are for float8_e4m3fn"):
            op(a.to(torch.bfloat16), w.to(torch.bfloat16), scale_a=one, scale_b=one)
        with pytest.raises(ValueError, match="float16, bfloat16 or float8_e4m3fn"):
            op(a.to(torch.float8_e5m2), w.to(torch.float8_e5m2), scale_a=one, scale_b=one)
        with pytest.raises(ValueError, match="float16 or bfloat16"):  # GEMM-RS takes no fp8
            to.GEMMReduceScatter(ctx, fallback="never")(_fp8((16 * W, 32), dev, "a"), w)
        with pytest.raises(ValueError, match="out must be torch.bfloat16"):
            op(a, w, scale_a=one, scale_b=one, out=torch.empty((16 * W, 24), dtype=FP8, device=dev))
        got = op(a, w, scale_a=one, scale_b=one * 2)  # and the op still works
        ctx.check()
        assert rel_err(got, (torch.cat([a.float()] * W) @ w.float()) * 2) < TOL[torch.bfloat16]
        return True


def test_ag_gemm_fp8_bad_input_raises_before_launch(pool):
    assert all(pool.run(_fp8_bad_inputs))


def _fp8_graph(replays, m_local, k, n):
    """fp8 in a CUDA graph: the scales are read when the graph runs, so a replay follows new scale values."""
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.AllGatherGEMM(ctx, fallback="never")
        a = torch.empty((m_local, k), dtype=FP8, device=dev)
        w = _fp8((n, k), dev, "w", r).t()
        sa, sb = torch.ones(1, device=dev), torch.ones(1, device=dev)
        out = torch.empty((m_local * W, n), dtype=torch.bfloat16, device=dev)

        def load(i):
            a.copy_(_fp8((m_local, k), dev, "a", i, r))
            sa.fill_(0.5 + i % 3)
            sb.fill_(1.0 / (1 + i % 5))
            full = torch.cat([_fp8((m_local, k), dev, "a", i, s) for s in range(W)]).float()
            return (full @ w.float()) * sa * sb

        check_replays(lambda: op(a, w, out=out, scale_a=sa, scale_b=sb), out, replays, load)
        ctx.check()
        return True


def test_ag_gemm_fp8_cuda_graph_replay(pool):
    if pool.backend == "host":
        pytest.skip("CUDA graphs need a GPU")
    assert all(pool.run(_fp8_graph, 20, 1024, 512, 768))


def test_ag_gemm_odd_rows_4091_per_rank(pool):
    if pool.backend == "host" and pool.world > 2:
        pytest.skip("4091 rows per rank in the interpreter: run at W=2 only to keep CI short")
    pool.run(_case, 4091, 32, 24, "bfloat16", False, False, 1024, None, 0.0, 1)


def _back_to_back(n_calls, m_local, k, n, consumer_first=False, mode="push"):
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        cfg = dataclasses.replace(AllGatherGEMMConfig.defaults(ctx), consumer_first=consumer_first, mode=mode)
        op = to.AllGatherGEMM(ctx, cfg, fallback="never")
        w = rand((k, n), torch.bfloat16, dev, "w", r)
        outs = []
        for i in range(n_calls):  # no host synchronisation between calls
            outs.append(op(rand((m_local, k), torch.bfloat16, dev, "a", i, r), w))
        ctx.synchronize()
        ctx.check()
        worst = 0.0
        for i, got in enumerate(outs):
            full = torch.cat([rand((m_local, k), torch.bfloat16, dev, "a", i, s) for s in range(W)]).float()
            worst = max(worst, rel_err(got, full @ w.float()))
        assert worst < TOL[torch.bfloat16], worst
        return worst


@pytest.mark.parametrize("consumer_first,mode", [(False, "push"), (True, "push"), (False, "pull"), (True, "pull")],
                         ids=["producers_first", "consumer_first", "pull", "pull_consumer_first"])
def test_ag_gemm_100_back_to_back_calls(pool, consumer_first, mode):
    if consumer_first and pool.backend == "host":
        pytest.skip("launch order only matters on GPUs (the host backend runs kernels synchronously)")
    shape = (19, 32, 32) if pool.backend == "host" else (1024, 1024, 1024)
    pool.run(_back_to_back, stress_rounds(pool, 100), *shape, consumer_first, mode)


def _bad_inputs():
    with to.Context(timeout_s=30) as ctx:
        dev, W = ctx.device, ctx.world_size
        op = to.AllGatherGEMM(ctx, fallback="never", max_m=64 * W)
        a = rand((16, 32), torch.bfloat16, dev, "a")
        w = rand((32, 24), torch.bfloat16, dev, "w")
        bad = {
            "inner dimensions": (a, rand((31, 24), torch.bfloat16, dev, "w")),
            "different dtypes": (a, w.half()),
            "float16, bfloat16 or float8_e4m3fn": (a.float(), w.float()),
            "2-D": (a[None], w),
            "max_m": (rand((65, 32), torch.bfloat16, dev, "a"), w),
            "is on": (a.to("meta"), w),
        }
        for msg, (x, y) in bad.items():
            with pytest.raises(ValueError, match=msg):
                op(x, y)
        with pytest.raises(ValueError, match="bias"):
            op(a, w, rand((23,), torch.bfloat16, dev, "b"))
        # ranks that disagree on the shard shape all get the error, none hangs
        with pytest.raises(ValueError, match="ranks disagree"):
            op(rand((16 + ctx.rank, 32), torch.bfloat16, dev, "a"), w)
        # and the op and Context still work
        got = op(a, w)
        ctx.check()
        ref = torch.cat([a.float()] * W) @ w.float()
        assert rel_err(got, ref) < TOL[torch.bfloat16]
        return True


def test_ag_gemm_bad_input_raises_before_launch(pool):
    assert all(pool.run(_bad_inputs))


def _fallback_path():
    with to.Context(timeout_s=30) as ctx:
        dev, W, r = ctx.device, ctx.world_size, ctx.rank
        a = rand((8, 16), torch.bfloat16, dev, "a", r)
        w = rand((16, 8), torch.bfloat16, dev, "w")
        b = rand((8,), torch.bfloat16, dev, "b")
        got = to.ag_gemm(a, w, ctx=ctx, bias=b)  # tiny shard: "auto" takes the NCCL path
        assert to.AllGatherGEMM.shared(ctx).last_path == "fallback"
        full = torch.cat([rand((8, 16), torch.bfloat16, dev, "a", s) for s in range(W)]).float()
        assert rel_err(got, full @ w.float() + b.float()) < TOL[torch.bfloat16]
        return True


def test_ag_gemm_small_shapes_fall_back(pool):
    assert all(pool.run(_fallback_path))


def _graph(replays, m_local, k, n, mode="push"):
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.AllGatherGEMM(ctx, dataclasses.replace(AllGatherGEMMConfig.defaults(ctx), mode=mode),
                              fallback="never")
        a = torch.empty((m_local, k), dtype=torch.bfloat16, device=dev)
        w = rand((k, n), torch.bfloat16, dev, "w", r)
        out = torch.empty((m_local * W, n), dtype=torch.bfloat16, device=dev)

        def load(i):
            a.copy_(rand((m_local, k), torch.bfloat16, dev, "a", i, r))
            return torch.cat([rand((m_local, k), torch.bfloat16, dev, "a", i, s) for s in range(W)]).float() @ w.float()

        check_replays(lambda: op(a, w, out=out), out, replays, load)
        ctx.check()
        return True


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_ag_gemm_cuda_graph_replay(pool, mode):
    if pool.backend == "host":
        pytest.skip("CUDA graphs need a GPU")
    assert all(pool.run(_graph, 50, 1024, 512, 768, mode))


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
        for want in ("overlap", "fallback"):
            rs(big.normal_(), w_rs, out=rs_out)
            assert rs.last_path == want

        def load_rs(i):
            big.copy_(rand((m_local * W, k), torch.bfloat16, dev, "rs", i, r))
            parts = sum(rand((m_local * W, k), torch.bfloat16, dev, "rs", i, s).float() for s in range(W))
            return (parts @ w_rs.float())[r * m_local:(r + 1) * m_local]

        check_replays(lambda: rs(big, w_rs, out=rs_out), rs_out, 5, load_rs)
        assert rs.last_path == "overlap"
        # with replay on: a new key of a prepared shape goes to NCCL once, and its repeat is captured
        rep = to.AllGatherGEMM(ctx, name="ag_gemm.rep")
        ref = load_ag(-3)
        rep(a, w, out=out)
        assert rep.last_path == "overlap"
        out2 = torch.empty_like(out)
        for want in ("fallback", "overlap", "overlap"):
            rep(a, w, out=poison(out2))
            assert rep.last_path == want
            assert rel_err(out2, ref) < TOL[torch.bfloat16]
        # (the capturing call replays the new graph without counting it: held graphs replayed once since)
        assert rep.replays.stats["captures"] == 1 and rep.replays.stats["replays"] == 1
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
    from triton_overlap.kernels.gemm import GemmTiles, desc_layout

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
    """A for the AllGather GEMMs' one descriptor (kernels.gemm.gather_a): two planes, the shard and the workspace,
    where one descriptor spans both (our rows at gathered row - rank * m_local in the shard's plane; the workspace
    untouched); else the workspace alone, after the shard is copied into its own rows (here: the shard's row stride
    differs; on GPUs also shard and workspace too far apart, as torch's allocator and cudaMalloc can place them)."""
    from triton_overlap.kernels.gemm import gather_a

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


def _staged_case(*case):
    """``_case`` with no descriptor spanning the shard and the workspace (as when the two lie 2^40 bytes apart or
    more): the GEMM (the Gluon one or kernels.gemm's descriptor path) reads this rank's rows from the workspace,
    copied there before the launch. Returns the worst error and how often a GEMM asked for the span."""
    from triton_overlap.kernels import gemm

    calls = []
    spans = gemm._pair_gap
    gemm._pair_gap = lambda a, ws: calls.append(1)  # None: no span
    try:
        return _case(*case), len(calls)
    finally:
        gemm._pair_gap = spans


#: (HOST_CASES, GPU_CASES) indices: descriptors with pull and with push (host); kernels.gemm's descriptors with push,
#: the Gluon GEMM with push and with pull (GPUs; kernels.gemm where the Gluon GEMM cannot run)
STAGED = ([5, 6], [5, 6, 7])


@pytest.mark.parametrize("case", range(3))
def test_shard_copied_into_workspace(pool, case):
    """Where one descriptor cannot span the shard and the workspace, the GEMM reads the shard from the workspace's
    own rows (both B layouts, push and pull, chunks across tiles) and matches the reference."""
    host = pool.backend == "host"
    cases, picks = (HOST_CASES, STAGED[0]) if host else (GPU_CASES, STAGED[1])
    if case >= len(picks):
        pytest.skip("no such case for this backend")
    for err, calls in pool.run(_staged_case, *cases[picks[case]]):
        assert err < 1e-2
        assert calls > 0 or not host, "the descriptor path was not taken"


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
