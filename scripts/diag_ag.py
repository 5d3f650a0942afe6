"""Staged diagnostic of the stream/kernel signalling on GPUs: which step stalls, if any.
    bash scripts/launch.sh scripts/diag_ag.py"""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, torch.distributed as dist
import triton_overlap as to
from triton_overlap.launch import init, say

def stamp(msg):
    torch.cuda.synchronize(); print(f"[rank {dist.get_rank()} {time.strftime('%X')}] {msg}", flush=True)

init()
with to.Context(timeout_s=5) as ctx:
    W, r = ctx.world_size, ctx.rank
    stamp("context up")
    ctx.barrier(); ctx.check(); stamp("barrier ok")
    m, K, N = 256, 256, 256
    a = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    ws = ctx.symmetric("d.ws", (m * W, K), torch.bfloat16)
    flags = ctx.symmetric("d.flags", (W * 2,), torch.int32)
    s = ctx.streams(1)[0]
    # A: copy + flag write to the peer, no waits
    d = (r + 1) % W
    s.wait_stream(ctx.current_stream())
    s.copy(ws.peer(d)[r * m:(r + 1) * m], a)
    s.write_value(flags.peer(d)[r:r + 1], 1)
    s.synchronize(); dist.barrier(); stamp(f"A push ok: flags {flags.local.tolist()} ws ok {bool(torch.isfinite(ws.local.float()).all())}")
    # B: a stream wait-value on a local flag that a later fill on the caller's stream sets.
    # On 2xH200 (2026-11-22) this stalled: the reason the library never waits on a memory value in a stream.
    from cuda.bindings import driver as drv
    go = torch.zeros(4, dtype=torch.int32, device="cuda")
    drv.cuStreamWaitValue32(s.handle, go[1:2].data_ptr(), 1, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    s.write_value(go[2:3], 7)
    go[1:2].fill_(1)
    s.synchronize(); stamp(f"B stream wait ok: go {go.tolist()}")
    # C: a Triton kernel notify releases a stream wait
    import triton
    from triton_overlap.kernels.signal import notify
    @triton.jit
    def _notify(p):
        notify(p, 1)
    go.zero_()
    drv.cuStreamWaitValue32(s.handle, go[0:1].data_ptr(), 1, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    _notify[(1,)](go)
    s.synchronize(); stamp(f"C kernel->stream ok {go.tolist()}")
    # D: the op with a short timeout
    op = to.AllGatherGEMM(ctx, fallback="never")
    w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    try:
        out = op(a, w)
        stamp("D op enqueued+synced")
        ctx.check(); stamp("D op ok")
    except Exception as e:
        stamp(f"D op raised: {e}")
    say("diag done")
