"""Diagnostic: where the host time of one eager call goes (AllGather-GEMM and GEMM-ReduceScatter).

    bash scripts/launch.sh scripts/profile_host.py [M,K,N]

For each op: the host time of whole calls with the GPU idle before each, then the same for the parts a call
is made of (one Triton barrier launch, the GEMM launch alone, the copies alone), then rank 0's cProfile of
20 calls (sorted by own time). Run on GPUs: on the host backend kernels run in the interpreter.
"""
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402


def host_us(fn, iters=20, busy=False):
    """Median host µs per call, max over ranks; ``busy``: the GPU is kept busy (a sleep kernel) meanwhile, as in
    a model whose host runs ahead of the GPU, so no call pays for waking an idle device."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        if busy:
            torch.cuda._sleep(20_000_000)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def profile(ctx, name, fn, iters=20):
    pr = cProfile.Profile()
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda._sleep(20_000_000)  # GPU busy: the host's own cost, not an idle device's wake-up
        pr.enable()
        fn()
        pr.disable()
    torch.cuda.synchronize()
    if ctx.rank == 0:
        st = pstats.Stats(pr, stream=io.StringIO())
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:30]
        lines = [f"{ct / iters * 1e6:9.1f} {tt / iters * 1e6:9.1f} {nc / iters:6.1f}  {fn[0].split('/')[-1]}:{fn[1]}({fn[2]})"
                 for fn, (cc, nc, tt, ct, _) in rows]
        say(f"--- cProfile {name}: per call µs cumulative, µs own, calls per call, function\n" + "\n".join(lines))


def main():
    init()
    M, K, N = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "8192,4096,4096").split(","))
    with to.Context() as ctx:
        W = ctx.world_size
        a = torch.randn(M // W, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ag = to.AllGatherGEMM(ctx, fallback="never")
        for _ in range(3):
            ag(a, w, out=out)
        torch.cuda.synchronize()
        ctx.check()
        say(f"ag_gemm {M}x{K}x{N} W={W}: whole call {host_us(lambda: ag(a, w, out=out)):.1f} µs host, "
            f"{host_us(lambda: ag(a, w, out=out), busy=True):.1f} µs with the GPU busy")
        say(f"  one barrier launch, GPU busy: {host_us(lambda: ctx.barrier(), busy=True):.1f} µs host")
        say(f"  torch.matmul, GPU idle / busy: {host_us(lambda: torch.matmul(a, w)):.1f} / "
            f"{host_us(lambda: torch.matmul(a, w), busy=True):.1f} µs host")
        say(f"  one barrier launch: {host_us(lambda: ctx.barrier()):.1f} µs host")
        say(f"  torch.zeros_ on the stream: {host_us(lambda: out[:1, :1].zero_()):.1f} µs host")
        profile(ctx, "ag_gemm", lambda: ag(a, w, out=out))

        a2 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        o2 = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
        rs = to.GEMMReduceScatter(ctx, fallback="never")
        for _ in range(3):
            rs(a2, w, out=o2)
        torch.cuda.synchronize()
        ctx.check()
        say(f"gemm_rs {M}x{K}x{N} W={W}: whole call {host_us(lambda: rs(a2, w, out=o2)):.1f} µs host, "
            f"{host_us(lambda: rs(a2, w, out=o2), busy=True):.1f} µs with the GPU busy")
        profile(ctx, "gemm_rs", lambda: rs(a2, w, out=o2))
        ctx.check()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
