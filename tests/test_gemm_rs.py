"""GEMM-ReduceScatter against matmul + reduce_scatter in float32."""
import dataclasses

import pytest
import torch

import triton_overlap as to
from harness import host_case_share, stress_rounds
from refs import TOL, check_replays, on_hopper, plain_gemm_worst, poison, rand, rel_err
from triton_overlap.ops.config import GEMMReduceScatterConfig


def _reference(m, k, n, dtype, dev, it, W, r, transposed, bias):
    parts = []
    for s in range(W):
        a = rand((m, k), dtype, dev, "a", it, s)
        w = rand((n, k) if transposed else (k, n), dtype, dev, "w", it, s)
        parts.append((a, w.t() if transposed else w))
    full = sum(a.float() @ w.float() for a, w in parts)
    rows = full[r * (m // W):(r + 1) * (m // W)]
    b = rand((n,), dtype, dev, "b", it) if bias else None
    return parts[r], b, rows + (b.float() if bias else 0)


def _case(m, k, n, dtype_name, bias, transposed, m_per_chunk, iters, scatter="store", jitter=0.0, fuse=True,
          strided_out=False, tma=None, claim=None, defer=None, warp_specialized=None, streams=None):
    dtype = getattr(torch, dtype_name)
    with to.Context(timeout_s=120) as ctx:
        ctx.set_producer_jitter(jitter)
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.GEMMReduceScatter(ctx, fallback="never")
        errs = []
        for it in range(iters):
            (a, w), b, ref = _reference(m, k, n, dtype, dev, it, W, r, transposed, bias)
            for buf in op.buffers().values():  # stale garbage in our receive slots and the staging buffer
                buf.copy_(torch.randn_like(buf, dtype=torch.float32))
            if strided_out:  # a transposed view: columns m // W elements apart
                out = poison(torch.empty((n, m // W), dtype=dtype, device=dev)).t()
            else:
                out = poison(torch.empty((m // W, n), dtype=dtype, device=dev))
            got = op(a, w, b, out=out, m_per_chunk=m_per_chunk, scatter=scatter, fuse_reduce=fuse, tma=tma, claim=claim,
                     defer_release=defer, gemm={True: "gluon", False: "triton", None: "auto"}[warp_specialized],
                     num_streams=streams)
            ctx.check()
            assert got.data_ptr() == out.data_ptr()
            errs.append(rel_err(got, ref))
            assert errs[-1] < TOL[dtype], f"rank {r} iter {it}: rel err {errs[-1]:.2e}"
        assert op.last_path == "overlap"
        if warp_specialized and fuse is not False and ctx.backend == "cuda" \
                and torch.cuda.get_device_capability(dev) == (9, 0):
            assert op.last_gemm == "gemm_warp_specialized", op.last_gemm  # the case ran the kernel it asked for
        return max(errs)


HOST_CASES = [
    # m (total rows), k_local, n, dtype, bias, transposed, m_per_chunk, iters, scatter, producer jitter (s)
    # [, fuse_reduce, strided out, tma, claim, defer_release, warp_specialized, copy streams]; 24 | m: W = 2, 3, 4,
    # 8. The reduction is in the GEMM (fuse_reduce) where every rank's rows are whole 32-row tiles (m = 32 * 24 or
    # 64 * 24), in a separate kernel otherwise
    (37 * 24, 48, 40, "bfloat16", True, False, 16, 2, "store", 0.0),
    (64 * 24, 48, 40, "bfloat16", True, False, 16, 2, "store", 0.0),
    (32 * 24, 64, 33, "float16", False, True, 7, 2, "copy", 0.003),
    (29 * 24, 64, 33, "float16", False, True, 7, 2, "store", 0.0),
    (32 * 24, 40, 24, "bfloat16", False, False, None, 1, "store", 0.0),
    (37 * 24, 48, 40, "bfloat16", True, True, 16, 2, "copy", 0.003),
    (29 * 24, 64, 33, "float16", False, False, 7, 2, "copy", 0.0),
    (37 * 24, 48, 40, "bfloat16", True, False, 16, 2, "store", 0.0, False),  # separate reduction kernel
    (29 * 24, 64, 33, "float16", False, False, 7, 1, "copy", 0.0, False, True),  # and a strided out
    (32 * 24, 48, 40, "bfloat16", True, False, 16, 1, "store", 0.0, True, False, True),  # descriptors, B [K, N]
    (32 * 24, 64, 33, "float16", False, True, 7, 1, "copy", 0.003, True, False, None, 1, False),  # counters at once
    (32 * 24, 48, 40, "bfloat16", True, False, 10 ** 6, 1, "copy", 0.0),  # one chunk per rank
    # a peer's chunks over two and three copy streams, taking turns (producers.scatter.copy_stream_index)
    (32 * 24, 64, 33, "float16", True, False, 32, 2, "copy", 0.003, True, False, None, None, None, None, 2),
    (37 * 24, 48, 40, "bfloat16", False, True, 16, 1, "copy", 0.003, False, False, None, None, None, None, 3),
]
GPU_CASES = [
    (4091 * 2 * 2, 1024, 1536, "bfloat16", True, False, 512, 3, "store", 0.0),
    (4091 * 4, 512, 1000, "float16", False, True, 1000, 3, "store", 0.0),
    (2048, 4096, 4096, "bfloat16", False, True, None, 3, "store", 0.0),
    (256 * 4, 256, 512, "bfloat16", True, False, 37, 3, "store", 0.0),
    (4091 * 2 * 2, 1024, 1536, "bfloat16", True, True, 512, 3, "copy", 0.0005),
    (4091 * 2 * 2, 1024, 1536, "bfloat16", True, False, 512, 3, "store", 0.0, False),
    (2048, 1024, 1000, "bfloat16", True, False, None, 2, "copy", 0.0, True, True),
    (8192, 1024, 1536, "bfloat16", True, True, 300, 3, "copy", 0.0005),
    (8192, 1000, 1536, "bfloat16", True, False, None, 3, "store", 0.0, True, False, True),  # descriptors, B [K, N]
    # the fused GEMM's two ways of taking tiles, and counters bumped at once or deferred (kernels.gemm CLAIM,
    # DEFER_RELEASE), whatever the defaults are
    (8192, 1024, 1536, "bfloat16", True, True, 300, 3, "copy", 0.0005, True, False, None, 0, True),
    (8192, 1024, 1536, "bfloat16", True, False, 512, 3, "store", 0.0005, True, False, None, 1, False),
    (4096, 1000, 1536, "float16", False, False, None, 3, "store", 0.0, True, False, True, 0, False),
    (4096, 1024, 1000, "bfloat16", True, True, 256, 3, "copy", 0.0, True, False, None, 1, True),
    # copy + fused: the warp-specialized GEMM (kernels.gemm_warp_specialized, sm_90 only) and kernels.gemm, each
    # asked for (warp_specialized); K and N off the tiles, a tile over two chunks (m_per_chunk 300), B either way round
    (4096, 1000, 1000, "float16", True, False, None, 3, "copy", 0.0005, True, False, None, None, None, True),
    (8192, 1024, 1536, "bfloat16", True, True, 300, 3, "copy", 0.0005, True, False, None, None, None, True),
    (8192, 1024, 1536, "bfloat16", True, True, 300, 3, "copy", 0.0005, True, False, None, None, None, False),
    # the warp-specialized GEMM with no bias; with 2048 rows a program's only tile is its last (partials preloaded)
    (8192, 1024, 1536, "bfloat16", False, False, None, 3, "copy", 0.0005, True, False, None, None, None, True),
    (2048, 1024, 1000, "bfloat16", True, True, None, 3, "copy", 0.0005, True, False, None, None, None, True),
    # and with a peer's two chunks on two copy streams side by side
    (2048, 1024, 1000, "bfloat16", False, False, 512, 3, "copy", 0.0005, True, False, None, None, None, True, 2),
    (4096, 1024, 1536, "bfloat16", True, True, 256, 3, "copy", 0.0005, True, False, None, None, None, True, 4),
    # rows of an odd N are not 16-byte aligned: the last tile's peer partial loaded by the epilogue's warps, not TMA
    (2048, 1024, 1001, "bfloat16", True, True, None, 3, "copy", 0.0005, True, False, None, None, None, True),
    # store + fused on the warp-specialized GEMM: peers' tiles straight into their receive slots once each owner's
    # start count says its call has started (PEER_STORES); a tile over two chunks, a program's only tile, odd N
    (8192, 1024, 1536, "bfloat16", True, True, 300, 3, "store", 0.0005, True, False, None, None, None, True),
    (2048, 1024, 1000, "bfloat16", False, False, None, 3, "store", 0.0005, True, False, None, None, None, True),
    (2048, 1024, 1001, "float16", True, True, None, 3, "store", 0.0, True, False, None, None, None, True),
]


@pytest.mark.parametrize("case", range(max(len(HOST_CASES), len(GPU_CASES))))
def test_gemm_rs_matches_reference(pool, case):
    cases = HOST_CASES if pool.backend == "host" else GPU_CASES
    if case >= len(cases):
        pytest.skip("no such case for this backend")
    host_case_share(pool, case)
    pool.run(_case, *cases[case])


def _back_to_back(n_calls, m, k, n, scatter="store"):
    with to.Context(timeout_s=120) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        cfg = dataclasses.replace(GEMMReduceScatterConfig.defaults(ctx), scatter=scatter)
        op = to.GEMMReduceScatter(ctx, cfg, fallback="never")
        outs, refs = [], []
        for i in range(n_calls):  # no host synchronisation between calls
            (a, w), _, ref = _reference(m, k, n, torch.bfloat16, dev, i, W, r, False, False)
            outs.append(op(a, w))
            refs.append(ref)
        ctx.synchronize()
        ctx.check()
        worst = max(rel_err(o, ref) for o, ref in zip(outs, refs))
        assert worst < TOL[torch.bfloat16], worst
        return worst


@pytest.mark.parametrize("scatter", ["store", "copy"])
def test_gemm_rs_100_back_to_back_calls(pool, scatter):
    shape = (24 * 4, 32, 32) if pool.backend == "host" else (2048, 1024, 1024)
    pool.run(_back_to_back, stress_rounds(pool, 100), *shape, scatter)


def _bad_inputs():
    with to.Context(timeout_s=30) as ctx:
        dev, W = ctx.device, ctx.world_size
        op = to.GEMMReduceScatter(ctx, fallback="never", max_m=64 * W)
        a = rand((16 * W, 32), torch.bfloat16, dev, "a")
        w = rand((32, 24), torch.bfloat16, dev, "w")
        bad = {
            "inner dimensions": (a, rand((31, 24), torch.bfloat16, dev, "w")),
            "different dtypes": (a, w.half()),
            "float16 or bfloat16": (a.float(), w.float()),
            "not divisible": (rand((16 * W + 1, 32), torch.bfloat16, dev, "a"), w),
            "max_m": (rand((65 * W, 32), torch.bfloat16, dev, "a"), w),
            "is on": (a.to("meta"), w),
        }
        for msg, (x, y) in bad.items():
            with pytest.raises(ValueError, match=msg):
                op(x, y)
        with pytest.raises(ValueError, match="ranks disagree"):
            op(rand((16 * W, 32), torch.bfloat16, dev, "a"), rand((32, 24 + ctx.rank), torch.bfloat16, dev, "w"))
        got = op(a, w)  # still usable
        ctx.check()
        ref = (a.float() @ w.float() * W)[ctx.rank * 16:(ctx.rank + 1) * 16]
        assert rel_err(got, ref) < TOL[torch.bfloat16]
        return True


def test_gemm_rs_bad_input_raises_before_launch(pool):
    assert all(pool.run(_bad_inputs))


def _fallback_path():
    with to.Context(timeout_s=30) as ctx:
        dev, W, r = ctx.device, ctx.world_size, ctx.rank
        (a, w), b, ref = _reference(8 * W, 16, 8, torch.bfloat16, dev, 0, W, r, False, True)
        got = to.gemm_rs(a, w, ctx=ctx, bias=b)  # tiny: "auto" takes the NCCL path
        assert to.GEMMReduceScatter.shared(ctx).last_path == "fallback"
        assert rel_err(got, ref) < TOL[torch.bfloat16]
        if ctx.backend != "host":  # 1 MiB a rank, but its tiles fit in one wave of the GPU's SMs: NCCL path too
            (a, w), b, ref = _reference(128 * W, 64, 4096, torch.bfloat16, dev, 0, W, r, False, True)
            got = to.gemm_rs(a, w, ctx=ctx, bias=b)
            assert to.GEMMReduceScatter.shared(ctx).last_path == "fallback"
            assert rel_err(got, ref) < TOL[torch.bfloat16]
        return True


def test_gemm_rs_small_shapes_fall_back(pool):
    assert all(pool.run(_fallback_path))


def test_one_wave_rule():
    """A GEMM whose tiles (every rank's rows in whole block_m tiles) fit in one wave of the SMs hides nothing of the
    reduce-scatter; one tile more and it spans two waves."""
    from triton_overlap.ops.gemm_reduce_scatter import one_wave

    cfg = GEMMReduceScatterConfig(block_m=128, block_n=256)
    assert one_wave(cfg, 1024, 4096, 2, 132)  # 2 x 4 x 16 = 128 tiles
    assert not one_wave(cfg, 2048, 4096, 2, 132)  # 256
    assert one_wave(cfg, 1000, 4096, 2, 128)  # 500 rows a rank: 4 tiles each
    assert not one_wave(cfg, 1000, 4096, 2, 127)
    assert not one_wave(cfg, 1024, 4097, 2, 132)  # 17 column tiles: 136
    assert one_wave(cfg, 4 * 128, 8192, 4, 132)  # 4 x 1 x 32


def test_scatter_auto_rule():
    """"auto" copies on GPUs from copy_bytes of partial output on, or from copy_bytes_fused where the reduction is
    fused (every rank's rows whole tiles, fuse_reduce not False), stores below and on the host backend; an explicit
    choice wins; anything else is refused."""
    from triton_overlap.ops.gemm_reduce_scatter import scatter_mode

    cfg = GEMMReduceScatterConfig()
    rows = cfg.copy_bytes // (2 * 4096)
    fused_rows = cfg.copy_bytes_fused // (2 * 4096)  # 512: 256 per rank at W = 2, whole 128-row tiles
    assert fused_rows < rows
    for engines, big, small in ((True, "copy", "store"), (False, "store", "store")):
        assert scatter_mode(cfg, rows + 2, 4096, 2, engines, 2) == big  # not whole tiles, but large enough
        assert scatter_mode(cfg, fused_rows, 4096, 2, engines, 2) == big
        assert scatter_mode(cfg, fused_rows - 2 * 128, 4096, 2, engines, 2) == small
        assert scatter_mode(cfg, fused_rows + 2, 4096, 2, engines, 2) == small  # rows not whole tiles: not fused
        no_fuse = GEMMReduceScatterConfig(fuse_reduce=False)
        assert scatter_mode(no_fuse, fused_rows, 4096, 2, engines, 2) == small
        assert scatter_mode(no_fuse, rows, 4096, 2, engines, 2) == big
    assert scatter_mode(GEMMReduceScatterConfig(scatter="store"), rows * 8, 4096, 2, True, 2) == "store"
    with pytest.raises(ValueError, match="scatter"):
        GEMMReduceScatterConfig(scatter="both")
    with pytest.raises(ValueError, match="claim"):
        GEMMReduceScatterConfig(claim=2)


def test_warp_specialized_rule():
    """The warp-specialized GEMM is taken only when asked for or by default, never on the host backend, never with
    claim=1 or deferred counters, never where a rank's rows are not whole 128-row tiles."""
    from types import SimpleNamespace

    from triton_overlap.kernels import gemm_warp_specialized
    from triton_overlap.ops.gemm_reduce_scatter import wants_warp_specialized

    a = torch.empty((2048, 64), dtype=torch.bfloat16)
    w = torch.empty((64, 256), dtype=torch.bfloat16)
    assert gemm_warp_specialized.layout_for(SimpleNamespace(backend="host"), a, w, 1024) is None
    C = GEMMReduceScatterConfig
    for cfg in (C(gemm="triton"), C(gemm="gluon", claim=1), C(gemm="gluon", defer_release=True)):
        assert not wants_warp_specialized(cfg), cfg
    assert wants_warp_specialized(C(gemm="gluon")) and wants_warp_specialized(C()) and C().gemm == "auto"
    with pytest.raises(ValueError, match="gemm"):
        C(gemm="cublas")
    odd = torch.empty((2 * 1000, 64), dtype=torch.bfloat16)
    assert gemm_warp_specialized.layout_for(SimpleNamespace(backend="cuda"), odd, w, 1000) is None
    # the kernel's own tiles, the other fields kept, made once per config
    from triton_overlap.ops.base import with_tiles

    cfg = C(block_m=64, block_n=128, block_k=32, num_stages=5, chunks_per_rank=3)
    t = gemm_warp_specialized.TILES
    got = with_tiles(cfg, t)
    assert (got.block_m, got.block_n, got.block_k, got.num_stages) == (t.block_m, t.block_n, t.block_k, t.num_stages)
    assert got.chunks_per_rank == 3 and with_tiles(cfg, t) is got


def _plain_warp_specialized():
    """kernels.gemm_warp_specialized.plain_gemm_ws (GEMM-RS's consumer alone in benchmarks) against float32
    matmul, on NaN-poisoned outputs: B as [K, N] and as weight.t(), with and without bias, K and N not multiples
    of the tile, called twice (the exit counts it leaves zeroed). "skip" where the kernel cannot run."""
    from triton_overlap.kernels import gemm_warp_specialized as ws

    with to.Context(timeout_s=120) as ctx:
        if (ctx.backend != "cuda" or torch.cuda.get_device_capability(ctx.device) != (9, 0)
                or not ws.gluon_available()):
            return "skip"
        return plain_gemm_worst(ctx, ws.plain_gemm_ws, "plain_gemm_ws",
                                ((384, 1000, 520, False, True), (1024, 512, 264, True, False)))


def test_plain_warp_specialized_gemm(pool):
    """The warp-specialized GEMM alone, where it runs (compute capability 9.0 with Gluon); elsewhere skipped."""
    on_hopper(pool, "the warp-specialized GEMM", _plain_warp_specialized)


def test_rs_chunks_carry_min_chunk_bytes():
    """GEMM-RS cuts each peer's partial rows into chunks_per_rank chunks of whole tiles, fewer where a chunk would
    carry under min_chunk_bytes (N x element size per row), at least one; every tile of our rows is counted once."""
    from triton_overlap.plan import ChunkLayout

    cfg = GEMMReduceScatterConfig(block_m=128, block_n=256, chunks_per_rank=4, min_chunk_bytes=16 << 20)
    for m_local, n, chunks in ((1024, 4096, 1), (2048, 4096, 1), (4096, 4096, 2), (4096, 8192, 4), (8192, 8192, 4),
                               (64, 4096, 1)):
        layout = ChunkLayout(2, m_local, cfg.chunk_rows(m_local, n * 2))
        assert layout.chunks_per_rank == chunks, (m_local, n)
        counts = layout.tile_stores(128, n // 256)
        assert sum(counts[0]) == -(-m_local // 128) * (n // 256)  # every tile of our rows counted once
    off = GEMMReduceScatterConfig(block_m=128, block_n=256, chunks_per_rank=4)
    assert ChunkLayout(2, 1024, off.chunk_rows(1024, 4096 * 2)).chunks_per_rank == 4  # the rule off


def _graph(replays, m, k, n, scatter="store"):
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        cfg = dataclasses.replace(GEMMReduceScatterConfig.defaults(ctx), scatter=scatter)
        op = to.GEMMReduceScatter(ctx, cfg, fallback="never")
        a = torch.empty((m, k), dtype=torch.bfloat16, device=dev)
        w = torch.empty((k, n), dtype=torch.bfloat16, device=dev)
        out = torch.empty((m // W, n), dtype=torch.bfloat16, device=dev)

        def load(i):
            (ai, wi), _, ref = _reference(m, k, n, torch.bfloat16, dev, i, W, r, False, False)
            a.copy_(ai), w.copy_(wi)
            return ref

        check_replays(lambda: op(a, w, out=out), out, replays, load)
        ctx.check()
        return True


@pytest.mark.parametrize("scatter", ["store", "copy"])
def test_gemm_rs_cuda_graph_replay(pool, scatter):
    if pool.backend == "host":
        pytest.skip("CUDA graphs need a GPU")
    assert all(pool.run(_graph, 20, 2048, 512, 768, scatter))
