"""Tutorial 01: the Context, symmetric memory and signals.

    bash scripts/launch.sh tutorials/01_context_and_signals.py

Every rank owns a Context. From it we get a *symmetric* buffer: a tensor of
the same shape on every rank, where each rank can also see (and write) every
other rank's copy. A copy-engine *producer* pushes our data, chunk by chunk,
into the next rank's buffer and raises a per-chunk *flag* after each chunk.
The next rank runs a Triton kernel that waits on each chunk's flag before
reading it. Because a flag is written on the same stream after its chunk, a
flag can never be seen before its data; because waits are bounded, a missing
flag ends in an error naming the rank and chunk instead of a hang.

Without GPUs the launcher runs this on the host backend: two processes,
shared-memory files, worker threads as streams and Triton's interpreter.
"""
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import triton_overlap as to
from triton_overlap.kernels.signal import wait_flag
from triton_overlap.torchrun import backend_name, init, say, verdict


# %% The consumer: programs (c, i) handle block i of chunk c; each waits for its chunk, then reads it.
@triton.jit
def consume(buf_ptr, flags_ptr, out_ptr, err_ptr, budget, rank, peer, op, CHUNK, BLOCK: tl.constexpr,
            CLOCK: tl.constexpr):
    c = tl.program_id(0)
    if wait_flag(flags_ptr + c, 1, err_ptr, budget, rank, op, peer, c, CLOCK):
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < CHUNK
        tl.store(out_ptr + c * CHUNK + offs, tl.load(buf_ptr + c * CHUNK + offs, mask=ok) + 1.0, mask=ok)


def main():
    init()
    with to.Context(backend=backend_name(), timeout_s=60) as ctx:
        r, w = ctx.rank, ctx.world_size
        nxt, prv = (r + 1) % w, (r - 1) % w
        n_chunks, chunk = 8, 1024
        op = ctx.op_id("tutorial.consume")  # what a wait that times out records, and the Context's messages name
        say(f"{ctx}: {n_chunks} chunks of {chunk} floats to the next rank")

        # %% Symmetric memory: same shape everywhere, every rank's copy visible to all.
        buf = ctx.symmetric("tutorial.buf", (n_chunks * chunk,), torch.float32)
        flags = ctx.symmetric("tutorial.flags", (n_chunks,), torch.int32)
        mine = torch.arange(n_chunks * chunk, dtype=torch.float32, device=ctx.device) + 1e5 * r
        out = torch.full((n_chunks * chunk,), float("nan"), device=ctx.device)

        # %% The producer: copy engine pushes chunk c, then sets the peer's flag c, on one stream.
        stream = ctx.streams(1)[0]
        stream.wait_stream(ctx.current_stream())  # our input is ready
        ctx.barrier(stream)  # every rank is here: its buffer and flags may be written
        for c in range(n_chunks):
            part = slice(c * chunk, (c + 1) * chunk)
            stream.copy(buf.peer(nxt)[part], mine[part])
            stream.write_value(flags.peer(nxt)[c:c + 1], 1)

        # %% The consumer runs at once, on our own stream, while chunks are still arriving.
        consume[(n_chunks, 1)](buf.local, flags.local, out, ctx.err, ctx.budget, r, prv, op, chunk, BLOCK=chunk,
                               CLOCK=ctx.clock)
        ctx.current_stream().wait_stream(stream)
        ctx.check()  # raises if any wait timed out

        # %% Verdict against what the previous rank sent.
        want = torch.arange(n_chunks * chunk, dtype=torch.float32) + 1e5 * prv + 1.0
        ok = torch.equal(out.cpu(), want)

        # %% On GPUs: the same ring pass at 64 MiB (copies, flags, consumer) beside NCCL send/recv + an add.
        if ctx.backend != "host":
            from triton_overlap.timing import time_dist

            big_chunk = (64 << 20) // 4 // n_chunks
            bbuf = ctx.symmetric("tutorial.big", (n_chunks * big_chunk,), torch.float32)
            bmine = torch.randn(n_chunks * big_chunk, device=ctx.device)
            bout, recv = torch.empty_like(bmine), torch.empty_like(bmine)

            def ours():
                stream.wait_stream(ctx.current_stream())
                ctx.barrier(stream)
                for c in range(n_chunks):
                    part = slice(c * big_chunk, (c + 1) * big_chunk)
                    stream.copy(bbuf.peer(nxt)[part], bmine[part])
                    stream.write_value(flags.peer(nxt)[c:c + 1], 1)
                consume[(n_chunks, triton.cdiv(big_chunk, 4096))](
                    bbuf.local, flags.local, bout, ctx.err, ctx.budget, r, prv, op, big_chunk,
                    BLOCK=4096, CLOCK=ctx.clock)
                ctx.current_stream().wait_stream(stream)
                flags.local.zero_()  # the next pass's flags are set only after the next barrier

            def nccl():
                ops = [dist.P2POp(dist.isend, bmine, nxt), dist.P2POp(dist.irecv, recv, prv)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
                torch.add(recv, 1.0, out=bout)

            flags.local.zero_()
            dist.barrier()
            t_ours, t_nccl = time_dist(ours, 20), time_dist(nccl, 20)
            ctx.check()
            say(f"64 MiB ring pass: ours {t_ours:.1f} µs, NCCL send/recv + add {t_nccl:.1f} µs "
                f"({t_nccl / t_ours:.2f}x)")
        if not verdict(ok, "every rank read exactly what its predecessor sent"):
            raise SystemExit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
