"""Diagnostic: the GPU timeline of one AllGather-GEMM or GEMM-ReduceScatter call, per rank, from torch's
profiler (kernels, copies and memsets with their streams; stream memory operations are not traced).

    bash scripts/launch.sh scripts/trace_ops.py ag_gemm|gemm_rs --shape M,K,N [--set key=value ...]

Each call is enqueued eagerly behind a sleep kernel, so the host's enqueue cost does not show and the GPU
runs the call as it would a replayed one; the ranks are lined up by a barrier before the sleep (what is
left between them is the hosts' skew). Prints, per rank, each GPU event of the last of three calls:
start and end in µs from that call's first event, stream, and name.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402


def value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(v, v)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("op", choices=["ag_gemm", "gemm_rs"])
    p.add_argument("--shape", required=True)
    p.add_argument("--set", nargs="*", default=[], help="GemmConfig overrides, key=value")
    args = p.parse_args()
    init()
    overrides = {k: value(v) for k, v in (s.split("=", 1) for s in args.set)}
    M, K, N = (int(v) for v in args.shape.split(","))
    with to.Context(timeout_s=30) as ctx:
        W, r = ctx.world_size, ctx.rank
        torch.manual_seed(r)
        if args.op == "ag_gemm":
            op = to.AllGatherGEMM(ctx, fallback="never", replay=False)
            a = torch.randn(M // W, K, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        else:
            op = to.GEMMReduceScatter(ctx, fallback="never", replay=False)
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        for _ in range(3):  # compile, allocate, plans
            op(a, w, out=out, **overrides)
        torch.cuda.synchronize()
        ctx.check()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                torch.cuda.synchronize()
                dist.barrier()
                torch.cuda._sleep(50_000_000)  # the host enqueues the whole call while this runs
                op(a, w, out=out, **overrides)
            torch.cuda.synchronize()
        ctx.check()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        gpu = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
               and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        gpu.sort(key=lambda e: e["ts"])
        sleeps = [i for i, e in enumerate(gpu) if "spin_kernel" in e["name"]]  # torch.cuda._sleep's kernel
        call = gpu[sleeps[-1] + 1:] if sleeps else gpu
        lines = []
        if call:
            t0 = call[0]["ts"]
            for e in call:
                stream = e.get("args", {}).get("stream", "?")
                lines.append(f"  {e['ts'] - t0:9.1f} {e['ts'] + e['dur'] - t0:9.1f}  stream {stream:>4}  "
                             f"{e['name'][:90]}")
            span = max(e["ts"] + e["dur"] for e in call) - t0
            lines.append(f"  span {span:.1f} µs")
        text = f"rank {r}: {args.op} {M}x{K}x{N} {overrides or ''}\n" + "\n".join(lines)
        everyone = [None] * W
        dist.all_gather_object(everyone, text)
        if r == 0:
            say("\n".join(everyone))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
