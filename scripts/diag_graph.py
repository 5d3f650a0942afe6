"""Why a large shape's CUDA-graph replay of our op timed slower than its eager call (eleventh session: RS
16384x7168x8192 3035 against 2574 µs, AG 16384x8192x14336 5349 against 5054).

    bash scripts/launch.sh scripts/diag_graph.py [--shapes op,M,K,N ...] [--rounds 2]

For each shape, in alternation and for several rounds (so that order and GPU heating show): the op as a
user gets it (replay on: an eager call replays the op's own graph), the op with replay off enqueued anew,
an outer CUDA graph of the op with replay off (bench.py's "ours graph"), an outer graph of the op with
replay on, and cuBLAS alone on the same GEMM. Every timing lines the ranks up before each call
(timing.time_dist with a lead). Beside each: the SM clock (MHz), power (W) and temperature (C) that
torch.cuda reports right after, where it can.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402
from triton_overlap.timing import capture, time_dist  # noqa: E402


def gpu_state() -> str:
    parts = []
    for name, fn in (("MHz", torch.cuda.clock_rate), ("W", lambda: torch.cuda.power_draw() / 1000),
                     ("C", torch.cuda.temperature)):
        try:
            parts.append(f"{fn():.0f} {name}")
        except Exception:  # noqa: BLE001 - pynvml may be missing
            pass
    return ", ".join(parts) or "no nvml"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=["rs,16384,7168,8192", "ag,16384,8192,14336", "rs,8192,4096,4096"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    init()
    with to.Context(timeout_s=30) as ctx:
        W, r = ctx.world_size, ctx.rank
        for spec in args.shapes:
            kind, *dims = spec.split(",")
            M, K, N = (int(v) for v in dims)
            torch.manual_seed(r)
            if kind == "rs":
                a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
                full = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                gemm_a = a
                Op = to.GEMMReduceScatter
            else:
                a = torch.randn(M // W, K, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                full = out
                gemm_a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                Op = to.AllGatherGEMM
            w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
            user = Op(ctx, name=f"dg.{kind}.user")
            anew = Op(ctx, name=f"dg.{kind}.anew", fallback="never", replay=False)
            runs = {
                "replay on (user)": lambda: user(a, w, out=out),
                "replay off, eager": lambda: anew(a, w, out=out),
                "outer graph, replay off": capture(lambda: anew(a, w, out=out)).replay,
                "outer graph, replay on": capture(lambda: user(a, w, out=out)).replay,
                "cuBLAS alone": lambda: torch.matmul(gemm_a, w, out=full),
            }
            ctx.check()
            mode = anew.scatter_mode(M, N, 2, anew.config_for((M, K, N))) if kind == "rs" else "-"
            say(f"{kind} {M}x{K}x{N} W={W}: scatter={mode} config={anew.config_for((M, K, N))}")
            for rnd in range(args.rounds):
                for name, fn in runs.items():
                    us = time_dist(fn, args.iters, lead_us=500.0)
                    ctx.check()
                    say(f"  round {rnd} {name:26s} {us:9.1f} µs   [{gpu_state()}]")
            say(f"  replays of the user op: {user.replays.stats}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
