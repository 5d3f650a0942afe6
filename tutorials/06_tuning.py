"""Tutorial 06: tuning chunk sizes and tiles for your GPUs, and how the ops pick the result up.

    bash scripts/launch.sh tutorials/06_tuning.py

The overlapped ops have knobs: GEMM tiles (block sizes, warps, pipeline
stages), how many chunks each rank's rows are cut into (finer chunks start
the consumer sooner but cost a flag and a copy each), how many producer
streams, and for AllGather-GEMM whether the GEMM is launched before the
copies. ``scripts/tune.py`` sweeps them for one op and shape on the GPUs at
hand and writes the winner into a tuned table, keyed by GPU name, world size
and shape:

    bash scripts/launch.sh scripts/tune.py ag_gemm --shape 8192,4096,4096
    bash scripts/launch.sh scripts/tune.py cp_attention --shape 1,32768,32,8,128,1

The ops read that table on their own (``triton_overlap.ops.tuned``): the user
cache (``$TRITON_OVERLAP_TUNED``, default ``~/.cache/triton_overlap/tuned.json``)
first, then the table shipped in the package, then built-in defaults. Tune
when your shapes differ from the shipped ones by more than a factor of two in
M, or on a GPU with no entry. This tutorial runs a short sweep (two candidates
a stage) into a scratch table and checks that the op then uses what it chose.
"""
import os
import tempfile

import torch
import torch.distributed as dist

import triton_overlap as to
from triton_overlap.ops import tuned
from triton_overlap.torchrun import backend_name, init, say, verdict
from triton_overlap.tuning import tune_gemm


def main():
    init()
    with to.Context(backend=backend_name(), timeout_s=120) as ctx:
        W, r = ctx.world_size, ctx.rank
        gpu = ctx.backend != "host"
        shape = (8192, 4096, 4096) if gpu else (48 * W, 48, 40)  # M, K_local, N for GEMM-ReduceScatter
        say(f"{ctx}: a short GEMM-ReduceScatter sweep at M, K, N = {shape}")

        # %% A scratch table, so this tutorial leaves your user cache alone.
        table = [os.path.join(tempfile.gettempdir(), f"triton_overlap_tutorial06_{os.getpid()}.json")]
        dist.broadcast_object_list(table, src=0)
        os.environ["TRITON_OVERLAP_TUNED"] = table[0]

        # %% The sweep (what scripts/tune.py runs: triton_overlap.tuning), shortened to two values of each knob.
        us, best = tune_gemm(ctx, "gemm_rs", shape, dry=True)
        if r == 0:
            tuned.save(table[0], "gemm_rs", tuned.gpu_key(ctx), W, list(shape), best)
        dist.barrier()
        say(f"best: {us:.1f} µs with {best}")

        # %% A new op finds the entry by itself and runs with it.
        op = to.GEMMReduceScatter(ctx, fallback="never")
        used = op.config_for(shape)
        M, K, N = shape
        g = torch.Generator().manual_seed(r)
        a = torch.randn(M, K, generator=g).to(ctx.device, torch.bfloat16)
        w = (torch.randn(K, N, generator=g) / K ** 0.5).to(ctx.device, torch.bfloat16)
        out = op(a, w)
        ctx.check()
        ref = a.float() @ w.float()
        dist.all_reduce(ref)
        ref = ref[r * (M // W):(r + 1) * (M // W)]
        err = float((out.float() - ref).norm() / ref.norm())
        say(f"the op used {used}; relative error {err:.2e} (tolerance 1e-2)")

        # %% On GPUs, the tuned op beside the defaults and NCCL: torch.matmul + reduce-scatter (eager).
        if gpu:
            from triton_overlap.context.collectives import reduce_scatter_rows
            from triton_overlap.timing import time_dist

            defaults = to.GEMMReduceScatterConfig.defaults(ctx)  # whatever the table says
            plain = to.GEMMReduceScatter(ctx, defaults, fallback="never", name="tutorial06.plain")
            part, red = torch.empty(M, N, device=ctx.device, dtype=a.dtype), torch.empty_like(out)

            def nccl():
                torch.matmul(a, w, out=part)
                reduce_scatter_rows(red, part)

            t_tuned, t_plain, t_nccl = (time_dist(fn, 20) for fn in (lambda: op(a, w), lambda: plain(a, w), nccl))
            say(f"tuned {t_tuned:.1f} µs, defaults {t_plain:.1f} µs, NCCL + cuBLAS {t_nccl:.1f} µs "
                f"({t_nccl / t_tuned:.2f}x); eager calls pay Python launch cost, see README for CUDA-graph numbers")
        if r == 0:
            os.remove(table[0])
        ok = used == to.GEMMReduceScatterConfig(**best) and err < 1e-2
        if not verdict(ok, "the op used the tuned config, result correct"):
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
