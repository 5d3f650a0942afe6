"""Sweeps that pick an op's configuration on the GPUs at hand; ``scripts/tune.py`` runs them and writes the winner
into a tuned table (ops.tuned), which the ops read on their own.

GEMM ops, two stages: the GEMM's tiles (block sizes, warps, stages, descriptor loads) with the default chunking,
then the chunking with the best tiles: chunk size, producer streams (W > 2), and for AllGather-GEMM push or pull and
launch order, for GEMM-ReduceScatter stores or copy engines. ``tune_tiles``: the GEMM's tiles alone, without
communication (one GPU is enough). MoE (``tune_moe``, both ops): the grouped GEMM's tiles, then chunks per rank
and copy streams; ``tune_moe_tiles``: the grouped GEMM alone. Attention: each kernel's tiles (forward, dQ, dK/dV)
on one GPU, as a rank of one. Every candidate is checked against a torch reference first; one that fails or does
not compile is skipped. Times are medians, max over ranks; GEMM and MoE candidates are timed as CUDA-graph replays
(triton_overlap.timing).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, replace
from itertools import product

import torch
import torch.distributed as dist

from .context.collectives import all_gather_rows
from .kernels.attention import Blocks, launch_fwd
from .kernels.attention_bwd import launch_bwd
from .kernels.capability import is_hopper
from .kernels.gemm import plain_gemm
from .kernels.grouped_gemm import launch_ag_grouped
from .ops.all_gather_gemm import AllGatherGEMM
from .ops.all_gather_moe import AllGatherMoEGEMM, consumer_schedule
from .ops.config import AllGatherGEMMConfig, AttentionConfig, GEMMReduceScatterConfig
from .ops.gemm_reduce_scatter import GEMMReduceScatter
from .ops.moe_config import MoEGEMMConfig
from .ops.moe_reduce_scatter import MoEGEMMReduceScatter
from .ops.moe_routing import grouped_matmul
from .torchrun import say

# block_m, block_n, block_k, num_warps, num_stages, tma (None: descriptors only for B passed as weight.t(); True:
# for B stored [K, N] too, which the sweep times)
GEMM_TILES = [(128, 256, 64, 8, 3, None), (128, 256, 64, 8, 4, None), (256, 128, 64, 8, 3, None),
              (256, 128, 64, 8, 4, None), (128, 128, 64, 4, 4, None), (128, 128, 64, 8, 3, None),
              (128, 128, 128, 8, 3, None), (128, 256, 32, 8, 4, None),
              (128, 256, 64, 8, 3, True), (128, 256, 64, 8, 4, True), (256, 128, 64, 8, 3, True),
              (256, 128, 64, 8, 4, True)]
# fp8 (e4m3) tiles, B passed as weight.t(): 128-deep K steps are 128 bytes, as 64 are for 16-bit types
FP8_TILES = [(128, 256, 128, 8, 3, None), (128, 256, 128, 8, 4, None), (256, 128, 128, 8, 3, None),
             (256, 128, 128, 8, 4, None), (128, 128, 128, 8, 4, None), (128, 128, 128, 4, 4, None),
             (128, 256, 64, 8, 4, None), (128, 128, 256, 8, 3, None)]
TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "tma")  # what a GEMM_TILES entry sets
CHUNKS = [1, 2, 4, 8]
FWD_TILES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
             (128, 128, 8, 2, True), (128, 64, 8, 3, True),  # True: warp-specialized (Hopper)
             (128, 128, 8, 3, True, 3)]  # three compute warpgroups (Hopper, D = 64)
DQ_TILES = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (128, 32, 4, 3), (64, 128, 8, 2)]
#: the grouped GEMM's tile choices (MoE); moe_tile_candidates keeps the combinations that can run
MOE_TILE_CHOICES = {"block_m": (64, 128), "block_n": (64, 128, 256), "block_k": (64, 128), "num_warps": (4, 8),
                    "num_stages": (2, 3, 4)}
MOE_TILE_FIELDS = tuple(MOE_TILE_CHOICES)
MOE_ROUTINGS = ("balanced", "zipf")
#: the skew of the "zipf" routing
ZIPF_EXPONENT = 1.0
DKDV_TILES = [(64, 128, 8, 2), (32, 128, 4, 3), (64, 128, 8, 3), (64, 64, 4, 2), (128, 128, 8, 2),
              (64, 128, 8, 2, True)]  # True: the single warp-specialized backward (Hopper; it takes its own tiles)


def timer(ctx, fn, iters=20, graph=False) -> float:
    """Median µs of ``fn``, max over ranks; ``graph``: of a CUDA-graph replay of ``fn`` (the host's launch cost,
    which does not depend on the config, drops out). Where kernels are interpreted (the host backend) a few
    wall-clock runs: a dry run."""
    if not ctx.interpreted:
        from .timing import graph_time, time_dist

        return graph_time(fn, iters) if graph else time_dist(fn, iters, budget_s=1.0, lead_us=300.0)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return float(t.item())


def rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def try_candidate(ctx, run, check, tol, graph=False):
    """(µs, None) or (None, why). ``run`` launches the candidate once; ``check`` returns its error."""
    try:
        run()
        ctx.synchronize()
        ctx.check()
        err = check()
        bad = torch.tensor([0.0 if err < tol else 1.0], device=ctx.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=ctx.group)
        if bad.item():
            return None, f"error {err:.2e} over {tol:g} on some rank"
        return timer(ctx, run, graph=graph), None
    except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run is reported and skipped
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def sweep(ctx, stage, candidates, make_run, check, tol, label=str, graph=False):
    best = None
    for i, cand in enumerate(candidates):
        run = make_run(cand)
        us, why = try_candidate(ctx, run, check, tol, graph)
        result = f"{us:.1f} µs" if us is not None else f"skipped ({why})"
        say(f"  {stage} [{i + 1}/{len(candidates)}] {label(cand)}: {result}")
        if us is not None and (best is None or us < best[0]):
            best = (us, cand)
    if best is None:
        raise SystemExit(f"tune: no {stage} candidate ran")
    return best


def _config_class(kind: str):
    return GEMMReduceScatterConfig if kind == "gemm_rs" else AllGatherGEMMConfig


def tile_candidates(base, dry, table=GEMM_TILES):
    """Configs with each of ``table``'s tiles on top of ``base``, base's own tiles first."""
    first = tuple(getattr(base, k) for k in TILE_FIELDS)
    tiles = [first] + [t for t in table if t != first]
    return [replace(base, **dict(zip(TILE_FIELDS, t))) for t in (tiles[:2] if dry else tiles)]


def tune_tiles(ctx, kind, shape, dry):
    """GEMM tiles alone (--tiles-only): our persistent GEMM on the op's per-rank GEMM (M x K x N, with K
    the local K for gemm_rs), without communication, on each rank's GPU; a world of one is enough. The
    result, the tile fields only, is stored under world size "any": the tiles for this GPU and shape at
    every world size that has no full tuning of its own (the other fields stay the op's defaults)."""
    M, K, N = shape
    dt = torch.bfloat16
    g = torch.Generator(device=ctx.device).manual_seed(99)
    a = torch.randn(M, K, device=ctx.device, dtype=dt, generator=g)
    w = torch.randn(K, N, device=ctx.device, dtype=dt, generator=g) / K ** 0.5
    out = torch.empty(M, N, device=ctx.device, dtype=dt)
    scales = None
    if kind == "ag_gemm_fp8":  # e4m3 operands, B as weight.t() (fp8 weights' layout), per-tensor scales, bf16 out
        a = (a * 8).to(torch.float8_e4m3fn)
        w = (w.t() * 8 * K ** 0.5).to(torch.float8_e4m3fn).contiguous().t()
        scales = (torch.full((1,), 1 / 8, device=ctx.device), torch.full((1,), 1 / (8 * K ** 0.5), device=ctx.device))
        ref = (a.float() @ w.float()) * (scales[0] * scales[1])
        cands = tile_candidates(AllGatherGEMMConfig.defaults(ctx).for_fp8(ctx), dry, FP8_TILES)
    else:
        ref = a.float() @ w.float()
        cands = tile_candidates(_config_class(kind).defaults(ctx), dry)
    say(f"tune {kind} {shape}, GEMM tiles alone: {len(cands)} tile configs")
    us, best = sweep(ctx, "tiles", cands, lambda cfg: plain_gemm(ctx, cfg, a, w, out, scales=scales),
                     lambda: rel(out, ref), 2e-2, graph=not ctx.interpreted)
    return us, {k: getattr(best, k) for k in TILE_FIELDS}


def tune_gemm(ctx, kind, shape, dry):
    M, K, N = shape
    W, r = ctx.world_size, ctx.rank
    dt = torch.bfloat16
    g = torch.Generator(device=ctx.device).manual_seed(1234 + r)
    if kind == "ag_gemm":
        a = torch.randn(M // W, K, device=ctx.device, dtype=dt, generator=g)
        w = torch.randn(K, N, device=ctx.device, dtype=dt, generator=g) / K ** 0.5
        full = torch.empty(M, K, device=ctx.device, dtype=dt)
        all_gather_rows(full, a, group=ctx.group)
        ref = full.float() @ w.float()
        op = AllGatherGEMM(ctx, fallback="never")
    else:
        a = torch.randn(M, K, device=ctx.device, dtype=dt, generator=g)
        w = torch.randn(K, N, device=ctx.device, dtype=dt, generator=g) / (K * W) ** 0.5
        part = a.float() @ w.float()
        dist.all_reduce(part, group=ctx.group)
        ref = part[r * (M // W):(r + 1) * (M // W)]
        op = GEMMReduceScatter(ctx, fallback="never")
    got = {}

    def make_run(cfg):
        def run():
            got["out"] = op(a, w, **asdict(cfg))
        return run

    check = lambda: rel(got["out"], ref)  # noqa: E731
    cands = tile_candidates(_config_class(kind).defaults(ctx), dry)
    say(f"tune {kind} {shape} on {W} rank(s): {len(cands)} tile configs")
    # in CUDA graphs: eager times of these ops are dominated by the host's launch cost, which does not depend on
    # the config
    _, best = sweep(ctx, "tiles", cands, make_run, check, 2e-2, graph=True)
    # producer streams: one per peer (None) or fewer; with W = 2 there is one peer, so nothing to choose
    streams = [None] + sorted({1, max(1, (W - 1) // 2)} - {W - 1})
    chunk_cands = [replace(best, chunks_per_rank=c, num_streams=n, min_chunk_bytes=0)  # exactly c chunks per rank
                   for c in (CHUNKS[:2] if dry else CHUNKS) for n in (streams[:2] if dry else streams)]
    if kind == "gemm_rs":  # GEMM stores into the owners' slots (no producer streams), or copy engines move the chunks
        chunk_cands = ([replace(c, scatter="store") for c in chunk_cands if c.num_streams is None]
                       + [replace(c, scatter="copy") for c in chunk_cands])
    if kind == "ag_gemm":  # push or pull producers; launch order (where launches are asynchronous: GPUs)
        chunk_cands += [replace(c, mode="pull") for c in chunk_cands]
        if not ctx.synchronous_launches:
            chunk_cands += [replace(c, consumer_first=not c.consumer_first) for c in chunk_cands]
    us, best = sweep(ctx, "chunking", chunk_cands, make_run, check, 2e-2, graph=True)
    return us, asdict(best)


def tune_attention(ctx, shape, dry):
    """Each kernel's tiles, on this rank's GPU alone (world of one), against torch autograd on the full sequence."""
    B, S, Hq, Hkv, D, causal = shape
    causal = bool(causal)
    dev = ctx.device
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(7)
    q, k, v = (torch.randn(B, S, h, D, device=dev, dtype=dt, generator=g) for h in (Hq, Hkv, Hkv))
    dout = torch.randn(B, S, Hq, D, device=dev, dtype=dt, generator=g)
    scale = 1.0 / D ** 0.5
    leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    if ctx.interpreted:
        kk, vv = (t.float().repeat_interleave(Hq // Hkv, 1) for t in leaves[1:])
        s = leaves[0].float() @ kk.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        ref_out = torch.softmax(s, -1) @ vv
    else:
        ref_out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    ref_out.backward(dout.transpose(1, 2))
    ref_out = ref_out.transpose(1, 2)
    ref_dq, ref_dk, ref_dv = (t.grad.transpose(1, 2) for t in leaves)

    base = AttentionConfig.defaults(ctx, D, 2, is_hopper(ctx), seq_len=S, causal=causal)
    cpr = 2
    flags = torch.ones(cpr, dtype=torch.int32, device=dev)  # every chunk in place: a world of one
    out, lse = torch.empty_like(q), torch.empty(B, Hq, S, device=dev, dtype=torch.float32)

    def fwd_run(blocks):
        return lambda: launch_fwd(ctx, q, k, v, k, v, out, lse, flags, S // cpr, cpr, scale, causal, blocks, rank=0,
                                  world=1)

    def pick(tiles, basic):
        cands = [basic] + [Blocks(*t) for t in tiles if Blocks(*t) != basic]
        return cands[:2] if dry else cands

    say(f"tune cp_attention {shape}: kernel tiles on one GPU")
    us_f, best_f = sweep(ctx, "forward", pick(FWD_TILES, base.fwd), fwd_run, lambda: rel(out, ref_out), 2e-2)
    fwd_run(best_f)()
    recv = torch.zeros(1, 2, B, S, Hkv, D, device=dev, dtype=torch.float32)
    counters = torch.zeros(1, dtype=torch.int32, device=dev)
    ptrs = (torch.tensor([recv.data_ptr()], dtype=torch.int64, device=dev),
            torch.tensor([counters.data_ptr()], dtype=torch.int64, device=dev))
    dq = torch.empty_like(q)

    def bwd_run(cfg):
        return lambda: launch_bwd(ctx, q, k, v, k, v, dout, out, lse, dq, *ptrs, flags, S // cpr, cpr, scale, causal,
                                  cfg.dq, cfg.dkdv, rank=0, world=1)

    two = replace(base.dkdv, warp_specialized=False)  # the dQ kernel runs beside the dK/dV kernel only
    us_q, best_q = sweep(ctx, "dq", [replace(base, dq=b, dkdv=two) for b in pick(DQ_TILES, base.dq)], bwd_run,
                         lambda: rel(dq, ref_dq), 3e-2, label=lambda c: str(c.dq))
    check_kv = lambda: max(rel(recv[0, 0], ref_dk), rel(recv[0, 1], ref_dv))  # noqa: E731
    us_kv, best_kv = sweep(ctx, "dkdv", [replace(best_q, dkdv=b) for b in pick(DKDV_TILES, base.dkdv)], bwd_run,
                           check_kv, 3e-2, label=lambda c: str(c.dkdv))
    cfg = AttentionConfig(2, best_f, best_q.dq, best_kv.dkdv)
    say(f"  best: forward {us_f:.1f} µs, backward (dq + dkdv) {us_kv:.1f} µs")
    return us_f, {"fwd": asdict(cfg.fwd), "dq": asdict(cfg.dq), "dkdv": asdict(cfg.dkdv)}


# ------------------------------------------------------------------------------------------------------------ MoE
def moe_routing_ids(tokens: int, experts: int, topk: int, kind: str, seed: int = 0) -> torch.Tensor:
    """int64 [tokens, topk] on the CPU, the same on every rank: each token's ``topk`` distinct experts, drawn
    uniformly ("balanced") or by ``zipf_popularity`` ("zipf"); the routings of the MoE tuning and benchmarks
    (benchmarks/moe.py)."""
    if kind not in MOE_ROUTINGS or not 1 <= topk <= experts:
        raise ValueError(f"moe routing: kind one of {MOE_ROUTINGS} and 1 <= topk <= experts, got {kind!r}, "
                         f"topk {topk}, experts {experts}")
    g = torch.Generator().manual_seed(seed)
    p = zipf_popularity(experts, g) if kind == "zipf" else torch.ones(experts)
    return torch.multinomial(p.expand(tokens, experts).contiguous(), topk, replacement=False, generator=g)


def zipf_popularity(experts: int, g: torch.Generator) -> torch.Tensor:
    """Each expert's share of the choices (sums to 1): Zipf over the ranks (``1 / rank ** ZIPF_EXPONENT``), the
    ranks in a random order drawn from ``g``."""
    p = torch.arange(1, experts + 1, dtype=torch.float64) ** -ZIPF_EXPONENT
    return (p / p.sum())[torch.randperm(experts, generator=g)].float()


def moe_tile_candidates(ctx, base, dry):
    """``base`` with each combination of MOE_TILE_CHOICES that can run, base's own tiles first: ``num_stages``
    buffers of 16-bit A and B tiles within the GPU's shared memory per block, and a float32 accumulator of 64 to
    128 registers a thread (fewer leaves the SMs idle between loads, more spills). A candidate that still fails to
    compile is skipped by the sweep."""
    smem = 1 << 30
    if not ctx.interpreted:
        smem = getattr(torch.cuda.get_device_properties(ctx.device), "shared_memory_per_block_optin", 0) or 64 << 10
    first = tuple(getattr(base, k) for k in MOE_TILE_FIELDS)
    fit = [t for t in product(*MOE_TILE_CHOICES.values())
           if t[4] * (t[0] + t[1]) * t[2] * 2 <= smem and 64 <= t[0] * t[1] // (32 * t[3]) <= 128]
    tiles = [first] + [t for t in fit if t != first]
    return [replace(base, **dict(zip(MOE_TILE_FIELDS, t))) for t in (tiles[:2] if dry else tiles)]


def _moe_tiles(cfg) -> str:
    return " ".join(f"{k}={getattr(cfg, k)}" for k in MOE_TILE_FIELDS)


def _moe_chunks(cfg) -> str:
    return f"chunks_per_rank={cfg.chunks_per_rank} num_streams={cfg.num_streams}"


def tune_moe(ctx, shape, routing, dry) -> dict:
    """Both MoE ops at ``shape`` = (tokens per rank, K, N, E, topk), each with a weight shard w [E, K, N]
    (ag_moe_gemm: x [T/W, K]; moe_gemm_rs: h [T, topk, K]), ``routing`` as moe_routing_ids draws it: the grouped
    GEMM's tiles with the default chunking, then chunks per rank and copy streams (one per peer down to one) with
    the best tiles. Each candidate is checked against the op's torch fallback and timed as CUDA-graph replays,
    routing checks off (they read the routing back to the host, which a graph cannot hold). Returns
    {op name: (µs, config dict)}."""
    m_local, K, N, E, topk = shape
    W, r, dev, dt = ctx.world_size, ctx.rank, ctx.device, torch.bfloat16
    T = m_local * W
    g = torch.Generator(device=dev).manual_seed(4321 + r)
    x = torch.randn(m_local, K, device=dev, dtype=dt, generator=g)
    h = torch.randn(T, topk, K, device=dev, dtype=dt, generator=g)
    w = torch.randn(E, K, N, device=dev, dtype=dt, generator=g) / K ** 0.5
    ids = moe_routing_ids(T, E, topk, routing).to(dev)
    weights = torch.softmax(torch.randn(T, topk, generator=torch.Generator().manual_seed(5)), dim=-1).to(dev)
    base = MoEGEMMConfig.defaults(ctx)
    streams = sorted({1, max(1, (W - 1) // 2), max(1, W - 1)})
    results = {}
    for cls, args in ((AllGatherMoEGEMM, (x, w, ids)), (MoEGEMMReduceScatter, (h, w, ids, weights))):
        kind = cls.KIND
        ref = cls(ctx, fallback="always", name=f"tune.{kind}.ref")(*args)
        op = cls(ctx, fallback="never", check_routing=False, name=f"tune.{kind}")
        got = {}

        def make_run(cfg, op=op, args=args):
            def run():
                op.user_config = cfg  # the candidate, as a caller's config
                got["out"] = op(*args)
            return run

        check = lambda ref=ref: rel(got["out"], ref)  # noqa: E731
        tiles = moe_tile_candidates(ctx, base, dry)
        say(f"tune {kind} {shape} ({routing}) on {W} rank(s): {len(tiles)} tile configs")
        _, best = sweep(ctx, f"{kind} tiles", tiles, make_run, check, 2e-2, _moe_tiles, graph=True)
        chunks = [replace(best, chunks_per_rank=c, m_per_chunk=None, min_chunk_bytes=0, num_streams=n)
                  for c in (CHUNKS[:2] if dry else CHUNKS) for n in (streams[:2] if dry else streams)]
        us, best = sweep(ctx, f"{kind} chunking", chunks, make_run, check, 2e-2, _moe_chunks, graph=True)
        results[kind] = (us, asdict(best))
    return results


def tune_moe_tiles(ctx, shape, routing, dry):
    """The grouped GEMM's tiles alone (--tiles-only): ``ag_grouped_gemm`` as a world of one, every token already
    here, on the T = tokens per rank x W tokens of ``shape`` (tokens per rank, K, N, E, topk) at this world size
    (one GPU: W = 1), each rank's GPU on its own. Both MoE ops' kernels run this tile loop, so the result, the
    tile fields only, serves both. Returns (µs, tiles)."""
    m_local, K, N, E, topk = shape
    T, dev, dt = m_local * ctx.world_size, ctx.device, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(99)
    x = torch.randn(T, K, device=dev, dtype=dt, generator=g)
    w = torch.randn(E, K, N, device=dev, dtype=dt, generator=g) / K ** 0.5
    ids = moe_routing_ids(T, E, topk, routing).to(dev)
    ref = grouped_matmul(x.repeat_interleave(topk, dim=0), ids.reshape(-1), w)
    out = torch.empty(T * topk, N, device=dev, dtype=dt)
    op = AllGatherMoEGEMM(ctx, name="tune.moe_tiles")
    flags = torch.ones(1, dtype=torch.int32, device=dev)

    def make_run(cfg):
        sched = consumer_schedule(cfg, T, dev)
        _, routes, table = op.route(sched, ids, E, False)
        return lambda: launch_ag_grouped(ctx, cfg, x, x, w, out, routes, table, flags, sched.layout, op=op.op, rank=0)

    cands = moe_tile_candidates(ctx, MoEGEMMConfig.defaults(ctx), dry)
    say(f"tune moe {shape} ({routing}), grouped GEMM tiles alone on {T} tokens: {len(cands)} tile configs")
    us, best = sweep(ctx, "tiles", cands, make_run, lambda: rel(out, ref), 2e-2, _moe_tiles,
                     graph=not ctx.interpreted)
    return us, {k: getattr(best, k) for k in MOE_TILE_FIELDS}
