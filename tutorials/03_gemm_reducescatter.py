"""Tutorial 03: GEMM + ReduceScatter, the reduction fed as tiles finish.

    bash scripts/launch.sh tutorials/03_gemm_reducescatter.py

The row-parallel half of a tensor-parallel MLP: each rank holds a slice of
the contraction dimension, computes a full-size partial product, and rank r
needs rows r*M/W ... (r+1)*M/W of the sum of everyone's partials.

One persistent Triton GEMM computes the rows owned by peers first and its
own rows last. Each finished tile of a peer's rows goes to its owner (stored
straight into the owner's receive slot, or moved there by a copy engine), and
the owner's counter for that chunk goes up; each tile of the GEMM's own rows
waits for its peers' partials and adds them, in float32, before it stores the
result.
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
        M, k_local, N = (8192, 4096, 4096) if gpu else (40 * W, 48, 56)
        dtype = torch.bfloat16
        say(f"{ctx}: a [{M}, {k_local}] and w [{k_local}, {N}] per rank, output [{M // W}, {N}] per rank")

        # %% Inputs, seeded per rank so every rank can rebuild the full sum.
        def inputs(s):
            g = torch.Generator().manual_seed(s)
            return (torch.randn(M, k_local, generator=g).to(device, dtype),
                    torch.randn(k_local, N, generator=g).to(device, dtype))

        a, w = inputs(r)
        op = to.GEMMReduceScatter(ctx, fallback="never")
        out = op(a, w)
        ctx.check()

        # %% Verdict against matmul + reduce_scatter in float32.
        full = sum(x.float() @ y.float() for x, y in map(inputs, range(W)))
        ref = full[r * (M // W):(r + 1) * (M // W)]
        err = float((out.float() - ref).norm() / ref.norm())
        say(f"relative error {err:.2e} (tolerance 1e-2 for bf16)")

        if gpu:
            from triton_overlap.context.collectives import reduce_scatter_rows
            from triton_overlap.timing import time_dist

            partial = torch.empty(M, N, device=device, dtype=dtype)
            ref_out = torch.empty_like(out)

            def nccl():
                torch.matmul(a, w, out=partial)
                reduce_scatter_rows(ref_out, partial)

            ours, base = time_dist(lambda: op(a, w, out=out), 20), time_dist(nccl, 20)
            say(f"ours {ours:.1f} µs, NCCL + cuBLAS {base:.1f} µs ({base / ours:.2f}x)")
        if not verdict(err < 1e-2, "within tolerance"):
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
