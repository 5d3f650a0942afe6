"""Tutorial 05: a tensor-parallel MLP in a model, converted from a single-process one in a line.

    bash scripts/launch.sh tutorials/05_tensor_parallel_mlp.py

``triton_overlap.nn`` has sequence-parallel layers: ``ColumnParallelLinear``
([S/W, *, in] -> [S, *, out/W], AllGather-GEMM) and ``RowParallelLinear``
([S, *, in/W] -> [S/W, *, out], GEMM-ReduceScatter); each one's backward uses
the other op. ``TPMLP.from_full(gate, up, down, ctx, dtype=torch.bfloat16)``
shards an existing SwiGLU MLP (without ``dtype`` it keeps the source layers'
dtype; float32 layers then need ``torch.autocast``). ``ParallelTransformerBlock`` puts one beside context-parallel
attention, and ``torch.compile(model, fullgraph=True)`` traces both (the ops
are torch custom ops with fake implementations and backward formulas).

This tutorial trains the same small MLP twice, unsharded in float32 and
sharded over the ranks in bf16, and compares the loss curves.
"""
import torch
import torch.distributed as dist
from torch import nn

import triton_overlap as to
from triton_overlap.torchrun import backend_name, init, say, verdict
from triton_overlap.nn import TPMLP


def main():
    device = init()
    with to.Context(backend=backend_name(), timeout_s=120) as ctx:
        W, r = ctx.world_size, ctx.rank
        gpu = ctx.backend != "host"
        S, B, dim, hidden, steps, lr = (4096, 2, 2048, 5632, 5, 0.5) if gpu else (24, 2, 32, 48, 5, 0.5)
        say(f"{ctx}: SwiGLU MLP dim={dim} hidden={hidden}, sequence S={S} x batch {B}, {S // W} positions per rank")

        # %% A single-process model, the same on every rank (seeded); weights rounded to bf16 so both start equal.
        torch.manual_seed(0)
        gate, up, down = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False), \
            nn.Linear(hidden, dim, bias=False)
        with torch.no_grad():
            for lin in (gate, up, down):
                lin.weight.copy_(lin.weight.bfloat16().float())
        full = lambda x: down(nn.functional.silu(gate(x)) * up(x))  # noqa: E731

        # %% The conversion: one line. Rank r keeps its hidden columns of gate/up and rows of down.
        # (Shards this small take torch's path under fallback="auto"; "never" runs the overlapped kernels, here in
        # Triton's interpreter.)
        mlp = TPMLP.from_full(gate, up, down, ctx, dtype=torch.bfloat16, fallback="auto" if gpu else "never")
        for lin in (gate, up, down):  # the unsharded reference runs on the same device
            lin.to(device)

        # %% Train both on the same data; each rank feeds its S/W positions (sequence-first) to the TP model.
        g = torch.Generator().manual_seed(1)
        x_full = torch.randn(S, B, dim, generator=g).bfloat16().float().to(device)
        target = torch.randn(S, B, dim, generator=g).to(device)
        rows = slice(r * S // W, (r + 1) * S // W)
        x, t = x_full[rows].bfloat16(), target[rows]
        ref_params = [gate.weight, up.weight, down.weight]
        losses, ref_losses = [], []
        for step in range(steps):
            loss_ref = ((full(x_full) - target) ** 2).mean()
            loss_ref.backward()
            part = ((mlp(x).float() - t) ** 2).sum() / target.numel()  # this rank's share of the mean
            part.backward()
            total = part.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total))
            ref_losses.append(float(loss_ref.detach()))
            with torch.no_grad():
                for p in ref_params + list(mlp.parameters()):
                    p -= lr * p.grad
                    p.grad = None
            say(f"step {step}: loss {losses[-1]:.5f} (single process {ref_losses[-1]:.5f})")
        ctx.check()
        gap = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
        say(f"largest relative gap between the curves {gap:.1e} (tolerance 3e-3); the layers took the "
            f"{mlp.gate_up.last_path} path")

        # %% On GPUs, one forward + backward beside the same MLP with NCCL all_gather / reduce_scatter + cuBLAS.
        if gpu:
            from triton_overlap.context.collectives import all_gather_rows, reduce_scatter_rows
            from triton_overlap.timing import time_dist

            wg = mlp.gate_up.weight.detach()
            wd = mlp.down.weight.detach()
            n = hidden // W

            def nccl_mlp():
                xg = torch.empty(S, B, dim, device=device, dtype=torch.bfloat16)
                all_gather_rows(xg, x)
                a, b = (xg @ wg.t()).split(n, dim=-1)
                y = nn.functional.silu(a) * b @ wd.t()
                out = torch.empty(S // W, B, dim, device=device, dtype=torch.bfloat16)
                reduce_scatter_rows(out, y)
                return out

            with torch.no_grad():
                ours, base = time_dist(lambda: mlp(x), 10), time_dist(nccl_mlp, 10)
            say(f"forward: ours {ours:.1f} µs, NCCL + cuBLAS {base:.1f} µs ({base / ours:.2f}x); eager calls pay "
                "Python launch cost, see README for CUDA-graph numbers")
        if not verdict(gap < 3e-3 and ref_losses[-1] < ref_losses[0], "the TP model follows the single-process "
                       "loss curve"):
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
