"""Host (CPU) backend: the whole protocol on processes of one machine.

* Symmetric memory is a file per allocation in /dev/shm, mapped by every rank
  with ``torch.from_file(shared=True)``. The owner unlinks the file as soon as
  every peer has mapped it, so nothing is left behind by a crash after set-up;
  files still pending are unlinked at interpreter exit, and files of processes
  that died before that (their names carry the owner's pid) are removed when
  the next Context starts.
* A stream is a worker thread that runs copies and flag writes in the order
  they were enqueued.
* Kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by the
  launcher and the test harness before triton is imported) on the calling
  thread; the interpreter is not thread-safe, so kernels never run on workers.
* The interpreter has no clock: a thread writes the milliseconds since the
  Context started into the error word (ERR_NOW_MS), which the kernels' waits
  read (CLOCK 0), so their timeouts are wall-clock time.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import queue
import random
import threading
import time

import torch

from .backend import Backend, Stream, each
from .wire import wire_exchange

_pending_files: set[str] = set()
SHM = "/dev/shm"
PREFIX = "triton_overlap-"


def remove_stale_files() -> list[str]:
    """Remove this backend's /dev/shm files whose owner process no longer exists; return their paths."""
    removed = []
    try:
        names = os.listdir(SHM)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = next((part[1:] for part in name.split("-") if part.startswith("p") and part[1:].isdigit()), None)
        if pid is None:
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM, name))
                removed.append(name)
        except PermissionError:  # another user's live process
            pass
    return removed


@atexit.register
def _unlink_pending() -> None:
    for path in list(_pending_files):
        with contextlib.suppress(OSError):
            os.unlink(path)
    _pending_files.clear()


class _Main(Stream):
    """The caller's own thread: everything runs at once, in program order."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def copy(self, dst, src):
        dst.copy_(src)

    def write_value(self, flag, value):
        flag.fill_(_as_int32(value))

    def wait_value(self, flag, value, what=""):
        _spin_until(flag, value, self.timeout_s, what)

    def call(self, fn):
        fn()

    def wait_stream(self, other):
        if isinstance(other, HostStream):
            other.synchronize()

    def synchronize(self):
        pass

    def jitter(self, max_s):
        time.sleep(random.uniform(0.0, max_s))

    def exchange(self, wire, sends, recvs, tag, what, on_timeout=None):
        wire_exchange(wire, sends, recvs, tag, what, on_timeout)


def _spin_until(flag, value: int, timeout_s: float, what: str) -> None:
    """Poll ``flag`` until ``(int32)(flag - value) >= 0``; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _as_int32(int(flag.item()) - value) < 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"host stream: {what or 'a flag'} did not reach {value} in {timeout_s:.1f} s "
                               f"(it holds {int(flag.item())})")
        time.sleep(1e-4)


def _as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= (1 << 31) else value


class HostStream(Stream):
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="triton_overlap-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # grad mode is per thread: copies on a stream are never part of autograd, and the views they write
        # may have been made under no_grad on the caller's thread
        torch.set_grad_enabled(False)
        while True:
            fn = self._q.get()
            try:
                if fn is None:
                    return
                if self._error is None:  # after an error the rest of the queue is dropped
                    fn()
            except BaseException as e:  # noqa: BLE001 - handed to the host in synchronize()
                self._error = e
            finally:
                self._q.task_done()

    def copy(self, dst, src):
        self._q.put(lambda: dst.copy_(src))

    def write_value(self, flag, value):
        v = _as_int32(value)
        self._q.put(lambda: flag.fill_(v))

    def wait_value(self, flag, value, what=""):
        self._q.put(lambda: _spin_until(flag, value, self.timeout_s, what))

    def call(self, fn):
        self._q.put(fn)

    def wait_stream(self, other):
        if not isinstance(other, HostStream) or other is self:
            return  # the caller's thread has already done its work by the time it enqueues
        done = threading.Event()
        other._q.put(done.set)

        def wait():
            if not done.wait(self.timeout_s):
                raise TimeoutError(f"host stream: waited {self.timeout_s:.1f} s for another stream")

        self._q.put(wait)

    def synchronize(self):
        self._q.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def jitter(self, max_s):
        d = random.uniform(0.0, max_s)
        self._q.put(lambda: time.sleep(d))

    def exchange(self, wire, sends, recvs, tag, what, on_timeout=None):
        self._q.put(lambda: wire_exchange(wire, sends, recvs, tag, what, on_timeout))

    def close(self):
        self._q.put(None)
        self._thread.join(timeout=5)


def _patch_interpreter_index() -> None:
    """Let a runtime scalar index a Python ``range`` in Triton 3.6's interpreter.

    Triton <= 3.6 holds a scalar kernel argument as a 1-element array and
    converts it with ``int(array)``, which NumPy >= 2.4 rejects ("only
    0-dimensional arrays can be converted"), so ``for p in range(0, world)``
    fails there. Newer Triton squeezes the array first; this does the same.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "triton_overlap_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.triton_overlap_patched = True
    interpreter._patch_lang_tensor = patched


class HostBackend(Backend):
    name = "host"
    clock = 0
    interpreted = synchronous_launches = True
    copy_engines = False

    def __init__(self, rank: int, world_size: int, namespace: str, timeout_s: float):
        _patch_interpreter_index()
        super().__init__(rank, world_size)
        self._namespace = namespace  # the same on every rank of the group, new for each Context
        self._count = 0
        self._timeout_s = timeout_s
        self._main = _Main(timeout_s)
        self._streams: list[HostStream] = []
        self._clock: threading.Thread | None = None
        self._stop = threading.Event()
        remove_stale_files()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def alloc(self, nbytes):
        self._count += 1
        path = f"{SHM}/{PREFIX}{self._namespace}-p{os.getpid()}-r{self.rank}-{self._count}"
        _pending_files.add(path)
        t = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        return t, path

    def open(self, handle, nbytes):
        return torch.from_file(handle, shared=True, size=max(nbytes, 1), dtype=torch.uint8)

    def after_exchange(self, handle):
        with contextlib.suppress(OSError):
            os.unlink(handle)
        _pending_files.discard(handle)

    def release(self, local, handle, peers):
        self.after_exchange(handle)  # the mapping itself goes with the last tensor that views it

    def new_stream(self):
        s = HostStream(self._timeout_s)
        self._streams.append(s)
        return s

    def current_stream(self):
        return self._main

    @contextlib.contextmanager
    def use_stream(self, stream):
        if isinstance(stream, HostStream):
            stream.synchronize()  # kernels run on this thread once the stream has caught up
        yield

    def error_mirror(self, err):
        """Start the clock thread that writes the ticks (ms) since now into ``err``, once a tick; the host reads
        ``err`` itself."""
        from ..kernels.signal import ERR_NOW_MS

        word, slot, t0, rate = err.numpy(), int(ERR_NOW_MS), time.monotonic(), self.ticks_per_second

        def tick():
            while not self._stop.wait(1 / rate):
                word[slot] = int((time.monotonic() - t0) * rate)

        word[slot] = 0
        self._clock = threading.Thread(target=tick, name="triton_overlap-clock", daemon=True)
        self._clock.start()
        return word

    def num_compute_units(self):
        return int(os.environ.get("TRITON_OVERLAP_HOST_PROGRAMS", "4"))

    def synchronize(self):
        each(self._streams, lambda s: s.synchronize())

    def close(self):
        for s in self._streams:
            s.close()
        self._streams.clear()
        self._stop.set()
        if self._clock is not None:
            self._clock.join(timeout=5)
