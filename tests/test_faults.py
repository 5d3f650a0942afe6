"""Faults never turn into wrong answers: each case makes ranks misbehave and asserts the outcome (an error on the
ranks it should reach, naming what it should) and the time to it; after a fault the Context refuses calls until
every rank calls reset(), and the calls after that are correct.

Timeouts are short (timeout_for) to keep the suite quick; SLACK_S is what a fault may take beyond its timeout on a
loaded machine. On GPUs a call returns before its kernels end, so its fault surfaces at ``ctx.check()`` (or at the
next call): the cases check there."""
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import triton_overlap as to
from refs import TOL, rand, rel_err, shm_files

TIMEOUT_S = 1.5  # the host backend's; GPUs (kernels built on a shape's first call) take GPU_TIMEOUT_S
GPU_TIMEOUT_S = 6.0
SLACK_S = 4.0
#: the earliest a call's wait gives up, as a share of T: the barrier's (context.BARRIER_SHARE, 0.9), less the host
#: backend's millisecond clock's lag
EARLIEST = 0.85
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timeout_for(pool) -> float:
    return TIMEOUT_S if pool.backend == "host" else GPU_TIMEOUT_S


def _ag_operands(ctx, m_local, tag=0):
    """An AllGather-GEMM call's operands and its float32 reference."""
    W, r, dev = ctx.world_size, ctx.rank, ctx.device
    shards = [rand((m_local, 32), torch.bfloat16, dev, "fa", tag, s) for s in range(W)]
    w = rand((32, 24), torch.bfloat16, dev, "fw", tag)
    return shards[r], w, torch.cat(shards).float() @ w.float()


def _correct(op, ctx, m_local=8, tag=0):
    a, w, ref = _ag_operands(ctx, m_local, tag)
    got = op(a, w)
    ctx.check()
    assert rel_err(got, ref) < TOL[torch.bfloat16]


def _refused(op, ctx, text):
    """The faulted Context refuses a call at once, with the first fault's text."""
    a, w, _ = _ag_operands(ctx, 8)
    t0 = time.monotonic()
    with pytest.raises(to.ContextError, match="reset") as info:
        op(a, w)
    assert text in str(info.value) and time.monotonic() - t0 < 0.5, str(info.value)


def _timed(ctx, fn):
    """``fn()`` and ``ctx.check()`` must raise a ContextError: its text, and the time it took."""
    t0 = time.monotonic()
    with pytest.raises(to.ContextError) as info:
        fn()
        ctx.check()
    return str(info.value), time.monotonic() - t0


# --------------------------------------------------------------------------------------------- a peer absent
def _peer_absent(repeated: bool, T: float, mode: str = "push"):
    """Rank 1 does not make a call within the timeout: on a shape's first call the others' agreement on shapes
    times out; on a repeated call (agreed before), their call's barrier does. Either names rank 1. ``mode``: the
    gather's (pull holds the GEMM until its opening steps are done: the barrier's timeout must still end it)."""
    with to.Context(timeout_s=T) as ctx:
        op = to.AllGatherGEMM(ctx, to.AllGatherGEMMConfig(mode=mode), fallback="never")
        if repeated:
            _correct(op, ctx)
        out = None
        if ctx.rank != 1:
            a, w, _ = _ag_operands(ctx, 8)
            msg, elapsed = _timed(ctx, lambda: op(a, w))
            want = "rank 1 to arrive at the call's barrier" if repeated else "rank 1 did not answer"
            assert want in msg and f"timeout_s={T:g}" in msg, msg
            assert T * EARLIEST <= elapsed <= T + SLACK_S, elapsed
            _refused(op, ctx, want)
            out = elapsed
        else:
            time.sleep(T + 0.5)  # absent for the whole timeout, then back for the reset
        ctx.reset()
        _correct(op, ctx, tag=1)
        _correct(op, ctx, tag=2)
        return out


@pytest.mark.parametrize("repeated,mode", [(False, "push"), (True, "push"), (True, "pull")],
                         ids=["first_call", "repeated_call", "repeated_call_pull"])
def test_peer_absent(pool, repeated, mode):
    pool.run(_peer_absent, repeated, timeout_for(pool), mode)


# ------------------------------------------------------------------------------------------- shapes disagree
def _disagree(case: str, T: float):
    """Ranks pass different shapes. On a first call the agreement on shapes says so (ValueError on every rank,
    the Context stays usable); on a repeated call (both shapes agreed before) the call's barrier finds the headers
    differ (ContextError on every rank, naming the op, both ranks and both shapes); mixed (rank 0 repeats a shape,
    rank 1 brings a new one) both time out, each naming the other. A rank a call behind may learn of the mismatch
    at its check of the call before, from peers that went on (the fault is the Context's)."""
    with to.Context(timeout_s=T) as ctx:
        r, W = ctx.rank, ctx.world_size
        op = to.AllGatherGEMM(ctx, fallback="never")
        mine = 8 + 4 * (r == W - 1)  # the last rank's shard is larger
        if case == "first":
            a, w, _ = _ag_operands(ctx, mine)
            with pytest.raises(ValueError, match="ranks disagree"):
                op(a, w)
            _correct(op, ctx)  # still usable
            return None
        _correct(op, ctx, 8)
        early = None
        try:
            _correct(op, ctx, 12)
        except to.ContextError as e:
            if case != "repeated":
                raise
            # peers that went on to the next call met the mismatch before this rank checked this call: the
            # Context is faulted for every rank, and this rank's check() says so
            early = str(e)
        if case == "repeated":
            a, w, _ = _ag_operands(ctx, mine)
            msg, elapsed = (early, 0.0) if early else _timed(ctx, lambda: op(a, w))
            assert "ranks disagree on the call" in msg and "ag_gemm" in msg, msg
            assert "ag_gemm 8 32" in msg and "ag_gemm 12 32" in msg, msg  # both shapes (m_local, K)
            assert elapsed <= SLACK_S, elapsed
        else:  # mixed
            a, w, _ = _ag_operands(ctx, 16 if r == W - 1 else 8)  # the last rank: a shape never agreed
            msg, elapsed = _timed(ctx, lambda: op(a, w))
            peers = [p for p in range(W) if p != r]
            assert any(re.search(rf"ranks? (\d+, )*{p}\b", msg) for p in peers), msg
            assert T * EARLIEST <= elapsed <= T + SLACK_S, (elapsed, msg)
        with pytest.raises(to.ContextError, match="reset"):
            ctx.check()
        ctx.reset()
        _correct(op, ctx, 8, tag=3)
        return elapsed


@pytest.mark.parametrize("case", ["first", "repeated", "mixed"])
def test_shapes_disagree(pool, case):
    pool.run(_disagree, case, timeout_for(pool))


def _relay_met_own_fault():
    """A peer's relay (its fields, then its code) and this rank's own kernel recording a mismatch (its code by
    compare-and-swap while the code was still 0, then its fields) interleave: the word holds this rank's fields under
    the relayed code. It reads as this rank's own mismatch, not as a fault relayed from itself."""
    from triton_overlap.kernels import signal as sig

    with to.Context(timeout_s=5) as ctx:
        mine = ctx.call(ctx.op_id("ag_gemm"), (8, 32), (8, 32))
        theirs = ctx.call(ctx.op_id("ag_gemm"), (12, 32), (12, 32))
        ctx.gather_object(None)  # every rank's set-up is over before any relays its fault
        peer = (ctx.rank + 1) % ctx.world_size
        word = [0] * sig.ERR_WORDS
        word[sig.ERR_CODE], word[sig.ERR_RANK], word[sig.ERR_OP] = int(sig.ERR_RELAYED), ctx.rank, mine.op
        word[sig.ERR_PEER], word[sig.ERR_CALL], word[sig.ERR_OWN_FINGERPRINT] = peer, 3, mine.fingerprint
        word[sig.ERR_ORIGIN_CODE] = int(sig.ERR_MISMATCH)
        word[sig.ERR_PEER_HEADER:sig.ERR_PEER_HEADER + 7] = [3, theirs.op, theirs.fingerprint, 12, 32, 0, 0]
        with pytest.raises(to.ContextError) as info:
            ctx.faults.observe(word)
            ctx.ensure_usable()
        msg = str(info.value)
        assert f"rank {ctx.rank}: call 3: ranks disagree on the call" in msg and "ag_gemm 12 32" in msg, msg
        ctx.reset()
        return True


def test_relay_meeting_own_fault_reads_as_own(pool):
    assert all(pool.run(_relay_met_own_fault))


# ----------------------------------------------------------------------------------- a timeout, then correct
def _late_peer(T: float):
    """Rank 1 comes late to a repeated call: rank 0 times out, tells rank 1 (its fault goes into rank 1's error
    word) and then refuses calls; rank 1's late call is refused at once with rank 0's fault. After reset() on every
    rank, calls are correct again."""
    with to.Context(timeout_s=T) as ctx:
        op = to.AllGatherGEMM(ctx, fallback="never")
        _correct(op, ctx)
        if ctx.rank == 1:
            time.sleep(T + 0.5)
        a, w, _ = _ag_operands(ctx, 8, tag=5)
        msg, elapsed = _timed(ctx, lambda: op(a, w))
        if ctx.rank == 0:
            assert "rank 1 to arrive at the call's barrier" in msg, msg
            assert T * EARLIEST <= elapsed <= T + SLACK_S, (elapsed, msg)
            _refused(op, ctx, "rank 1 to arrive")
        else:
            assert "rank 0 faulted" in msg and "rank 1 to arrive at the call's barrier" in msg, msg
            assert elapsed < 0.5, elapsed
        ctx.reset()
        for tag in range(6, 9):
            _correct(op, ctx, tag=tag)
        return elapsed


def test_timeout_then_reset_then_correct_calls(pool):
    if pool.world != 2:
        pytest.skip("W = 2")
    pool.run(_late_peer, timeout_for(pool))


# ------------------------------------------------------------------------------------------------- close()
def _close_alone(T: float):
    """Rank 0 closes while rank 1 has not: rank 0's close() frees its resources and, within the timeout, raises
    naming rank 1; rank 1's later close() finds rank 0's and returns."""
    ctx = to.Context(timeout_s=T)
    op = to.AllGatherGEMM(ctx, fallback="never")
    _correct(op, ctx)
    if ctx.rank == 0:
        t0 = time.monotonic()
        with pytest.raises(to.ContextError) as info:
            ctx.close()
        msg, elapsed = str(info.value), time.monotonic() - t0
        assert "rank 1 did not answer" in msg and "freed" in msg, msg
        assert T * 0.9 <= elapsed <= T + SLACK_S, elapsed
        with pytest.raises(RuntimeError, match="closed"):
            op(*_ag_operands(ctx, 8)[:2])
        return elapsed
    time.sleep(T + 0.5)
    t0 = time.monotonic()
    ctx.close()
    assert time.monotonic() - t0 < SLACK_S
    return None


def test_close_on_one_rank_only(pool):
    if pool.world != 2:
        pytest.skip("W = 2")
    pool.run(_close_alone, timeout_for(pool))


# -------------------------------------------------------------------------------------------- empty inputs
def _empty_inputs():
    """Empty operands get the op's ValueError before any collective (so a rank alone gets it too)."""
    with to.Context(timeout_s=TIMEOUT_S) as ctx:
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
    """A rank dies mid-call (or during the Context's set-up, leaving its /dev/shm file): the survivor's call fails
    within the timeout naming it, and the dead rank's file is removed when the next Context starts."""
    code, out = _launch(os.path.join(ROOT, "tests", "fault_script.py"), when, str(TIMEOUT_S))
    lines = [ln for ln in out.splitlines() if ln.startswith("fault_script:")]
    assert code == 0, out[-3000:]
    report = dict(ln.split(": ", 2)[1:] for ln in lines)
    assert "rank 1" in report["error"], out[-3000:]
    assert float(report["elapsed"]) <= TIMEOUT_S + SLACK_S, report
    dead = report["dead pid"]
    if when == "set_up":
        assert shm_files(dead), "the dead rank's file should still be there before the next Context starts"
    code, out = _launch(os.path.join(ROOT, "tests", "fault_script.py"), "clean", str(TIMEOUT_S))
    assert code == 0, out[-3000:]
    assert not shm_files(dead), shm_files(dead)
