"""Context-parallel attention against full-sequence attention in float32: the op's spec and cases (forward and
backward), which get the contract's tests (tests/contract.py), then packed documents, a group of one, the
simulated worlds of the kernels and the waits' faults."""
import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

import contract
import triton_overlap as to
from contract import Call, Cases, GradCall, OpSpec
from harness import host_case_share
from refs import (GRAD_TOL, TOL, OfflineContext, assert_own_fault, attention, attention_docs, attention_problem,
                  late_chunk_faults, on_hopper, poison, rand, rel_err)


@dataclass(frozen=True, kw_only=True)
class CPCase:
    """q [B, S, Hq, D] and k, v [B, S, Hkv, D] over the full sequence of S (48 | S: W = 2, 3, 4, 8), zigzag-sharded;
    ``iters`` calls on one op with ``chunks_per_rank``, producers delayed at random up to ``jitter`` s;
    ``num_streams``: the copy streams, ``in_host``: reduce_in_host (the rest of the config as the op picks it);
    ``keep_kv``: backward reads the K/V the forward kept, else gathers them again. A gradient case rounds S up to a
    length every rank's shard splits into its chunks."""
    B: int = 1
    S: int
    Hq: int
    Hkv: int
    D: int
    causal: bool = True
    dtype: str = "bfloat16"
    iters: int = 1
    chunks_per_rank: int = 2
    jitter: float = 0.0
    num_streams: int | None = None
    keep_kv: bool = False
    in_host: bool | None = None


def _make(ctx, case, fallback):
    op = to.ContextParallelAttention(ctx, chunks_per_rank=case.chunks_per_rank, keep_kv=case.keep_kv)
    fields = {k: v for k, v in (("num_streams", case.num_streams), ("reduce_in_host", case.in_host)) if v is not None}
    if fields:  # these fields set, the rest of the config as the op would pick it
        cfg = op.config_for((case.S, case.Hq, case.Hkv, case.D, int(case.causal)))
        op = to.ContextParallelAttention(ctx, config=dataclasses.replace(cfg, **fields), keep_kv=case.keep_kv)
    return op


def _inputs(ctx, case, it):
    dtype = getattr(torch, case.dtype)
    B, S, Hq, Hkv, D = case.B, case.S, case.Hq, case.Hkv, case.D
    q, k, v = (rand((B, S, h, D), dtype, ctx.device, name, it) for name, h in (("q", Hq), ("k", Hkv), ("v", Hkv)))
    ref_out, ref_lse = attention(q, k, v, case.causal, 1.0 / math.sqrt(D))
    qs = to.zigzag.shard(q, ctx)
    lse = poison(torch.empty((B, Hq, qs.shape[1]), dtype=torch.float32, device=ctx.device))
    return Call((qs, to.zigzag.shard(k, ctx), to.zigzag.shard(v, ctx)), dict(causal=case.causal, lse=lse),
                to.zigzag.shard(ref_out, ctx), torch.empty_like(qs), dict(kv=(k, v), out=ref_out, lse=ref_lse))


def _garbage(ctx, op, case, it):
    if it:
        for name in ("k", "v"):  # stale garbage where peers write
            ws = ctx.symmetric(f"cp_attention.{name}", (case.B, case.S, case.Hkv, case.D), getattr(torch, case.dtype))
            ws.local.copy_(torch.randn_like(ws.local, dtype=torch.float32))


def _check(ctx, op, case, call, result):
    out, lse = result
    assert lse.data_ptr() == call.kwargs["lse"].data_ptr()
    # the zigzag shard of the position sequence is what cp.positions says
    shard_pos = to.zigzag.shard(torch.arange(case.S)[None], ctx)[0]
    assert torch.equal(shard_pos, to.zigzag.positions(ctx.rank, ctx.world_size, case.S // ctx.world_size))
    # the Hopper forward's tile counter (the op's own) is zero again for the next call
    assert op.state["tile counter"].tolist() == [0, 0]
    # the producers delivered every peer's K/V shard, every batch, into our workspace
    B, S = case.B, case.S
    for name, full in zip("kv", call.expect["kv"]):
        ws = ctx.symmetric(f"cp_attention.{name}", (B, S, case.Hkv, case.D), full.dtype).local
        S_loc = S // ctx.world_size  # rank p's shard: global chunks p and 2W-1-p of S_loc/2 rows
        for p in range(ctx.world_size):
            if p != ctx.rank:
                want = torch.cat([full[:, p * (S_loc // 2):(p + 1) * (S_loc // 2)],
                                  full[:, S - (p + 1) * (S_loc // 2):S - p * (S_loc // 2)]], dim=1)
                bad = [b for b in range(B) if not torch.equal(ws[b, p * S_loc:(p + 1) * S_loc], want[b])]
                assert not bad, f"{name} rows from rank {p} wrong in batch(es) {bad}"
    # the whole sequence, every rank's rows
    e_out = rel_err(to.zigzag.unshard(out, ctx), call.expect["out"])
    e_lse = rel_err(to.zigzag.unshard(lse, ctx, dim=2), call.expect["lse"])
    assert e_out < TOL[out.dtype], f"out rel err {e_out:.2e}"
    assert e_lse < 1e-3, f"lse rel err {e_lse:.2e}"


def _bad_inputs(ctx):
    dev = ctx.device
    bf = torch.bfloat16
    op = to.ContextParallelAttention(ctx)
    q = rand((1, 16, 4, 64), bf, dev, "q")
    kv = rand((1, 16, 2, 64), bf, dev, "k")
    odd = [rand((1, 15, h, 64), bf, dev, n) for n, h in (("q", 4), ("k", 2), ("k", 2))]
    bad = [
        ("chunks_per_rank", lambda: to.ContextParallelAttention(ctx, chunks_per_rank=3)),
        ("differs from the config", lambda: to.ContextParallelAttention(ctx, chunks_per_rank=4,
                                                                        config=to.AttentionConfig(chunks_per_rank=2))),
        ("num_streams", lambda: to.AttentionConfig(num_streams=0)),
        ("multiple of Hkv", lambda: op(rand((1, 16, 3, 64), bf, dev, "q"), kv, kv)),
        ("head dim", lambda: op(rand((1, 16, 4, 32), bf, dev, "q"), rand((1, 16, 2, 32), bf, dev, "k"),
                                rand((1, 16, 2, 32), bf, dev, "k"))),
        ("different dtypes", lambda: op(q, kv.half(), kv)),
        ("zigzag", lambda: op(*odd)),
        ("4-D", lambda: op(q[0], kv, kv)),
        ("float16 or bfloat16", lambda: op(q.float(), kv.float(), kv.float())),
    ]
    return op, bad, _inputs(ctx, CPCase(S=48, Hq=4, Hkv=2, D=64), 0)


def _grad_inputs(ctx, case):
    unit = ctx.world_size * case.chunks_per_rank  # S grows to the next length every rank's shard splits evenly
    S = -(-case.S // unit) * unit
    inputs, want = attention_problem(ctx.device, case.B, S, case.Hq, case.Hkv, case.D, case.causal,
                                     getattr(torch, case.dtype), "g")
    q, k, v, dout = (to.zigzag.shard(t, ctx) for t in inputs)
    return GradCall(dict(q=q, k=k, v=v), dict(causal=case.causal), dout,
                    {name: to.zigzag.shard(g, ctx) for name, g in zip("qkv", want[1:])})


def _after_forward(ctx, op, case, result):
    out, lse = result
    assert not lse.requires_grad
    if case.keep_kv:  # a second call in between overwrites the workspaces: backward must use the kept copies
        for ws in ("k", "v"):
            ctx.symmetric(f"{op.name}.{ws}", (case.B, ctx.world_size * out.shape[1], case.Hkv, case.D),
                          out.dtype).local.normal_()


CP_ATTENTION = OpSpec(
    name="cp_attention", module=__name__, op=to.ContextParallelAttention, make=_make, inputs=_inputs,
    stale=_garbage, check=_check, bad_inputs=_bad_inputs, reference="full_sequence",
    cases=Cases(
        host=(
            CPCase(S=96, Hq=4, Hkv=1, D=64, iters=2, jitter=0.005),  # MQA, causal, producers delayed at random
            CPCase(B=2, S=96, Hq=4, Hkv=2, D=64, causal=False, dtype="float16"),  # GQA 2:1, not causal, B = 2
            CPCase(S=144, Hq=8, Hkv=2, D=128, chunks_per_rank=6),  # GQA 4:1, D = 128, finer chunks
        ),
        gpu=(  # S a multiple of 2W x 128 at W = 2, 3 and 4 (the warp-specialized forward's blocks on Hopper)
            CPCase(S=6144, Hq=32, Hkv=8, D=128, iters=2),
            # on Hopper: three compute warpgroups (AttentionConfig.defaults)
            CPCase(B=2, S=9216, Hq=8, Hkv=8, D=64, causal=False, dtype="float16", iters=2, chunks_per_rank=4),
            CPCase(S=6144, Hq=16, Hkv=1, D=128, iters=2, chunks_per_rank=8),
        )),
    grad_inputs=_grad_inputs, after_forward=_after_forward,
    grad_cases=Cases(
        host=(
            CPCase(S=48, Hq=4, Hkv=1, D=64),
            CPCase(B=2, S=48, Hq=4, Hkv=2, D=64, causal=False, dtype="float16", chunks_per_rank=4),
            CPCase(S=48, Hq=4, Hkv=2, D=64, keep_kv=True),  # backward on the K/V the forward kept
        ),
        gpu=(
            CPCase(S=4096, Hq=16, Hkv=4, D=128),
            CPCase(S=2048, Hq=8, Hkv=8, D=64, causal=False, dtype="float16", chunks_per_rank=4),
            CPCase(S=4096, Hq=16, Hkv=4, D=128, chunks_per_rank=4, keep_kv=True),
        )),
)

# the contract's tests: test_cp_attention_matches_full_sequence, test_cp_attention_gradients_match_full_sequence,
# test_cp_attention_bad_input_raises_before_launch
globals().update(contract.tests(CP_ATTENTION))


@pytest.mark.parametrize("num_streams", [1, 2])
def test_cp_attention_copy_streams(pool, num_streams):
    """Every peer's chunks pushed on one copy stream in turn, or spread over two, producers delayed at random."""
    host_case_share(pool, num_streams - 1)
    case = dataclasses.replace(CP_ATTENTION.cases.on(pool)[0], num_streams=num_streams)
    pool.run(contract.matches_reference, CP_ATTENTION, case)


def _one_rank_case(B, S, Hq, Hkv, D, causal, dtype_name, keep_kv):
    """A group of one: the forward into poisoned out/lse and, through autograd, the backward (with ``keep_kv``, on
    the K/V the forward kept), against the float32 reference; no barrier runs (the call number stays) and no K/V
    workspace is allocated."""
    dtype = getattr(torch, dtype_name)
    with to.Context(timeout_s=120) as ctx:
        assert ctx.world_size == 1
        op = to.ContextParallelAttention(ctx, chunks_per_rank=2, keep_kv=keep_kv)
        (q, k, v, dout), want = attention_problem(ctx.device, B, S, Hq, Hkv, D, causal, dtype, "one")
        _, ref_lse = attention(q, k, v, causal, 1.0 / math.sqrt(D))
        calls = ctx.call_number.item()
        out = poison(torch.empty_like(q))
        lse = poison(torch.empty((B, Hq, S), dtype=torch.float32, device=ctx.device))
        op(q, k, v, causal=causal, out=out, lse=lse)
        ctx.check()
        errs = {"out": rel_err(out, want[0]), "lse": rel_err(lse, ref_lse)}
        assert errs["out"] < TOL[dtype] and errs["lse"] < 1e-3, f"one rank: {errs}"
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        o, _ = op(*mine, causal=causal)
        (o.float() * dout.float()).sum().backward()
        ctx.check()
        errs.update({f"d{n}": rel_err(m.grad, r) for n, m, r in zip("qkv", mine, want[1:])})
        bad = {n: e for n, e in errs.items() if n.startswith("d") and e > GRAD_TOL[dtype]}
        assert not bad, f"one rank: gradient rel err {bad}"
        assert ctx.call_number.item() == calls, "a barrier ran on a group of one"
        assert not {"k", "v"} & set(op.buffers()), f"K/V workspaces allocated on a group of one: {list(op.buffers())}"
        return errs


ONE_RANK_CASES = {  # odd lengths take the Triton kernels; on Hopper 4096 takes the warp-specialized ones
    "host": [(1, 54, 4, 2, 64, True, "bfloat16", False), (2, 40, 4, 4, 64, False, "float16", True)],
    "cuda": [(1, 2000, 8, 2, 128, True, "bfloat16", False), (1, 4096, 16, 4, 128, True, "bfloat16", True),
             (2, 1024, 8, 8, 64, False, "float16", False)],
}


@pytest.mark.parametrize("case", range(3))
def test_one_rank_runs_the_kernels_alone(pool, case):
    """On a group of one the op launches its kernels alone: nothing to gather, no peer to meet. Runs on a pool of
    one rank of the same backend, once per backend (from its two-rank pool)."""
    from harness import get_pool

    cases = ONE_RANK_CASES["host" if pool.backend == "host" else "cuda"]
    if pool.world != 2 or case >= len(cases):
        pytest.skip("runs once per backend, from its two-rank pool" if pool.world != 2 else "no such case here")
    get_pool(pool.backend, 1).run(_one_rank_case, *cases[case])


def simulate_ranks(ctx, q, k, v, dout, world, causal, chunks_per_rank=2, head_split=None, cfg=None):
    """Every rank's share of cp_attention forward and backward for a world of ``world``, run one after another
    on this process's device with forward_on_gathered / backward_on_gathered (the helpers the NCCL baselines use).
    Full-sequence inputs in, full-sequence (out, dq, dk, dv) out. The dK/dV partials land in NaN-poisoned
    buffers. ``cfg``: the AttentionConfig (None: the defaults for the backend)."""
    from triton_overlap.ops.attention_on_gathered import backward_on_gathered, forward_on_gathered

    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D)
    cfg = to.AttentionConfig.defaults(ctx, D, chunks_per_rank) if cfg is None else cfg
    sh = lambda t, r: to.zigzag.shard_for(t, r, world, dim=1)  # noqa: E731
    kg, vg = (torch.cat([sh(t, r) for r in range(world)], dim=1) for t in (k, v))
    outs, dqs, parts = [], [], []
    for r in range(world):
        qr, kr, vr, dr = (sh(t, r) for t in (q, k, v, dout))
        o, lse = forward_on_gathered(ctx, qr, kr, vr, kg, vg, r, world, causal, scale, cfg)
        B, S, _, _ = qr.shape
        p = torch.full((world, 2, B, S, k.shape[2], D), float("nan"), dtype=torch.float32, device=q.device)
        dq, p = backward_on_gathered(ctx, qr, kr, vr, kg, vg, o, lse, dr, r, world, causal, scale, cfg, parts=p,
                                     head_split=head_split)
        outs.append(o)
        dqs.append(dq)
        parts.append(p)
    total = torch.stack(parts).sum(0)  # [owner, 2, B, S_local, Hkv, D]: what the owners' reductions add up
    unsh = lambda xs: to.zigzag.unshard_parts(list(xs), dim=1)  # noqa: E731
    return (unsh(outs), unsh(dqs), unsh(total[:, 0].to(k.dtype)), unsh(total[:, 1].to(v.dtype)))


def _on_gathered_case(world, causal, split, S_unit, Hq, D):
    """The helpers behind the NCCL forward + backward baseline (forward_on_gathered, backward_on_gathered): every
    simulated rank's share, summed, equals attention on the full sequence, with the dK/dV kernel's query heads of
    each K/V block split over ``split`` programs (what the op chooses where K/V heads are few) and whole (against
    the split)."""
    dtype = torch.bfloat16
    with to.Context(timeout_s=120) as ctx:
        inputs, want = attention_problem(ctx.device, 1, S_unit * 2 * world, Hq, 2, D, causal, dtype, "split")
        got = simulate_ranks(ctx, *inputs, world, causal, head_split=split)
        errs = [rel_err(g, r) for g, r in zip(got, want)]
        assert max(errs) < GRAD_TOL[dtype], f"head_split {split}, world {world}: rel errs out/dq/dk/dv {errs}"
        whole = simulate_ranks(ctx, *inputs, world, causal, head_split=1)
        diff = [rel_err(g, w) for g, w in zip(got[2:], whole[2:])]  # dk, dv: only the float32 sum order differs
        assert max(diff) < 1e-2, f"head_split {split} against 1: rel diff dk/dv {diff}"
        return errs


@pytest.mark.parametrize("world,causal,split", [(1, True, 4), (3, True, 2), (4, False, 2)])
def test_on_gathered_helpers_match_full_sequence(pool, world, causal, split):
    _simulated_once(pool)
    if pool.backend == "host":  # one query head a program of the split
        pool.run(_on_gathered_case, world, causal, split, 8, 2 * split, 64)
    else:
        pool.run(_on_gathered_case, world, causal, split, 384, 8, 128)


def test_tail_heads_choice():
    """The closing heads of the Hopper forward's tile order hold TAIL_ROUNDS tiles a program, or every head where
    there are fewer tiles than that; always at least one head."""
    from triton_overlap.kernels.attention_hopper import TAIL_ROUNDS, tail_heads

    for bh, blocks, programs in ((32, 64, 132), (32, 16, 132), (64, 256, 132), (1, 8, 8), (5, 3, 15), (7, 1000, 114)):
        tail = tail_heads(bh, blocks, programs)
        assert 1 <= tail <= bh, (bh, blocks, programs, tail)
        assert tail == bh or tail * blocks >= TAIL_ROUNDS * programs > (tail - 1) * blocks, (bh, blocks, programs)


def test_warp_groups_choice():
    """The Hopper forward's compute warpgroups: three at D = 64 where a tile reads LONG_WALK key blocks or more on
    average (S / 128 not causal, half that causal), else two; never three at D = 128 or off Hopper. Each half of a
    shard is cut into tiles from its end, the first one short where the tile's rows do not divide it."""
    from triton_overlap.kernels.attention_hopper import query_tiles
    from triton_overlap.ops.config import LONG_WALK

    def groups(D, S, causal, hopper=True):
        fwd = to.AttentionConfig.defaults(OfflineContext("cuda"), D, 2, hopper, seq_len=S, causal=causal).fwd
        return fwd.warp_groups if fwd.warp_specialized else None

    long_causal, long_not = 2 * 128 * LONG_WALK, 128 * LONG_WALK
    assert groups(64, long_causal, True) == 3 and groups(64, long_causal - 128, True) == 2
    assert groups(64, long_not, False) == 3 and groups(64, long_not - 128, False) == 2
    assert groups(64, 4 * long_causal, True) == 3 and groups(64, 1024, False) == 2
    assert groups(128, 4 * long_causal, True) == 2 and groups(128, 4 * long_causal, False) == 2
    assert groups(64, 4 * long_causal, True, hopper=False) is None  # the Triton kernel
    assert to.AttentionConfig.defaults(OfflineContext("cuda"), 64, 2, True).fwd.warp_groups == 2  # no length given
    assert to.AttentionConfig.defaults(OfflineContext(), 64, 2, True, seq_len=long_causal).fwd.warp_groups == 2
    for S, bm, want in ((16384, 128, 128), (16384, 192, 2 * 43), (1280, 192, 2 * 4), (512, 192, 4), (384, 192, 2)):
        assert query_tiles(S, bm) == want, (S, bm)


def test_tail_split_choice():
    """Not causal, the last round's worth of tiles goes in parts where the tiles do not fill the grid's rounds
    evenly; every part at least TAIL_MIN_BLOCKS key blocks, at most TAIL_PARTS parts; causal never splits."""
    from triton_overlap.kernels.attention_hopper import TAIL_MIN_BLOCKS, TAIL_PARTS, tail_split

    assert tail_split(4096, 132, 128, True) == (0, 1)
    assert tail_split(132 * 31, 132, 128, False) == (0, 1)  # whole rounds
    assert tail_split(4096, 132, 128, False) == (132, TAIL_PARTS)
    assert tail_split(40, 132, 16, False) == (40, 2)  # fewer tiles than programs: every one, in 2 parts of 8
    assert tail_split(40, 132, 15, False) == (0, 1)  # too few blocks for two parts
    for n, programs, blocks in ((4096, 132, 128), (768, 132, 64), (40, 132, 16), (100, 114, 9), (9000, 114, 1024)):
        n_split, parts = tail_split(n, programs, blocks, False)
        if n_split:
            assert n_split == min(n, programs) and 2 <= parts <= TAIL_PARTS and blocks // parts >= TAIL_MIN_BLOCKS
        else:
            assert n % programs == 0 or blocks // 2 < TAIL_MIN_BLOCKS


def _merge_parts_case(parts, D, dtype_name, BM):
    """kernels.attention_hopper.merge_parts against softmax over every key: the last three of six ``BM``-row tiles
    (head by head, later positions first, each zigzag half cut from its end) each given as ``parts`` runs of the
    keys, normalised O (in ``dtype``) and lse per part, written by torch; the merged rows match full-key attention
    in float32, and the rows of the whole tiles (and, with 192-row tiles, the rows a tile holds from before its
    half) stay as poisoned."""
    from triton_overlap.kernels.attention_hopper import merge_parts
    from triton_overlap.kernels.cached_launch import launch

    dtype = getattr(torch, dtype_name)
    with to.Context(timeout_s=60) as ctx:
        dev = ctx.device
        B, S, Hq, keys, C = 1, 256, 3, 100 + parts, 128  # keys not a multiple of the parts
        n_h = -(-C // BM)
        n_m, n_split = 2 * n_h, 3
        n_tiles = n_m * Hq
        q = rand((Hq, S, D), torch.float32, dev, "q", "merge")
        k = rand((Hq, keys, D), torch.float32, dev, "k", "merge")
        v = rand((Hq, keys, D), torch.float32, dev, "v", "merge")
        scores = q @ k.transpose(1, 2) / math.sqrt(D)
        ref_lse = torch.logsumexp(scores, dim=-1)
        ref_out = torch.softmax(scores, dim=-1) @ v
        part_o = rand((n_split * parts * BM, D), torch.float32, dev, "o", "merge").to(dtype)
        part_lse = rand((n_split * parts * BM, ), torch.float32, dev, "lse", "merge")
        rows = []
        for s in range(n_split):
            t = n_tiles - n_split + s
            h, j = t // n_m, t % n_m
            hh = 1 if j < n_h else 0
            m0 = hh * C + C - (j % n_h + 1) * BM
            lo = max(m0, hh * C)  # the tile's rows from here
            rows.append((h, lo, m0 + BM))
            for p in range(parts):
                a, e = p * keys // parts, (p + 1) * keys // parts
                sc = scores[h, lo:m0 + BM, a:e]
                r = slice((s * parts + p) * BM + lo - m0, (s * parts + p + 1) * BM)
                part_lse[r] = torch.logsumexp(sc, dim=-1)
                part_o[r] = (torch.softmax(sc, dim=-1) @ v[h, a:e]).to(dtype)
        out = poison(torch.empty((B, S, Hq, D), dtype=dtype, device=dev))
        lse = poison(torch.empty((B, Hq, S), dtype=torch.float32, device=dev))
        launch(merge_parts, (n_split, BM // 64), (part_o, part_lse, out, lse, n_tiles - n_split, S, Hq, parts,
                                                  out.stride(0), out.stride(1), out.stride(2)),
               dict(BLOCK_M=BM, ROWS=64, HEAD_D=D), num_warps=4)
        merged = 0
        for h, lo, hi in rows:
            e_out = rel_err(out[0, lo:hi, h], ref_out[h, lo:hi])
            e_lse = rel_err(lse[0, h, lo:hi], ref_lse[h, lo:hi])
            assert e_out < TOL[dtype] and e_lse < 1e-5, f"head {h} rows {lo}: out {e_out:.2e}, lse {e_lse:.2e}"
            out[0, lo:hi, h] = 0
            lse[0, h, lo:hi] = 0
            merged += hi - lo
        assert torch.isnan(out).sum() == B * Hq * S * D - merged * D, "rows not of a split tile were written"
        assert torch.isnan(lse).sum() == B * Hq * S - merged
        return True


@pytest.mark.parametrize("parts, D, dtype_name, BM", [(2, 64, "bfloat16", 128), (4, 128, "float16", 128),
                                                      (4, 64, "bfloat16", 192)])
def test_merge_parts(pool, parts, D, dtype_name, BM):
    _simulated_once(pool)
    assert all(pool.run(_merge_parts_case, parts, D, dtype_name, BM))


def test_head_split_choice():
    """The split fills the GPU where K/V blocks are few, divides the group, and stays 1 where blocks are many."""
    from triton_overlap.kernels.attention_bwd import HEAD_SPLIT_WAVES, head_split_for

    class Gpu:
        backend = "cuda"

        def num_compute_units(self):
            return 132

    want = HEAD_SPLIT_WAVES * 132
    assert head_split_for(Gpu(), 128 * 8, 4) == 1
    for programs, group in ((128, 32), (256, 32), (100, 6), (10, 3), (64, 12)):
        split = head_split_for(Gpu(), programs, group)
        assert group % split == 0
        assert programs * split >= want or split == group
        smaller = [d for d in range(1, split) if group % d == 0]
        assert all(programs * d < want for d in smaller), (programs, group, split)


def test_heads_interleaved_choice():
    """The Hopper backward interleaves units only where one unit's key blocks fill less than half the SMs, then the
    fewest (a power of two, no more than the units) whose blocks fill every SM."""
    from triton_overlap.kernels.attention_bwd_hopper import heads_interleaved

    assert heads_interleaved(128, 8, 132) == 1  # 16k: one K/V head's blocks spread over the GPU
    assert heads_interleaved(66, 8, 132) == 1
    assert heads_interleaved(64, 8, 132) == 4  # 8k
    assert heads_interleaved(32, 16, 132) == 8  # 4k
    assert heads_interleaved(4, 12, 132) == 8  # (then a last group of 4)
    assert heads_interleaved(4, 3, 132) == 2
    assert heads_interleaved(4, 1, 132) == 1
    for blocks in range(1, 70):
        for units in range(1, 20):
            g = heads_interleaved(blocks, units, 132)
            assert g & (g - 1) == 0 and (g == 1 or g <= units)
            assert g == 1 or g * blocks >= 132 or 2 * g > units
            assert g == 1 or g // 2 * blocks < 132


# ------------------------------------------------------------------ packed documents (cu_seqlens)
def _varlen_case(units, Hq, Hkv, D, causal, dtype_name, chunks_per_rank, grad, as_tensor=False):
    """Documents of ``units`` x 2W tokens (zero-length ones included), packed into one sequence: forward against
    ``refs.attention_docs`` on poisoned outputs and random workspaces (twice, the second call possibly replayed),
    and with ``grad`` the gradients through autograd."""
    dtype = getattr(torch, dtype_name)
    with to.Context(timeout_s=120) as ctx:
        W, dev = ctx.world_size, ctx.device
        cu = [0]
        for u in units:
            cu.append(cu[-1] + 2 * W * u)
        T, scale = cu[-1], 1.0 / math.sqrt(D)
        cu_arg = torch.tensor(cu, dtype=torch.int32) if as_tensor else cu
        op = to.ContextParallelAttention(ctx, chunks_per_rank=chunks_per_rank)
        pos = to.zigzag.shard(torch.arange(T)[None], ctx, cu_seqlens=cu)[0]
        assert torch.equal(pos, to.zigzag.positions(ctx.rank, W, T // W, cu_seqlens=cu))
        q, k, v = (rand((1, T, h, D), dtype, dev, name, "docs") for name, h in (("q", Hq), ("k", Hkv), ("v", Hkv)))
        qs, ks, vs = (to.zigzag.shard(t, ctx, cu_seqlens=cu) for t in (q, k, v))
        ref_out, ref_lse = attention_docs(q, k, v, cu, causal, scale)
        errs = {}
        for it in range(2):
            for name in ("k", "v"):  # stale garbage where peers write
                ws = ctx.symmetric(f"cp_attention.{name}", (1, T, Hkv, D), dtype)
                ws.local.copy_(torch.randn_like(ws.local, dtype=torch.float32))
            out = poison(torch.empty_like(qs))
            lse = poison(torch.empty((1, Hq, T // W), dtype=torch.float32, device=dev))
            op(qs, ks, vs, causal=causal, cu_seqlens=cu_arg, out=out, lse=lse)
            ctx.check()
            e_out = rel_err(to.zigzag.unshard(out, ctx, cu_seqlens=cu), ref_out)
            e_lse = rel_err(to.zigzag.unshard(lse, ctx, dim=2, cu_seqlens=cu), ref_lse)
            assert e_out < TOL[dtype] and e_lse < 1e-3, f"rank {ctx.rank} call {it}: out {e_out:.2e}, lse {e_lse:.2e}"
            errs["out"] = max(errs.get("out", 0.0), e_out)
        if grad:
            dout = rand((1, T, Hq, D), dtype, dev, "do", "docs")
            ref = [t.float().requires_grad_() for t in (q, k, v)]
            (attention_docs(*ref, cu, causal, scale)[0] * dout.float()).sum().backward()
            mine = [t.clone().requires_grad_() for t in (qs, ks, vs)]
            o, _ = op(*mine, causal=causal, cu_seqlens=cu_arg)
            (o.float() * to.zigzag.shard(dout, ctx, cu_seqlens=cu).float()).sum().backward()
            ctx.check()
            for name, m, r in zip("qkv", mine, ref):
                errs["d" + name] = rel_err(to.zigzag.unshard(m.grad, ctx, cu_seqlens=cu), r.grad)
            bad = {n: e for n, e in errs.items() if n != "out" and e > GRAD_TOL[dtype]}
            assert not bad, f"rank {ctx.rank}: gradient rel err {bad}"
        return errs


# units of 2W tokens per document, Hq, Hkv, D, causal, dtype, chunks_per_rank, grad[, cu_seqlens as a tensor]
VARLEN_CASES = {
    "host": [([5, 1, 0, 3, 8], 4, 1, 64, True, "bfloat16", 2, True),  # MQA; a 2W-token and an empty document
             ([3, 1, 4], 4, 2, 64, False, "float16", 4, True, True),  # chunks cut across document bounds
             ([12], 4, 2, 128, True, "bfloat16", 2, False)],  # one document: the dense layout
    "cuda": [([768, 128, 1, 258, 1900], 16, 4, 128, True, "bfloat16", 2, True),
             ([300, 1, 723, 512], 8, 8, 64, False, "float16", 4, True, True),
             ([2048, 2048], 32, 8, 128, True, "bfloat16", 4, False)],
}


@pytest.mark.parametrize("case", range(3))
def test_cp_attention_packed_documents(pool, case):
    host_case_share(pool, case)
    pool.run(_varlen_case, *VARLEN_CASES["host" if pool.backend == "host" else "cuda"][case])


def _varlen_bad_inputs():
    with to.Context(timeout_s=30) as ctx:
        W, dev = ctx.world_size, ctx.device
        op = to.ContextParallelAttention(ctx)
        S = 8 * W  # local rows 8
        q = rand((1, 8, 4, 64), torch.bfloat16, dev, "q")
        kv = rand((1, 8, 2, 64), torch.bfloat16, dev, "k")
        cases = {
            "multiple of 2 \\* world size": [0, 2 * W + 1, S],
            "ends at": [0, 2 * W, 4 * W],
            "start at 0": [2 * W, S],
            "decreases": [0, 4 * W, 2 * W, S],
            "sequence of ints": ["a", S],
        }
        for msg, cu in cases.items():
            with pytest.raises(ValueError, match=msg):
                op(q, kv, kv, cu_seqlens=cu)
        with pytest.raises(ValueError, match="1-D integer tensor"):
            op(q, kv, kv, cu_seqlens=torch.tensor([0.0, float(S)]))
        q2, kv2 = (torch.cat([t, t]) for t in (q, kv))
        with pytest.raises(ValueError, match="B = 2"):
            op(q2, kv2, kv2, cu_seqlens=[0, S])
        out, _ = op(q, kv, kv, cu_seqlens=[0, S])  # still usable, and one document is the dense layout
        ctx.check()
        dense, _ = op(q, kv, kv)
        assert torch.equal(out, dense)
        return True


def test_cp_attention_packed_bad_input_raises_before_launch(pool):
    assert all(pool.run(_varlen_bad_inputs))


def test_packed_tables_are_bounded_and_ordered():
    """The per-boundaries tables stay at SEGMENT_CACHE sets at most (training feeds new boundaries every batch),
    and each lists every block of every document once, longest documents first."""
    from triton_overlap.ops.attention_on_gathered import SEGMENT_CACHE, DocumentTables

    tables = DocumentTables()
    for i in range(SEGMENT_CACHE + 20):
        local_cu = (0, 2 + i, 40 + 2 * i)
        docs = tables.get(local_cu, 16, "cpu")
        rows = [tuple(r) for r in docs.segments.tolist()]
        lengths = [local_cu[d + 1] - local_cu[d] for d, _ in rows]
        assert lengths == sorted(lengths, reverse=True), f"{local_cu}: longest documents first"
        want = {(d, r0) for d in range(2) for r0 in range(0, local_cu[d + 1] - local_cu[d], 16)}
        assert set(rows) == want and docs.blocks == len(want) == len(rows), f"{local_cu}: every block once"
        assert docs.bounds.tolist() == list(local_cu)
    assert len(tables.recent) == SEGMENT_CACHE
    assert ((0, 2 + SEGMENT_CACHE + 19, 40 + 2 * (SEGMENT_CACHE + 19)), 16) in tables.recent
    assert ((0, 2, 40), 16) not in tables.recent  # the least recently used went first


# ------------------------------------------------------------------ the warp-specialized forward (Hopper)
def _hopper_forward_case(B, S, Hq, Hkv, D, causal, dtype_name, world, block_n, stages, warp_groups):
    """kernels.attention_hopper's forward for every rank of a simulated world (forward_on_gathered), on outputs
    poisoned before the call, against full-sequence attention; checks that the warp-specialized kernel is the
    one that runs and that its tile counter is zero again after the launches. Not causal, where the tiles do not
    fill the grid's rounds evenly, the last round's tiles go in parts (tail_split) and are merged."""
    from triton_overlap.kernels import attention_hopper
    from triton_overlap.kernels.attention import Blocks
    from triton_overlap.ops.attention_on_gathered import forward_on_gathered

    dtype = getattr(torch, dtype_name)
    with to.Context(timeout_s=120) as ctx:
        if torch.cuda.get_device_capability(ctx.device) != (9, 0) or not attention_hopper.gluon_available():
            return "skip"
        blocks = Blocks(128, block_n, 8, stages, warp_specialized=True, warp_groups=warp_groups)
        cfg = to.AttentionConfig(2, blocks)
        q, k, v = (rand((B, S, h, D), dtype, ctx.device, name, "ws") for name, h in (("q", Hq), ("k", Hkv), ("v", Hkv)))
        scale = 1.0 / math.sqrt(D)
        ref_out, ref_lse = attention(q, k, v, causal, scale)
        sh = lambda t, r: to.zigzag.shard_for(t, r, world, dim=1).contiguous()  # noqa: E731
        kg, vg = (torch.cat([sh(t, r) for r in range(world)], dim=1) for t in (k, v))
        outs, lses = [], []
        for r in range(world):
            qr, kr, vr = (sh(t, r) for t in (q, k, v))
            assert attention_hopper.usable(ctx, qr, kr, vr, kg, vg, None, blocks)
            out = poison(torch.empty_like(qr))
            lse = poison(torch.empty((B, Hq, qr.shape[1]), dtype=torch.float32, device=ctx.device))
            forward_on_gathered(ctx, qr, kr, vr, kg, vg, r, world, causal, scale, cfg, out=out, lse=lse)
            outs.append(out)
            lses.append(lse)
        ctx.check()
        # the tile counter is left zeroed for the next launch on this stream (each launch above began from it)
        assert attention_hopper.tile_counter(ctx).tolist() == [0, 0]
        e_out = rel_err(to.zigzag.unshard_parts(outs, dim=1), ref_out)
        e_lse = rel_err(to.zigzag.unshard_parts(lses, dim=2), ref_lse)
        assert e_out < TOL[dtype] and e_lse < 1e-3, f"world {world}: out {e_out:.2e}, lse {e_lse:.2e}"
        return e_out, e_lse


# B, S (global), Hq, Hkv, D, causal, dtype, simulated world, block_n, stages, compute warpgroups; each zigzag half
# whole key blocks. Three warpgroups take 192-row tiles, which divide none of these halves: each half's first tile
# holds rows of the half before it (or, in the first, of the batch before, or before the tensor), which must be
# left as they are.
HOPPER_CASES = [
    (1, 3 * 2 * 384, 12, 3, 128, True, "bfloat16", 3, 128, 2, 2),  # GQA 4:1, three ranks
    (2, 2 * 2 * 256, 5, 5, 64, False, "float16", 2, 64, 3, 2),  # B = 2, odd heads, not causal
    (2, 2 * 2 * 256, 5, 5, 64, False, "float16", 2, 128, 2, 3),
    (1, 4 * 2 * 512, 8, 1, 128, True, "bfloat16", 4, 64, 2, 2),  # MQA, four ranks
    (1, 4 * 2 * 512, 8, 1, 64, True, "bfloat16", 4, 128, 2, 3),
    (1, 2 * 640, 4, 2, 64, True, "float16", 1, 128, 2, 2),  # a world of one
    (2, 2 * 640, 4, 2, 64, True, "bfloat16", 1, 128, 2, 3),
    # more tiles than a GPU has programs (one per SM): each program takes several, Q's two buffers in turn
    (2, 2 * 2 * 1024, 16, 4, 128, True, "bfloat16", 2, 128, 2, 2),
    (1, 2 * 4096, 24, 8, 64, False, "float16", 2, 128, 2, 2),
    (2, 2 * 2 * 1024, 16, 4, 64, True, "bfloat16", 2, 128, 2, 3),
    # not causal with more tiles than programs, not a whole number of rounds: the last round's tiles in parts
    (1, 2 * 2 * 2048, 16, 4, 128, False, "bfloat16", 2, 128, 2, 2),
    (1, 4096, 8, 8, 128, False, "bfloat16", 1, 128, 2, 2),
    (1, 2 * 2 * 2048, 16, 4, 64, False, "bfloat16", 2, 128, 2, 3),
]


@pytest.mark.parametrize("case", range(len(HOPPER_CASES)))
def test_hopper_forward_matches_full_sequence(pool, case):
    """The warp-specialized forward where it runs (compute capability 9.0 with Gluon); elsewhere skipped."""
    on_hopper(pool, "the warp-specialized forward", _hopper_forward_case, *HOPPER_CASES[case])


def _late_chunk_setup(ctx, warp_specialized: bool, kernels, names):
    """The inputs of a simulated world of two for late_chunk_faults: None where ``warp_specialized`` asks for a
    Hopper kernel (module ``kernels``) this GPU cannot run; else S, chunks per rank, D, the ``names``d [1, S, H, D]
    tensors (2 heads for k and v, 4 for the rest), K/V workspaces of zeros and every flag up."""
    dev = ctx.device
    if warp_specialized and (ctx.backend != "cuda" or torch.cuda.get_device_capability(dev) != (9, 0)
                             or not kernels.gluon_available()):
        return None
    S, cpr, D = (64, 2, 32) if ctx.backend == "host" else (512, 2, 128 if warp_specialized else 64)
    tensors = [rand((1, S, 2 if n in ("k", "v") else 4, D), torch.bfloat16, dev, n, "late") for n in names]
    kw, vw = (torch.zeros(1, 2 * S, 2, D, dtype=torch.bfloat16, device=dev) for _ in range(2))
    return S, cpr, D, tensors, kw, vw, torch.ones(2 * cpr, dtype=torch.int32, device=dev)


def _forward_times_out(warp_specialized: bool, timeout_s: float):
    """A peer's chunk that never lands: the forward kernel's wait (with ``warp_specialized``, the Hopper kernel's
    loader) times out, and the fault names the rank, the op, the peer and the chunk (a simulated world of two, as
    rank 0, with rank 1's flags down)."""
    from triton_overlap.kernels import attention_hopper
    from triton_overlap.kernels.attention import Blocks, launch_fwd

    with to.Context(timeout_s=timeout_s) as ctx:
        setup = _late_chunk_setup(ctx, warp_specialized, attention_hopper, ("q", "k", "v"))
        if setup is None:
            return "skip"
        S, cpr, D, (q, k, v), kw, vw, flags = setup
        dev = ctx.device
        if warp_specialized:
            blocks = Blocks(128, 128, 8, 2, warp_specialized=True)
            assert attention_hopper.usable(ctx, q, k, v, kw, vw, None, blocks)
        else:
            blocks = to.AttentionConfig.defaults(ctx, D, 2).fwd
        out, lse = torch.empty_like(q), torch.empty(1, 4, S, dtype=torch.float32, device=dev)
        return late_chunk_faults(ctx, flags, "cp_attention", "0", lambda op: launch_fwd(
            ctx, q, k, v, kw, vw, out, lse, flags, S // cpr, cpr, 0.1, False, blocks, rank=0, world=2, op=op))


def _simulated_once(pool):
    """Tests that simulate a world on each rank run on the host backend's 2-rank pool only (the others would
    repeat them)."""
    if pool.backend == "host" and pool.world != 2:
        pytest.skip("a simulated world: run once on the host backend, at W = 2")


def test_forward_wait_times_out(pool):
    _simulated_once(pool)
    assert_own_fault(pool.run(_forward_times_out, False, 1.5 if pool.backend == "host" else 5.0))


def test_hopper_forward_wait_times_out(pool):
    assert_own_fault(on_hopper(pool, "the warp-specialized forward", _forward_times_out, True, 5.0))


def _hopper_backward_case(world, causal, Hq, Hkv, D, unit, dtype_name):
    """kernels.attention_bwd_hopper's single backward kernel for every rank of a simulated world (simulate_ranks:
    NaN-poisoned dK/dV partial buffers), against the full-sequence float32 reference and against the two Triton
    kernels: with the query heads whole (``head_split=1``) and split as the op chooses for the GPU (these small
    shapes have few programs, so it splits them); checks that it is the warp-specialized kernel that runs."""
    from dataclasses import replace

    from triton_overlap.kernels import attention_bwd_hopper
    from triton_overlap.kernels.attention import Blocks
    from triton_overlap.kernels.attention_bwd import head_split_for

    dtype = getattr(torch, dtype_name)
    with to.Context(timeout_s=120) as ctx:
        if torch.cuda.get_device_capability(ctx.device) != (9, 0) or not attention_bwd_hopper.gluon_available():
            return "skip"
        inputs, want = attention_problem(ctx.device, 1, unit * 2 * world, Hq, Hkv, D, causal, dtype, "bws")
        two = to.AttentionConfig.defaults(ctx, D, 2)
        fused = replace(two, dkdv=Blocks(64, 128, 8, 2, warp_specialized=True))
        splits, launch_ws = [], attention_bwd_hopper.launch_bwd_ws

        def counted(*args, **kw):
            splits.append(args[-1].split)
            return launch_ws(*args, **kw)

        attention_bwd_hopper.launch_bwd_ws = counted
        try:
            whole = simulate_ranks(ctx, *inputs, world, causal, cfg=fused, head_split=1)
            split = simulate_ranks(ctx, *inputs, world, causal, cfg=fused)  # head split chosen by the op
        finally:
            attention_bwd_hopper.launch_bwd_ws = launch_ws
        chosen = head_split_for(ctx, unit * 2 // attention_bwd_hopper.BLOCK_N * Hkv * world, Hq // Hkv,
                                attention_bwd_hopper.MIN_WAVES)
        assert splits == [1] * world + [chosen] * world, f"warp-specialized launches (their split): {splits}"
        ctx.check()
        base = simulate_ranks(ctx, *inputs, world, causal, cfg=two)
        errs = {}
        for name, got in (("whole", whole), (f"split {chosen}", split)):
            errs[name] = [rel_err(g, r) for g, r in zip(got, want)]
            assert max(errs[name]) < GRAD_TOL[dtype], f"world {world}, {name}: rel errs out/dq/dk/dv {errs[name]}"
            diff = [rel_err(g, b) for g, b in zip(got[1:], base[1:])]  # dq, dk, dv: only the float32 sum order
            assert max(diff) < 1e-2, f"world {world}, {name}: rel diff dq/dk/dv against the two kernels {diff}"
        return errs


# simulated world, causal, Hq, Hkv, D, local rows per zigzag half (whole 128-key blocks), dtype
HOPPER_BACKWARD_CASES = [
    (1, True, 8, 2, 128, 256, "bfloat16"),  # a world of one, GQA 4:1
    (2, False, 4, 4, 128, 128, "float16"),  # not causal, MHA
    (3, True, 12, 3, 128, 128, "bfloat16"),  # three ranks
    (4, True, 8, 1, 128, 128, "bfloat16"),  # MQA, four ranks: few programs, so the op splits instead
    (2, True, 8, 2, 64, 256, "bfloat16"),  # D = 64
    (3, False, 6, 3, 64, 128, "float16"),  # D = 64, not causal
]


@pytest.mark.parametrize("case", range(len(HOPPER_BACKWARD_CASES)))
def test_hopper_backward_matches_full_sequence(pool, case):
    """The single warp-specialized backward where it runs (compute capability 9.0 with Gluon); elsewhere skipped."""
    on_hopper(pool, "the warp-specialized backward", _hopper_backward_case, *HOPPER_BACKWARD_CASES[case])


def _single_pass_case(world, causal, Hq, Hkv, D, S, dtype_name, head_split):
    """The host backend's single backward pass (the Hopper kernel's algorithm in Triton: the dK/dV kernel adds dQ
    up in a float32 buffer, delta before, dQ scaled after), asked for by ``dkdv.warp_specialized``, for every rank of
    a simulated world: against the full-sequence float32 reference and the two kernels; checks that it ran."""
    from dataclasses import replace

    from triton_overlap.kernels import attention_bwd

    dtype = getattr(torch, dtype_name)
    with to.Context(timeout_s=120) as ctx:
        if ctx.backend != "host":
            return "skip"
        inputs, want = attention_problem(ctx.device, 1, S, Hq, Hkv, D, causal, dtype, "sp")
        two = to.AttentionConfig.defaults(ctx, D, 2)
        single = replace(two, dkdv=replace(two.dkdv, warp_specialized=True))
        passes, frame = [], attention_bwd.single_pass

        def counted(*args, **kw):
            passes.append(1)
            return frame(*args, **kw)

        attention_bwd.single_pass = counted
        try:
            got = simulate_ranks(ctx, *inputs, world, causal, cfg=single, head_split=head_split)
        finally:
            attention_bwd.single_pass = frame
        assert len(passes) == world, f"single passes: {len(passes)} for {world} ranks"
        ctx.check()
        base = simulate_ranks(ctx, *inputs, world, causal, cfg=two, head_split=head_split)
        errs = [rel_err(g, r) for g, r in zip(got, want)]
        assert max(errs) < GRAD_TOL[dtype], f"world {world}: rel errs out/dq/dk/dv {errs}"
        diff = [rel_err(g, b) for g, b in zip(got[1:], base[1:])]  # dq, dk, dv: only the float32 sum order
        assert max(diff) < 1e-2, f"world {world}: rel diff dq/dk/dv against the two kernels {diff}"
        return errs


# simulated world, causal, Hq, Hkv, D, full sequence (halves that end inside a block), dtype, head split
SINGLE_PASS_CASES = [
    (1, True, 4, 2, 32, 40, "bfloat16", None),  # a world of one, GQA 2:1
    (2, False, 4, 4, 32, 48, "float16", None),  # not causal, MHA
    (3, True, 6, 3, 32, 36, "bfloat16", 2),  # three ranks, query heads split
    (4, True, 4, 1, 16, 32, "bfloat16", 2),  # MQA, four ranks, split
]


@pytest.mark.parametrize("case", range(len(SINGLE_PASS_CASES)))
def test_single_pass_backward_matches_full_sequence(pool, case):
    """The host backend's path of the Hopper backward's algorithm; on GPUs that is the Gluon kernel (above)."""
    if pool.backend != "host":
        pytest.skip("on GPUs the single pass is the Hopper kernel (test_hopper_backward_matches_full_sequence)")
    _simulated_once(pool)
    pool.run(_single_pass_case, *SINGLE_PASS_CASES[case])


def _backward_times_out(warp_specialized: bool, timeout_s: float):
    """A peer's chunk that never lands: the backward's waits (with ``warp_specialized``, the Hopper kernel's
    loader) time out, and the fault names the rank, the op, the peer and the chunk (a simulated world of two, as
    rank 0, with rank 1's flags down)."""
    from dataclasses import replace

    from triton_overlap.kernels import attention_bwd_hopper
    from triton_overlap.kernels.attention import Blocks
    from triton_overlap.kernels.attention_bwd import launch_bwd

    with to.Context(timeout_s=timeout_s) as ctx:
        setup = _late_chunk_setup(ctx, warp_specialized, attention_bwd_hopper, ("q", "k", "v", "do", "o"))
        if setup is None:
            return "skip"
        S, cpr, D, (q, k, v, dout, out), kw, vw, flags = setup
        dev = ctx.device
        lse = torch.zeros(1, 4, S, dtype=torch.float32, device=dev)
        dq = torch.empty_like(q)
        recv = torch.zeros(2, 2, 1, S, 2, D, dtype=torch.float32, device=dev)
        counters = torch.zeros(2, dtype=torch.int32, device=dev)
        recv_ptrs = torch.full((2,), recv.data_ptr(), dtype=torch.int64, device=dev)
        counter_ptrs = torch.full((2,), counters.data_ptr(), dtype=torch.int64, device=dev)
        if warp_specialized:
            assert attention_bwd_hopper.usable(ctx, q, k, v, kw, vw, dq, None)
            dq_blocks = dkdv_blocks = Blocks(64, 128, 8, 2, warp_specialized=True)
        else:
            cfg = to.AttentionConfig.defaults(ctx, D, 2)
            dq_blocks, dkdv_blocks = cfg.dq, replace(cfg.dkdv, warp_specialized=False)
        return late_chunk_faults(ctx, flags, "cp_attention", r"\d+", lambda op: launch_bwd(
            ctx, q, k, v, kw, vw, dout, out, lse, dq, recv_ptrs, counter_ptrs, flags, S // cpr, cpr, 0.1, False,
            dq_blocks, dkdv_blocks, rank=0, world=2, op=op, head_split=1))


def test_backward_wait_times_out(pool):
    _simulated_once(pool)
    assert_own_fault(pool.run(_backward_times_out, False, 1.5 if pool.backend == "host" else 5.0))


def test_hopper_backward_wait_times_out(pool):
    assert_own_fault(on_hopper(pool, "the warp-specialized backward", _backward_times_out, True, 5.0))
