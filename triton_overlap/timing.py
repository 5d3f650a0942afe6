"""Timing collective ops across ranks, as the benchmarks, tuning and tutorials report them: CUDA events around
each call, the ranks lined up on the device before it, the median over iterations, the maximum over ranks."""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist


def capture(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after one eager call (compiles and loads every kernel it launches) and
    a barrier across ranks (no rank captures while a peer still runs the eager call). The graph holds ``fn``:
    the tensors it closes over, which the replays read, live as long as the graph (a replay after they were freed
    reads whatever the allocator put there since)."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    g.captured_fn = fn
    return g


def spin(us: float) -> None:
    """Enqueue a one-program kernel that spins ``us`` µs of wall-clock time on the current stream (the GPU's
    ns timer, not its SM clock, which differs between GPUs and over time)."""
    from .kernels.signal import TICKS_PER_SECOND, spin_kernel

    clock = 2 if torch.version.hip is not None else 1
    spin_kernel[(1,)](int(us * TICKS_PER_SECOND[clock] / 10 ** 6), CLOCK=clock, num_warps=1)


#: profile_to's state: the folder (None: no profiles), whether to record Python stacks, and how many
#: time_interleaved calls have profiled so far
_PROFILE = {"dir": None, "stacks": False, "seq": 0}
#: calls of each function under the profiler (after the timed ones, so everything is compiled and warm)
PROFILE_CALLS = 3


def profile_to(directory: str | None, stacks: bool = False) -> None:
    """Make every later time_interleaved call also profile each function it timed: PROFILE_CALLS calls under
    torch.profiler on every rank (the functions are collective), and rank 0 writes
    ``<directory>/<NNN>-<name>.txt``: the host's wall time per call against the GPU's busy time per call, then
    the kernels and ops by their own device time. NNN counts time_interleaved calls, so a benchmark's log, which
    prints its rows in order, says which case each file belongs to. ``stacks``: also record the Python stack of
    every op and add a table grouped by the innermost frames (which line of which layer launched each copy or
    kernel); recording stacks slows the host, so the wall times of such a run say less. None stops profiling."""
    _PROFILE["dir"], _PROFILE["stacks"] = directory, stacks
    if directory:
        os.makedirs(directory, exist_ok=True)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):  # the profiler's own start-up,
            torch.zeros(1, device="cuda").add_(1)  # which costs a rank 100s of ms once, outside any profile
            torch.cuda.synchronize()


def _profile(name: str, fn) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=_PROFILE["stacks"]) as prof:
        t0 = time.perf_counter()
        for _ in range(PROFILE_CALLS):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / PROFILE_CALLS
    if dist.get_rank() == 0:
        _write_profile(name, prof, wall)
    dist.barrier()  # the other ranks wait while rank 0 writes, so the next call's barrier does not time out


def _write_profile(name: str, prof, wall: float) -> None:
    from torch.autograd import DeviceType

    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / PROFILE_CALLS
    path = os.path.join(_PROFILE["dir"], f"{_PROFILE['seq']:03d}-{name}.txt")
    with open(path, "w") as f:
        f.write(f"{name}: {PROFILE_CALLS} calls, host wall {wall * 1e6:.1f} us per call, GPU busy (sum of kernels' "
                f"and copies' own time, overlapping ones counted each) {busy:.1f} us per call\n\n")
        f.write(events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
        if _PROFILE["stacks"]:
            f.write("\n\nby Python stack (innermost frames):\n")
            f.write(prof.key_averages(group_by_stack_n=6).table(sort_by="self_device_time_total", row_limit=40,
                                                                 max_name_column_width=60))


def time_dist(fn, iters: int, warmup: int = 5, budget_s: float | None = None, lead_us: float = 0.0) -> float:
    """Median µs per call of ``fn`` over ``iters`` iterations, max over ranks (GPUs only).

    Before each iteration a one-element all_reduce on the stream lines the ranks
    up on the device; CUDA events time the call alone. ``budget_s`` caps the
    iterations so that they take about that long (at least 3; the ranks agree).

    ``lead_us``: the stream spins this long before the all_reduce and again
    after it, before the start event, so the host has enqueued the call by the
    time the GPU reaches it (as in a model whose host runs ahead) and every
    rank starts it together, as the all_reduce ends plus the spin. Without it
    the GPU waits for the host's enqueue, and each rank's GPU starts when its
    own host is done: the ranks start apart by the difference, which a
    collective op pays as waiting and a single-GPU one does not.
    """
    return time_interleaved({"fn": fn}, iters, warmup, budget_s, lead_us)["fn"]


def _lined_up(fn, tiny: torch.Tensor, lead_us: float) -> float:
    """One call of ``fn`` timed with CUDA events after the ranks are lined up (time_dist); µs."""
    if lead_us > 0:  # the host gets ahead here, so the spin after the all_reduce starts as it ends
        spin(lead_us)
    dist.all_reduce(tiny)
    if lead_us > 0:
        spin(lead_us)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3


def time_interleaved(fns: dict, iters: int, warmup: int = 2, budget_s: float | None = None,
                     lead_us: float = 0.0) -> dict:
    """``{name: median µs per call, max over ranks}`` for every function of ``fns`` (``{name: fn}``), each call
    timed as in time_dist, the functions taking turns within every iteration, in a new order each iteration
    (turn_orders). On large shapes the SM clock falls as the GPU draws more power, so functions timed one after
    another for a few hundred ms each would be compared at different clocks; in turns each sees the same GPU on
    average (docs/decisions.md).
    ``budget_s`` caps the iterations so that all of them take about that long per function (at least 3)."""
    names = list(fns)
    tiny = torch.zeros(1, device="cuda")
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(warmup):
        for n in names:
            fns[n]()
    e.record()
    torch.cuda.synchronize()
    if budget_s is not None:
        per_round = torch.tensor([s.elapsed_time(e) / 1e3 / max(warmup, 1)], device="cuda")
        dist.all_reduce(per_round, op=dist.ReduceOp.MAX)
        iters = max(3, min(iters, int(budget_s * len(names) / max(float(per_round.item()), 1e-6))))
    times = {n: [] for n in names}
    for order in turn_orders(len(names), iters):
        for j in order:
            times[names[j]].append(_lined_up(fns[names[j]], tiny, lead_us))
    med = torch.tensor([statistics.median(times[n]) for n in names], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if _PROFILE["dir"]:
        for n in names:
            _profile(n, fns[n])
        _PROFILE["seq"] += 1
    return dict(zip(names, med.tolist()))


def turn_orders(n: int, iters: int) -> list[list[int]]:
    """The order of ``n`` functions in each of ``iters`` iterations taken in turns: the rows of a Williams design
    (a Latin square balanced for the function before: over its n rows, 2n where n is odd, each function runs
    right after each other one equally often), cycled. A fixed order rotated by one each iteration varies each
    function's place but never the function before it, and a call runs faster after a lighter one (the SM clock
    recovers while the GPU draws less power)."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(f + r) % n for f in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [rows[i % len(rows)] for i in range(iters)]


def host_us(fn, iters: int = 20, busy: bool = False) -> float:
    """Median host µs to enqueue one call of ``fn``, max over ranks (GPUs only). Before each call the device
    is idle and the ranks aligned; ``busy``: a sleep kernel keeps the GPU busy meanwhile, as in a model whose
    host runs ahead of the GPU, so no call pays for waking an idle device."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        if busy:
            torch.cuda._sleep(20_000_000)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def graph_time(fn, iters: int = 20, budget_s: float = 1.0, lead_us: float = 300.0) -> float:
    """Median µs of a CUDA-graph replay of ``fn``, max over ranks (``capture``, then ``time_dist`` with the ranks
    lined up): GPU time without the host's launch cost, which does not depend on a kernel's configuration."""
    return time_dist(capture(fn).replay, iters, budget_s=budget_s, lead_us=lead_us)
