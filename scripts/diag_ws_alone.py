"""GEMM-ReduceScatter's warp-specialized GEMM (kernels.gemm_ws) alone on ONE GPU, as one rank of a simulated world:
every wait passes at once (its counters start full), peers' tiles go to a local staging buffer, our rows add
whatever the receive slots hold. Beside cuBLAS (the bound) and kernels.gemm on the same [M, K] @ [K, N], all as
CUDA-graph replays (timing.time_dist). For A/B runs of the kernel's knobs where a single GPU is lent; what the
overlap itself costs needs two GPUs (diag_rs.py).

    bash scripts/launch.sh scripts/diag_ws_alone.py [--shapes M,K,N ...] [--world 2] [--rank 0]
        [--variants "group_m=4" "WS_SUB_M=64" ...]

A variant is comma-separated NAME=int: a GemmConfig field (group_m) or an ops.gemm_rs module constant
(WS_SUB_M, WS_EPILOGUE_REGS, WS_PRELOAD_TMA), set for that row only.
"""
from __future__ import annotations

import argparse
from dataclasses import fields, replace
import importlib
import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402
from triton_overlap.ops.common import GemmConfig, default_config, plain_gemm  # noqa: E402
from diag_small import graph_us  # noqa: E402

rs = importlib.import_module("triton_overlap.ops.gemm_rs")  # the module (triton_overlap.ops.gemm_rs is also a function)


def simulated(ctx, world: int, rank: int):
    """A GEMMReduceScatter whose plans and launches see ``world`` ranks and ``rank``, on ``ctx``'s one GPU."""
    fake = types.SimpleNamespace(world_size=world, rank=rank, device=ctx.device, err=ctx.err, budget=ctx.budget,
                                 clock=ctx.clock, backend=ctx.backend, num_compute_units=ctx.num_compute_units,
                                 after_launch=ctx.after_launch)
    op = rs.GEMMReduceScatter.__new__(rs.GEMMReduceScatter)
    op.ctx, op._plans = fake, {}
    return op


def ws_alone(op, cfg, a, w, out):
    """A launcher of kernels.gemm_ws for ``a @ w`` as rank op.ctx.rank: counters full, so nothing waits."""
    W = op.ctx.world_size
    (M, _), N = a.shape, w.shape[1]
    m = M // W
    layout, order, expected = op._plan(m, N, cfg, a.element_size())
    recv = types.SimpleNamespace(local=torch.randn(W, m, N, device=a.device).to(a.dtype))
    counters = types.SimpleNamespace(local=torch.full((layout.num_chunks,), 1 << 30, dtype=torch.int32,
                                                      device=a.device))
    _, _, sp, cp = op._staging(recv, counters, layout, a.dtype)
    tick = torch.zeros(2, dtype=torch.int32, device=a.device)

    def run():
        op._launch_ws(cfg, "kn", a, w, recv.local.view(W * m, N), out, None, layout, order, expected, counters.local,
                      sp, cp, tick, reset=False)
        tick.zero_()
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=["2048,4096,4096", "8192,4096,4096", "8192,8192,8192",
                                                   "16384,7168,8192", "8192,1792,8192"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--variants", nargs="*", default=[])
    args = p.parse_args()
    init()
    cfg_fields = {f.name for f in fields(GemmConfig)}
    with to.Context(timeout_s=30) as ctx:
        op = simulated(ctx, args.world, args.rank)
        base = replace(default_config(ctx), **rs.WS_TILES)  # the op's chunking, gemm_ws's tiles
        for spec in args.shapes:
            M, K, N = (int(v) for v in spec.split(","))
            torch.manual_seed(0)
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            full = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(M // args.world, N, device="cuda", dtype=torch.bfloat16)
            row = {"bound (cuBLAS)": graph_us(lambda: torch.matmul(a, w, out=full)),
                   "kernels.gemm alone": graph_us(plain_gemm(ctx, default_config(ctx), a, w, full)),
                   "gemm_ws alone (defaults)": graph_us(ws_alone(op, base, a, w, out))}
            for variant in args.variants:
                kv = dict(item.split("=") for item in variant.split(","))
                saved = {k: getattr(rs, k) for k in kv if k not in cfg_fields}
                try:
                    for k in saved:
                        setattr(rs, k, type(saved[k])(int(kv[k])))
                    cfg = replace(base, **{k: int(v) for k, v in kv.items() if k in cfg_fields})
                    row[f"gemm_ws alone, {variant}"] = graph_us(ws_alone(op, cfg, a, w, out))
                finally:
                    for k, v in saved.items():
                        setattr(rs, k, v)
            ctx.check()
            say(f"{M}x{K}x{N} bf16, as rank {args.rank} of {args.world}, {torch.cuda.get_device_name()}")
            for k, v in row.items():
                say(f"  {k:44s} {v:8.1f} µs  ({v / row['bound (cuBLAS)']:.3f} of the bound)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
