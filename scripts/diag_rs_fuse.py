"""GEMM-RS with the reduction in the GEMM (fuse_reduce=True) against the separate reduction kernel, both in
CUDA graphs, same run: ``bash scripts/launch.sh scripts/diag_rs_fuse.py [M,K,N ...]``."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402
from triton_overlap.timing import capture, time_dist  # noqa: E402

init()
shapes = [tuple(map(int, s.split(","))) for s in sys.argv[1:]] or [(2048, 4096, 4096), (8192, 8192, 8192)]
with to.Context() as ctx:
    W = ctx.world_size
    op = to.GEMMReduceScatter(ctx, fallback="never", replay=False)
    for M, K, N in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M // W, N, device="cuda", dtype=torch.bfloat16)
        row = [f"{M}x{K}x{N}"]
        for scatter in ("store", "copy"):
            for fuse in (True, False):
                t = time_dist(capture(lambda: op(a, w, out=out, scatter=scatter, fuse_reduce=fuse)).replay, 30)
                ctx.check()
                row.append(f"{scatter} fused={fuse}: {t:.1f} us")
        say(" | ".join(row))
