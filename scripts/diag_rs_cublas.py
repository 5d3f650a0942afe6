"""Would a GEMM-ReduceScatter made of cuBLAS chunks beat ours? A prototype, W = 2 only, graph-timed, ranks lined
up (diag_small.graph_us), max over ranks. Not an op: a measurement to decide whether to build one.

    bash scripts/launch.sh scripts/diag_rs_cublas.py [--shapes M,K,N ...] [--chunks 1 2 4]   (K is K_local)

The prototype, per call on each rank r (peer p): the copy stream follows the caller's and runs the device barrier
(the peer has finished reading its receive slots); on the caller's stream, for each of C chunks of the peer's
rows, torch.mm into a staging buffer, then on the copy stream the chunk's copy into the peer's receive slot and a
flag write there (copy engines); then for each of C chunks of our own rows, the caller's stream waits for the
peer's flag (a stream wait-value) and torch.addmm adds our partial to the peer's (cuBLAS, beta = 1) into the
output. The flags are zeroed after, and the copy stream joined.

Rows: cuBLAS on the whole local GEMM (the bound); the C chunks' mm/addmm with no communication; the prototype; our
op's whole call (default config) beside it.
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
from triton_overlap.producers.allgather import follow_caller, join  # noqa: E402
from diag_rs import rs_operands  # noqa: E402 - the same operands as the RS diag
from diag_small import graph_us  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=["2048,4096,4096", "8192,4096,4096", "8192,1792,8192"])
    p.add_argument("--chunks", nargs="*", type=int, default=[1, 2, 4])
    args = p.parse_args()
    init()
    with to.Context(timeout_s=30) as ctx:
        W, r = ctx.world_size, ctx.rank
        if W != 2:
            raise SystemExit("diag_rs_cublas: the prototype is for W = 2")
        peer = 1 - r
        for spec in args.shapes:
            M, K, N, m, a, w, full, out = rs_operands(spec, W, r)
            row = {"bound (cuBLAS)": graph_us(lambda: torch.matmul(a, w, out=full))}
            op = to.GEMMReduceScatter(ctx, fallback="never", replay=False)
            ref = op(a, w, out=out.clone())
            row["ours, whole call"] = graph_us(lambda: op(a, w, out=out))
            ctx.synchronize()
            for C in args.chunks:
                mc = m // C
                recv = ctx.symmetric(f"crs{C}.recv", (C, mc, N), a.dtype)
                flags = ctx.symmetric(f"crs{C}.flags", (C,), torch.int32)
                flags.local.zero_()
                staging = torch.empty(C, mc, N, device="cuda", dtype=a.dtype)
                stream = ctx.streams(1)

                def peer_rows(j):
                    return a[peer * m + j * mc: peer * m + (j + 1) * mc]

                def own_rows(j):
                    return a[r * m + j * mc: r * m + (j + 1) * mc]

                def chunks_alone():
                    for j in range(C):
                        torch.mm(peer_rows(j), w, out=staging[j])
                    for j in range(C):
                        torch.addmm(staging[j], own_rows(j), w, out=out[j * mc:(j + 1) * mc])

                def call():
                    cur = ctx.current_stream()  # (under capture, the capturing stream)
                    follow_caller(ctx, stream)
                    s = stream[0]
                    ctx.barrier(s)  # the peer is done reading its receive slots
                    for j in range(C):
                        torch.mm(peer_rows(j), w, out=staging[j])
                        s.wait_stream(cur)
                        s.copy(recv.peer(peer)[j], staging[j])
                        s.write_value(flags.peer(peer)[j:j + 1], 1)
                    for j in range(C):
                        cur.wait_value(flags.local[j:j + 1], 1, f"rank {r} cublas-rs chunk {j}")
                        torch.addmm(recv.local[j], own_rows(j), w, out=out[j * mc:(j + 1) * mc])
                    flags.local.zero_()
                    join(ctx, stream)

                row[f"C={C}: chunks' mm/addmm alone"] = graph_us(chunks_alone)
                ctx.synchronize()
                dist.barrier()
                out.fill_(float("nan"))
                call()
                ctx.synchronize()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row[f"C={C}: prototype (rel. err vs ours {err:.1e})"] = graph_us(call)
                ctx.synchronize()
                dist.barrier()
            if r == 0:
                bound = row["bound (cuBLAS)"]
                say(f"{M}x{K}x{N} bf16 W={W}")
                for k, v in row.items():
                    say(f"  {k:<58} {v:8.1f} µs  ({v / bound:.3f} of the bound)")
            ctx.check()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
