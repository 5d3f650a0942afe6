"""A randomised soak of the ops on the host backend: many short jobs of 2 to 4 ranks, each making calls of every op
(AllGather-GEMM, GEMM-RS, CP attention, both AllReduce kernels) with random shapes, chunking, variants and producer
delays, every result checked against torch; then tutorial 05 run over and over, counting processes that abort at
exit.

    python dev/soak.py [--jobs 20] [--calls 25] [--exit-runs 200] [--seed 0]

Prints, at the end: calls made (each on every rank of its job), mismatches (a rank's result off its reference: must
be 0), faults (a rank's call that raised a ContextError; each one's text is printed as it happens), hangs (jobs
killed at their time limit: must be 0), and tutorial runs, failures and aborts at exit.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_LIMIT_S = 900


def worker(calls: int, seed: int) -> None:
    """One job: ``calls`` random calls on every rank (the same draws on every rank), counts reported by rank 0."""
    import torch
    import torch.distributed as dist

    import triton_overlap as to
    from triton_overlap.torchrun import init

    init()
    rng = random.Random(seed)  # the same on every rank: every rank makes the same calls
    stats = torch.zeros(3, dtype=torch.int64)  # calls, mismatches, faults
    with to.Context(timeout_s=20) as ctx:
        ctx.set_producer_jitter(rng.choice([0.0, 0.002]))
        W, r = ctx.world_size, ctx.rank
        ops = {"ag": to.AllGatherGEMM(ctx, fallback="never"), "rs": to.GEMMReduceScatter(ctx, fallback="never"),
               "cp": to.ContextParallelAttention(ctx, chunks_per_rank=rng.choice([2, 4])),
               "ar": {a: to.AllReduce(ctx, algorithm=a, fallback="never") for a in ("one_shot", "two_shot")}}
        for i in range(calls):
            kind = rng.choice(list(ops))
            g = torch.Generator().manual_seed(seed * 1000 + i)
            bf = torch.bfloat16
            try:
                if kind == "ag":
                    m, k, n = rng.randint(1, 40), rng.choice([16, 32, 48]), rng.randint(1, 40)
                    shards = [torch.randn(m, k, generator=g).to(bf) for _ in range(W)]
                    w = torch.randn(k, n, generator=g).to(bf)
                    cfg = dict(m_per_chunk=rng.choice([None, 1, 7, 16]), mode=rng.choice(["push", "pull"]))
                    got = ops["ag"](shards[r], w, **cfg)
                    ref = torch.cat(shards).float() @ w.float()
                elif kind == "rs":
                    m, k, n = W * rng.randint(1, 20), rng.choice([16, 32]), rng.randint(1, 40)
                    parts = [(torch.randn(m, k, generator=g).to(bf), torch.randn(k, n, generator=g).to(bf))
                             for _ in range(W)]
                    cfg = dict(m_per_chunk=rng.choice([None, 3, 8]), scatter=rng.choice(["store", "copy"]))
                    got = ops["rs"](*parts[r], **cfg)
                    ref = sum(a.float() @ b.float() for a, b in parts)[r * (m // W):(r + 1) * (m // W)]
                elif kind == "ar":
                    n = rng.choice([1, 7, 1000, 1025, 3000])
                    xs = [torch.randn(n, generator=g).to(bf) for _ in range(W)]
                    got = ops["ar"][rng.choice(["one_shot", "two_shot"])](xs[r])
                    ref = sum(x.float() for x in xs)
                else:
                    cpr = ops["cp"].chunks_per_rank
                    s_local = 2 * W * rng.randint(1, 3) * cpr // 2
                    S, causal = s_local * W, rng.choice([True, False])
                    q, kk, v = (torch.randn(1, S, h, 64, generator=g).to(bf) for h in (4, 2, 2))
                    with torch.no_grad():
                        o, _ = ops["cp"](*(to.zigzag.shard(t, ctx) for t in (q, kk, v)), causal=causal)
                    got = to.zigzag.unshard(o, ctx)
                    ref = torch.nn.functional.scaled_dot_product_attention(
                        q.float().transpose(1, 2), kk.float().transpose(1, 2), v.float().transpose(1, 2),
                        is_causal=causal, enable_gqa=True).transpose(1, 2)
                ctx.check()
                err = float((got.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                stats[1] += int(not err < 2e-2)
            except to.ContextError as e:
                print(f"soak: call {i} ({kind}) faulted: {e}", file=sys.stderr, flush=True)
                stats[2] += 1
                ctx.reset()
            stats[0] += 1
    dist.all_reduce(stats)
    if r == 0:
        # calls as the program makes them (each on every rank); mismatches and faults counted per rank
        print(f"soak: W {W} calls {int(stats[0]) // W} mismatches {int(stats[1])} faults {int(stats[2])}", flush=True)
    dist.destroy_process_group()


def launch(args, nproc=None, limit=JOB_LIMIT_S):
    env = dict(os.environ, PYTHON=sys.executable, TRITON_OVERLAP_BACKEND="host")
    cmd = ["bash", os.path.join(ROOT, "scripts", "launch.sh")] + (["-n", str(nproc)] if nproc else []) + args
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return None, ""
    return proc.returncode, proc.stdout + proc.stderr


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--calls", type=int, default=25)
    p.add_argument("--exit-runs", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.calls, args.seed)
    rng = random.Random(args.seed)
    totals = dict(calls=0, mismatches=0, faults=0, hangs=0, failed_jobs=0)
    for j in range(args.jobs):
        world = rng.randint(2, 4)
        code, out = launch([os.path.abspath(__file__), "--worker", "--calls", str(args.calls), "--seed",
                            str(args.seed * 100 + j)], nproc=world)
        line = next((ln for ln in out.splitlines() if ln.startswith("soak: W ")), None)
        if code is None:
            totals["hangs"] += 1
        elif code != 0 or line is None:
            totals["failed_jobs"] += 1
            print(out[-3000:], file=sys.stderr)
        else:
            f = line.split()
            totals["calls"] += int(f[4])
            totals["mismatches"] += int(f[6])
            totals["faults"] += int(f[8])
        print(f"job {j + 1}/{args.jobs}: W = {world}: {line or 'no report'}", flush=True)
        for ln in out.splitlines():
            if ln.startswith("soak: call"):
                print("  " + ln, flush=True)
    tutorial = os.path.join(ROOT, "tutorials", "05_tensor_parallel_mlp.py")
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: launch([tutorial], limit=600), range(args.exit_runs)))
    aborts = sum(1 for code, out in runs if "terminate called" in out)
    failures = sum(1 for code, out in runs if code != 0 or "verdict: PASS" not in out)
    print(f"soak: {args.jobs} jobs, {totals['calls']} calls, {totals['mismatches']} mismatches, "
          f"{totals['faults']} faults, {totals['hangs']} hangs, {totals['failed_jobs']} failed jobs; "
          f"tutorial 05: {len(runs)} runs, {failures} failed, {aborts} aborted at exit")


if __name__ == "__main__":
    sys.exit(main())
