"""GEMM + AllReduce and RowParallelLinear(sequence_parallel=False): against float64 references of the unsharded
computation, at odd sizes, with and without bias, on poisoned outputs; autograd through the layer."""
import pytest
import torch
from torch import nn

import triton_overlap as to
from refs import TOL, rand, rel_err
from triton_overlap.nn import RowParallelLinear


#: (M, K_local, N, dtype, bias, w as a transpose's view); K_local of -1: 16 + rank (ranks hold different K)
CASES = [(1, 16, 19, torch.bfloat16, True, True), (5, 24, 33, torch.float16, False, False),
         (33, -1, 40, torch.bfloat16, False, True), (64, 32, 72, torch.bfloat16, True, False),
         (3, 40, 17, torch.bfloat16, True, False)]


def _gemm_ar(algorithm: str, fallback: str):
    """Every case, then the first again (the slots shrink back to a small call), against float64 sums; ``out``
    poisoned with NaN on every other call. Returns the algorithm each call took."""
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.GEMMAllReduce(ctx, algorithm=algorithm, fallback=fallback, fused_max_rows=40,
                              one_shot_max_bytes=4096, two_shot_max_bytes=4096)
        took = []
        for call, i in enumerate(list(range(len(CASES))) + [0]):
            M, K, N, dtype, has_bias, transposed = CASES[i]
            ks = [16 + s if K < 0 else K for s in range(W)]
            a_all = [rand((M, ks[s]), dtype, dev, "gar-a", i, s) for s in range(W)]
            w_all = [rand((N, ks[s]) if transposed else (ks[s], N), dtype, dev, "gar-w", i, s) for s in range(W)]
            w_all = [w.t() if transposed else w for w in w_all]
            bias = rand((N,), dtype, dev, "gar-b", i) if has_bias else None
            ref = sum(a.double() @ w.double() for a, w in zip(a_all, w_all))
            if bias is not None:
                ref = ref + bias.double()
            out = torch.full((M, N), float("nan"), dtype=dtype, device=dev) if call % 2 else None
            got = op(a_all[r], w_all[r], bias, out=out)
            ctx.check()
            assert out is None or got is out
            # partials (each rank's GEMM output) are rounded to bf16/fp16 before they are summed: twice the GEMM's
            # tolerance
            err = rel_err(got, ref)
            assert err < 2 * TOL[dtype], f"case {i}: rel err {err:.2e}"
            took.append(op.last_algorithm)
        with pytest.raises(ValueError, match="different dtypes"):
            op(a_all[r], w_all[r].half() if dtype == torch.bfloat16 else w_all[r].bfloat16())
        with pytest.raises(ValueError, match="out must be"):
            op(a_all[r], w_all[r], out=torch.empty(3, 3, dtype=torch.bfloat16, device=dev))
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


def _replays(n_replays: int):
    """The fused kernel captured in a CUDA graph and replayed with new inputs each time."""
    from triton_overlap.timing import capture

    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.GEMMAllReduce(ctx, algorithm="fused", fallback="never")
        a = torch.empty(7, 96, dtype=torch.bfloat16, device=dev)
        w = rand((96, 200), torch.bfloat16, dev, "garg-w", r)
        w_all = [rand((96, 200), torch.bfloat16, dev, "garg-w", s).double() for s in range(W)]
        out = torch.empty(7, 200, dtype=torch.bfloat16, device=dev)
        a.copy_(rand((7, 96), torch.bfloat16, dev, "garg-a", -1, r))
        op(a, w, out=out)  # sizes the slots (not allowed inside a capture)
        ctx.check()
        g = capture(lambda: op(a, w, out=out))
        for i in range(n_replays):
            a_all = [rand((7, 96), torch.bfloat16, dev, "garg-a", i % 50, s) for s in range(W)]
            a.copy_(a_all[r])
            out.fill_(float("nan"))
            g.replay()
            err = rel_err(out, sum(x.double() @ y for x, y in zip(a_all, w_all)))
            assert err < 2 * TOL[torch.bfloat16], f"replay {i}: rel err {err:.2e}"
        ctx.check()
        return True


def test_graph_replays(pool):
    if pool.backend == "host":
        pytest.skip("CUDA graphs need a GPU")
    assert all(pool.run(_replays, 1000))


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
