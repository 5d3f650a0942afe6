"""Faults never turn into wrong answers: each case makes ranks misbehave and asserts the outcome (an error on the
ranks it should reach, naming what it should) and the time to it; after a fault the Context refuses calls until
every rank calls reset(), and the calls after that are correct.

Timeouts are short (contract.timeout_for) to keep the suite quick; SLACK_S is what a fault may take beyond its
timeout on a loaded machine. On GPUs a call returns before its kernels end, so its fault surfaces at ``ctx.check()``
(or at the next call): the cases check there. A peer absent and shapes that disagree are the contract's fault bodies
(contract.peer_absent, contract.shapes_disagree; test_topology runs them between hosts), here with AllGather-GEMM's
call."""
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

import contract
import triton_overlap as to
from contract import SLACK_S, TIMEOUT_S, timeout_for
from refs import shm_files
from test_ag_gemm import AG_GEMM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the fault cases' AllGather-GEMM call (contract.Faults)
CASE = AG_GEMM.faults.case


def _correct(op, ctx, tag=0):
    contract.correct(AG_GEMM, op, ctx, CASE, tag)


def _call(op, ctx, tag=0):
    """The fault cases' call on ``op`` (inputs ``tag``), to make later."""
    call = AG_GEMM.inputs(ctx, CASE, tag)
    return lambda: op(*call.args, **call.kwargs)


# ------------------------------------------------------------------------------- a peer absent, shapes disagree
@pytest.mark.parametrize("repeated,mode", [(False, "push"), (True, "push"), (True, "pull")],
                         ids=["first_call", "repeated_call", "repeated_call_pull"])
def test_peer_absent(pool, repeated, mode):
    """contract.peer_absent: ``mode`` the gather's (pull holds the GEMM until its opening steps are done: the
    barrier's timeout must still end it)."""
    pool.run(contract.peer_absent, AG_GEMM, repeated, timeout_for(pool), replace(CASE, mode=mode))


@pytest.mark.parametrize("case", ["first", "repeated", "mixed"])
def test_shapes_disagree(pool, case):
    """contract.shapes_disagree."""
    pool.run(contract.shapes_disagree, AG_GEMM, case, timeout_for(pool))


def _one_rank_refuses(when: str, T: float):
    """The last rank's input is bad (an ``out`` of the wrong shape: ValueError there, before any exchange), the
    others' good. ``when`` "first": on a shape's first call the others wait for it in the agreement on shapes and
    raise ValueError at once, naming it and its error, and every Context stays usable. "repeated" (the shape agreed
    before): the others launch the call and time out at its barrier, their ContextError saying why the last rank
    did not come; the last rank waits for them (its next call must not meet their launch of this one) and faults
    too."""
    with to.Context(timeout_s=T) as ctx:
        r, W = ctx.rank, ctx.world_size
        op = to.AllGatherGEMM(ctx, fallback="never", replay=False)
        if when == "repeated":
            _correct(op, ctx)
        a, w = AG_GEMM.inputs(ctx, CASE, 1).args[:2]
        out = torch.empty(a.shape[0] * W + (r == W - 1), w.shape[1], dtype=a.dtype, device=a.device)
        ctx.barrier()
        t0 = time.monotonic()
        if when == "first":
            why = "out must be" if r == W - 1 else rf"rank {W - 1} raised before it came: ValueError: ag_gemm: out"
            with pytest.raises(ValueError, match=why):
                op(a, w, out=out)
            assert time.monotonic() - t0 < SLACK_S
        else:
            msg, elapsed = contract.timed(ctx, lambda: op(a, w, out=out))
            assert f"rank {W - 1}" in msg and "ValueError: ag_gemm: out must be" in msg, msg
            assert elapsed <= T + SLACK_S and (r == W - 1 or contract.in_time(msg, elapsed, T)), (elapsed, msg)
        if when == "repeated":
            ctx.reset()  # the others are faulted; reset() is every rank's
        _correct(op, ctx, tag=2)  # usable, correct
        return True


@pytest.mark.parametrize("when", ["first", "repeated"])
def test_one_rank_refuses_its_input(pool, when):
    assert all(pool.run(_one_rank_refuses, when, timeout_for(pool)))


def _relay_met_own_fault(own: str):
    """A peer's relay (its fields, then its code) and this rank's own kernel recording a fault (its code by
    compare-and-swap while the code was still 0, then its fields and ERR_OWN_CODE) interleave: the word holds this
    rank's fields under the relayed code. It reads as this rank's own fault (``own``: a mismatch, or a peer's expert
    ids out of range), not as a fault relayed from itself."""
    from triton_overlap.kernels import signal as sig

    with to.Context(timeout_s=5) as ctx:
        mine = ctx.call(ctx.op_id("ag_gemm"), (8, 32), (8, 32))
        theirs = ctx.call(ctx.op_id("ag_gemm"), (12, 32), (12, 32))
        dispatch = ctx.op_id("ep_dispatch")
        ctx.gather_object(None)  # every rank's set-up is over before any relays its fault
        peer = (ctx.rank + 1) % ctx.world_size
        word = [0] * sig.ERR_WORDS
        word[sig.ERR_CODE], word[sig.ERR_RANK], word[sig.ERR_PEER], word[sig.ERR_CALL] = (
            int(sig.ERR_RELAYED), ctx.rank, peer, 3)
        if own == "mismatch":
            word[sig.ERR_OP], word[sig.ERR_OWN_FINGERPRINT] = mine.op, mine.fingerprint
            word[sig.ERR_ORIGIN_CODE] = word[sig.ERR_OWN_CODE] = int(sig.ERR_MISMATCH)
            word[sig.ERR_PEER_HEADER:sig.ERR_PEER_HEADER + 7] = [3, theirs.op, theirs.fingerprint, 12, 32, 0, 0]
            want = f"rank {ctx.rank}: call 3: ranks disagree on the call"
        else:  # the peer saw the same ids (its relay's origin code) and relayed first
            word[sig.ERR_OP], word[sig.ERR_WHAT], word[sig.ERR_SEEN], word[sig.ERR_WANTED] = dispatch, 4, 0, 4
            word[sig.ERR_ORIGIN_CODE] = word[sig.ERR_OWN_CODE] = int(sig.ERR_BAD_IDS)
            want = (f"rank {ctx.rank}: ep_dispatch (call 3): rank {peer} passed expert ids from 0 to 4; topk_ids "
                    f"must lie in [0, 4)")
        with pytest.raises(to.ContextError) as info:
            ctx.faults.observe(word)
            ctx.ensure_usable()
        msg = str(info.value)
        assert want in msg and (own == "bad_ids" or "ag_gemm 12 32" in msg), msg
        ctx.reset()
        return True


@pytest.mark.parametrize("own", ["mismatch", "bad_ids"])
def test_relay_meeting_own_fault_reads_as_own(pool, own):
    assert all(pool.run(_relay_met_own_fault, own))


# ----------------------------------------------------------------------------------- a timeout, then correct
def _late_peer(T: float):
    """Rank 1 comes late to a repeated call: rank 0 times out, tells rank 1 (its fault goes into rank 1's error
    word) and then refuses calls; rank 1's late call is refused at once with rank 0's fault. After reset() on every
    rank, calls are correct again."""
    with to.Context(timeout_s=T) as ctx:
        op = to.AllGatherGEMM(ctx, fallback="never")
        _correct(op, ctx)
        call = _call(op, ctx, tag=5)
        ctx.barrier()  # rank 0's wait starts when rank 1 stays away
        ctx.check()
        if ctx.rank == 1:  # away until rank 0's fault has reached this rank
            deadline = time.monotonic() + T + SLACK_S
            while time.monotonic() < deadline:
                ctx.faults.read()
                if ctx.faults.faulted:
                    break
                time.sleep(0.05)
        msg, elapsed = contract.timed(ctx, call)
        if ctx.rank == 0:
            assert "rank 1 to arrive at the call's barrier" in msg, msg
            assert T * contract.EARLIEST <= elapsed <= T + SLACK_S, (elapsed, msg)
            contract.refused(AG_GEMM, op, ctx, CASE, "rank 1 to arrive")
        else:  # refused at once
            assert "rank 0 faulted" in msg and "rank 1 to arrive at the call's barrier" in msg, msg
            assert elapsed < T * contract.EARLIEST, elapsed
        ctx.reset()
        for tag in range(6, 9):
            _correct(op, ctx, tag=tag)
        return elapsed


def test_timeout_then_reset_then_correct_calls(pool):
    if pool.world != 2:
        pytest.skip("W = 2")
    pool.run(_late_peer, timeout_for(pool))


def _host_error_mid_call(T: float = 60.0, late_s: float = 0.0, repeated: bool = False):
    """The consumer of an AllGather-GEMM call raises on the host (an allocation that fails, a kernel that does not
    compile), after the call's barrier and its copies and flags were enqueued: the error reaches the caller, the
    Context refuses calls until reset() (the flags and workspaces the call left would pass as the next call's),
    and after reset() calls are correct again. The last rank comes to reset() ``late_s`` after the others.
    ``repeated``: the failing call comes after two calls of its layout (at other addresses), so on GPUs the op
    captures it as its layout's graph (ops.replay rebinds layouts), and it fails inside that capture."""
    from triton_overlap.ops import all_gather_gemm as module

    with to.Context(timeout_s=T) as ctx:
        op = to.AllGatherGEMM(ctx, fallback="never")
        _correct(op, ctx)
        call = _call(op, ctx, tag=1)
        if repeated:
            call()
            ctx.synchronize()
            ctx.check()
        original = module.launch_gemm

        def failing(*a, **kw):
            raise MemoryError("injected: no memory for the consumer")

        if repeated:
            call = _call(op, ctx, tag=1)  # new tensors (the earlier call's still held): a capture, not a replay
        module.launch_gemm = failing
        try:
            with pytest.raises(MemoryError, match="injected"):
                call()
        finally:
            module.launch_gemm = original
        contract.refused(AG_GEMM, op, ctx, CASE, f"rank {ctx.rank}: ag_gemm stopped on the host mid-call")
        ctx.synchronize()
        torch.empty(4, device=ctx.device).random_()  # a capture that failed left torch's generator usable
        if ctx.rank == ctx.world_size - 1:
            time.sleep(late_s)
        ctx.reset()
        for tag in range(2, 4):
            _correct(op, ctx, tag=tag)


@pytest.mark.parametrize("repeated", [False, True], ids=["first_call", "repeated_call"])
def test_host_error_mid_call_faults_until_reset(pool, repeated):
    if pool.world != 2:
        pytest.skip("W = 2")
    pool.run(_host_error_mid_call, 60.0, 0.0, repeated)


def test_reset_waits_for_a_peer_a_timeout_late(pool):
    """Ranks learn of a fault at different times (one from its own wait, a peer from the wait that ends a timeout
    later), so reset() waits for a peer longer than one timeout."""
    if pool.world != 2:
        pytest.skip("W = 2")
    T = timeout_for(pool)
    pool.run(_host_error_mid_call, T, 1.5 * T)


# ------------------------------------------------------------------------------------------------- close()
def _close_alone(T: float):
    """Rank 0 closes while rank 1 has not: rank 0's close() frees its resources and, within the timeout, raises
    naming rank 1; rank 1's later close() finds rank 0's and returns."""
    import torch.distributed as dist

    ctx = to.Context(timeout_s=T)
    op = to.AllGatherGEMM(ctx, fallback="never")
    _correct(op, ctx)
    if ctx.rank == 0:
        t0 = time.monotonic()
        with pytest.raises(to.ContextError) as info:
            ctx.close()
        msg, elapsed = str(info.value), time.monotonic() - t0
        dist.barrier()  # (the harness's group) rank 1 closes only now
        assert "rank 1 did not answer" in msg and "freed" in msg, msg
        assert T * 0.9 <= elapsed <= T + SLACK_S, elapsed
        with pytest.raises(RuntimeError, match="closed"):
            _call(op, ctx)()
        return elapsed
    dist.barrier()
    t0 = time.monotonic()
    ctx.close()
    assert time.monotonic() - t0 < SLACK_S
    return None


def test_close_on_one_rank_only(pool):
    if pool.world != 2:
        pytest.skip("W = 2")
    pool.run(_close_alone, timeout_for(pool))


def _producer_failed():
    raise RuntimeError("a producer step failed")


def _stream_errors_at_reset_and_close():
    """A producer stream that holds an error does not cut short the wait for the others: reset() zeroes nothing
    before a later stream's late flag into a peer has landed (else the flag outlives the reset), and close() still
    meets every rank before it frees, then raises that error on its own rank only."""
    import torch.distributed as dist

    ctx = to.Context(timeout_s=TIMEOUT_S)
    flags = ctx.symmetric("late_flags", (ctx.world_size,), torch.int32)
    failed, late = ctx.streams(2)
    failed.call(_producer_failed)
    late.call(lambda: time.sleep(1.0))
    late.write_value(flags.peer((ctx.rank + 1) % ctx.world_size)[ctx.rank:ctx.rank + 1], 1)
    ctx.reset()
    dist.barrier()  # (the harness's group) every rank's late write would have landed by now
    assert flags.local.eq(0).all(), flags.local.tolist()
    t0 = time.monotonic()
    if ctx.rank == 0:
        late.call(_producer_failed)
        with pytest.raises(RuntimeError, match="a producer step failed"):
            ctx.close()
    else:
        ctx.close()
    assert time.monotonic() - t0 < SLACK_S
    return True


def test_stream_errors_at_reset_and_close(pool):
    if pool.backend != "host":
        pytest.skip("host backend: a stream there holds a producer step's error")
    assert all(pool.run(_stream_errors_at_reset_and_close))


# -------------------------------------------------------------------------------------------- empty inputs
def _empty_inputs():
    """Empty operands get the op's ValueError before any collective, so a rank alone gets it too (its peers wait
    in close(), which launches nothing: the refusal needs no more of them)."""
    with to.Context(timeout_s=60) as ctx:  # (the other ranks wait in close() while rank 0 works)
        dev = ctx.device
        bf = torch.bfloat16
        empty_rows = torch.empty((0, 32), dtype=bf, device=dev)
        w = torch.empty((32, 24), dtype=bf, device=dev)
        if ctx.rank == 0:  # only rank 0 calls: no collective may be reached
            with pytest.raises(ValueError, match="ag_gemm: empty"):
                to.AllGatherGEMM(ctx)(empty_rows, w)
            with pytest.raises(ValueError, match="gemm_rs: empty"):
                to.GEMMReduceScatter(ctx)(empty_rows, w)
            attn = to.ContextParallelAttention(ctx)
            for S, B in ((0, 1), (4, 0)):
                q = torch.empty((B, S, 4, 64), dtype=bf, device=dev)
                k = torch.empty((B, S, 2, 64), dtype=bf, device=dev)
                with pytest.raises(ValueError, match="cp_attention: empty"):
                    attn(q, k, k)
                with pytest.raises(ValueError, match="cp_attention: empty"):
                    attn(q, k[:, :, :1], k[:, :, :1])  # sliced K/V
        return True


def test_empty_inputs_raise_before_any_collective(pool):
    assert all(pool.run(_empty_inputs))


# ------------------------------------------------------------------------- a rank that dies, files left behind
def _launch(script, *args, extra_env=None, timeout=240):
    env = dict(os.environ, PYTHON=sys.executable, TRITON_OVERLAP_BACKEND="host", **(extra_env or {}))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), script, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the host backend's files in /dev/shm")
@pytest.mark.parametrize("when", ["mid_call", "set_up"])
def test_rank_killed(when):
    """A rank dies mid-call (or during the Context's set-up): the survivor's call fails within the timeout naming it.
    Mid-call nothing of the dead rank is left in /dev/shm (every file is unlinked once its peers mapped it); during
    set-up its file is left, and removed when the next Context starts."""
    code, out = _launch(os.path.join(ROOT, "tests", "fault_script.py"), when, str(TIMEOUT_S))
    lines = [ln for ln in out.splitlines() if ln.startswith("fault_script:")]
    assert code == 0, out[-3000:]
    report = dict(ln.split(": ", 2)[1:] for ln in lines)
    assert "rank 1" in report["error"], out[-3000:]
    assert float(report["elapsed"]) <= TIMEOUT_S + SLACK_S, report
    dead = report["dead pid"]
    left = shm_files(dead)
    assert bool(left) == (when == "set_up"), left  # set-up: still there before the next Context starts
    code, out = _launch(os.path.join(ROOT, "tests", "fault_script.py"), "clean", str(TIMEOUT_S))
    assert code == 0, out[-3000:]
    assert not shm_files(dead), shm_files(dead)
