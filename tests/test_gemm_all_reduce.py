"""GEMM + AllReduce and RowParallelLinear(sequence_parallel=False): against float64 references of the unsharded
computation, at odd sizes, with and without bias, on poisoned outputs; autograd through the layer; CUDA-graph
replays of the fused kernel (from the contract, tests/contract.py)."""
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import contract
import triton_overlap as to
from contract import Call, OpSpec, Variants
from refs import TOL, poison, rand, rel_err
from triton_overlap.nn import RowParallelLinear
from triton_overlap.ops.gemm_all_reduce import FUSED_MAX_ROWS, FUSED_MAX_ROWS_W2


@dataclass(frozen=True, kw_only=True)
class GARCase:
    """Every rank's [m, k] A times its [k, n] W (``transposed``: a transpose's view of [n, k]; ``k`` None: 16 + rank,
    ranks holding different K), summed over ranks, plus ``bias``, by ``algorithm``."""
    m: int
    k: int | None
    n: int
    dtype: str = "bfloat16"
    bias: bool = False
    transposed: bool = False
    algorithm: str = "auto"


def _inputs(ctx, case, it):
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    dtype = getattr(torch, case.dtype)
    ks = [16 + s if case.k is None else case.k for s in range(W)]
    a_all = [rand((case.m, ks[s]), dtype, dev, "gar-a", it, s) for s in range(W)]
    w_all = [rand((case.n, ks[s]) if case.transposed else (ks[s], case.n), dtype, dev, "gar-w", it, s)
             for s in range(W)]
    w_all = [w.t() if case.transposed else w for w in w_all]
    bias = rand((case.n,), dtype, dev, "gar-b", it) if case.bias else None
    ref = sum(a.double() @ w.double() for a, w in zip(a_all, w_all))
    if bias is not None:
        ref = ref + bias.double()
    return Call((a_all[r], w_all[r]), dict(bias=bias), ref, torch.empty((case.m, case.n), dtype=dtype, device=dev))


GEMM_AR = OpSpec(
    name="gemm_ar", module=__name__, op=to.GEMMAllReduce, inputs=_inputs, paths=False,
    make=lambda ctx, case, fallback: to.GEMMAllReduce(ctx, algorithm=case.algorithm, fallback=fallback),
    # partials (each rank's GEMM output) are rounded to bf16/fp16 before they are summed: twice the GEMM's tolerance
    tol={dtype: 2 * tol for dtype, tol in TOL.items()},
    # the fused kernel captured and replayed 1,000 times; the first call sizes the slots (not inside a capture)
    replay=Variants(host=None, gpu=GARCase(m=7, k=96, n=200, algorithm="fused"), calls=1000, warm=True),
)

# the contract's tests: test_gemm_ar_cuda_graph_replay
globals().update(contract.tests(GEMM_AR))

CASES = [GARCase(m=1, k=16, n=19, bias=True, transposed=True), GARCase(m=5, k=24, n=33, dtype="float16"),
         GARCase(m=33, k=None, n=40, transposed=True), GARCase(m=64, k=32, n=72, bias=True),
         GARCase(m=3, k=40, n=17, bias=True), GARCase(m=9, k=512, n=136, bias=True, transposed=True)]


def _gemm_ar(algorithm: str, fallback: str):
    """Every case, then the first again (the slots shrink back to a small call), against float64 sums; ``out``
    poisoned with NaN on every other call. Returns the algorithm each call took."""
    with to.Context(timeout_s=30) as ctx:
        dev = ctx.device
        op = to.GEMMAllReduce(ctx, algorithm=algorithm, fallback=fallback, fused_max_rows=40,
                              one_shot_max_bytes=4096, two_shot_max_bytes=4096)
        took = []
        for call, i in enumerate(list(range(len(CASES))) + [0]):
            c = GEMM_AR.inputs(ctx, CASES[i], i)
            (a, w), dtype = c.args, getattr(torch, CASES[i].dtype)
            out = poison(c.out) if call % 2 else None
            got = op(a, w, c.kwargs["bias"], out=out)
            ctx.check()
            assert out is None or got is out
            err, tol = GEMM_AR.error(got, c.ref)
            assert err < tol, f"case {i}: rel err {err:.2e}"
            took.append(op.last_algorithm)
        with pytest.raises(ValueError, match="different dtypes"):
            op(a, w.half() if dtype == torch.bfloat16 else w.bfloat16())
        with pytest.raises(ValueError, match="out must be"):
            op(a, w, out=torch.empty(3, 3, dtype=torch.bfloat16, device=dev))
        return took


@pytest.mark.parametrize("algorithm,fallback", [("auto", "auto"), ("fused", "never"), ("two_shot", "never"),
                                                ("auto", "always")])
def test_gemm_ar(pool, algorithm, fallback):
    took = pool.run(_gemm_ar, algorithm, fallback)[0]
    if fallback == "always":
        assert set(took) == {"process group"}
    elif algorithm == "auto":  # M = 64 is over 40 rows, and its [64, 72] bf16 output over 4 KiB: matmul, then NCCL
        assert took[:3] == ["fused"] * 3 and took[3] == "process group" and took[-1] == "fused", took
    else:
        assert set(took) == {algorithm}, took


def _default_row_limit():
    """The default op takes the fused kernel up to its row limit (64 rows at W = 2, 16 elsewhere) and matmul + the
    AllReduce one row above it, both right."""
    with to.Context(timeout_s=30) as ctx:
        op = to.GEMMAllReduce(ctx)
        limit = FUSED_MAX_ROWS_W2 if ctx.world_size == 2 else FUSED_MAX_ROWS
        assert op.fused_max_rows == limit
        took = []
        for m in (limit, limit + 1):
            c = _inputs(ctx, GARCase(m=m, k=8, n=12), m)
            out = op(*c.args, out=poison(c.out))
            assert rel_err(out, c.ref) < 2 * TOL[torch.bfloat16], m
            took.append(op.last_algorithm)
        assert took[0] == "fused" and took[1] != "fused", took
        return limit


def test_gemm_ar_default_row_limit(pool):
    assert pool.run(_default_row_limit)[0] in (16, 64)


def _gemm_ar_disagree(T: float):
    """Both shapes used before; then the last rank passes another M: the fused kernel's header comparison names
    the op on every rank that meets it; after reset() the sums are right again."""
    with to.Context(timeout_s=T) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.GEMMAllReduce(ctx, algorithm="fused", fallback="never")
        w = rand((24, 20), torch.bfloat16, dev, "gard-w", r)

        def call(m, tag):
            a_all = [rand((m, 24), torch.bfloat16, dev, "gard-a", tag, s) for s in range(W)]
            w_all = [rand((24, 20), torch.bfloat16, dev, "gard-w", s) for s in range(W)]
            got = op(a_all[r], w)
            ctx.check()
            ref = sum(a.double() @ b.double() for a, b in zip(a_all, w_all))
            assert rel_err(got, ref) < 2 * TOL[torch.bfloat16]

        call(8, 0)
        with pytest.raises(to.ContextError) as info:
            call(12, 1)  # a rank a call behind may see the mismatch at its check of this call
            op(rand((12 if r == W - 1 else 8, 24), torch.bfloat16, dev, "gard-a", 2, r), w)
            ctx.check()
        msg = str(info.value)
        assert "gemm_ar" in msg and ("disagree" in msg or "faulted" in msg), msg
        ctx.reset()
        call(12, 3)
        return msg


def test_ranks_disagree(pool):
    msgs = pool.run(_gemm_ar_disagree, 2.0 if pool.backend == "host" else 6.0)
    assert any("ranks disagree on the call" in m for m in msgs), msgs


def _row_layer():
    """RowParallelLinear(sequence_parallel=False) against nn.Linear: the output on every rank, and the gradients of
    the input shard, the weight shard and the bias."""
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        torch.manual_seed(0)
        full = nn.Linear(16 * W, 24, bias=True).to(dev)
        with torch.no_grad():
            full.weight.copy_(full.weight.bfloat16().float())
            full.bias.copy_(full.bias.bfloat16().float())
        layer = RowParallelLinear.from_full_weight(full, ctx, dtype=torch.bfloat16, sequence_parallel=False)
        x = rand((3, 5, 16 * W), torch.bfloat16, dev, "row-x").float()  # [*, in], the same on every rank
        x_ref = x.clone().requires_grad_(True)
        y_ref = full(x_ref)
        g = rand(tuple(y_ref.shape), torch.float32, dev, "row-g")
        (y_ref * g).sum().backward()
        cols = slice(r * 16, (r + 1) * 16)
        x_mine = x[..., cols].bfloat16().requires_grad_(True)
        y = layer(x_mine)
        assert y.shape == y_ref.shape
        assert rel_err(y, y_ref.detach()) < 2 * TOL[torch.bfloat16]
        (y.float() * g).sum().backward()
        assert rel_err(x_mine.grad, x_ref.grad[..., cols]) < 2 * TOL[torch.bfloat16]
        assert rel_err(layer.weight.grad, full.weight.grad[:, cols]) < 2 * TOL[torch.bfloat16]
        assert rel_err(layer.bias.grad, full.bias.grad) < 2 * TOL[torch.bfloat16]
        return True


def test_row_parallel_without_sequence_parallel(pool):
    assert all(pool.run(_row_layer))


def _unswapped_tiles():
    """The fused kernel with tiles of more than SWAP_MAX_ROWS rows (computed A @ B, not swapped) on a few rows."""
    from triton_overlap.ops.config import GEMMAllReduceConfig

    with to.Context(timeout_s=30) as ctx:
        cfg = GEMMAllReduceConfig(block_m=32, block_n=16, block_k=16, num_warps=1, num_stages=1)
        op = to.GEMMAllReduce(ctx, cfg, algorithm="fused", fallback="never")
        errs = []
        for i, case in enumerate((GARCase(m=5, k=24, n=33, bias=True), GARCase(m=3, k=32, n=17, transposed=True))):
            c = GEMM_AR.inputs(ctx, case, i)
            got = op(*c.args, c.kwargs["bias"], out=poison(c.out))
            ctx.check()
            err, tol = GEMM_AR.error(got, c.ref)
            assert err < tol and op.last_algorithm == "fused", (i, err)
            errs.append(err)
        return errs


def test_unswapped_tiles(pool):
    assert len(pool.run(_unswapped_tiles)[0]) == 2


def test_decode_tiles_rule():
    """GEMMAllReduceConfig.defaults on a GPU: 16-row tiles (computed swapped) in 256-deep steps where 4 stages fit
    sm_90's shared memory, shallower where a program has less; 64-row tiles in 128-deep steps."""
    from types import SimpleNamespace

    from triton_overlap.ops.config import GEMMAllReduceConfig
    from triton_overlap.ops.gemm_all_reduce import SWAP_MAX_ROWS

    def gpu(shared):
        return SimpleNamespace(backend="cuda", interpreted=False, shared_memory_per_program=lambda: shared)

    cfg = GEMMAllReduceConfig.defaults(gpu(227 << 10), 1, 8192, 132)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages) == (16, 64, 256, 4)
    assert cfg.block_m <= SWAP_MAX_ROWS
    small = GEMMAllReduceConfig.defaults(gpu(99 << 10), 1, 8192, 84)
    assert small.block_k <= 128 and (small.block_m + small.block_n) * small.block_k * 2 * small.num_stages <= 95 << 10
    cfg = GEMMAllReduceConfig.defaults(gpu(227 << 10), 32, 8192, 132)
    assert (cfg.block_m, cfg.block_k, cfg.num_stages) == (64, 128, 4) and cfg.block_m > SWAP_MAX_ROWS
