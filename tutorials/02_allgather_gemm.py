"""Tutorial 02: AllGather + GEMM with the gather hidden behind the GEMM.

    bash scripts/launch.sh tutorials/02_allgather_gemm.py

In sequence-parallel tensor parallelism, each rank holds M/W rows of the
activations and a column shard of the weight; the layer needs every row:
``all_gather(a) @ w``. Done naively, the GPU idles while NCCL gathers.

Here, copy engines push our rows into every peer's workspace chunk by chunk
and raise a flag after each chunk, while one persistent Triton GEMM computes
the tiles of our own rows first (they need no transfer) and then the remote
ones, each tile waiting only for the chunks it reads. The transfer runs on
the copy engines, so the GEMM keeps every SM but one.
"""
import torch
import torch.distributed as dist

import triton_overlap as to
from triton_overlap.torchrun import backend_name, init, say, verdict


def main():
    device = init()
    with to.Context(backend=backend_name(), timeout_s=120) as ctx:
        W, r = ctx.world_size, ctx.rank
        gpu = ctx.backend != "host"
        m_local, K, N = (4096, 4096, 4096) if gpu else (61, 64, 48)
        dtype = torch.bfloat16
        say(f"{ctx}: a [{m_local}, {K}] per rank, w [{K}, {N}] per rank, gathered M = {m_local * W}")

        # %% Inputs. Seeded per rank, so every rank can rebuild the full gathered matrix for the check.
        shards = [torch.randn(m_local, K, generator=torch.Generator().manual_seed(s)).to(device, dtype)
                  for s in range(W)]
        a = shards[r]
        w = torch.randn(K, N, generator=torch.Generator().manual_seed(100 + r)).to(device, dtype)

        # %% The op. fallback="never" so that even these tiny host shapes take the overlapped path.
        op = to.AllGatherGEMM(ctx, fallback="never")
        out = op(a, w)
        ctx.check()

        # %% Verdict against all_gather + matmul in float32.
        ref = torch.cat(shards).float() @ w.float()
        err = float((out.float() - ref).norm() / ref.norm())
        say(f"relative error {err:.2e} (tolerance 1e-2 for bf16)")

        # %% On GPUs, the time beside NCCL all_gather + torch.matmul (eager, as called here).
        if gpu:
            from triton_overlap.context.collectives import all_gather_rows
            from triton_overlap.timing import time_dist

            gathered = torch.empty(m_local * W, K, device=device, dtype=dtype)
            ref_out = torch.empty_like(out)

            def nccl():
                all_gather_rows(gathered, a)
                torch.matmul(gathered, w, out=ref_out)

            ours, base = time_dist(lambda: op(a, w, out=out), 20), time_dist(nccl, 20)
            say(f"ours {ours:.1f} µs, NCCL + cuBLAS {base:.1f} µs ({base / ours:.2f}x); "
                "eager calls pay Python launch cost, see README for CUDA-graph numbers")
        # %% fp8 (e4m3): the same op gathers one byte per element and applies per-tensor scales in the GEMM's
        # epilogue. scale_a covers the whole gathered A, so every rank uses the same one (here from every shard's
        # amax, which each rank can rebuild; in a model, an amax all-reduced over the group).
        err8 = 0.0
        if not gpu or torch.cuda.get_device_capability(device) >= (8, 9):
            f8, top = torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max
            sa = (max(float(t.abs().max()) for t in shards) / top) * torch.ones(1, device=device)
            sb = (w.abs().max().float() / top).reshape(1)
            a8 = (a.float() / sa).to(f8)
            w8 = (w.t().float() / sb).to(f8).t()  # stored [N, K] as fp8 weights are, passed transposed
            out8 = op(a8, w8, scale_a=sa, scale_b=sb)  # bf16 out
            ctx.check()
            full8 = torch.cat([(t.float() / sa).to(f8) for t in shards]).float()
            ref8 = (full8 @ w8.float()) * sa * sb
            err8 = float((out8.float() - ref8).norm() / ref8.norm())
            say(f"fp8: relative error {err8:.2e} against the dequantised inputs in float32, "
                f"{float((out8.float() - ref).norm() / ref.norm()):.2e} against the bf16 reference (quantisation)")
        if not verdict(err < 1e-2 and err8 < 1e-2, "within tolerance"):
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
