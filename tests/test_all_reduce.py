"""AllReduce: the sum over ranks against a float64 sum of every rank's input, on poisoned outputs, at odd sizes, in
every dtype; repeated calls with changing sizes, calls between other ops' on the same Context, ranks arriving at
different times; bad input; ranks that disagree; a peer that never comes; CUDA-graph replays on GPUs (from the
contract, tests/contract.py)."""
import random
import time
from dataclasses import dataclass

import pytest
import torch

import contract
import triton_overlap as to
from contract import Call, OpSpec, Variants
from refs import exact_inputs, poison, rand, rel_err

#: ||out - ref|| / ||ref|| against the float64 sum: one rounding of a float32 sum to the output dtype
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
#: odd sizes (16-bit values read and written one at a time) and multiples of 8 (32 bits at a time: WORD_IO), in one
#: block and in several
SIZES = [(1,), (7,), (40,), (1023,), (1025,), (3, 677), (4099,), (2, 2056), (2, 3, 1031)]


@dataclass(frozen=True, kw_only=True)
class ARCase:
    """Every rank's ``shape`` of ``dtype`` summed over ranks, by ``algorithm``."""
    shape: tuple
    dtype: str = "bfloat16"
    algorithm: str = "auto"


def _inputs(ctx, case, it):
    xs = [rand(case.shape, getattr(torch, case.dtype), ctx.device, "ar", it, r) for r in range(ctx.world_size)]
    x = xs[ctx.rank]
    return Call((x,), {}, sum(x.double() for x in xs), torch.empty_like(x))


ALL_REDUCE = OpSpec(
    name="all_reduce", module=__name__, op=to.AllReduce, inputs=_inputs, tol=TOL, paths=False,
    make=lambda ctx, case, fallback: to.AllReduce(ctx, algorithm=case.algorithm, fallback=fallback),
    # 1,000 replays of each kernel, the one-shot in each of its tilings (ops.all_reduce.one_shot_tiling: programs of
    # 8 warps, a one-warp program per 256 elements, a program of 4 warps per 1024 up to one per compute unit); the
    # first call sizes the slots, not allowed inside a capture
    replay=Variants(host=None, gpu=ARCase(shape=(3001,)), calls=1000, warm=True,
                    ids={"one_shot": dict(algorithm="one_shot"), "two_shot": dict(algorithm="two_shot"),
                         "one_shot_mid": dict(algorithm="one_shot", shape=(20011,)),
                         "one_shot_large": dict(algorithm="one_shot", shape=(200_003,))}),
)

# the contract's tests: test_all_reduce_cuda_graph_replay
globals().update(contract.tests(ALL_REDUCE))


def _check(op, ctx, shape, dtype, tag, out=None):
    call = ALL_REDUCE.inputs(ctx, ARCase(shape=shape, dtype=str(dtype).removeprefix("torch.")), tag)
    (x,), ref = call.args, call.ref
    before = x.clone()
    if out is not None:
        out.fill_(float("nan"))
    got = op(x, out=out)
    ctx.check()
    assert got.shape == x.shape and got.dtype == dtype and (out is None or got is out)
    assert torch.equal(x, before), "the input was modified"
    err = rel_err(got, ref)
    assert err < TOL[dtype], f"{shape} {dtype}: rel err {err:.2e}"
    return got


def _sums(fallback: str, algorithm: str):
    with to.Context(timeout_s=30) as ctx:
        op = to.AllReduce(ctx, algorithm=algorithm, fallback=fallback, one_shot_max_bytes=2048,
                          two_shot_max_bytes=8192)
        paths, digests = [], []
        for i, shape in enumerate(SIZES):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                out = torch.empty(shape, dtype=dtype, device=ctx.device) if i % 2 else None
                got = _check(op, ctx, shape, dtype, (i, str(dtype)), out)
                paths.append(op.last_algorithm)
                digests.append(got.float().sum().item())
        return paths, digests


@pytest.mark.parametrize("fallback, algorithm", [("never", "one_shot"), ("never", "two_shot"), ("auto", "auto"),
                                                 ("always", "auto")])
def test_sums(pool, fallback, algorithm):
    results = pool.run(_sums, fallback, algorithm)
    paths, digests = results[0]
    assert all(p == paths for p, _ in results)
    if fallback == "never":
        assert set(paths) == {algorithm}
        assert all(d == digests for _, d in results), "ranks' results differ"  # summed in one order everywhere
    elif fallback == "always":
        assert set(paths) == {"process group"}
    else:  # up to 2 KiB one-shot, up to 8 KiB two-shot, then the process group
        assert set(paths) == {"one_shot", "two_shot", "process group"}


def _exact(shapes, iters: int):
    """The one-shot's output, call after call with new inputs, equals torch's float32 sum of every rank's input in
    rank order, rounded once, to the bit: a word taken from a slot before it held this call's value would show."""
    with to.Context(timeout_s=30) as ctx:
        op = to.AllReduce(ctx, algorithm="one_shot", fallback="never")
        for i in range(iters):
            for shape in shapes:
                for dtype in (torch.bfloat16, torch.float32):
                    xs = [exact_inputs(shape, dtype, ctx.device, ctx.interpreted, "exact", i, r)
                          for r in range(ctx.world_size)]
                    want = xs[0].float()
                    for x in xs[1:]:
                        want = want + x.float()
                    got = op(xs[ctx.rank], out=poison(torch.empty_like(xs[0])))
                    ctx.check()
                    assert torch.equal(got, want.to(dtype)), (i, shape, dtype)
        return True


def test_one_shot_sum_is_exact(pool):
    host = pool.backend == "host"
    shapes = [(40,), (1025,), (2, 2056)] if host else [(1024,), (4096,), (8193,), (65536,), (64, 4096)]
    assert all(pool.run(_exact, shapes, 2 if host else 20))


def _small_calls(calls: int):
    """Many one-shot calls of a few elements, each waited for: a peer's header and words land while the kernel
    reads them, call after call, and every call must end with the exact sum (a wait whose threads disagreed on
    whether they had landed hung the kernel past its timeout)."""
    with to.Context(timeout_s=30) as ctx:
        op = to.AllReduce(ctx, algorithm="one_shot", fallback="never")
        for i in range(calls):
            shape, dtype = [(1,), (7,), (40,), (300,)][i % 4], [torch.float32, torch.bfloat16][i // 4 % 2]
            xs = [exact_inputs(shape, dtype, ctx.device, True, "small", i, r) for r in range(ctx.world_size)]
            got = op(xs[ctx.rank], out=poison(torch.empty_like(xs[0])))
            ctx.check()
            assert torch.equal(got, sum(x.float() for x in xs).to(dtype)), (i, shape, dtype)
        return True


def test_many_small_one_shot_calls(pool):
    assert all(pool.run(_small_calls, 12 if pool.backend == "host" else 2000))


def _changing_sizes(seed: int):
    """Calls whose sizes grow and shrink, with other ops' calls between them and ranks arriving at random times."""
    rng = random.Random(seed)  # the same draws on every rank
    with to.Context(timeout_s=30) as ctx:
        # both algorithms on one workspace (the same name): they share the slots, flags and call count
        ops = [to.AllReduce(ctx, algorithm=a, fallback="never", name="ar") for a in ("one_shot", "two_shot")]
        ag = to.AllGatherGEMM(ctx, fallback="never")
        late = random.Random(seed * 100 + ctx.rank)  # each rank's own delays
        for i in range(14):
            time.sleep(late.choice([0.0, 0.0, 0.05]))
            n = rng.choice([1, 5, 1024, 2049, 5000, 300])
            dtype = rng.choice([torch.float32, torch.bfloat16])
            _check(rng.choice(ops), ctx, (n,), dtype, ("chg", i))
            if i % 4 == 3:
                a = rand((9, 32), torch.bfloat16, ctx.device, "chg-a", i, ctx.rank)
                w = rand((32, 17), torch.bfloat16, ctx.device, "chg-w", i)
                ag(a, w)
                ctx.check()
        return True


def test_changing_sizes_between_other_ops(pool):
    assert all(pool.run(_changing_sizes, 3))


# --------------------------------------------------------------------------------------------------- errors
def _bad_input():
    with to.Context(timeout_s=30) as ctx:
        with pytest.raises(ValueError, match="algorithm"):
            to.AllReduce(ctx, algorithm="ring")
        op = to.AllReduce(ctx)
        dev = ctx.device
        x = torch.ones(10, device=dev)
        with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
            op(torch.ones(10, dtype=torch.int32, device=dev))
        with pytest.raises(ValueError, match="non-contiguous"):
            op(x, out=torch.empty(20, device=dev)[::2])
        with pytest.raises(ValueError, match="shape"):
            op(x, out=torch.empty(11, device=dev))
        with pytest.raises(ValueError, match="out must not be x"):
            op(x, out=x)
        with pytest.raises(ValueError, match="torch.Tensor"):
            op([1.0])
        # ranks with different shapes on a shape's first call: a ValueError on every rank, the Context usable
        with pytest.raises(ValueError, match="ranks disagree"):
            op(torch.ones(10 + ctx.rank, device=dev))
        assert torch.equal(op(x), torch.full((10,), float(ctx.world_size), device=dev))
        assert op(torch.ones(0, device=dev)).shape == (0,)
        return True


def test_bad_input(pool):
    assert all(pool.run(_bad_input))


def _disagree():
    """Both sizes agreed before; then the ranks pass different ones (the same block count): every rank whose peer's
    header differs gets a ContextError naming both; after reset() the sums are right again."""
    with to.Context(timeout_s=10) as ctx:
        op = to.AllReduce(ctx, fallback="never")
        _check(op, ctx, (8,), torch.float32, "d8")
        x = torch.ones(8 if ctx.rank == 0 else 12, device=ctx.device)
        with pytest.raises(to.ContextError) as info:
            # a rank a call behind may see the mismatch at its check of the call before (the Context's fault)
            _check(op, ctx, (12,), torch.float32, "d12")
            op(x)
            ctx.check()
        msg = str(info.value)
        assert "all_reduce" in msg and ("disagree" in msg or "faulted" in msg), msg
        ctx.reset()
        _check(op, ctx, (12,), torch.float32, "d12b")
        return msg


def test_ranks_disagree(pool):
    msgs = pool.run(_disagree)
    assert any("ranks disagree on the call" in m for m in msgs), msgs


def _absent(T: float):
    """Rank 1 does not call: the others' waits expire within the timeout, naming rank 1."""
    with to.Context(timeout_s=T) as ctx:
        op = to.AllReduce(ctx, fallback="never")
        _check(op, ctx, (100,), torch.float32, "abs")
        x = torch.ones(100, device=ctx.device)
        ctx.barrier()  # the waits start together
        ctx.check()
        if ctx.rank != 1:
            t0 = time.monotonic()
            with pytest.raises(to.ContextError) as info:
                op(x)
                ctx.check()
            elapsed = time.monotonic() - t0
            msg = str(info.value)
            assert "all_reduce" in msg and "rank 1" in msg, msg
            assert contract.in_time(msg, elapsed, T), (elapsed, msg)
        else:
            time.sleep(T + 1)
        ctx.reset()
        _check(op, ctx, (100,), torch.float32, "abs2")
        return True


def test_peer_absent(pool):
    assert all(pool.run(_absent, 1.5 if pool.backend == "host" else 6.0))


# ------------------------------------------------------------------------------------------------ slot layout
class _Buffers:
    """What slot_elements asks of a Context: its world size and the size of a buffer, grown as symmetric() grows
    it (to exactly what a call asks for, when that is more than it holds)."""

    def __init__(self, world):
        self.world_size, self.nbytes, self.allocations = world, 0, 0

    def symmetric_nbytes(self, name):
        return self.nbytes

    def ask(self, nbytes):
        if nbytes > self.nbytes:
            self.nbytes, self.allocations = nbytes, self.allocations + 1


def test_consecutive_calls_never_share_slots():
    """A peer may store call e + 1's parts (half (e + 1) % 2) while this rank still reads call e's (half e % 2): in
    one allocation, the byte ranges of consecutive calls' slots must be disjoint for every sender, whatever the
    sizes and dtypes (a large call, then a small one, included)."""
    from triton_overlap.ops.all_reduce import slot_elements

    rng = random.Random(0)
    calls = [(1 << 20, torch.float32), (1000, torch.bfloat16), (1, torch.float32), (300_000, torch.float16),
             (5, torch.bfloat16), (1 << 22, torch.bfloat16), (2048, torch.float32)]
    calls += [(rng.randrange(1, 1 << 21), rng.choice([torch.float32, torch.bfloat16])) for _ in range(200)]
    for W in (2, 3, 4, 8):
        buf, previous = _Buffers(W), None
        for e, (n, dtype) in enumerate(calls, start=1):
            element = torch.empty((), dtype=dtype).element_size()
            cap = slot_elements(buf, "slots", n, dtype)
            allocations = buf.allocations
            buf.ask(2 * W * cap * element)
            assert cap >= n and 2 * W * cap * element <= buf.nbytes
            half = e % 2
            regions = [(((half * W + p) * cap) * element, ((half * W + p) * cap + n) * element) for p in range(W)]
            if previous is not None and buf.allocations == allocations:  # the same memory as the call before
                for lo, hi in regions:
                    for plo, phi in previous:
                        assert hi <= plo or phi <= lo, (W, e, n, dtype, (lo, hi), (plo, phi))
            previous = regions
        assert buf.allocations <= 6, buf.allocations  # grown in powers of two only


def test_one_shot_tiling_keeps_every_program_resident(monkeypatch):
    """Every program of the one-shot waits on its blocks from every peer, so a launch never has more programs than
    compute units, and never a program without a block (a program loops over blocks past the units). Programmatic
    dependents: on CUDA from compute capability 9.0, up to PDL_MAX_WARPS warps a launch; never on the host."""
    import sys

    from triton_overlap.ops.all_reduce import PDL_MAX_WARPS, dependent_launch, one_shot_tiling

    for units in (1, 8, 78, 132, 304):
        for n in [1, 7, 1024, 1025, 4096, 4097, 30000, 33792, 33793, 65536, 1 << 20, 3_000_001]:
            block, programs, warps = one_shot_tiling(n, units)
            assert 1 <= programs <= units, (n, units, programs)
            assert block & (block - 1) == 0 and block // 2 >= 32 * warps, (n, block, warps)  # a word a thread
            assert programs <= -(-n // block), (n, block, programs)
    device = torch.device("cuda", 0)
    make = lambda backend: type("Ctx", (), {"backend": backend, "device": device})()  # noqa: E731
    assert dependent_launch(make("host"), 1) == ({}, {})
    module = sys.modules["triton_overlap.ops.all_reduce"]
    for major, warps, want in ((9, PDL_MAX_WARPS, True), (9, PDL_MAX_WARPS + 1, False), (8, 1, False)):
        monkeypatch.setattr(module, "capability", lambda index, major=major: (major, 0))
        pdl, option = dependent_launch(make("cuda"), warps)
        assert (pdl, option) == (({"PDL": True}, {"launch_pdl": True}) if want else ({}, {})), (major, warps)
