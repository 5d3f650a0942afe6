"""The Context: one per process group, owning symmetric memory, signals, the error word, the barrier, the producer
stream pool and what ops keep between calls. Ops take a Context; nothing else holds global state."""
from __future__ import annotations

import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..kernels import signal as sig
from ..kernels.cached_launch import launch, triton_interprets
from .backend import Backend, Stream
from .control import ControlPlane, PeerFault, PeerTimeout
from .topology import Topology, host_key

# Names of the ops that can report a fault, by the id kernels record.
OPS: dict[int, str] = {}


def op_id(name: str) -> int:
    """The id kernels record for op ``name``: the same in every process (a hash of the name), since ranks compare
    them at every call's barrier."""
    k = zlib.crc32(name.encode()) & 0x7FFFFFFF
    OPS[k] = name
    return k


OP_BARRIER = op_id("barrier")

#: the share of timeout_s a call's barrier waits for its peers (Context.barrier_budget)
BARRIER_SHARE = 0.9


class ContextError(RuntimeError):
    """A fault of a Context: a wait that timed out, ranks that disagree on a call, a peer that did not answer. After
    one, the Context refuses every call until ``reset()`` (or ``close()``), the way a communicator is aborted."""


@dataclass(frozen=True)
class Call:
    """What a call will read and write, as the ranks compare it at the call's barrier: the op, a fingerprint of
    everything that must match across ranks (shapes, dtypes, chunking), and up to four sizes for messages."""
    op: int
    fingerprint: int
    dims: tuple
    text: str


#: the Context's own barriers (set-up, reset): nothing to compare beyond the call number
_OWN = Call(OP_BARRIER, 0, (0, 0, 0, 0), "its barrier")


def _pick_backend(name: str) -> str:
    if name != "auto":
        return name
    if getattr(torch.version, "hip", None) and torch.cuda.is_available():
        return "hip"
    if torch.cuda.is_available():
        return "cuda"
    return "host"


@dataclass
class _Allocation:
    nbytes: int
    local: torch.Tensor
    handle: Any
    peers: list  # uint8 tensor per rank (None at our own rank)
    ptrs: torch.Tensor  # int64 [W] base address of every rank's buffer


@dataclass
class SymmetricTensor:
    """A tensor of the same shape and dtype on every rank, each rank's mapped by all.

    ``local`` is this rank's; ``peer(r)`` views rank r's (``peer(rank) is local``), for the ranks on this rank's
    host; ``ptrs`` is a device int64 array of every rank's base address, for kernels (0 for ranks on other hosts).
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    rank: int
    _alloc: _Allocation = field(repr=False)
    _views: list = field(repr=False, default_factory=list)

    def __post_init__(self):
        numel = 1
        for s in self.shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=self.dtype).element_size()
        self._views = []
        for r, raw in enumerate(self._alloc.peers):
            raw = self._alloc.local if r == self.rank else raw
            self._views.append(None if raw is None else raw[:nbytes].view(self.dtype).view(self.shape))

    @property
    def local(self) -> torch.Tensor:
        return self._views[self.rank]

    def peer(self, rank: int) -> torch.Tensor:
        view = self._views[rank]
        if view is None:
            raise ValueError(f"symmetric buffer {self.name!r}: rank {rank} is on another host, its memory is not "
                             f"mapped here")
        return view

    @property
    def ptrs(self) -> torch.Tensor:
        return self._alloc.ptrs


class Context:
    """Owns what the overlapped ops share on one process group.

    Args:
        group: an initialised torch.distributed group (None: WORLD). The Context maps the memory of the peers on
            its own host (``num_hosts`` and ``local_ranks`` say what it found); on a group that spans hosts,
            AllGather-GEMM, GEMM-ReduceScatter and context-parallel attention move data between hosts through the
            process group's point-to-point (producers.link), and AllReduce and GEMM + AllReduce take the process
            group's all_reduce.
        backend: "cuda", "hip", "host", or "auto" (hip on ROCm torch, cuda when a CUDA GPU is present, host
            otherwise).
        timeout_s: how long any wait may last before it gives up with an error: the kernels' waits and the
            host-side exchanges alike (agreeing on shapes, set-up, growing a buffer, reset, close).
        producer_jitter_s: testing aid; every producer step is delayed by a random time up to this many seconds.

    After a fault (a wait that timed out, ranks that disagree on a call) the Context refuses every call with the
    first fault's text until ``reset()``, which every rank calls, restores it.
    """

    def __init__(self, group=None, backend: str = "auto", timeout_s: float = 30.0, producer_jitter_s: float = 0.0):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("triton_overlap.Context needs torch.distributed.init_process_group() first")
        self._group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self._group)
        if self.rank < 0:
            raise ValueError(f"triton_overlap.Context: this process (rank {dist.get_rank()}) is not in the group "
                             f"it was given; make a Context only on the group's own ranks")
        self.world_size = dist.get_world_size(self._group)
        self.timeout_s = float(timeout_s)
        self.producer_jitter_s = float(producer_jitter_s)
        self._control = ControlPlane(self._group, self.rank, self.world_size, self.timeout_s)
        self._fault: str | None = None
        self._resets = 0
        self._closed = False
        keys = self._exchange(host_key(dist.get_rank(), dist.get_world_size()), "Context set-up: finding hosts")
        self.topology = Topology.from_keys(keys)
        self._mapped = set(self.topology.local_ranks(self.rank))  # the ranks whose memory this rank maps
        name = _pick_backend(backend)
        self.backend_name = name
        self._backend = self._make_backend(name)
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
        self._allocs: dict[str, _Allocation] = {}
        self._views: dict[tuple, SymmetricTensor] = {}  # (name, shape, dtype) -> view agreed on, current buffers
        #: bumped whenever a symmetric buffer is allocated or freed: what holds addresses (ops.replay) drops them
        self.generation = 0
        self._streams: list[Stream] = []
        self._cache: dict = {}  # what ops keep per Context (plans, op objects, copy plans); freed by close()
        self._on_close: list = []
        self._on_reset: list = []
        self._calls: dict[int, str] = {}  # fingerprint -> what it describes, for messages
        # the error word, symmetric: a rank that faults writes its fault into every peer's, so their waits stop too
        self._errors = self.symmetric("__errors", (sig.ERR_WORDS,), torch.int32)
        self.err = self._errors.local
        self._seen = self._backend.error_mirror(self.err)  # read by the host without synchronising
        self._barrier_slots = self.symmetric("__barrier", (self.world_size,), torch.int32)
        self._headers = self.symmetric("__headers", (2, self.world_size, sig.HEADER_WORDS), torch.int32)
        self._barrier_count = torch.zeros(1, dtype=torch.int32, device=self.device)
        # the barrier kernel is built and loaded now, before any op's persistent kernel can spin (loading a module
        # while a kernel that waits on peers occupies the GPU may wait for that kernel); built alone first, so that
        # the ranks' first barrier starts in step rather than a kernel build apart
        self._build_barrier()
        devices = self._exchange(self._device_key(), "Context set-up")
        #: how many of the group's ranks run on this rank's GPU (1 on a GPU of its own): several when ranks share one
        #: GPU, where a copy between them is a copy within the GPU, which runs on SMs (num_compute_units)
        self.ranks_on_device = 1 if devices[self.rank] is None else devices.count(devices[self.rank])
        self._open_link()
        self.barrier()
        self.synchronize()
        self.check()

    def _open_link(self) -> None:
        """On a group that spans hosts, make the exchanges between hosts (producers.link) now, while every rank is
        known to be here: over NCCL they make a communicator of their own, which every rank must join at once."""
        if self.num_hosts > 1 and self.topology.uniform:  # (hosts of different sizes take no path between them)
            from ..producers.link import link

            link(self)

    def _build_barrier(self) -> None:
        """Run the barrier kernel once on scratch memory where every peer is this rank and has arrived."""
        W, dev = self.world_size, self.device
        slots = torch.full((W,), 1 << 30, dtype=torch.int32, device=dev)
        headers = torch.zeros(2 * W * sig.HEADER_WORDS, dtype=torch.int32, device=dev)
        err = torch.zeros(sig.ERR_WORDS, dtype=torch.int32, device=dev)
        block = 1
        while block < W:
            block *= 2
        launch(sig.barrier_kernel, (1,), (
            torch.full((W,), slots.data_ptr(), dtype=torch.int64, device=dev), slots,
            torch.zeros(1, dtype=torch.int32, device=dev), torch.full((W,), headers.data_ptr(), dtype=torch.int64,
                                                                     device=dev),
            headers, err, self.budget, self.rank, W, _OWN.op, _OWN.fingerprint, *_OWN.dims),
            dict(BLOCK_W=block, CLOCK=self.clock))
        self._backend.synchronize()

    # ------------------------------------------------------------------ set-up
    def _make_backend(self, name: str) -> Backend:
        if name == "host":
            if not triton_interprets():
                raise RuntimeError("the host backend runs kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
                                   "before triton is imported (scripts/launch.sh does this on machines without GPUs)")
            from .host import HostBackend

            namespace = self._exchange(uuid.uuid4().hex[:12], "Context set-up")[0]
            return HostBackend(self.rank, self.world_size, namespace, self.timeout_s)
        if name in ("cuda", "hip"):
            built_for = "ROCm" if name == "hip" else "CUDA"
            if not torch.cuda.is_available():
                raise RuntimeError(f"Context(backend={name!r}) needs a GPU and a {built_for} build of torch; this "
                                   f"torch ({torch.__version__}) sees none. Without GPUs use backend='host' or 'auto'.")
            if name == "cuda":
                from .cuda import CudaBackend, runtime_available

                if not runtime_available():
                    raise RuntimeError("Context(backend='cuda') needs cuda-python: pip install 'triton-overlap[cuda]'")
                return CudaBackend(self.rank, self.world_size)
            from .hip import HipBackend, runtime_available

            if not runtime_available():
                raise RuntimeError("Context(backend='hip') needs hip-python: pip install 'triton-overlap[rocm]'")
            return HipBackend(self.rank, self.world_size)
        raise ValueError(f"unknown backend {name!r}: use 'cuda', 'hip', 'host' or 'auto'")

    @property
    def backend(self) -> str:
        return self.backend_name

    @property
    def interpreted(self) -> bool:
        """Whether kernels run in Triton's interpreter on the CPU (the host backend): a launch runs to its end before
        the host goes on, and float accumulations take float32 dots."""
        return self.backend_name == "host"

    @property
    def num_hosts(self) -> int:
        """How many hosts the group's ranks are on (hostname and boot id; TRITON_OVERLAP_VIRTUAL_HOSTS splits one
        machine into several for tests)."""
        return self.topology.num_hosts

    @property
    def local_ranks(self) -> list[int]:
        """The group ranks on this rank's host, this rank included."""
        return self.topology.local_ranks(self.rank)

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

    @staticmethod
    def op_name(op: int) -> str:
        """The name of the op with id ``op`` (op_id)."""
        return OPS.get(op, f"op#{op}")

    def _exchange(self, obj, what: str, tag: str | None = None) -> list:
        """Every rank's ``obj`` through the control plane (bounded); a missing peer, or a peer's fault, faults the
        Context."""
        try:
            return self._control.exchange(obj, what, tag)
        except PeerTimeout as e:
            peer = e.missing[0]
            raise self._fail(f"rank {self.rank}: {e}", (sig.ERR_RELAYED, self.rank, 0, peer, sig.WHAT_ANSWER)) from None
        except PeerFault as e:
            raise self._peer_faulted(e.rank, str(e)) from None

    def gather_object(self, obj, what: str = "exchange") -> list:
        """Every rank's ``obj``, in rank order (a collective, waiting at most ``timeout_s``: a rank that does not
        come is named in a ContextError, and the Context is faulted)."""
        self.ensure_usable()
        return self._exchange(obj, what)

    def ensure_open(self) -> None:
        """Raise RuntimeError if this Context is closed."""
        if self._closed:
            raise RuntimeError("this Context is closed")

    def ensure_usable(self) -> None:
        """Raise if this Context is closed or faulted (ops call it first): a fault the host has not seen yet is
        read from the error word's host copy without synchronising."""
        if self._closed:
            raise RuntimeError("this Context is closed")
        if self._fault is None and self._seen is not None and self._seen[0] != 0:
            self._observe([int(v) for v in self._seen])
        if self._fault is not None:
            raise ContextError(f"{self._fault} (this Context refuses calls until every rank calls ctx.reset(), "
                               f"or ctx.close())")

    def _fail(self, text: str, relay=None) -> ContextError:
        """Fault the Context with ``text`` (the first fault's text stays) and return the error to raise. ``relay``:
        (code, rank, op, peer, what) of an error word to write into every peer's, so that their waits stop at once;
        None for a fault another rank relayed here."""
        if self._fault is None:
            self._fault = f"triton_overlap: {text}"
            if relay is not None:
                self._relay(self._fault, relay)
        return ContextError(self._fault)

    def _relay(self, text: str, fields) -> None:
        """Post this rank's fault in the store (for peers waiting in an exchange, and for the text of messages) and
        write it into every peer's error word (for their kernels' waits), unless a peer has a fault of its own."""
        try:
            self._control.post_fault(text)
            word = [0] * sig.ERR_WORDS
            code, rank, op, peer, what = (int(f) for f in fields)
            word[sig.ERR_CODE], word[sig.ERR_RANK], word[sig.ERR_OP] = int(sig.ERR_RELAYED), rank, op
            word[sig.ERR_PEER], word[sig.ERR_WHAT], word[sig.ERR_ORIGIN_CODE] = peer, what, code
            for p in self._mapped - {self.rank}:  # ranks on other hosts learn it from the store
                self._backend.relay_error(self._errors.peer(p), word)
        except Exception:  # noqa: BLE001 - telling the peers is best effort: their own waits are bounded anyway
            pass

    def record_timeout(self, op: int, peer: int, what: int, elapsed_s: float, call: int) -> ContextError:
        """Fault the Context with a wait outside the kernels (an exchange between hosts) that timed out, as a
        kernel's wait records it: this rank's error word is set, so that its kernels' waits stop at once, and
        peers are told. Returns the error to raise."""
        word = [0] * sig.ERR_WORDS
        word[sig.ERR_CODE], word[sig.ERR_RANK], word[sig.ERR_OP] = int(sig.ERR_TIMEOUT), self.rank, op
        word[sig.ERR_PEER], word[sig.ERR_WHAT], word[sig.ERR_WANTED] = peer, what, 1
        word[sig.ERR_ELAPSED_US], word[sig.ERR_CALL] = int(elapsed_s * 1e6), call
        try:
            self._backend.relay_error(self.err, word)
        except Exception:  # noqa: BLE001 - the host-side fault below stands on its own
            pass
        return self._fail(self._describe(word), (word[sig.ERR_CODE], self.rank, op, peer, what))

    def _observe(self, word) -> None:
        """Fault the Context with the fault in error word ``word`` (this rank's own, or one a peer relayed)."""
        word = list(word)
        if word[sig.ERR_CODE] == sig.ERR_RELAYED and word[sig.ERR_RANK] == self.rank:
            # no rank relays to itself: a peer's relay (fields, then its code) met this rank's own kernel recording
            # a fault (its code by compare-and-swap while the code was still 0, then its fields), so the fields are
            # this rank's own and only the code is the peer's. Only a mismatch records this rank's fingerprint.
            word[sig.ERR_CODE] = int(sig.ERR_MISMATCH if word[sig.ERR_OWN_FINGERPRINT] else sig.ERR_TIMEOUT)
        if word[sig.ERR_CODE] == sig.ERR_RELAYED:
            origin = word[sig.ERR_RANK]
            try:
                text = self._control.fault_text(origin)
            except Exception:  # noqa: BLE001 - the store is gone: the word alone
                text = None
            self._peer_faulted(origin, text or self._describe(word))
        else:
            self._fail(self._describe(word), (word[sig.ERR_CODE], word[sig.ERR_RANK], word[sig.ERR_OP],
                                               word[sig.ERR_PEER], word[sig.ERR_WHAT]))

    # ------------------------------------------------------------- what ops keep
    def cached(self, key, make):
        """The object kept under ``key`` for this Context, made by ``make()`` on first use. Ops keep here what
        they build once and reuse (plans, address tables, the functional forms' op objects); ``close()`` frees
        it all, whoever still holds the ops."""
        self.ensure_open()
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = make()
        return got

    def on_close(self, fn) -> None:
        """Call ``fn()`` when this Context closes (registries that name its ops let go of them)."""
        self._on_close.append(fn)

    def on_reset(self, fn) -> None:
        """Call ``fn()`` once, at the start of the next ``reset()`` (before it waits for this rank's work) or at
        ``close()``: what a reset drops and must let go of first (producers.link's communicator)."""
        self._on_reset.append(fn)

    def fault_of_peers(self) -> bool:
        """Fault this Context if another rank posted a fault of its own (how ranks on other hosts, whose error
        words this rank does not map, learn of one); say whether it is faulted."""
        if self._fault is None:
            got = self._control.fault_of_others()
            if got is not None:
                self._peer_faulted(*got)
        return self._fault is not None

    def _peer_faulted(self, rank: int, text: str) -> ContextError:
        """Fault this Context with rank ``rank``'s posted fault ``text``; return the error to raise."""
        return self._fail(f"rank {self.rank}: rank {rank} faulted: {text.removeprefix('triton_overlap: ')}")

    def _run_reset_hooks(self) -> None:
        hooks, self._on_reset = self._on_reset, []
        for fn in hooks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - letting go is best effort: the reset or close goes on
                pass

    def call(self, op: int, descriptor: tuple, dims=()) -> Call:
        """The header a call of op ``op`` publishes at its barrier: ``descriptor`` holds everything every rank's
        call must agree on (shapes, dtypes, chunking, variant), ``dims`` up to four sizes for messages. Ops keep
        the result per shape."""
        text = " ".join(str(d) for d in descriptor)
        fingerprint = zlib.crc32(f"{op}:{text}".encode()) & 0x7FFFFFFF
        self._calls[fingerprint] = text
        dims = (tuple(int(d) for d in dims) + (0, 0, 0, 0))[:4]
        return Call(op, fingerprint, dims, text)

    @property
    def group(self):
        """The process group (RuntimeError once closed: close() lets go of it)."""
        if self._group is None:
            raise RuntimeError("this Context is closed")
        return self._group

    # ------------------------------------------------------- symmetric memory
    def symmetric_nbytes(self, name: str) -> int:
        """The size in bytes of every rank's buffer ``name`` (0 before its first allocation). It changes only when
        the buffer grows, and a grown buffer is new memory, allocated once no rank uses the old one."""
        alloc = self._allocs.get(name)
        return 0 if alloc is None else alloc.nbytes

    def symmetric(self, name: str, shape, dtype: torch.dtype) -> SymmetricTensor:
        """A symmetric tensor (collective: every rank calls it with the same arguments).

        A new ``name``, or one whose buffer is too small, is agreed on by every rank and allocated (or grown) on
        all of them, so every rank's buffer of one name has the same size; arguments that differ across ranks
        raise ValueError on every rank. Asking again for a name whose buffer is large enough makes no collective:
        a view of any shape inside it is valid on every rank (ops check at each call's barrier that the ranks agree
        on what they read and write).
        """
        self.ensure_open()
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)))
        cached = self._views.get((name, shape, dtype))
        if cached is not None:
            return cached  # ops ask every call
        if any(s < 0 for s in shape):
            raise ValueError(f"symmetric({name!r}): negative size in {shape}")
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        alloc = self._allocs.get(name)
        if alloc is not None and alloc.nbytes >= nbytes:
            view = self._views[(name, shape, dtype)] = SymmetricTensor(name, shape, dtype, self.rank, alloc)
            return view
        mine = (name, shape, str(dtype))
        everyone = self._exchange(mine, f"symmetric buffer {name!r}")
        if any(o != mine for o in everyone):
            raise ValueError(f"symmetric({name!r}): ranks asked for different buffers: "
                             + ", ".join(f"rank {r}: {o[1]} {o[2]}" for r, o in enumerate(everyone)))
        if alloc is None or alloc.nbytes < nbytes:
            if alloc is not None:
                self._free(alloc, name)
                self._views = {k: v for k, v in self._views.items() if k[0] != name}  # views of the old buffer
            alloc = self._allocate(max(nbytes, 16), name)
            self._allocs[name] = alloc
        view = self._views[(name, shape, dtype)] = SymmetricTensor(name, shape, dtype, self.rank, alloc)
        return view

    def _allocate(self, nbytes: int, name: str) -> _Allocation:
        b = self._backend
        local, handle = b.alloc(nbytes)
        try:
            handles = self._exchange(handle, f"allocating {name!r}")
            peers = [b.open(h, nbytes) if r != self.rank and r in self._mapped else None
                     for r, h in enumerate(handles)]  # ranks on other hosts: not mapped (None)
            self._exchange(None, f"allocating {name!r}, mapped")  # every rank has mapped every buffer it can
        except BaseException:
            b.release(local, handle, [])
            raise
        b.after_exchange(handle)
        ptrs = torch.tensor([local.data_ptr() if r == self.rank else 0 if p is None else p.data_ptr()
                             for r, p in enumerate(peers)], dtype=torch.int64, device=self.device)
        self.generation += 1
        return _Allocation(nbytes, local, handle, peers, ptrs)

    def _free(self, alloc: _Allocation, name: str) -> None:
        self._backend.synchronize()
        self._exchange(None, f"growing {name!r}")  # no peer still reads or writes it
        self.generation += 1
        self._backend.release(alloc.local, alloc.handle, alloc.peers)

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

    def _device_key(self):
        """What identifies this rank's GPU among the group's (None where kernels are interpreted)."""
        if self.device.type != "cuda":
            return None
        return self.topology.host_of(self.rank), str(torch.cuda.get_device_properties(self.device).uuid)

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
        call = call or _OWN
        block = 1
        while block < self.world_size:
            block *= 2
        self._backend.mirror_errors(stream, self.err, self._seen)  # the previous calls' faults, for ensure_usable
        with self.use_stream(stream):
            launch(sig.barrier_kernel, (1,), (
                self._barrier_slots.ptrs, self._barrier_slots.local, self._barrier_count, self._headers.ptrs,
                self._headers.local, self.err, self.barrier_budget, self.rank, self.world_size, call.op,
                call.fingerprint, *call.dims), dict(BLOCK_W=block, CLOCK=self.clock))
        self.after_launch()

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
        word = self.err.tolist()
        if word[sig.ERR_CODE] != 0 and self._fault is None:
            self._observe(word)
            raise ContextError(self._fault)
        self.ensure_usable()

    def _describe(self, word) -> str:
        """The text of the fault in error word ``word``."""
        op = OPS.get(word[sig.ERR_OP], f"op#{word[sig.ERR_OP]}")
        rank, peer, call = word[sig.ERR_RANK], word[sig.ERR_PEER], word[sig.ERR_CALL]
        if word[sig.ERR_CODE] == sig.ERR_MISMATCH:
            h = word[sig.ERR_PEER_HEADER:sig.ERR_PEER_HEADER + sig.HEADER_WORDS]
            peer_op = OPS.get(h[1], f"op#{h[1]}")
            mine = self._calls.get(word[sig.ERR_OWN_FINGERPRINT], "")
            theirs = self._calls.get(h[2]) or "sizes " + " x ".join(str(d) for d in h[3:7] if d)
            if h[0] != call:
                return (f"rank {rank}: call {call} ({op} {mine}) meets rank {peer} at its call {h[0]} ({peer_op} "
                        f"{theirs}): the ranks' calls are out of step")
            return (f"rank {rank}: call {call}: ranks disagree on the call: rank {rank} called {op} {mine}, rank "
                    f"{peer} called {peer_op} {theirs}")
        what = word[sig.ERR_WHAT]
        if word[sig.ERR_CODE] == sig.ERR_RELAYED:
            return f"rank {rank} faulted ({op}, waiting for rank {peer})"
        waited = ("the ranks' programs to start" if what == sig.WHAT_STARTED
                  else f"rank {peer}'s call to start (before storing into its receive slot)"
                  if what == sig.WHAT_PEER_STARTED
                  else f"rank {peer} to arrive at the call's barrier" if what == sig.WHAT_ARRIVAL
                  else f"rank {peer}'s dK/dV partials" if what == sig.WHAT_PARTIALS
                  else f"chunk {what} of rank {peer}")
        return (f"rank {rank}: {op} (call {call}) timed out after {word[sig.ERR_ELAPSED_US] / 1e6:.2f} s "
                f"(timeout_s={self.timeout_s:g}) waiting for {waited} (saw {word[sig.ERR_SEEN]}, waited for "
                f"{word[sig.ERR_WANTED]})")

    def after_launch(self) -> None:
        """Called by ops after each kernel launch: on the host backend kernels are synchronous, so a fault is
        raised right away; GPU backends leave it to ``check()`` and the next call's ``ensure_usable()``."""
        if self._backend.name == "host":
            self.check()

    def synchronize(self) -> None:
        """Wait for all of this rank's device and producer work."""
        for s in self._streams:
            s.synchronize()
        self._backend.synchronize()

    def jitter(self, stream: Stream) -> None:
        if self.producer_jitter_s > 0:
            stream.jitter(self.producer_jitter_s)

    # ------------------------------------------------------------------ reset
    def reset(self) -> None:
        """Make a faulted Context usable again (collective: every rank calls it, and it waits at most timeout_s
        for them). Every rank waits for its own work, then the barrier counts, call headers, flags, counters and
        workspaces of every op are zeroed on every rank, and what ops built is dropped (plans, captured graphs),
        so the next calls start from nothing, in step."""
        self.ensure_open()
        self._resets += 1
        tag = f"reset{self._resets}"
        self._run_reset_hooks()
        try:
            self.synchronize()  # every kernel of this rank has ended (their waits are bounded)
        except Exception:  # noqa: BLE001 - a producer stream's recorded error: the reset goes on
            pass
        self._control.barrier("reset", tag + "/a")  # every rank's work has ended: nothing writes into peers
        for name, alloc in self._allocs.items():
            if name != "__errors":
                alloc.local.zero_()
        now = int(sig.ERR_NOW_MS)  # the host backend's clock runs on
        self.err[:now].zero_()
        self.err[now + 1:].zero_()
        self._barrier_count.zero_()
        self._backend.synchronize()
        self._control.barrier("reset", tag + "/b")  # every rank has zeroed
        self._control.resync(self._resets)
        self._cache.clear()
        self._open_link()
        self.generation += 1  # ops drop their captured graphs
        if self._seen is not None and self.device.type != "cpu":  # a copy of the word (the host backend's is it)
            self._seen[:] = 0
        self._fault = None

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
            self.synchronize()
            self._control.barrier("close", "close")  # no peer still uses our memory when we free it
        except Exception as e:  # noqa: BLE001 - freed below all the same, then raised
            error = e
        finally:
            self._run_reset_hooks()
            for fn in self._on_close:
                fn()
            self._on_close.clear()
            self._cache.clear()
            for alloc in self._allocs.values():
                self._backend.release(alloc.local, alloc.handle, alloc.peers)
            self._allocs.clear()
            self._views.clear()
            self.generation += 1
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
                import warnings

                warnings.warn(f"Context.close() during an exception: {e}", stacklevel=2)
        return False

    def __repr__(self):
        return (f"Context(backend={self.backend_name!r}, rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device})")
