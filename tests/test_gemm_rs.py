"""GEMM-ReduceScatter against matmul + reduce_scatter in float32: the op's spec and cases, which get the contract's
tests (tests/contract.py), then the op's own rules and kernels."""
from dataclasses import dataclass

import pytest
import torch

import contract
import triton_overlap as to
from contract import Call, Cases, GemmCase, OpSpec, Variants, gemm_weight, set_fields
from refs import on_hopper, plain_gemm_worst, rand
from triton_overlap.ops.config import GEMMReduceScatterConfig


@dataclass(frozen=True, kw_only=True)
class RSCase(GemmCase):
    """Every rank's [M, k] A times its own weight (GemmCase), summed over ranks, this rank's M / W rows of it (plus
    ``bias``, the same on every rank); M is ``m`` in all, or ``m_local`` per rank (M = m_local x W). The op's receive
    slots and staging buffer are filled with garbage before each call; ``strided_out``: the output a transposed view
    (columns M / W elements apart). The rest are the call's config where set (None: the op's own): ``scatter`` store
    or copy, ``fuse`` (fuse_reduce; the reduction is in the GEMM where every rank's rows are whole tiles),
    ``claim``, ``defer`` (defer_release), ``streams`` (copy streams); ``gemm`` "gluon" (the warp-specialized GEMM)
    or "triton", and with "gluon" and the reduction fused it checks, on compute capability 9.0, that the op ran
    the warp-specialized GEMM; ``in_host`` (reduce_in_host: across hosts, the host's partials summed before they
    cross)."""
    m: int = 0
    m_local: int = 0
    strided_out: bool = False
    scatter: str | None = None
    fuse: bool | None = None
    claim: int | None = None
    defer: bool | None = None
    in_host: bool | None = None

    def rows(self, world: int) -> int:
        return self.m or self.m_local * world


def _inputs(ctx, case, it):
    dtype = getattr(torch, case.dtype)
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    m, k, n = case.rows(W), case.k, case.n
    parts = []
    for s in range(W):
        a = rand((m, k), dtype, dev, "a", it, s)
        parts.append((a, gemm_weight(case, lambda shape, *seed: rand(shape, dtype, dev, *seed), "w", it, s)))
    full = sum(a.float() @ w.float() for a, w in parts)
    rows = full[r * (m // W):(r + 1) * (m // W)]
    b = rand((n,), dtype, dev, "b", it) if case.bias else None
    overrides = set_fields(m_per_chunk=case.m_per_chunk, scatter=case.scatter, fuse_reduce=case.fuse, tma=case.tma,
                           claim=case.claim, defer_release=case.defer, gemm=case.gemm, num_streams=case.streams,
                           reduce_in_host=case.in_host)
    if case.strided_out:  # a transposed view: columns m // W elements apart
        out = torch.empty((n, m // W), dtype=dtype, device=dev).t()
    else:
        out = torch.empty((m // W, n), dtype=dtype, device=dev)
    return Call(parts[r], dict(bias=b, **overrides),
                rows + (b.float() if case.bias else 0), out)


def _garbage(ctx, op, case, it):
    for buf in op.buffers().values():  # stale garbage in our receive slots and the staging buffer
        buf.copy_(torch.randn_like(buf, dtype=torch.float32))


def _finish(ctx, op, case):
    if case.gemm == "gluon" and case.fuse is not False and ctx.backend == "cuda" \
            and torch.cuda.get_device_capability(ctx.device) == (9, 0):
        assert op.last_gemm == "gemm_warp_specialized", op.last_gemm  # the case ran the kernel it asked for


def _bad_inputs(ctx):
    dev, W = ctx.device, ctx.world_size
    bf = torch.bfloat16
    op = to.GEMMReduceScatter(ctx, fallback="never", max_m=64 * W)
    a = rand((16 * W, 32), bf, dev, "a")
    w = rand((32, 24), bf, dev, "w")
    bad = [
        ("inner dimensions", lambda: op(a, rand((31, 24), bf, dev, "w"))),
        ("different dtypes", lambda: op(a, w.half())),
        ("float16 or bfloat16", lambda: op(a.float(), w.float())),
        ("not divisible", lambda: op(rand((16 * W + 1, 32), bf, dev, "a"), w)),
        ("max_m", lambda: op(rand((65 * W, 32), bf, dev, "a"), w)),
        ("is on", lambda: op(a.to("meta"), w)),
        ("ranks disagree", lambda: op(rand((16 * W, 32), bf, dev, "a"), rand((32, 24 + ctx.rank), bf, dev, "w"))),
    ]
    return op, bad, Call((a, w), {}, (a.float() @ w.float() * W)[ctx.rank * 16:(ctx.rank + 1) * 16])


#: a tiny partial: fallback="auto" takes the NCCL path
SMALL = RSCase(m_local=8, k=16, n=8, bias=True)

GEMM_RS = OpSpec(
    name="gemm_rs", module=__name__, op=to.GEMMReduceScatter, functional=to.gemm_rs, inputs=_inputs,
    stale=_garbage, finish=_finish, bad_inputs=_bad_inputs,
    # 24 | m: W = 2, 3, 4, 8. The reduction is in the GEMM (fuse) where every rank's rows are whole 32-row tiles
    # (m = 32 * 24 or 64 * 24) on the host backend, in a separate kernel otherwise
    cases=Cases(
        host=(
            RSCase(m=37 * 24, k=48, n=40, bias=True, m_per_chunk=16, iters=2, scatter="store"),
            RSCase(m=64 * 24, k=48, n=40, bias=True, m_per_chunk=16, iters=2, scatter="store"),
            RSCase(m=32 * 24, k=64, n=33, dtype="float16", transposed=True, m_per_chunk=7, iters=2, scatter="copy",
                   jitter=0.003),
            RSCase(m=29 * 24, k=64, n=33, dtype="float16", transposed=True, m_per_chunk=7, iters=2, scatter="store"),
            RSCase(m=32 * 24, k=40, n=24, scatter="store"),
            RSCase(m=37 * 24, k=48, n=40, bias=True, transposed=True, m_per_chunk=16, iters=2, scatter="copy",
                   jitter=0.003),
            RSCase(m=29 * 24, k=64, n=33, dtype="float16", m_per_chunk=7, iters=2, scatter="copy"),
            RSCase(m=37 * 24, k=48, n=40, bias=True, m_per_chunk=16, iters=2, scatter="store",
                   fuse=False),  # separate reduction kernel
            RSCase(m=29 * 24, k=64, n=33, dtype="float16", m_per_chunk=7, scatter="copy", fuse=False,
                   strided_out=True),  # and a strided out
            RSCase(m=32 * 24, k=48, n=40, bias=True, m_per_chunk=16, scatter="store",
                   tma=True),  # descriptors, B [K, N]
            RSCase(m=32 * 24, k=64, n=33, dtype="float16", transposed=True, m_per_chunk=7, scatter="copy",
                   jitter=0.003, claim=1, defer=False),  # counters at once
            RSCase(m=32 * 24, k=48, n=40, bias=True, m_per_chunk=10 ** 6, scatter="copy"),  # one chunk per rank
            # a peer's chunks over two and three copy streams, taking turns (plan.scatter_schedule)
            RSCase(m=32 * 24, k=64, n=33, dtype="float16", bias=True, m_per_chunk=32, iters=2, scatter="copy",
                   jitter=0.003, streams=2),
            RSCase(m=37 * 24, k=48, n=40, transposed=True, m_per_chunk=16, scatter="copy", jitter=0.003, fuse=False,
                   streams=3),
        ),
        gpu=(
            RSCase(m=4091 * 2 * 2, k=1024, n=1536, bias=True, m_per_chunk=512, iters=3, scatter="store"),
            RSCase(m=4091 * 4, k=512, n=1000, dtype="float16", transposed=True, m_per_chunk=1000, iters=3,
                   scatter="store"),
            RSCase(m=2048, k=4096, n=4096, transposed=True, iters=3, scatter="store"),
            RSCase(m=256 * 4, k=256, n=512, bias=True, m_per_chunk=37, iters=3, scatter="store"),
            RSCase(m=4091 * 2 * 2, k=1024, n=1536, bias=True, transposed=True, m_per_chunk=512, iters=3,
                   scatter="copy", jitter=0.0005),
            RSCase(m=4091 * 2 * 2, k=1024, n=1536, bias=True, m_per_chunk=512, iters=3, scatter="store", fuse=False),
            RSCase(m=2048, k=1024, n=1000, bias=True, iters=2, scatter="copy", strided_out=True),
            RSCase(m=8192, k=1024, n=1536, bias=True, transposed=True, m_per_chunk=300, iters=3, scatter="copy",
                   jitter=0.0005),
            RSCase(m=8192, k=1000, n=1536, bias=True, iters=3, scatter="store", tma=True),  # descriptors, B [K, N]
            # the fused GEMM's two ways of taking tiles, and counters bumped at once or deferred (kernels.gemm
            # CLAIM, DEFER_RELEASE), whatever the defaults are
            RSCase(m=8192, k=1024, n=1536, bias=True, transposed=True, m_per_chunk=300, iters=3, scatter="copy",
                   jitter=0.0005, claim=0, defer=True),
            RSCase(m=8192, k=1024, n=1536, bias=True, m_per_chunk=512, iters=3, scatter="store", jitter=0.0005,
                   claim=1, defer=False),
            RSCase(m=4096, k=1000, n=1536, dtype="float16", iters=3, scatter="store", tma=True, claim=0,
                   defer=False),
            RSCase(m=4096, k=1024, n=1000, bias=True, transposed=True, m_per_chunk=256, iters=3, scatter="copy",
                   claim=1, defer=True),
            # copy + fused: the warp-specialized GEMM (kernels.gemm_warp_specialized, sm_90 only) and kernels.gemm,
            # each asked for (gemm); K and N off the tiles, a tile over two chunks (m_per_chunk 300), B either way
            # round
            RSCase(m=4096, k=1000, n=1000, dtype="float16", bias=True, iters=3, scatter="copy", jitter=0.0005,
                   gemm="gluon"),
            RSCase(m=8192, k=1024, n=1536, bias=True, transposed=True, m_per_chunk=300, iters=3, scatter="copy",
                   jitter=0.0005, gemm="gluon"),
            RSCase(m=8192, k=1024, n=1536, bias=True, transposed=True, m_per_chunk=300, iters=3, scatter="copy",
                   jitter=0.0005, gemm="triton"),
            # the warp-specialized GEMM with no bias; with 2048 rows a program's only tile is its last (partials
            # preloaded)
            RSCase(m=8192, k=1024, n=1536, iters=3, scatter="copy", jitter=0.0005, gemm="gluon"),
            RSCase(m=2048, k=1024, n=1000, bias=True, transposed=True, iters=3, scatter="copy", jitter=0.0005,
                   gemm="gluon"),
            # and with a peer's two chunks on two copy streams side by side
            RSCase(m=2048, k=1024, n=1000, m_per_chunk=512, iters=3, scatter="copy", jitter=0.0005, gemm="gluon",
                   streams=2),
            RSCase(m=4096, k=1024, n=1536, bias=True, transposed=True, m_per_chunk=256, iters=3, scatter="copy",
                   jitter=0.0005, gemm="gluon", streams=4),
            # rows of an odd N are not 16-byte aligned: the last tile's peer partial loaded by the epilogue's warps,
            # not TMA
            RSCase(m=2048, k=1024, n=1001, bias=True, transposed=True, iters=3, scatter="copy", jitter=0.0005,
                   gemm="gluon"),
            # store + fused on the warp-specialized GEMM: peers' tiles straight into their receive slots once each
            # owner's start count says its call has started (PEER_STORES); a tile over two chunks, a program's only
            # tile, odd N
            RSCase(m=8192, k=1024, n=1536, bias=True, transposed=True, m_per_chunk=300, iters=3, scatter="store",
                   jitter=0.0005, gemm="gluon"),
            RSCase(m=2048, k=1024, n=1000, iters=3, scatter="store", jitter=0.0005, gemm="gluon"),
            RSCase(m=2048, k=1024, n=1001, dtype="float16", bias=True, transposed=True, iters=3, scatter="store",
                   gemm="gluon"),
        )),
    back_to_back=Variants(host=RSCase(m=24 * 4, k=32, n=32), gpu=RSCase(m=2048, k=1024, n=1024), calls=100,
                          ids={"store": dict(scatter="store"), "copy": dict(scatter="copy")}),
    # GPUs: also 1 MiB a rank whose tiles fit in one wave of the GPU's SMs, which takes the NCCL path too
    falls_back=Cases(host=(SMALL,), gpu=(SMALL, RSCase(m_local=128, k=64, n=4096, bias=True))),
    replay=Variants(host=None, gpu=RSCase(m=2048, k=512, n=768), calls=20,
                    ids={"store": dict(scatter="store"), "copy": dict(scatter="copy")}),
)

# the contract's tests: test_gemm_rs_matches_reference, test_gemm_rs_100_back_to_back_calls,
# test_gemm_rs_bad_input_raises_before_launch, test_gemm_rs_small_shapes_fall_back, test_gemm_rs_cuda_graph_replay
globals().update(contract.tests(GEMM_RS))


# ------------------------------------------------------------------------------------------ the op's own rules
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
