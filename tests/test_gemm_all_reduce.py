"""GEMM + AllReduce and RowParallelLinear(sequence_parallel=False): against float64 references of the unsharded
computation, at odd sizes, with and without bias, on poisoned outputs; autograd through the layer."""
import pytest
import torch
from torch import nn

import triton_overlap as to
from refs import TOL, rand, rel_err
from triton_overlap.nn import RowParallelLinear


def _gemm_ar(fallback: str):
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        op = to.GEMMAllReduce(ctx, fallback=fallback, one_shot_max_bytes=4096, two_shot_max_bytes=4096)
        paths = []
        for i, (M, K, N, dtype, has_bias, transposed) in enumerate([
                (1, 16, 19, torch.bfloat16, True, True), (5, 24, 33, torch.float16, False, False),
                (33, 16, 40, torch.bfloat16, False, True), (64, 32, 72, torch.bfloat16, True, False)]):
            a_all = [rand((M, K), dtype, dev, "gar-a", i, s) for s in range(W)]
            w_all = [rand((N, K) if transposed else (K, N), dtype, dev, "gar-w", i, s) for s in range(W)]
            w_all = [w.t() if transposed else w for w in w_all]
            bias = rand((N,), dtype, dev, "gar-b", i) if has_bias else None
            ref = sum(a.double() @ w.double() for a, w in zip(a_all, w_all))
            if bias is not None:
                ref = ref + bias.double()
            out = torch.full((M, N), float("nan"), dtype=dtype, device=dev) if i % 2 else None
            got = op(a_all[r], w_all[r], bias, out=out)
            ctx.check()
            assert out is None or got is out
            # bf16 partials (each rank's GEMM output) are rounded before they are summed: twice the GEMM tolerance
            err = rel_err(got, ref)
            assert err < 2 * TOL[dtype], f"case {i}: rel err {err:.2e}"
            paths.append(op.last_path)
        with pytest.raises(ValueError, match="different dtypes"):
            op(a_all[r], w_all[r].half() if dtype == torch.bfloat16 else w_all[r].bfloat16())
        with pytest.raises(ValueError, match="out must be"):
            op(a_all[r], w_all[r], out=torch.empty(3, 3, dtype=torch.bfloat16, device=dev))
        return paths


@pytest.mark.parametrize("fallback", ["never", "auto"])
def test_gemm_ar(pool, fallback):
    paths = pool.run(_gemm_ar, fallback)[0]
    if fallback == "never":
        assert set(paths) == {"overlap"}
    else:  # the last case's [64, 72] bf16 output is over 4 KiB
        assert paths[0] == "overlap" and paths[-1] == "fallback"


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
