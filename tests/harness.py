"""Runs test bodies on every rank of a real process group.

A pool of W worker processes per (backend, world size) is spawned once and
reused by every test; ``pool.run(fn, *args)`` calls the module-level function
``fn(*args)`` on all ranks and returns their results, or raises with the
traceback of each rank that failed. A call that does not finish in time kills
the pool (the next test gets a fresh one) and fails, so a hang is a failure,
not a stuck CI; the failure names what each hung rank was doing: its threads'
states and kernel wait channels (from /proc, where there is one: "D" is a rank
inside a driver call) and every thread's Python stack (faulthandler, into a file
per rank, read back; absent where the rank could not run its signal handler).
The host backend's workers set TRITON_INTERPRET=1 before anything imports triton.
"""
from __future__ import annotations

import atexit
import faulthandler
import importlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ERROR_GRACE_S = 30.0
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def gpu_count() -> int:
    """GPUs visible, without initialising CUDA in this (parent) process."""
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def _stack_file(pid: int) -> str:
    """Where the worker ``pid`` writes its threads' stacks when asked (SIGUSR1)."""
    return os.path.join(tempfile.gettempdir(), f"triton_overlap-test-stacks-{pid}.txt")


def _threads(pid: int) -> str:
    """Each thread of ``pid``: its state (R running, S sleeping, D uninterruptible: inside the kernel, e.g. a
    driver call) and what it waits in (wchan); empty where /proc has none."""
    lines = []
    try:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
            try:
                with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                    wchan = f.read().strip() or "-"
            except OSError:
                wchan = "?"
            lines.append(f"  thread {tid} ({name}): state {state}, waits in {wchan}")
    except (OSError, ValueError):
        return ""
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, backend: str, port: int, conn) -> None:
    stacks = open(_stack_file(os.getpid()), "w")  # the parent asks a hung rank where it is, and reads this file
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if backend == "host":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        for k, v in GPU_ENV.items():
            os.environ.setdefault(k, v)
    for p in (ROOT, HERE):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "host":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    elif backend == "cuda-shared":  # every rank on GPU 0 (NCCL refuses two ranks on one GPU; the Context needs
        # only object collectives and barriers, which gloo has). Kernels of the ranks' processes take turns on the
        # GPU (time slices), so waits across ranks pass a slice later: a check of the protocol, never a timing.
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        module, name, args = msg
        try:
            fn = getattr(importlib.import_module(module), name)
            # the ranks start together: a first import or build can take one rank seconds longer, and the bodies'
            # Contexts wait for their peers' set-up no longer than their (short) timeouts
            dist.barrier()
            conn.send(("ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - reported to the parent
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()
    stacks.close()
    os.unlink(stacks.name)


class RankPool:
    def __init__(self, backend: str, world: int, start_timeout: float = 300.0):
        self.backend, self.world = backend, world
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        # the environment must be right from the child's first import (spawn re-imports __main__)
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if backend == "host" else "0"
        try:
            for r in range(world):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker, args=(r, world, backend, port, child), daemon=True)
                p.start()
                self.conns.append(parent)
                self.procs.append(p)
        finally:
            if saved is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = saved
        for r, c in enumerate(self.conns):
            if not c.poll(start_timeout):
                self.kill()
                raise RuntimeError(f"rank {r} of the {backend} pool did not start in {start_timeout} s")
            c.recv()

    def run(self, fn, *args, timeout: float = float(os.environ.get("TRITON_OVERLAP_TEST_TIMEOUT", "300"))):
        """Call ``fn(*args)`` on every rank; return the list of results (rank order)."""
        msg = (fn.__module__, fn.__name__, args)
        for c in self.conns:
            c.send(msg)
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world:
            if any(status == "err" for status, _ in replies.values()):
                # a rank failed: the others may be blocked in a collective it never joined
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
            for r, c in enumerate(self.conns):
                if r not in replies and c.poll(0.05):
                    try:
                        replies[r] = c.recv()
                    except EOFError:
                        self.procs[r].join(timeout=5)
                        replies[r] = ("err", f"rank {r} died (exit code {self.procs[r].exitcode})")
            if time.monotonic() > deadline and len(replies) < self.world:
                missing = [r for r in range(self.world) if r not in replies]
                where = self.dump_stacks(missing)
                self.kill()
                errors = [f"--- rank {r} ---\n{v}" for r, (st, v) in sorted(replies.items()) if st == "err"]
                raise TimeoutError(f"{fn.__name__}: ranks {missing} did not finish (pool killed)\n"
                                   + "\n".join(errors + where))
        errors = [f"--- rank {r} ---\n{v}" for r, (st, v) in sorted(replies.items()) if st == "err"]
        if errors:
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [replies[r][1] for r in range(self.world)]

    def dump_stacks(self, ranks) -> list[str]:
        """What each of the hung ``ranks`` was doing: its threads' states (before it is signalled), then every
        thread's Python stack, which it writes into its stack file when signalled."""
        states = {r: _threads(self.procs[r].pid) for r in ranks if self.procs[r].is_alive()}
        for r in states:
            os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        out = []
        for r, threads in states.items():
            try:
                with open(_stack_file(self.procs[r].pid)) as f:
                    stack = f.read().strip()
            except OSError:
                stack = ""
            out.append(f"--- rank {r} (hung) ---\n{threads or '  (no /proc)'}\n"
                       + (stack or "  no Python stack came within 1 s (a thread inside the kernel runs no handler)"))
        return out

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
            if p.pid is not None and os.path.exists(_stack_file(p.pid)):
                os.unlink(_stack_file(p.pid))

    def close(self):
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=30)
        self.kill()


_pools: dict[tuple[str, int], RankPool] = {}


def get_pool(backend: str, world: int) -> RankPool:
    key = (backend, world)
    pool = _pools.get(key)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _pools[key] = RankPool(backend, world)
    return pool


@atexit.register
def _close_all():
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def stress_rounds(pool, n: int) -> int:
    """How many rounds a stress test (calls back to back, barrier rounds) makes: ``n`` on GPUs, an eighth of it on
    the host backend, whose interpreted kernels make each round take milliseconds where a GPU takes microseconds
    (and at W > 2 the ranks outnumber a CI machine's cores)."""
    return n if pool.backend != "host" else max(1, n // 8)


def host_case_share(pool, case: int) -> None:
    """Which of an op test's cases the host backend runs at each W: every case at W = 2, the odd-numbered ones at
    W = 3, none at W = 4 and above, where the topology tests run the ops' cases as two hosts of two
    (test_topology.test_ops_between_hosts). Three or four ranks of interpreted kernels share a CI machine's two
    cores, and the larger worlds' value is the chunk and host layouts, not the cases' shapes. Every GPU world runs
    every case."""
    import pytest

    if pool.backend != "host" or pool.world <= 2 or (pool.world == 3 and case % 2):
        return
    if pool.world == 3:
        pytest.skip("the host backend at W = 3 runs the odd-numbered cases, to keep CI short")
    pytest.skip("the host backend at W >= 4 runs the ops' cases in test_topology only, to keep CI short")
