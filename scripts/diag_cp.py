"""Diagnostic: cp_attention forward, copies enqueued before the kernel vs after (kernel_first), eager timings.

    bash scripts/launch.sh scripts/diag_cp.py [S_total]

Each call's waits time out after 20 s with an error naming rank, op and chunk, so an ordering that cannot make
progress shows as an error, not a hang.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.launch import backend_name, init, say  # noqa: E402
from triton_overlap.timing import time_dist  # noqa: E402

S = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
init()
with to.Context(backend=backend_name(), timeout_s=20) as ctx:
    W = ctx.world_size
    g = torch.Generator(device=ctx.device).manual_seed(0)
    q, k, v = (torch.randn(1, S // W, h, 128, device=ctx.device, dtype=torch.bfloat16, generator=g) for h in (32, 8, 8))
    for kf in (False, True):
        op = to.ContextParallelAttention(ctx, chunks_per_rank=4, name=f"diag{int(kf)}")
        op.kernel_first = kf
        ref = None
        for i in range(3):
            out, _ = op(q, k, v, causal=True)
            torch.cuda.synchronize()
            ctx.check()
            say(f"kernel_first={kf} call {i}: ok")
        t = time_dist(lambda: op(q, k, v, causal=True), 20)
        say(f"kernel_first={kf}: {t:.1f} µs per call (eager, S={S})")
dist.destroy_process_group()
