"""Where the time goes in a GEMM-ReduceScatter call: its parts timed alone and together, all as CUDA-graph
replays (GPU time, no host launch cost), max over ranks.

    bash scripts/launch.sh scripts/diag_rs.py [--shapes M,K,N ...]   (K is K_local)

Parts: cuBLAS on the local GEMM (the bound); our GEMM alone; the copy variant's chunk copies alone (this
rank's partial rows for every peer, chunked as the op chunks them, on the op's streams, no waits); those
copies beside our GEMM alone (what the two cost each other); the device barrier alone; the whole call with
the barrier gating the GEMM (as before the tenth session) and on the copy stream only (now); the store
variant; and the call with exactly 2, 4 and 8 chunks per rank.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.kernels.chunks import ChunkLayout  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402
from triton_overlap.ops.common import plain_gemm  # noqa: E402
from triton_overlap.producers.allgather import follow_caller, join  # noqa: E402
from triton_overlap.timing import capture, time_dist  # noqa: E402


def graph_us(fn, iters=40):
    try:
        return time_dist(capture(fn).replay, iters)
    except Exception as e:  # noqa: BLE001 - reported, the diag goes on
        say(f"  failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return float("nan")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=["2048,4096,4096", "8192,4096,4096", "8192,1792,8192"])
    args = p.parse_args()
    init()
    with to.Context(timeout_s=30) as ctx:
        W, r = ctx.world_size, ctx.rank
        for spec in args.shapes:
            M, K, N = (int(v) for v in spec.split(","))
            m = M // W
            torch.manual_seed(r)
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            full = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
            op = to.GEMMReduceScatter(ctx, fallback="never", replay=False)
            cfg = op.config_for((M, K, N))
            row = {}
            row["bound (cuBLAS)"] = graph_us(lambda: torch.matmul(a, w, out=full))
            row["our GEMM alone"] = graph_us(plain_gemm(ctx, cfg, a, w, full))
            op(a, w, out=out, scatter="copy")  # workspaces, plans, staging
            ctx.synchronize()
            layout = ChunkLayout(W, m, cfg.chunk_rows(m))
            recv = ctx.symmetric(f"{op.name}.recv", (W, m, N), a.dtype)
            counters = ctx.symmetric(f"{op.name}.counters", (layout.num_chunks,), torch.int32)
            staging = op._staging(recv, counters, layout, a.dtype)[0]
            streams = ctx.streams(cfg.streams_for(W))

            def copies():
                for i in range(1, W):
                    d = (r + i) % W
                    s = streams[(i - 1) % len(streams)]
                    for j in range(layout.chunks_per_rank):
                        rows = layout.local_rows(j)
                        s.copy(recv.peer(d)[r, rows], staging[d, rows])

            def copies_alone():
                follow_caller(ctx, streams)
                for s in streams[1:]:
                    s.wait_stream(streams[0])
                copies()
                join(ctx, streams)

            gemm = plain_gemm(ctx, cfg, a, w, full)

            def copies_beside_gemm():
                follow_caller(ctx, streams)
                for s in streams[1:]:
                    s.wait_stream(streams[0])
                gemm()
                copies()
                join(ctx, streams)

            # the copies write peers' receive slots: every rank's op is idle here (the op synchronised above)
            dist.barrier()
            row["copies alone"] = graph_us(copies_alone)
            row["copies beside our GEMM"] = graph_us(copies_beside_gemm)
            ctx.synchronize()
            dist.barrier()
            one = ctx.streams(1)

            def barrier():
                follow_caller(ctx, one)
                ctx.barrier(one[0])
                join(ctx, one)

            row["barrier alone"] = graph_us(barrier)
            op.gate_gemm = True
            row["whole call (copy), barrier gates GEMM"] = graph_us(lambda: op(a, w, out=out, scatter="copy"))
            op.gate_gemm = False
            row["whole call (copy), barrier on copy stream"] = graph_us(lambda: op(a, w, out=out, scatter="copy"))
            row["whole call (store)"] = graph_us(lambda: op(a, w, out=out, scatter="store"))
            row["whole call (default: auto)"] = graph_us(lambda: op(a, w, out=out))
            for c in (2, 4, 8):
                row[f"whole call (copy), {c} chunks/rank"] = graph_us(lambda: op(a, w, out=out, scatter="copy",
                                                                             chunks_per_rank=c))
            ctx.check()
            mib = (W - 1) * m * N * a.element_size() / 2 ** 20
            say(f"{M}x{K}x{N} bf16 W={W} cfg={cfg} ({layout.chunks_per_rank} chunks/rank by default, "
                f"{mib:.0f} MiB sent per rank)")
            for k, v in row.items():
                say(f"  {k:44s} {v:8.1f} µs  ({v / row['bound (cuBLAS)']:.2f} of the bound)")
            say(f"  copy bandwidth alone: {mib * 2 ** 20 / row['copies alone'] / 1e3:.0f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
