"""Where the time goes in a GEMM-ReduceScatter call: its parts timed alone and together, all as CUDA-graph
replays (GPU time, no host launch cost), max over ranks, the ranks lined up by a spin before each replay
(timing.time_dist's lead_us) except where a row says otherwise.

    bash scripts/launch.sh scripts/diag_rs.py [--shapes M,K,N ...]   (K is K_local)

Parts: cuBLAS on the local GEMM (the bound); our GEMM alone; the copy variant's GEMM alone (scatter only, or
with the reduction in its own-row tiles), with each tile's counters bumped at once or after the next tile's K
loop (defer), and the fused kernel's tiles claimed one by one through an atomic or round-robin (claim 1 / 0);
the copy variant's chunk copies alone (this rank's partial rows for every peer, chunked as the op chunks them,
on the op's streams, no waits); those copies beside our GEMM alone (what the two cost each other); the device
barrier alone; the whole call by default, and in each mode (copy or store; reduction fused or in its own
kernel) with each claim and defer setting.
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
from triton_overlap.launch import init, say  # noqa: E402
from triton_overlap.ops.common import launch_gemm, plain_gemm, with_overrides  # noqa: E402
from triton_overlap.ops.gemm_rs import OP, WS_TILES  # noqa: E402
from triton_overlap.producers.allgather import follow_caller, join  # noqa: E402
from diag_small import barrier_alone, graph_us  # noqa: E402 - the same timing and barrier as the AG diag


def rs_operands(spec: str, W: int, r: int):
    """The diag's operands for shape "M,K,N" (K is K_local): M, K, N, rows per rank, A [M, K], B [K, N] (bf16,
    seeded by rank), a [M, N] output for the bound and a [M/W, N] one for the op."""
    M, K, N = (int(v) for v in spec.split(","))
    m = M // W
    torch.manual_seed(r)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    full = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
    return M, K, N, m, a, w, full, out


def rs_gemm_alone(ctx, cfg, a, w, recv, layout, order, expected, ready, sp, cp, out, tick, fuse, claim=None,
                  defer=None):
    """A launcher of the copy variant's GEMM alone (rank ``ctx.rank`` of ``ctx.world_size``): tiles stored into the
    staging buffer and our receive slot (``recv``, [W, M/W, N]) through the address tables ``sp``/``cp``, counters
    bumped; ``ready``: flags every wait passes at once. ``fuse``: own-row tiles add the peers' partials (whatever the
    slots hold) into ``out``, ``tick`` zeroed after; ``claim``/``defer``: launch_gemm's (None: the defaults)."""
    W = ctx.world_size
    (M, K), N = a.shape, w.shape[1]
    m = M // W

    def run():
        launch_gemm(ctx, cfg, a=a, ws=None, b=w, c=recv.view(W * m, N), bias=None, M=M, N=N, K=K, m_local=m,
                    m_per_chunk=layout.m_per_chunk, chunks_per_rank=layout.chunks_per_rank, tile_order=order,
                    flags=ready, op=OP, gather=False, scatter_ptrs=sp, counter_ptrs=cp,
                    reduce_into=out if fuse else None, expected=expected if fuse else None,
                    tick=tick if fuse else None, split_m=(W - 1) * m // cfg.block_m, free_sm=fuse,
                    local_counters=True, claim=claim, defer_release=defer)
        if fuse:
            tick.zero_()
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=["2048,4096,4096", "8192,4096,4096", "8192,1792,8192"])
    p.add_argument("--quick", action="store_true", help="the bound, the GEMMs alone and the whole call, defaults only "
                   "(to compare two versions of the code, run one after another)")
    p.add_argument("--cfgs", nargs="*", default=[], help="with --quick: also time the GEMMs alone and the whole call "
                   "with these GemmConfig overrides, each 'field=value,field=value'")
    p.add_argument("--module", nargs="*", default=[], help="ops.gemm_rs module constants to set first, NAME=int "
                   "(e.g. WS_PRELOAD_TMA=0)")
    args = p.parse_args()
    import importlib
    rs_module = importlib.import_module("triton_overlap.ops.gemm_rs")
    for kv in args.module:
        name, v = kv.split("=", 1)
        if not hasattr(rs_module, name):
            raise SystemExit(f"ops.gemm_rs has no {name}")
        setattr(rs_module, name, type(getattr(rs_module, name))(int(v)))
    def value(v):  # GemmConfig fields: ints, or a word (scatter=store)
        return int(v) if v.lstrip("-").isdigit() else v

    overrides = [(spec, {k: value(v) for k, v in (kv.split("=") for kv in spec.split(","))}) for spec in args.cfgs]
    init()
    with to.Context(timeout_s=30) as ctx:
        W, r = ctx.world_size, ctx.rank
        for spec in args.shapes:
            M, K, N, m, a, w, full, out = rs_operands(spec, W, r)
            op = to.GEMMReduceScatter(ctx, fallback="never", replay=False)
            cfg = op.config_for((M, K, N))
            row = {}
            row["bound (cuBLAS)"] = graph_us(lambda: torch.matmul(a, w, out=full))
            row["our GEMM alone"] = graph_us(plain_gemm(ctx, cfg, a, w, full))
            op(a, w, out=out, scatter="copy")  # workspaces, plans, staging
            ctx.synchronize()
            layout, order, expected = op._plan(m, N, cfg, a.element_size())  # the op's own chunking and tile order
            recv = ctx.symmetric(f"{op.name}.recv", (W, m, N), a.dtype)
            counters = ctx.symmetric(f"{op.name}.counters", (layout.num_chunks,), torch.int32)
            staging, done, sp, cp = op._staging(recv, counters, layout, a.dtype)
            streams = ctx.streams(op.copy_streams(cfg, layout))
            ready = torch.full((layout.num_chunks,), 1 << 30, dtype=torch.int32, device="cuda")  # every wait passes
            tick = torch.zeros(1, dtype=torch.int32, device="cuda")

            def rs_gemm(fuse, claim=None, defer=None):  # with the current cfg, order and expected counts
                return rs_gemm_alone(ctx, cfg, a, w, recv.local, layout, order, expected, ready, sp, cp, out, tick,
                                     fuse, claim, defer)

            if args.quick:
                row["RS GEMM alone, scatter only"] = graph_us(rs_gemm(False))
                row["RS GEMM alone, fused"] = graph_us(rs_gemm(True))
                b_layout = op.ws_layout(a, w, replace(cfg, ws=True))  # whatever WS_DEFAULT says
                ws_cfg = replace(cfg, **WS_TILES)
                ws_plan = op._plan(m, N, ws_cfg, a.element_size())
                if b_layout is not None and ws_plan[0] == layout:  # the warp-specialized GEMM (kernels.gemm_ws)
                    tick2 = torch.zeros(2, dtype=torch.int32, device="cuda")

                    def ws_alone():
                        op._launch_ws(ws_cfg, b_layout, a, w, recv.local.view(W * m, N), out, None, *ws_plan, ready,
                                      sp, cp, tick2, reset=False)
                        tick2.zero_()
                    row["RS GEMM alone, fused, warp-specialized"] = graph_us(ws_alone)
                base = cfg
                for spec, over in overrides:
                    cfg = with_overrides(base, **over)
                    row[f"our GEMM alone, {spec}"] = graph_us(plain_gemm(ctx, cfg, a, w, full))
                    over_layout, order, expected = op._plan(m, N, cfg, a.element_size())
                    if over_layout != layout:  # the buffers above are the default chunking's: whole call only
                        say(f"  {spec}: chunks differ from the default's; RS GEMM alone not timed, whole call is")
                        continue
                    row[f"RS GEMM alone, scatter only, {spec}"] = graph_us(rs_gemm(False))
                    row[f"RS GEMM alone, fused, {spec}"] = graph_us(rs_gemm(True))
                cfg = base
                _, order, expected = op._plan(m, N, cfg, a.element_size())
            else:
                for defer in (False, True):
                    row[f"RS GEMM alone, scatter only, defer={int(defer)}"] = graph_us(rs_gemm(False, defer=defer))
                for claim in (1, 0):
                    for defer in (False, True):
                        row[f"RS GEMM alone, fused, claim={claim} defer={int(defer)}"] = graph_us(
                            rs_gemm(True, claim, defer))
            ctx.synchronize()
            counters.local.zero_()  # the GEMMs alone bumped them; a call starts from zero
            done.zero_()
            ctx.synchronize()
            dist.barrier()

            def copies():
                for i in range(1, W):
                    d = (r + i) % W
                    for j in range(layout.chunks_per_rank):
                        s = op.copy_stream(streams, W, i, j)
                        rows = layout.local_rows(j)
                        s.copy(recv.peer(d)[r, rows], staging[d, rows])

            gemm = plain_gemm(ctx, cfg, a, w, full)

            def copies_beside(work=None):
                """The copies on the op's streams (which follow the caller's), ``work`` on the caller's meanwhile."""
                def run():
                    follow_caller(ctx, streams)
                    for s in streams[1:]:
                        s.wait_stream(streams[0])
                    if work is not None:
                        work()
                    copies()
                    join(ctx, streams)
                return run

            # the copies write peers' receive slots: every rank's op is idle here (the op synchronised above)
            dist.barrier()
            if not args.quick:
                row["copies alone"] = graph_us(copies_beside())
                row["copies beside our GEMM"] = graph_us(copies_beside(gemm))
                ctx.synchronize()
                dist.barrier()
                row["barrier alone"] = graph_us(barrier_alone(ctx))
                row["whole call (store)"] = graph_us(lambda: op(a, w, out=out, scatter="store"))
            row["whole call (default: auto)"] = graph_us(lambda: op(a, w, out=out))
            row["whole call (default: auto), again"] = graph_us(lambda: op(a, w, out=out))
            for spec, over in overrides if args.quick else ():
                row[f"whole call, {spec}"] = graph_us(lambda: op(a, w, out=out, **over))
            calls = []
            if not args.quick:
                row["whole call (default), ranks not lined up"] = graph_us(lambda: op(a, w, out=out), lead_us=0)
                calls = [(mode, True, claim, defer) for mode in ("copy", "store") for claim in (1, 0) for defer in (0, 1)]
                calls += [(mode, False, None, defer) for mode in ("copy", "store") for defer in (0, 1)]
            for mode, fuse, claim, defer in calls:
                name = f"whole call ({mode}, {'fused, claim=' + str(claim) if fuse else 'reduce kernel'}, defer={defer})"
                row[name] = graph_us(lambda: op(a, w, out=out, scatter=mode, fuse_reduce=fuse, claim=claim,
                                                defer_release=bool(defer)))
            ctx.check()
            mib = (W - 1) * m * N * a.element_size() / 2 ** 20
            say(f"{M}x{K}x{N} bf16 W={W} cfg={cfg} ({layout.chunks_per_rank} chunks/rank by default, "
                f"{mib:.0f} MiB sent per rank)")
            for k, v in row.items():
                say(f"  {k:56s} {v:8.1f} µs  ({v / row['bound (cuBLAS)']:.2f} of the bound)")
            if "copies alone" in row:
                say(f"  copy bandwidth alone: {mib * 2 ** 20 / row['copies alone'] / 1e3:.0f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
