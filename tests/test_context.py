"""The Context: symmetric memory, signals, barrier, streams, timeouts, errors, close.

Bodies prefixed ``_`` run on every rank (harness.RankPool); the pytest
functions below them choose the backend and world size through ``pool``.
"""
import re
import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import triton_overlap as to
from harness import stress_rounds
from triton_overlap.kernels.signal import wait_flag, wait_kernel


@triton.jit
def _recv_chunks(buf_ptr, flags_ptr, out_ptr, err_ptr, budget, rank, peer, op, n_chunks, CHUNK: tl.constexpr,
                 CLOCK: tl.constexpr):
    """One program per chunk: wait for its flag, then copy the chunk out (x2 so a copy is not a no-op)."""
    c = tl.program_id(0)
    ok = wait_flag(flags_ptr + c, 1, err_ptr, budget, rank, op, peer, c, CLOCK)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    if ok:
        x = tl.load(buf_ptr + offs)
        tl.store(out_ptr + offs, x * 2)


def _sync(ctx):
    ctx.synchronize()
    dist.barrier()


# ----------------------------------------------------------------- visibility
def _peer_visibility():
    with to.Context(timeout_s=60) as ctx:
        buf = ctx.symmetric("x", (37, 5), torch.float32)
        buf.local.copy_(torch.full((37, 5), float(ctx.rank + 1)) + torch.arange(5.0))
        _sync(ctx)
        for r in range(ctx.world_size):
            want = torch.full((37, 5), float(r + 1)) + torch.arange(5.0)
            got = buf.peer(r).cpu()
            assert torch.equal(got, want), f"rank {ctx.rank} sees wrong data for rank {r}"
        assert buf.peer(ctx.rank).data_ptr() == buf.local.data_ptr()
        assert buf.ptrs.shape == (ctx.world_size,) and int(buf.ptrs[ctx.rank]) == buf.local.data_ptr()
        _sync(ctx)  # everyone has checked before anyone writes
        # writes into a peer land in its local view
        nxt = (ctx.rank + 1) % ctx.world_size
        buf.peer(nxt)[0, 0] = 1000.0 + ctx.rank
        _sync(ctx)
        prv = (ctx.rank - 1) % ctx.world_size
        assert float(buf.local[0, 0]) == 1000.0 + prv
        return ctx.backend


def test_peer_visibility(pool):
    backends = pool.run(_peer_visibility)
    assert backends == [pool.backend.replace("-shared", "")] * pool.world  # cuda-shared: the cuda backend


# ------------------------------------------------------------------- ordering
def _ordering(n_chunks, chunk, rounds, jitter):
    """A producer pushes chunks to the next rank with a flag after each; a kernel waits per chunk.

    With random producer delays, any flag seen before its data would show as a wrong value.
    """
    with to.Context(timeout_s=60) as ctx:
        ctx.set_producer_jitter(jitter)
        w, r = ctx.world_size, ctx.rank
        nxt, prv = (r + 1) % w, (r - 1) % w
        buf = ctx.symmetric("buf", (n_chunks * chunk,), torch.float32)
        flags = ctx.symmetric("flags", (n_chunks,), torch.int32)
        out = torch.empty(n_chunks * chunk, device=ctx.device)
        stream = ctx.streams(1)[0]
        gen = torch.Generator().manual_seed(1234)
        for it in range(rounds):
            base = torch.randn(n_chunks * chunk, generator=gen)  # same draw on every rank
            src, peer_src = (base + r).to(ctx.device), base + prv
            buf.local.fill_(float("nan"))  # poison what the producer will overwrite
            out.fill_(float("nan"))
            _sync(ctx)  # every rank has poisoned and its flags are 0 before anyone sends
            stream.wait_stream(ctx.current_stream())
            for c in range(n_chunks):
                ctx.jitter(stream)
                sl = slice(c * chunk, (c + 1) * chunk)
                stream.copy(buf.peer(nxt)[sl], src[sl])
                stream.write_value(flags.peer(nxt)[c:c + 1], 1)
            _recv_chunks[(n_chunks,)](buf.local, flags.local, out, ctx.err, ctx.budget, r, prv, ctx.op_id("test.recv"),
                                      n_chunks, CHUNK=chunk, CLOCK=ctx.clock)
            ctx.after_launch()
            ctx.current_stream().wait_stream(stream)
            ctx.check()
            torch.testing.assert_close(out.cpu(), peer_src * 2, rtol=0, atol=0)
            flags.local.zero_()
        return True


@pytest.mark.parametrize("jitter", [0.0, 0.002])
def test_flag_never_seen_before_data(pool, jitter):
    n_chunks, chunk = (16, 4096) if pool.backend != "host" else (6, 64)
    assert all(pool.run(_ordering, n_chunks, chunk, 3, jitter if pool.backend == "host" else jitter * 5))


# -------------------------------------------------------------------- barrier
def _barrier_rounds(rounds):
    with to.Context(timeout_s=60) as ctx:
        w = ctx.world_size
        slot = ctx.symmetric("slot", (1,), torch.int32)
        start = int(ctx.call_number.item())  # the Context's own barriers so far
        seen = torch.empty((rounds, w), dtype=torch.int32, device=ctx.device)
        for i in range(rounds):
            slot.local.fill_(i)
            ctx.barrier()
            # after barrier i every peer has written i, and none can be past i + 1
            for p in range(w):
                seen[i, p] = slot.peer(p)[0]
        ctx.check()
        seen = seen.cpu()
        want = torch.arange(rounds).unsqueeze(1)
        ok = (seen == want) | (seen == want + 1)
        early = torch.nonzero(~ok)[:5].tolist()
        assert bool(ok.all()), f"rank {ctx.rank}: barrier let a peer through early at rounds {early}"
        return int(ctx.call_number.item()) - start


def test_barrier_1000_rounds(pool):
    rounds = stress_rounds(pool, 1000)
    assert pool.run(_barrier_rounds, rounds) == [rounds] * pool.world


# -------------------------------------------------------------------- timeout
def _timeout(timeout_s):
    ctx = to.Context(timeout_s=timeout_s)
    flag = ctx.symmetric("never", (4,), torch.int32)
    peer = (ctx.rank + 1) % ctx.world_size
    _sync(ctx)  # the waits start together, so the ranks come to reset() together
    t0 = time.monotonic()
    with pytest.raises(to.ContextError) as info:
        wait_kernel[(1,)](flag.local[2:], 7, ctx.err, ctx.budget, ctx.rank, ctx.op_id("test.never"), peer, 2,
                          CLOCK=ctx.clock)
        ctx.after_launch()
        ctx.check()
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    # its own wait's fault, or the peer's, which stops this rank's wait when it comes first
    own = f"rank {ctx.rank}: test.never" in msg and f"chunk 2 of rank {peer}" in msg
    told = re.search(rf"rank {ctx.rank}: rank (\d+) faulted: rank \1: test.never", msg) is not None
    assert (own or told) and "waited for 7" in msg and f"timeout_s={timeout_s:g}" in msg, msg
    # faulted: every call is refused with the first fault's text until every rank resets the Context
    with pytest.raises(to.ContextError, match="test.never"):
        ctx.gather_object(1)
    with pytest.raises(to.ContextError, match="reset"):
        ctx.check()
    ctx.reset()
    ctx.check()
    ctx.barrier()
    ctx.check()
    again = ctx.symmetric("after", (3,), torch.float32)
    again.local.fill_(ctx.rank)
    _sync(ctx)
    assert float(again.peer(peer)[0]) == peer
    ctx.close()
    ctx.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        ctx.symmetric("x", (1,), torch.float32)
    with pytest.raises(RuntimeError, match="closed"):  # close() lets go of the process group (see close())
        ctx.group
    return elapsed, own


def test_expired_wait_raises_and_reset_restores_the_context(pool):
    timeout_s = 1.0
    results = pool.run(_timeout, timeout_s)
    # the wait measures wall-clock time (GPUs: their timer; the host backend: a clock thread, a few ms coarse), so
    # a rank's own wait ends at the timeout, give or take the clock's grain and the launch; a peer's relayed fault
    # may end it sooner (that peer's wait started first)
    assert all((not own or 0.95 * timeout_s <= e) and e <= timeout_s + 5 for e, own in results), results
    assert any(own for _, own in results), results  # the first fault is a rank's own


def _named_waits():
    """What each kind of wait names when it expires: every program's start (WHAT_STARTED), a peer's call start
    (WHAT_PEER_STARTED), a peer's dK/dV partials (WHAT_PARTIALS). Rank 0 waits; every rank then resets."""
    from triton_overlap.kernels.signal import WHAT_PARTIALS, WHAT_PEER_STARTED, WHAT_STARTED

    with to.Context(timeout_s=0.5) as ctx:
        count = torch.zeros(1, dtype=torch.int32, device=ctx.device)
        peer = (ctx.rank + 1) % ctx.world_size
        # build the kernel first (a wait already met), so the timed waits below take their 0.5 s, not a compile
        wait_kernel[(1,)](count, 0, ctx.err, ctx.budget, ctx.rank, ctx.op_id("gemm_rs"), -1, int(WHAT_STARTED),
                          CLOCK=ctx.clock)
        ctx.check()
        dist.barrier()  # (the harness's group, no timeout) the ranks' builds may end far apart
        ctx.barrier()
        for peer_arg, what, want, text in ((-1, WHAT_STARTED, 131, "programs to start"),
                                           (peer, WHAT_PEER_STARTED, 1, f"rank {peer}'s call to start"),
                                           (peer, WHAT_PARTIALS, 5, f"rank {peer}'s dK/dV partials")):
            if ctx.rank == 0:
                with pytest.raises(to.ContextError) as info:
                    wait_kernel[(1,)](count, want, ctx.err, ctx.budget, ctx.rank, ctx.op_id("gemm_rs"), peer_arg,
                                      int(what), CLOCK=ctx.clock)
                    ctx.after_launch()
                    ctx.check()
                msg = str(info.value)
                assert f"rank {ctx.rank}: gemm_rs" in msg and text in msg and f"waited for {want}" in msg, msg
            else:  # told by rank 0's fault, which it relays once its wait expires
                deadline = time.monotonic() + 30
                with pytest.raises(to.ContextError, match="rank 0 faulted"):
                    while time.monotonic() < deadline:
                        ctx.check()
                        time.sleep(0.05)
            ctx.reset()
    return True


def test_expired_waits_name_what_they_waited_for(pool):
    assert all(pool.run(_named_waits))


# ---------------------------------------------------------- bad collective use
def _mismatch():
    with to.Context(timeout_s=30) as ctx:
        with pytest.raises(ValueError, match="different buffers"):
            ctx.symmetric("m", (4, 4 + (ctx.rank == 0)), torch.float32)
        with pytest.raises(ValueError, match="different buffers"):
            ctx.symmetric("d", (8,), torch.float16 if ctx.rank == 1 else torch.bfloat16)
        ok = ctx.symmetric("m", (4, 4), torch.float32)  # still usable
        ok.local.fill_(ctx.rank)
        _sync(ctx)
        assert float(ok.peer(0)[0, 0]) == 0.0
        # reuse when it fits, grow when not
        small = ctx.symmetric("m", (2, 2), torch.float32)
        assert small.local.data_ptr() == ok.local.data_ptr()
        big = ctx.symmetric("m", (64, 64), torch.float32)
        big.local.fill_(ctx.rank + 0.5)
        _sync(ctx)
        assert float(big.peer((ctx.rank + 1) % ctx.world_size)[63, 63]) == (ctx.rank + 1) % ctx.world_size + 0.5
        return True


def test_mismatched_collective_arguments_raise_everywhere(pool):
    assert all(pool.run(_mismatch))


def _bad_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        to.Context(backend="tpu")
    return True


def test_unknown_backend(pool):
    assert all(pool.run(_bad_backend))


# --------------------------------------------------------------- CUDA graphs
def _graph_replays(replays):
    with to.Context(timeout_s=30) as ctx:
        w, r = ctx.world_size, ctx.rank
        nxt, prv = (r + 1) % w, (r - 1) % w
        n = 8192
        buf = ctx.symmetric("g", (n,), torch.float32)
        flags = ctx.symmetric("gf", (1,), torch.int32)
        src = torch.empty(n, device=ctx.device)
        out = torch.empty(n, device=ctx.device)
        stream = ctx.streams(1)[0]

        def step():
            ctx.barrier()  # peers have reset their flag and read their buffer
            stream.wait_stream(ctx.current_stream())
            stream.copy(buf.peer(nxt), src)
            stream.write_value(flags.peer(nxt), 1)
            _recv_chunks[(1,)](buf.local, flags.local, out, ctx.err, ctx.budget, r, prv, ctx.op_id("test.graph"), 1,
                               CHUNK=n, CLOCK=ctx.clock)
            ctx.current_stream().wait_stream(stream)
            flags.local.zero_()

        src.fill_(0)
        step()  # warm up (compiles the kernels) outside the capture
        _sync(ctx)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        _sync(ctx)
        for i in range(replays):
            src.copy_(torch.arange(n, device=ctx.device, dtype=torch.float32) + 1000 * r + i)
            out.fill_(float("nan"))
            dist.barrier()
            g.replay()
            torch.cuda.synchronize()
            want = (torch.arange(n, dtype=torch.float32) + 1000 * prv + i) * 2
            torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)
        ctx.check()
        return True


def test_cuda_graph_replays_of_signal_round_trip(pool):
    if pool.backend == "host":
        pytest.skip("CUDA graphs need a GPU")
    assert all(pool.run(_graph_replays, 100))


def _ranks_on_device():
    with to.Context(timeout_s=30) as ctx:
        expected = 1
        if not ctx.interpreted:  # the ranks of this group on this rank's GPU (cuda-shared: all of them)
            devices = [None] * ctx.world_size
            dist.all_gather_object(devices, torch.cuda.current_device(), group=ctx.group)
            expected = devices.count(torch.cuda.current_device())
        assert ctx.ranks_on_device == expected, (ctx.ranks_on_device, expected)
        found = ctx.ranks_on_device
        ctx.ranks_on_device = 1
        units = ctx.num_compute_units()
        ctx.ranks_on_device = 2  # as where two ranks share this GPU: one SM left to their copies
        assert ctx.num_compute_units() == max(1, units - 1)
        ctx.ranks_on_device = found
        return True


def test_ranks_sharing_a_gpu_leave_it_an_sm(pool):
    """Where ranks share one GPU (cuda-shared), a copy between them runs on SMs: persistent kernels are sized one
    SM short (Context.num_compute_units), else a consumer that holds every SM waits for ever for such a copy."""
    assert pool.run(_ranks_on_device) == [True] * pool.world
