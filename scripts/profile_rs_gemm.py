"""One GPU, no peers: launch the GEMM-ReduceScatter kernel as rank 0 of two would, with every address local
(the copy variant's staging buffer for the peer's rows, the receive slot for ours) and every counter it
waits on already complete, so a profiler (Nsight Compute) can look inside one launch of it:

    python3 scripts/profile_rs_gemm.py --variant fused [--shape 8192,1792,8192] [--launches 3]
    ncu --clock-control none --kernel-name regex:persistent_gemm --launch-skip 2 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o rep python3 scripts/profile_rs_gemm.py --variant fused

Variants: "plain" (our GEMM alone, what the benchmarks call consumer alone), "scatter" (the copy variant's GEMM,
reduction in a separate kernel: every tile stored and its counter bumped), "fused" (the default: own-row tiles
add the peer's partial in their epilogue). The same launches as scripts/diag_rs.py's "GEMM alone" rows; without
a profiler the script prints each variant's time (triton.testing.do_bench_cudagraph).
"""
from __future__ import annotations

import argparse
import os
import sys

from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from triton_overlap.ops.common import default_config, plain_gemm  # noqa: E402
from triton_overlap.ops.gemm_rs import GEMMReduceScatter  # noqa: E402
from diag_rs import rs_gemm_alone, rs_operands  # noqa: E402 - the RS diag's operands and launch


class OneGPU:
    """The little of a Context that launch_gemm and GEMMReduceScatter._plan read, for rank 0 of ``world``."""
    backend = "cuda"
    clock = 1
    rank = 0

    def __init__(self, world: int):
        self.world_size = world
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.err = torch.zeros(8, dtype=torch.int32, device=self.device)
        self.budget = 10 ** 9  # ns: every wait passes at once here

    def num_compute_units(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def after_launch(self) -> None:
        pass


def launcher(variant: str, spec: str, world: int = 2):
    """A function launching ``variant`` once on shape "M,K,N" (K is K_local), and its config."""
    ctx = OneGPU(world)
    M, K, N, m, a, w, full, out = rs_operands(spec, world, ctx.rank)  # diag_rs's operands
    op = GEMMReduceScatter.__new__(GEMMReduceScatter)  # only its planning: no Context, no process group
    op.ctx, op._plans, op._tuned, op.user_config, op.config = ctx, {}, {}, None, default_config(ctx)
    cfg = op.config_for((M, K, N))  # the tuned table's entry for this GPU, as the op would take
    if variant == "plain":
        return plain_gemm(ctx, cfg, a, w, full), cfg
    layout, order, expected = op._plan(m, N, cfg, a.element_size())
    # the op's receive slots and counters, here plain local tensors; the op's staging buffer and address tables
    recv = SimpleNamespace(local=torch.empty(world, m, N, device="cuda", dtype=a.dtype))
    counters = SimpleNamespace(local=torch.zeros(layout.num_chunks, dtype=torch.int32, device="cuda"))
    _, _, sp, cp = op._staging(recv, counters, layout, a.dtype)
    ready = torch.full((layout.num_chunks,), 1 << 30, dtype=torch.int32, device="cuda")  # every wait passes
    tick = torch.zeros(1, dtype=torch.int32, device="cuda")
    run = rs_gemm_alone(ctx, cfg, a, w, recv.local, layout, order, expected, ready, sp, cp, out, tick,
                        variant == "fused")
    run.buffers = (op, counters)  # the kernel reaches the staging buffer (op's) and counters through address tables
    return run, cfg


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", nargs="*", default=["plain", "scatter", "fused"])
    p.add_argument("--shape", default="8192,1792,8192")
    p.add_argument("--launches", type=int, default=0, help="launch each variant this many times and stop (for a "
                   "profiler); 0: time each")
    args = p.parse_args()
    import triton.testing
    for variant in args.variant:
        run, cfg = launcher(variant, args.shape)
        if args.launches:
            for _ in range(args.launches):
                run()
            torch.cuda.synchronize()
            print(f"{variant} {args.shape}: {args.launches} launches, {cfg}")
        else:
            run()
            with torch.cuda.stream(torch.cuda.Stream()):
                us = triton.testing.do_bench_cudagraph(run, rep=200) * 1e3
            print(f"{variant:8s} {args.shape}: {us:8.1f} us  {cfg}")


if __name__ == "__main__":
    main()
