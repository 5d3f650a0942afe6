"""Diagnostic: when things happen inside one GEMM-ReduceScatter call that takes kernels.gemm_ws, from the GPU's
%globaltimer (ns), per rank, as CUDA-graph replays with the ranks lined up (timing.time_dist's lead).

    bash scripts/launch.sh scripts/diag_rs_trace.py [--shapes M,K,N ...] [--iters N]

Each replay is bracketed by two one-program stamp kernels on the caller's stream; the GEMM writes its
per-program timestamps (kernels.gemm_ws TRACE, slots in gemm_ws.TRACE_SLOTS' comment). Printed per rank: every
time in µs from the first stamp, the median over iterations of the earliest, median and latest program. Then the
copy stream, from CUDA events of eager calls behind a spin (a kernel on the copy stream can queue behind the
spinning GEMM and never run): when it passed the barrier, and each chunk's wait, copy and signal. Also the GEMM
alone (its waits pass at once), traced the same way.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import os
import statistics
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.kernels.signal import _now  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402
from triton_overlap.ops.gemm_rs import WS_TILES  # noqa: E402
from triton_overlap.timing import capture, spin, time_dist  # noqa: E402
from diag_rs import rs_operands  # noqa: E402

SLOTS = ["kernel start", "first tile's K loop done", "last tile's K loop done", "K loop warps past 'free' (last)",
         "first tile's epilogue done", "last tile's partials landed", "epilogue done", "kernel end"]


@triton.jit
def stamp_kernel(ptr, slot, CLOCK: tl.constexpr):
    tl.store(ptr + slot, _now(CLOCK))


def stamp(buf, slot):
    stamp_kernel[(1,)](buf, slot, CLOCK=1, num_warps=1)


def timed_copies(op, events):
    """op._copy_chunks with CUDA events recorded on the copy streams (no kernels there: a kernel queued behind a
    stream wait can be held up behind the spinning GEMM, and the call then never ends): ``events`` gets the first
    copy stream past the barrier, then per chunk its wait passed, copied, signalled (in send order)."""
    copy_chunks = op._copy_chunks

    def mark(s):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(s.torch_stream)
        events.append(ev)

    def run(streams, *args):
        events.clear()
        mark(streams[0])
        copy_chunks(streams, *args, mark=mark)
    return run


def run_eager_timed(fn, events, iters, lead_us=300.0):
    """Eager calls of ``fn`` behind a spin (the host ahead), ranks lined up: per iteration the copy stream's
    events and the end of the call, in µs from an event recorded just before the call."""
    tiny = torch.zeros(1, device="cuda")
    rows = []
    for _ in range(iters):
        spin(lead_us)
        dist.all_reduce(tiny)
        spin(lead_us + 200)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        rows.append([s.elapsed_time(ev) * 1e3 for ev in events] + [s.elapsed_time(e) * 1e3])
    return rows


def run_traced(fn, trace, stamps, iters, lead_us=300.0):
    """Replays of ``fn`` (captured with a stamp before and after), the ranks lined up; per iteration the trace
    and stamps relative to the first stamp, in µs."""
    def bracketed():
        stamp(stamps, 0)
        fn()
        stamp(stamps, 1)
    g = capture(bracketed)
    tiny = torch.zeros(1, device="cuda")
    rows = []
    for _ in range(iters):
        trace.zero_()
        stamps.zero_()
        spin(lead_us)
        dist.all_reduce(tiny)
        spin(lead_us)
        g.replay()
        torch.cuda.synchronize()
        t0 = stamps[0].item()
        tr = (trace.double() - t0) / 1e3
        st = [(v - t0) / 1e3 if v else float("nan") for v in stamps.tolist()]
        rows.append((tr, st))
    return g, rows


def out(line):
    print(f"[{dist.get_rank()}]{line}", flush=True)  # every rank prints its own (say prints rank 0's only)


def summarize(name, rows):
    out(f"  {name}")
    for k, label in enumerate(SLOTS):
        cols = [r[0][:, k] for r in rows]
        lo = statistics.median(float(c.min()) for c in cols)
        mid = statistics.median(float(c.median()) for c in cols)
        hi = statistics.median(float(c.max()) for c in cols)
        out(f"    {label:36s} earliest {lo:7.1f}  median {mid:7.1f}  latest {hi:7.1f} µs")
    out(f"    {'stamp after the call':36s} {statistics.median(r[1][1] for r in rows):7.1f} µs")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=["2048,4096,4096", "8192,4096,4096"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--set", nargs="*", default=[], help="GemmConfig overrides for the whole call, key=int")
    p.add_argument("--hang-s", type=float, default=0, help="print every thread's stack and exit after this long")
    args = p.parse_args()
    if args.hang_s:
        import faulthandler
        faulthandler.dump_traceback_later(args.hang_s, exit=True)
    over = {k: int(v) for k, v in (s.split("=", 1) for s in args.set)}
    init()
    with to.Context(timeout_s=30) as ctx:
        W, r = ctx.world_size, ctx.rank
        for spec in args.shapes:
            M, K, N, m, a, w, full, res = rs_operands(spec, W, r)
            op = to.GEMMReduceScatter(ctx, fallback="never", replay=False)
            cfg = op.config_for((M, K, N))
            if op.ws_layout(a, w, replace(cfg, **over)) is None:
                say(f"{spec}: the call does not take gemm_ws here; nothing to trace")
                continue
            if op.scatter_mode(M, N, a.element_size(), replace(cfg, **over)) != "copy":
                say(f"{spec}: the call takes the store variant here; this traces the copy variant's stream")
                continue
            ws_cfg = replace(replace(cfg, **over), **WS_TILES)
            programs = op.ws_programs(ws_cfg, M, N)  # the copy variant's grid, which every traced launch has
            trace = torch.zeros((programs, len(SLOTS)), dtype=torch.int64, device="cuda")
            stamps = torch.zeros(2, dtype=torch.int64, device="cuda")  # before and after the call
            launch_ws = op._launch_ws

            def traced_ws(*a_, **k_):
                return launch_ws(*a_, trace=trace, **k_)
            op._launch_ws = traced_ws
            step(r, spec, "first call")
            op(a, w, out=res, **over)
            ctx.synchronize()
            ms = {}
            step(r, spec, "whole call")
            g, rows = run_traced(lambda: op(a, w, out=res, **over), trace, stamps, args.iters)
            ms["whole call"] = time_dist(g.replay, 30, lead_us=300.0)
            layout, order, expected = op._plan(m, N, ws_cfg, a.element_size())
            step(r, spec, "eager, copy stream timed")
            copy_orig = op._copy_chunks
            events = []
            op._copy_chunks = timed_copies(op, events)
            ev_rows = run_eager_timed(lambda: op(a, w, out=res, **over), events, args.iters)
            op._copy_chunks = copy_orig
            ctx.synchronize()
            dist.barrier()
            # the GEMM alone: every wait passes at once (flags set high, diag_rs.py's "RS GEMM alone ... ws")
            recv = ctx.symmetric(f"{op.name}.recv", (W, m, N), a.dtype)
            counters = ctx.symmetric(f"{op.name}.counters", (layout.num_chunks,), torch.int32)
            staging, done, sp, cp = op._staging(recv, counters, layout, a.dtype)
            ready = torch.full((layout.num_chunks,), 1 << 30, dtype=torch.int32, device="cuda")
            tick2 = torch.zeros(2, dtype=torch.int32, device="cuda")
            b_layout = op.ws_layout(a, w, replace(cfg, ws=True))

            def ws_alone():
                launch_ws(ws_cfg, b_layout, a, w, recv.local.view(W * m, N), res, None, layout, order, expected,
                          ready, sp, cp, tick2, reset=False, trace=trace)
                tick2.zero_()
            step(r, spec, "GEMM alone")
            g3, rows3 = run_traced(ws_alone, trace, stamps, args.iters)
            ms["GEMM alone"] = time_dist(g3.replay, 30, lead_us=300.0)
            ctx.synchronize()
            counters.local.zero_()  # the GEMM alone bumped them; a call starts from zero
            done.zero_()
            ctx.synchronize()
            dist.barrier()
            bound_g = capture(lambda: torch.matmul(a, w, out=full))
            ms["bound (cuBLAS)"] = time_dist(bound_g.replay, 30, lead_us=300.0)
            ctx.check()
            for rank in range(W):
                if rank == r:
                    out(f"rank {r}: {spec} bf16 W={W}, {layout.chunks_per_rank} chunk(s) per rank, {programs} "
                        f"programs; event-timed replays (max over ranks): "
                        + ", ".join(f"{k} {v:.1f} µs" for k, v in ms.items()))
                    summarize("whole call", rows)
                    labels = ["copy stream past the barrier"]
                    for j in range(layout.chunks_per_rank):
                        labels += [f"chunk {j}: wait passed", f"chunk {j}: copied", f"chunk {j}: signalled"]
                    out("  eager call behind a spin, CUDA events from one recorded just before it, median µs")
                    for k, label in enumerate(labels + ["the call's end"]):
                        out(f"    {label:36s} {statistics.median(row[k] for row in ev_rows):7.1f} µs")
                    summarize("GEMM alone", rows3)
                dist.barrier()
    dist.destroy_process_group()


def step(r, spec, what):
    print(f"rank {r}: {spec}: {what}", flush=True)


if __name__ == "__main__":
    main()
