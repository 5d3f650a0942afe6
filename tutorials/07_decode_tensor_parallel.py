"""Tutorial 07: tensor parallelism at decode time: a one-kernel AllReduce, GEMM + AllReduce, and an MLP block
stepping token by token under a CUDA graph.

    bash scripts/launch.sh tutorials/07_decode_tensor_parallel.py

At decode time each step feeds a few tokens through the model, the row-parallel GEMM's output is a few KB to a few
MB, and its AllReduce is bound by latency, not bandwidth. ``to.all_reduce(x, ctx=ctx)`` sums a tensor over the
ranks in one Triton kernel: every rank stores its input into every peer's receive slot (symmetric memory, mapped
by the Context) as words that each carry the call number, and each rank sums the slots as the words arrive. There
is no host synchronisation and no call number kept on the host, so a decode step that contains it can be captured
in a CUDA graph once and replayed for every token. ``to.gemm_ar(a, w, ctx=ctx)`` is the row-parallel GEMM and that
AllReduce in one kernel at decode sizes (each tile of the partial product goes to every rank as soon as it is
computed, and each rank sums the tiles as they arrive), and ``RowParallelLinear(..., sequence_parallel=False)`` is
the layer. The block's end meets the next block's RMSNorm: ``RowParallelLinear.forward_rmsnorm`` does the
AllReduce, the residual add and the norm in one kernel (``to.all_reduce_rmsnorm``).

This tutorial builds a SwiGLU MLP block sharded over the ranks (gate/up by output columns, down by input rows),
steps it over 16 tokens (on GPUs as replays of one captured step), and compares every step's output with the
unsharded block (then the same steps through the next block's norm), and on GPUs its time per step with the same
block using ``dist.all_reduce`` (NCCL).
"""
import torch
import torch.distributed as dist
from torch import nn

import triton_overlap as to
from triton_overlap.nn import RowParallelLinear
from triton_overlap.timing import time_dist
from triton_overlap.torchrun import backend_name, init, say, verdict


def main():
    device = init()
    with to.Context(backend=backend_name(), timeout_s=120) as ctx:
        W, r = ctx.world_size, ctx.rank
        gpu = ctx.backend != "host"
        B, dim, hidden, steps = (8, 4096, 14336, 16) if gpu else (2, 32, 64, 16)
        say(f"{ctx}: decode, batch {B}, dim {dim}, hidden {hidden} ({hidden // W} per rank)")

        # %% The unsharded block (the same on every rank), weights rounded to bf16 so both start equal.
        torch.manual_seed(0)
        gate_up, down = nn.Linear(dim, 2 * hidden, bias=False), nn.Linear(hidden, dim, bias=True)
        with torch.no_grad():
            for p in (gate_up.weight, down.weight, down.bias):
                p.copy_(p.bfloat16().float())

        def full(x):
            g, u = gate_up(x).chunk(2, dim=-1)
            return down(nn.functional.silu(g) * u)

        # %% Sharded: this rank's hidden columns of gate and up (a local GEMM), and its rows of down (GEMM +
        # AllReduce). The input and the output are the same on every rank.
        n = hidden // W
        cols = torch.cat([torch.arange(r * n, (r + 1) * n), hidden + torch.arange(r * n, (r + 1) * n)])
        w_gate_up = gate_up.weight[cols].to(device, torch.bfloat16)
        down_tp = RowParallelLinear.from_full_weight(down, ctx, dtype=torch.bfloat16, sequence_parallel=False)

        @torch.no_grad()
        def step(x):
            g, u = nn.functional.linear(x, w_gate_up).chunk(2, dim=-1)
            return down_tp(nn.functional.silu(g) * u)

        # %% Decode: one token per sequence per step. On GPUs the step is captured once and replayed.
        g = torch.Generator().manual_seed(1)
        tokens = [torch.randn(B, dim, generator=g).bfloat16().float() for _ in range(steps)]
        x = torch.empty(B, dim, device=device, dtype=torch.bfloat16)
        errs = []
        if gpu:
            x.copy_(tokens[0])
            y = step(x)  # an eager call first: sizes the AllReduce's slots and builds its kernel
            ctx.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = step(x)
        for t in range(steps):
            x.copy_(tokens[t])
            if gpu:
                graph.replay()
            else:
                y = step(x)
            with torch.no_grad():
                ref = full(tokens[t])
            errs.append(float((y.float().cpu() - ref).norm() / ref.norm()))
        ctx.check()
        say(f"{steps} steps: largest relative error against the unsharded block {max(errs):.1e} (tolerance 2e-2)")

        # %% On GPUs: time per step, ours against the same block with dist.all_reduce (NCCL), both as graphs.
        if gpu:
            @torch.no_grad()
            def step_nccl(x):
                g, u = nn.functional.linear(x, w_gate_up).chunk(2, dim=-1)
                y = nn.functional.linear(nn.functional.silu(g) * u, down_tp.weight)
                dist.all_reduce(y)
                return y + down_tp.bias

            step_nccl(x)
            torch.cuda.synchronize()
            nccl_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(nccl_graph):
                step_nccl(x)
            ours, base = time_dist(graph.replay, 50), time_dist(nccl_graph.replay, 50)
            say(f"one decode step: ours {ours:.1f} µs, matmul + dist.all_reduce {base:.1f} µs ({base / ours:.2f}x)")
            # a live graph holding NCCL work keeps destroy_process_group() from returning (pytorch#115388)
            del graph, nccl_graph
            torch.cuda.synchronize()

        # %% The next block starts with an RMSNorm of the residual stream (the residual plus this block's output).
        # ``down_tp.forward_rmsnorm`` ends the block there: the local GEMM, then the AllReduce, the residual add and
        # the norm in one kernel (``to.all_reduce_rmsnorm``), returning the normed rows and the new residual.
        norm_w = torch.randn(dim, generator=g).bfloat16().to(device)
        residual = torch.empty(B, dim, device=device, dtype=torch.bfloat16)

        @torch.no_grad()
        def step_norm(x, residual):
            g_, u = nn.functional.linear(x, w_gate_up).chunk(2, dim=-1)
            return down_tp.forward_rmsnorm(nn.functional.silu(g_) * u, residual, norm_w, eps=1e-6)

        residuals = [torch.randn(B, dim, generator=g).bfloat16() for _ in range(steps)]
        if gpu:
            x.copy_(tokens[0])
            residual.copy_(residuals[0])
            step_norm(x, residual)
            ctx.synchronize()
            norm_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(norm_graph):
                normed, new_residual = step_norm(x, residual)
        norm_errs = []
        for t in range(steps):
            x.copy_(tokens[t])
            residual.copy_(residuals[t])
            if gpu:
                norm_graph.replay()
            else:
                normed, new_residual = step_norm(x, residual)
            with torch.no_grad():
                h = residuals[t].double() + full(tokens[t]).double()
                ref = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6) * norm_w.double().cpu()
            norm_errs.append(max(float((normed.double().cpu() - ref).norm() / ref.norm()),
                                 float((new_residual.double().cpu() - h).norm() / h.norm())))
        ctx.check()
        say(f"{steps} steps into the next block's norm: largest relative error {max(norm_errs):.1e} (tolerance 2e-2)")
        if gpu:
            @torch.no_grad()
            def step_norm_nccl(x, residual):
                g_, u = nn.functional.linear(x, w_gate_up).chunk(2, dim=-1)
                y = nn.functional.linear(nn.functional.silu(g_) * u, down_tp.weight)
                dist.all_reduce(y)
                h = residual + y + down_tp.bias
                return nn.functional.rms_norm(h, (dim,), norm_w, eps=1e-6), h

            step_norm_nccl(x, residual)
            torch.cuda.synchronize()
            nccl_norm_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(nccl_norm_graph):
                step_norm_nccl(x, residual)
            ours, base = time_dist(norm_graph.replay, 50), time_dist(nccl_norm_graph.replay, 50)
            say(f"one decode step into the norm: ours {ours:.1f} µs, matmul + dist.all_reduce + add + rms_norm "
                f"{base:.1f} µs ({base / ours:.2f}x)")
            del norm_graph, nccl_norm_graph
            torch.cuda.synchronize()
        if not verdict(max(errs + norm_errs) < 2e-2, "every decode step matches the unsharded block, and so does "
                       "its output through the next block's norm"):
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
