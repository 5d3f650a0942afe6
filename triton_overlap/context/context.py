"""The Context: one per process group, owning symmetric memory (context.heap), the error word and its faults
(context.errors), the barrier, the producer stream pool and what ops keep between calls, and saying what the
layers above need to know of its backend. Ops take a Context; nothing else holds global state."""
from __future__ import annotations

import time
import uuid
import warnings

import torch
import torch.distributed as dist

from ..kernels import signal as sig
from . import backends, wire as wires
from .barrier import BARRIER_SHARE, Barrier
from .backend import Stream, each
from .control import CLOSE, ControlPlane, PeerTimeout
from .errors import OWN_CALL, Call, ContextError, Faults, op_id
from .heap import SymmetricHeap, SymmetricTensor
from .topology import Topology, host_key
from .wire import Wire

__all__ = ["BARRIER_SHARE", "Call", "Context", "ContextError", "SymmetricTensor", "op_id"]


def _fact(name: str, doc: str) -> property:
    return property(lambda ctx: getattr(ctx._backend, name), doc=doc)


class Context:
    """Owns what the overlapped ops share on one process group.

    Args:
        group: an initialised torch.distributed group (None: WORLD). The Context maps the memory of the peers on
            its own host (``num_hosts`` and ``local_ranks`` say what it found); on a group that spans hosts,
            AllGather-GEMM, GEMM-ReduceScatter and context-parallel attention move data between hosts through the
            process group's point-to-point (``wire``, producers.link), and AllReduce and GEMM + AllReduce take the
            process group's all_reduce.
        backend: "cuda", "hip", "host", or "auto" (host where Triton interprets kernels, else hip on ROCm torch,
            cuda when a CUDA GPU is present, host otherwise).
        timeout_s: how long any wait may last before it gives up with an error: the kernels' waits and the
            host-side exchanges alike (agreeing on shapes, set-up, growing a buffer, reset, close).

    After a fault (a wait that timed out, ranks that disagree on a call) the Context refuses every call with the
    first fault's text until ``reset()``, which every rank calls, restores it. Tests delay producers with
    ``set_producer_jitter``.
    """

    def __init__(self, group=None, backend: str = "auto", timeout_s: float = 30.0):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("triton_overlap.Context needs torch.distributed.init_process_group() first")
        self._group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self._group)
        if self.rank < 0:
            raise ValueError(f"triton_overlap.Context: this process (rank {dist.get_rank()}) is not in the group "
                             f"it was given; make a Context only on the group's own ranks")
        self.world_size = dist.get_world_size(self._group)
        self.timeout_s = float(timeout_s)
        self._producer_jitter_s = 0.0
        self._control = ControlPlane(self._group, self.rank, self.world_size, self.timeout_s)
        self._faults = Faults(self.rank, self.timeout_s, self._control)
        self._resets = 0
        self._closed = False
        keys = self._faults.exchange(host_key(dist.get_rank(), dist.get_world_size()), "Context set-up: finding hosts")
        self.topology = Topology.from_keys(keys)
        self._mapped = set(self.topology.local_ranks(self.rank))  # the ranks whose memory this rank maps
        self.backend_name = backends.pick(backend)
        self._backend = backends.make(self.backend_name, self.rank, self.world_size, self.timeout_s,
                                      lambda: self._faults.exchange(uuid.uuid4().hex[:12], "Context set-up")[0])
        self.device = self._backend.device
        #: consumers start only after the exchanges between hosts (producers.pipeline, step 3): on a group that spans
        #: hosts over NCCL, whose kernels need SMs and whose calls may synchronise the device, so a consumer spinning
        #: for their data could keep them from ever delivering it (docs/hosts.md)
        self.holds_for_link = (self.topology.num_hosts > 1 and self.device.type == "cuda"
                               and dist.get_backend(self._group) == "nccl")
        self.budget = self._backend.timeout_budget(self.timeout_s)
        #: the barrier gives up first: a peer that never arrives is named as absent, not as the data it never sent
        #: (a consumer launched beside the barrier waits for that data as long as the barrier waits for the peer)
        self.barrier_budget = self._backend.timeout_budget(BARRIER_SHARE * self.timeout_s)
        self.clock = self._backend.clock
        self._heap = SymmetricHeap(self._backend, self.rank, self._mapped, self.device, self._faults.exchange)
        self._streams: list[Stream] = []
        self._cache: dict = {}  # what ops keep per Context (plans, op objects, copy plans); freed by close()
        self._on_close: list = []
        self._kept: list = []
        self._on_reset: list = []
        self._wire: Wire | None = None
        self._wire_ended: bool | None = None  # how the current wire's ending went; None: not ended
        # the error word, symmetric: a rank that faults writes its fault into every peer's, so their waits stop too
        self._faults.attach(self.symmetric("__errors", (sig.ERR_WORDS,), torch.int32), self._backend, self._mapped)
        self.err = self._faults.word
        self._shared_memory = None
        self._barrier = Barrier(self.symmetric, self.rank, self.world_size, self.device, self.clock)
        self._barrier_count = self._barrier.count
        # the barrier kernel is built and loaded now, before any op's persistent kernel can spin (loading a module
        # while a kernel that waits on peers occupies the GPU may wait for that kernel); built alone first, so that
        # the ranks' first barrier starts in step rather than a kernel build apart
        self._barrier.build(self.budget)
        if self.topology.num_hosts > 1 and not self._backend.interpreted:  # (and the Link's check of a sender's word)
            sig.build_remote_status(self.device, self.world_size, len(self.topology.remote_ranks(self.rank)))
        self._backend.synchronize()
        gpu = (None if self.device.type != "cuda"  # what tells this rank's GPU from the group's other GPUs
               else (self.topology.host_of(self.rank), str(torch.cuda.get_device_properties(self.device).uuid)))
        devices = self._faults.exchange(gpu, "Context set-up")
        #: how many of the group's ranks run on this rank's GPU (1 on a GPU of its own): several when ranks share one
        #: GPU, where a copy between them is a copy within the GPU, which runs on SMs (num_compute_units)
        self.ranks_on_device = 1 if devices[self.rank] is None else devices.count(devices[self.rank])
        self._open_wire()
        self.barrier()
        self.synchronize()
        self.check()

    # ------------------------------------------------------------------ facts
    backend = property(lambda self: self.backend_name, doc="The backend's name: 'cuda', 'hip' or 'host'.")
    # what the layers above know of the backend, instead of its name (backend.Backend says what each means)
    interpreted = _fact("interpreted", "Whether kernels run in Triton's interpreter on the CPU (the host backend).")
    synchronous_launches = _fact("synchronous_launches", "Whether a kernel launch returns once the kernel has ended.")
    copy_engines = _fact("copy_engines", "Whether producers' copies run on the device's copy engines (GPUs).")
    ticks_per_second = _fact("ticks_per_second", "The rate of ``clock``: ``budget`` is ``timeout_s`` in its ticks.")
    num_hosts = property(lambda self: self.topology.num_hosts, doc="How many hosts the group's ranks are on "
                         "(hostname and boot id; TRITON_OVERLAP_VIRTUAL_HOSTS splits one machine for tests).")
    local_ranks = property(lambda self: self.topology.local_ranks(self.rank),
                           doc="The group ranks on this rank's host, this rank included.")

    def across_hosts(self, what: str, why: str) -> str:
        """Why ``what`` cannot overlap on this Context's group, which spans hosts (ops take their torch.distributed
        path, or refuse with this text where they have none)."""
        return f"{what}: this Context's group spans {self.num_hosts} hosts ({self.topology.describe()}); {why}"

    @property
    def store(self):
        """The key-value store of this Context's host-side exchanges (a prefix of the process group's store)."""
        return self._control.store

    @property
    def resets(self) -> int:
        """How many times ``reset()`` has run."""
        return self._resets

    @property
    def call_number(self) -> torch.Tensor:
        """The device int32 holding how many barriers this rank has passed: the number of the call in progress,
        once its barrier has run (kernels.signal.barrier_kernel)."""
        return self._barrier_count

    @property
    def generation(self) -> int:
        """Bumped whenever a symmetric buffer is allocated or freed, and by ``reset()``: what holds addresses or
        captured calls (ops.replay) drops them."""
        return self._heap.generation

    @property
    def group(self):
        """The process group (RuntimeError once closed: close() lets go of it)."""
        if self._group is None:
            raise RuntimeError("this Context is closed")
        return self._group

    # ----------------------------------------------------------- between hosts
    wire = property(lambda self: self._wire, doc="What exchanges between hosts travel on (producers.link), made "
                    "at set-up and again by ``reset()``; None on one host and on hosts of different sizes.")

    def end_wire(self, wire: Wire | None) -> bool:
        """End ``wire``'s communicator of its own (over NCCL), if it is this Context's current one and not ended
        yet: exchanges still open on it end with an error, so every stream behind them drains (what a fault across
        hosts does: producers.link.Watch). ``reset()`` and ``close()`` end it too. Returns False where it did not
        end within ``timeout_s`` (a CUDA graph holds it: wire.end), at this call or at the one that ended it
        (a Watch's, before ``reset()``); ``reset()`` then warns, ``close()`` raises."""
        if wire is None or wire is not self._wire:
            return True
        if self._wire_ended is None:
            self._wire_ended = wires.end(wire)
        return self._wire_ended

    def _held_wire(self, then: str) -> str:
        """What reset() and close() say where the wire's communicator did not end in time (wire.HELD_WIRE)."""
        return f"triton_overlap: {wires.HELD_WIRE.format(self.rank, self.timeout_s)}; {then}"

    def _open_wire(self) -> None:
        """Make the wire now, while every rank is known to be here (set-up, reset; over NCCL a collective)."""
        self._wire = wires.open_wire(self._group, self.rank, self.topology, self.device, self.store, self.timeout_s)
        self._wire_ended = None

    # ------------------------------------------------------------------ faults
    def gather_object(self, obj, what: str = "exchange") -> list:
        """Every rank's ``obj``, in rank order (a collective, waiting at most ``timeout_s``: a rank that does not
        come is named in a ContextError, and the Context is faulted)."""
        self.ensure_usable()
        return self._faults.exchange(obj, what)

    def ensure_open(self) -> None:
        """Raise RuntimeError if this Context is closed."""
        if self._closed:
            raise RuntimeError("this Context is closed")

    def ensure_usable(self) -> None:
        """Raise if this Context is closed or faulted (ops call it first): a fault the host has not seen yet is
        read from the error word's host copy without synchronising."""
        if self._closed:
            raise RuntimeError("this Context is closed")
        self._faults.poll()
        if self._faults.text is not None:
            raise ContextError(f"{self._faults.text} (this Context refuses calls until every rank calls ctx.reset(), "
                               f"or ctx.close())")

    closed = property(lambda self: self._closed, doc="Whether ``close()`` was called.")
    faults = property(lambda self: self._faults, doc="This Context's faults (errors.Faults): the first fault's "
                      "text, faulting it, the peers' faults, and what ranks post while they wait between hosts.")

    def op_id(self, name: str) -> int:
        """The id kernels record for op ``name`` (errors.op_id), named ``name`` in this Context's messages."""
        return self._faults.name_op(name)

    def op_name(self, op: int) -> str:
        """The name of the op with id ``op`` (``op_id``)."""
        return self._faults.op_name(op)

    def call(self, op: int, descriptor: tuple, dims=()) -> Call:
        """The header a call of op ``op`` publishes at its barrier: ``descriptor`` holds everything every rank's
        call must agree on (shapes, dtypes, chunking, variant), ``dims`` up to four sizes for messages. Ops keep
        the result per shape."""
        return self._faults.call(op, descriptor, dims)

    # ------------------------------------------------------------- what ops keep
    def cached(self, key, make):
        """The object kept under ``key`` for this Context, made by ``make()`` on first use. Ops keep here what
        they build once and reuse (plans, address tables, the functional forms' op objects, the link between
        hosts); ``close()`` frees it all, whoever still holds the ops, and ``reset()`` drops it."""
        self.ensure_open()
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = make()
        return got

    def keep(self, obj) -> None:
        """Hold ``obj`` until ``close()`` (``reset()`` keeps it): what is named elsewhere only weakly (the custom
        ops' handles, ops.custom_ops)."""
        self._kept.append(obj)

    def on_close(self, fn) -> None:
        """Call ``fn()`` when this Context closes (registries that name its ops let go of them)."""
        self._on_close.append(fn)

    def on_reset(self, fn) -> None:
        """Call ``fn()`` once, at the start of the next ``reset()`` (before it waits for this rank's work) or at
        ``close()``: what a reset drops and must let go of first (producers.link's watch)."""
        self._on_reset.append(fn)

    def _run_reset_hooks(self) -> None:
        hooks, self._on_reset = self._on_reset, []
        for fn in hooks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - letting go is best effort: the reset or close goes on
                pass

    # ------------------------------------------------------- symmetric memory
    def symmetric_nbytes(self, name: str) -> int:
        """The size in bytes of every rank's buffer ``name`` (0 before its first allocation). It changes only when
        the buffer grows, and a grown buffer is new memory, allocated once no rank uses the old one."""
        return self._heap.nbytes(name)

    def symmetric(self, name: str, shape, dtype: torch.dtype) -> SymmetricTensor:
        """A symmetric tensor (collective: every rank calls it with the same arguments).

        A new ``name``, or one whose buffer is too small, is agreed on by every rank and allocated (or grown) on
        all of them, so every rank's buffer of one name has the same size; arguments that differ across ranks
        raise ValueError on every rank. Asking again for a name whose buffer is large enough makes no collective:
        a view of any shape inside it is valid on every rank (ops check at each call's barrier that the ranks agree
        on what they read and write).
        """
        self.ensure_open()
        return self._heap.tensor(name, shape, dtype)

    # ---------------------------------------------------------------- streams
    def streams(self, n: int) -> list[Stream]:
        """``n`` high-priority producer streams, created once and reused across calls."""
        self.ensure_open()
        while len(self._streams) < n:
            self._streams.append(self._backend.new_stream())
        return self._streams[:n]

    def current_stream(self) -> Stream:
        return self._backend.current_stream()

    def use_stream(self, stream: Stream):
        return self._backend.use_stream(stream)

    def num_compute_units(self) -> int:
        """The SMs (CUs) a persistent kernel may fill. Where ranks share one GPU, one fewer: their copies run on SMs
        there, and a consumer holding every SM while it waits for such a copy would wait for ever."""
        units = self._backend.num_compute_units()
        return max(1, units - 1) if self.ranks_on_device > 1 else units

    def shared_memory_per_program(self) -> int:
        """The shared memory (LDS) one program may use on this rank's device, in bytes: torch's opt-in limit per
        block (0 on the host backend)."""
        if self._shared_memory is None:
            props = None if self.device.type == "cpu" else torch.cuda.get_device_properties(self.device)
            self._shared_memory = 0 if props is None else int(getattr(props, "shared_memory_per_block_optin", 0)
                                                              or getattr(props, "shared_memory_per_block", 0))
        return self._shared_memory

    @property
    def producer_jitter_s(self) -> float:
        """The producers' testing delay (``set_producer_jitter``; 0: none)."""
        return self._producer_jitter_s

    def set_producer_jitter(self, max_s: float) -> None:
        """Testing aid: delay every producer step by a random time up to ``max_s`` seconds (0: no delay), so that a
        flag seen before its data would show. While it is set, ops enqueue every call anew and never replay a
        captured one (ops.replay): a replayed graph would repeat the delays of its capture."""
        self._producer_jitter_s = float(max_s)

    def jitter(self, stream: Stream) -> None:
        """Enqueue the testing delay on ``stream`` (producers call it before each step)."""
        if self._producer_jitter_s > 0:
            stream.jitter(self._producer_jitter_s)

    # ----------------------------------------------------------- synchronising
    def barrier(self, stream: Stream | None = None, call: Call | None = None) -> None:
        """A barrier across ranks that runs on ``stream`` (default: current), with no host synchronisation.

        It is a one-program Triton kernel (kernels.signal.barrier_kernel says why it stays correct under CUDA-graph
        replay). ``call``: the header of the call it opens (``Context.call``); every rank compares the others' with
        its own before any of the call's data moves, and a difference faults the Context on every rank. Launch it
        before, not during, a persistent kernel that occupies every SM. On a group that spans hosts the barrier is
        among this host's ranks (ops compare calls across hosts through producers.link).
        """
        self.ensure_open()
        stream = stream or self.current_stream()
        self.mirror_errors(stream)  # the previous calls' faults (ensure_usable)
        with self.use_stream(stream):
            self._barrier.launch(self.err, self.barrier_budget, call or OWN_CALL)
        self.after_launch()

    def mirror_errors(self, stream: Stream | None = None) -> None:
        """Enqueue on ``stream`` (default: current) the copy of this rank's error word to its host copy, without
        synchronising: once the host knows that the stream has passed this point (an event), ``ensure_usable()``
        raises for any fault recorded before it. Nothing to enqueue where the host reads the word itself (the host
        backend)."""
        self._backend.mirror_errors(stream or self.current_stream(), self.err, self._faults.seen)

    def check(self) -> None:
        """Raise ContextError if a wait of this Context timed out or ranks disagreed on a call (synchronises with
        the device); the Context then refuses calls until ``reset()``."""
        if self.holds_for_link and self.device.type == "cuda":
            # wait by polling: a blocking copy would hold the driver from the link's watch, which may have to end an
            # exchange before this stream can finish
            done = torch.cuda.Event()
            done.record(self.current_stream().torch_stream)
            while not done.query():
                time.sleep(0.0002)
        if self._faults.read():
            raise ContextError(self._faults.text)
        self.ensure_usable()

    def after_launch(self) -> None:
        """Called by ops after each kernel launch: where launches are synchronous (the host backend) a fault is
        raised right away; GPU backends leave it to ``check()`` and the next call's ``ensure_usable()``."""
        if self._backend.synchronous_launches:
            self.check()

    def synchronize(self) -> None:
        """Wait for all of this rank's device and producer work: for every stream, also where one raises (a
        producer stream's recorded error, raised once all have ended), so that nothing of this rank still runs."""
        each([*self._streams, self._backend], lambda s: s.synchronize())

    # ------------------------------------------------------------------ reset
    def reset(self) -> None:
        """Make a faulted Context usable again (collective: every rank calls it). It waits for the others at most
        ``2 * timeout_s + 1`` seconds: a peer may learn of the fault up to one timeout after this rank (from a wait
        of its own), and its own work, whose waits are bounded by ``timeout_s``, may take up to one more to drain.
        Every rank waits for its own work, then the barrier counts, call headers, flags, counters and
        workspaces of every op are zeroed on every rank, and what ops built is dropped (plans, captured graphs,
        the link between hosts, whose communicator is made anew), so the next calls start from nothing, in step."""
        self.ensure_open()
        self._resets += 1
        tag = f"reset{self._resets}"
        self._run_reset_hooks()
        ended = self.end_wire(self._wire)
        try:
            self.synchronize()  # every kernel of this rank has ended (their waits are bounded)
        except Exception:  # noqa: BLE001 - a producer stream's recorded error: the reset goes on
            pass
        wait_s = 2 * self.timeout_s + 1.0
        self._control.barrier("reset", tag + "/a", wait_s)  # every rank's work has ended: nothing writes into peers
        wires.drop_left(self._wire)
        self._heap.zero(keep="__errors")
        self._faults.zero_word()
        self._barrier_count.zero_()
        self._backend.synchronize()
        self._control.barrier("reset", tag + "/b", wait_s)  # every rank has zeroed
        self._control.resync(self._resets)
        self._cache.clear()
        self._open_wire()
        self._heap.generation += 1  # ops drop their captured graphs
        self._faults.clear(self.device.type)
        if not ended:
            warnings.warn(self._held_wire("reset() made a new one"), stacklevel=2)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Free IPC mappings, buffers and streams and let go of the process group, after waiting (at most
        timeout_s) for every rank to close too; a rank that does not is named in a ContextError, raised once this
        rank's resources are freed. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        error = None
        try:
            try:
                self.synchronize()
            except Exception as e:  # noqa: BLE001 - a stream's recorded error: raised once closed
                error = e
            self._control.barrier("close", CLOSE)  # no peer still uses our memory when we free it
            wires.drop_left(self._wire)
        except Exception as e:  # noqa: BLE001 - freed below all the same, then raised
            error = error or e
        finally:
            self._run_reset_hooks()
            if not self.end_wire(self._wire) and error is None:
                error = ContextError(self._held_wire("this rank's resources are freed"))
            for fn in self._on_close:
                fn()
            self._on_close.clear()
            self._kept.clear()
            self._cache.clear()
            self._heap.release_all()
            self._streams.clear()
            self._backend.close()
            # ops may keep this Context until the interpreter finalises; the process group must not live that long
            # (a gloo group held past destroy_process_group can abort the process at exit: docs/decisions.md)
            self._group = None
        if error is not None:
            if isinstance(error, PeerTimeout):
                raise ContextError(f"triton_overlap: rank {self.rank}: {error}; this rank's resources are freed")
            raise error

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:  # an exception is on its way: close, and let a failure to close not replace it
            try:
                self.close()
            except Exception as e:  # noqa: BLE001 - reported beside the exception in flight
                warnings.warn(f"Context.close() during an exception: {e}", stacklevel=2)
        return False

    def __repr__(self):
        return (f"Context(backend={self.backend_name!r}, rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device})")
