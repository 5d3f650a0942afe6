"""The split tail (kernels.gemm SPLIT_TAIL) on and off, same run: our GEMM alone (as bench.py's consumer column, M = the gathered rows) against
cuBLAS, and AllGather-GEMM in CUDA graphs. ``bash scripts/launch.sh scripts/diag_split_tail.py [M,K,N ...]``."""
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402
from triton_overlap.ops.common import plain_gemm  # noqa: E402
from triton_overlap.timing import capture, time_dist  # noqa: E402

init()
shapes = [tuple(map(int, s.split(","))) for s in sys.argv[1:]] or [(4096, 8192, 1792), (2048, 4096, 4096)]
with to.Context() as ctx:
    W = ctx.world_size
    op = to.AllGatherGEMM(ctx, fallback="never", replay=False)
    for M, K, N in shapes:
        full = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        a = full[ctx.rank * (M // W):(ctx.rank + 1) * (M // W)].contiguous()
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ref = full.float() @ w.float()
        row = [f"{M}x{K}x{N}", f"cuBLAS {time_dist(lambda: torch.matmul(full, w, out=out), 30, budget_s=2.0):.1f} us"]
        cfg = op.config_for((M, K, N))
        for sk in (1, None):
            run = plain_gemm(ctx, dataclasses.replace(cfg, split_tail=sk), full, w, out)
            row.append(f"ours alone split_tail={sk or 'rule'} {time_dist(run, 30, budget_s=2.0):.1f} us")
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row.append(f"err {err:.1e}")
        for sk in (1, None):
            t = time_dist(capture(lambda: op(a, w, out=out, split_tail=sk)).replay, 30)
            ctx.check()
            row.append(f"ag_gemm graph split_tail={sk or 'rule'} {t:.1f} us")
        say(" | ".join(row))
