"""Diagnostic: where the host time of one eager call goes (AllGather-GEMM, GEMM-ReduceScatter, CP attention).

    bash scripts/launch.sh scripts/profile_host.py [M,K,N [S_total]]

For each op: the host time of whole calls with the GPU idle before each, then the same for the parts a call
is made of (one Triton barrier launch, the GEMM launch alone, the copies alone), then rank 0's cProfile of
20 calls (sorted by own time). Run on GPUs: on the host backend kernels run in the interpreter.
"""
import cProfile
import io
import os
import pstats
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402
from triton_overlap.timing import host_us  # noqa: E402


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
        lines = [f"{ct / iters * 1e6:9.1f} {tt / iters * 1e6:9.1f} {nc / iters:6.1f}  "
                 f"{where[0].split('/')[-1]}:{where[1]}({where[2]})" for where, (_, nc, tt, ct, _) in rows]
        say(f"--- cProfile {name}: per call µs cumulative, µs own, calls per call, function\n" + "\n".join(lines))


def whole_call(ctx, name, call):
    """Three warm-up calls (compile, load, plans), then the host time of one call with the GPU idle and busy."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    ctx.check()
    say(f"{name}: whole call {host_us(call):.1f} µs host, {host_us(call, busy=True):.1f} µs with the GPU busy")


def main():
    init()
    M, K, N = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "8192,4096,4096").split(","))
    with to.Context() as ctx:
        W = ctx.world_size
        a = torch.randn(M // W, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ag = to.AllGatherGEMM(ctx, fallback="never")
        whole_call(ctx, f"ag_gemm {M}x{K}x{N} W={W}", lambda: ag(a, w, out=out))
        for name, call in (("one barrier launch", ctx.barrier), ("torch.matmul", lambda: torch.matmul(a, w))):
            say(f"  {name}, GPU idle / busy: {host_us(call):.1f} / {host_us(call, busy=True):.1f} µs host")
        say(f"  a one-element zero_ on the stream: {host_us(lambda: out[:1, :1].zero_()):.1f} µs host")
        profile(ctx, "ag_gemm", lambda: ag(a, w, out=out))

        a2 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        o2 = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
        rs = to.GEMMReduceScatter(ctx, fallback="never")
        whole_call(ctx, f"gemm_rs {M}x{K}x{N} W={W}", lambda: rs(a2, w, out=o2))
        profile(ctx, "gemm_rs", lambda: rs(a2, w, out=o2))
        ctx.check()

        S = int(sys.argv[2]) if len(sys.argv) > 2 else 16384  # total sequence; B=1, Hq=32, Hkv=8, D=128, causal
        q = torch.randn(1, S // W, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, S // W, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cp = to.ContextParallelAttention(ctx)
        with torch.no_grad():
            whole_call(ctx, f"cp_attention S={S} W={W}", lambda: cp(q, k, v))
            profile(ctx, "cp_attention", lambda: cp(q, k, v))
        ctx.check()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
