"""Where the time goes in an AllGather-GEMM call of a small shape: its parts timed alone, all as CUDA-graph
replays (GPU time, no host launch cost), max over ranks.

    bash scripts/launch.sh scripts/diag_small.py [--shapes M,K,N ...] [--fp8]

Parts: cuBLAS on the gathered shape (the bound); our GEMM alone, storing C through a descriptor (TMA, the
default) and through pointers (GemmConfig.tma_store=False); our gather GEMM with every flag already
set (no producers: the cost of the flag checks and the two-source A); the device barrier alone; the
producers alone (barrier, copies, flags, no GEMM); the whole call, with the default launch order, with
pointer stores, with producers first, and with exactly 1, 2 and 8 chunks per rank (GemmConfig.min_chunk_bytes
off).
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.kernels.chunks import ChunkLayout  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402
from triton_overlap.ops.ag_gemm import OP  # noqa: E402
from triton_overlap.ops.common import launch_gemm, plain_gemm  # noqa: E402
from triton_overlap.producers.allgather import follow_caller, join, push_rows  # noqa: E402
from triton_overlap.timing import capture, time_dist  # noqa: E402


def graph_us(fn, iters=50, lead_us=300.0):  # diag_rs.py uses it too
    """Graph-replay time of ``fn``; ``lead_us``: the stream spins this long before each timed replay, so the
    ranks start together (timing.time_dist; before the tenth session they were not)."""
    try:
        return time_dist(capture(fn).replay, iters, lead_us=lead_us)
    except Exception as e:  # noqa: BLE001 - reported, the diag goes on
        say(f"  failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return float("nan")


def barrier_alone(ctx):
    """A function enqueueing the device barrier alone, on a stream that follows the caller's and joins it."""
    stream = ctx.streams(1)

    def barrier():
        follow_caller(ctx, stream)
        ctx.barrier(stream[0])
        join(ctx, stream)
    return barrier


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=["2048,4096,4096", "4096,8192,1792"])
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--quick", action="store_true", help="the bound, the gather GEMM with its flags set and the whole "
                   "call, defaults only (to compare two versions of the code, run one after another)")
    args = p.parse_args()
    init()
    with to.Context(timeout_s=30) as ctx:
        W, r = ctx.world_size, ctx.rank
        for spec in args.shapes:
            M, K, N = (int(v) for v in spec.split(","))
            m = M // W
            torch.manual_seed(r)
            dt = torch.float8_e4m3fn if args.fp8 else torch.bfloat16
            a = torch.randn(m, K, device="cuda").to(dt)
            w = torch.randn(N, K, device="cuda").to(dt).t()  # weight.t(): the descriptor path
            kw = dict(scale_a=torch.ones(1, device="cuda"), scale_b=torch.ones(1, device="cuda")) if args.fp8 else {}
            scales = (kw["scale_a"], kw["scale_b"]) if args.fp8 else None
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            gathered = torch.empty(M, K, device="cuda", dtype=dt)
            dist.all_gather_into_tensor(gathered.view(torch.uint8), a.view(torch.uint8))
            op = to.AllGatherGEMM(ctx, fallback="never", replay=False)
            cfg = op.config_for((M, K, N), fp8=args.fp8)
            row = {}
            if args.fp8:
                row["bound (cuBLAS)"] = graph_us(lambda: torch._scaled_mm(gathered, w, *scales, out_dtype=out.dtype,
                                                                          out=out))
            else:
                row["bound (cuBLAS)"] = graph_us(lambda: torch.matmul(gathered, w, out=out))
            if not args.quick:
                row["our GEMM alone"] = graph_us(plain_gemm(ctx, cfg, gathered, w, out, scales=scales))
                row["our GEMM alone, pointer stores"] = graph_us(plain_gemm(ctx, replace(cfg, tma_store=False), gathered, w,
                                                                        out, scales=scales))
            op(a, w, out=out, **kw)  # workspace, flags, plans
            ctx.synchronize()
            layout = ChunkLayout(W, m, cfg.chunk_rows(m, K * a.element_size()))
            ws = op._workspace(a)
            ones = torch.ones(layout.num_chunks, dtype=torch.int32, device="cuda")
            order = op._tile_order(layout, cfg)
            row["gather GEMM, flags set"] = graph_us(lambda: launch_gemm(
                ctx, cfg, a=a, ws=ws.local, b=w, c=out, bias=None, M=M, N=N, K=K, m_local=m,
                m_per_chunk=layout.m_per_chunk, chunks_per_rank=layout.chunks_per_rank, tile_order=order, flags=ones,
                op=OP, gather=True, stride_wm=ws.local.stride(0), scales=scales))
            row["whole call"] = graph_us(lambda: op(a, w, out=out, **kw))
            row["whole call, again"] = graph_us(lambda: op(a, w, out=out, **kw))
            if not args.quick:  # the parts alone and the whole call's variants
                row["barrier alone"] = graph_us(barrier_alone(ctx))
                flags = ctx.symmetric(f"{op.name}.flags", (layout.num_chunks,), torch.int32)
                streams = ctx.streams(cfg.streams_for(W))

                def producers():
                    follow_caller(ctx, streams)
                    push_rows(ctx, streams, layout, a, ws, flags, follow=False)
                    join(ctx, streams)

                row["producers alone"] = graph_us(producers)
                flags.local.zero_()
                dist.barrier()
                row["whole call, pointer stores"] = graph_us(lambda: op(a, w, out=out, tma_store=False, **kw))
                row["whole call, ranks not lined up"] = graph_us(lambda: op(a, w, out=out, **kw), lead_us=0)
                row["whole call, producers first"] = graph_us(lambda: op(a, w, out=out, gemm_first=False, **kw))
                for c in (1, 2, 8):
                    row[f"whole call, {c} chunk(s)/rank"] = graph_us(lambda: op(a, w, out=out, chunks_per_rank=c,
                                                                                min_chunk_bytes=0, **kw))
            ctx.check()
            say(f"{M}x{K}x{N} {'fp8' if args.fp8 else 'bf16'} W={W} cfg={cfg}")
            for k, v in row.items():
                say(f"  {k:32s} {v:8.1f} µs  ({v / row['bound (cuBLAS)']:.2f} of the bound)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
