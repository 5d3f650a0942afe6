"""A two-rank job for test_faults.test_rank_killed, started through scripts/launch.sh on the host backend.

    fault_script.py mid_call|set_up|clean TIMEOUT_S

mid_call: rank 1 dies while its call's copies are under way; set_up: rank 1 dies during the Context's set-up, after
making its /dev/shm file and before the peers have mapped it; clean: both ranks make a Context and close it (which
removes dead processes' files). Rank 0 prints ``fault_script: KEY: VALUE`` lines for the test to read. Rank 1 exits
with status 0 when it dies, so that torchrun lets rank 0 finish.
"""
import os
import sys
import threading
import time
import types

import torch
import torch.distributed as dist

import triton_overlap as to
from triton_overlap.context import host
from triton_overlap.torchrun import init


def report(key, value):
    print(f"fault_script: {key}: {value}", flush=True)


def main():
    when, timeout_s = sys.argv[1], float(sys.argv[2])
    init()
    rank = dist.get_rank()
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        report("dead pid", pids[1])
    if when == "clean":
        with to.Context(timeout_s=timeout_s):
            pass
    elif when == "set_up":
        if rank == 1:
            host.HostBackend.open = lambda self, handle, nbytes: os._exit(0)  # dies with its own file made
        t0 = time.monotonic()
        try:
            to.Context(timeout_s=timeout_s)
            report("error", "none")
        except to.ContextError as e:
            report("error", e)
        report("elapsed", time.monotonic() - t0)
    else:  # mid_call
        if rank == 1:  # its copies the whole jitter late (not a random part of it), so that it dies before them
            host.random = types.SimpleNamespace(uniform=lambda lo, hi: hi)
        ctx = to.Context(timeout_s=timeout_s)
        op = to.AllGatherGEMM(ctx, fallback="never")
        a = torch.randn(64, 32, dtype=torch.bfloat16)
        w = torch.randn(32, 16, dtype=torch.bfloat16)
        op(a, w)  # a first call, undelayed: the shape agreed, the kernels built
        ctx.set_producer_jitter(0.5 if rank == 1 else 0.0)
        dist.barrier()
        if rank == 1:
            threading.Timer(0.2, os._exit, args=(0,)).start()  # while its delayed copies are still to come
        t0 = time.monotonic()
        try:
            op(a, w)
            report("error", "none")
        except to.ContextError as e:
            report("error", e)
        report("elapsed", time.monotonic() - t0)
        try:
            ctx.close()
        except to.ContextError as e:
            report("close", e)
    os._exit(0)  # the peer is gone: no process-group teardown to wait for


if __name__ == "__main__":
    main()
