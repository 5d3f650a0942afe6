"""Eager calls replayed from CUDA graphs the op captures of itself.

An eager overlapped call costs the host a kernel launch or two and a copy and a
flag write per chunk and peer, and a GPU with nothing else queued idles
meanwhile (docs/decisions.md has the figures). Every step of a call is on
streams and every flag value a constant (producers.pipeline), so a call
captured once replays correctly for as long as it reads and writes the same
memory.

``ReplayCache`` keeps, per op, graphs keyed by everything a call's enqueued
work depends on: the addresses, shapes, strides and dtypes of its tensors and
the config overrides. The second eager call with a key captures the call on a
side stream and replays it; later ones replay it (one cudaGraphLaunch). What
does not repeat costs nothing beyond the key: a call whose key was not seen
before runs eagerly.

A call whose key already has a graph takes ``hit``, before the op's checks:
every check an op makes depends only on what the key holds (shapes, strides,
dtypes; the device is implied by the address, since CUDA's unified addressing
gives every device and the host distinct address ranges), and a call with this
key passed them when it was captured. The rest of a call's host work is then
one key and one dictionary lookup. Rules:

* never on the host backend, never while the caller is capturing (the call
  then joins the caller's graph), never with producer jitter (a testing aid
  that must vary per call); on hip it is off until it has run on an AMD GPU;
* a key is captured only after a call of its shape and layout (B's strides,
  bias or not, overrides) ran the overlap eagerly in the current workspace
  generation (workspaces allocated and agreed on, kernels compiled, plans
  built: capturing must not need a collective or a compile); a call the eager
  rule sent to NCCL counts as a sighting of its key too (``saw``); whether
  the rule sends small calls to NCCL is agreed by the ranks every few calls
  (OverlapOp.tick: the ranks' keys differ, their paths must not);
* when the Context allocates or frees a symmetric buffer (a workspace grew or
  moved) every graph of every op on it is dropped (they hold the old addresses);
* at most ``capacity`` graphs per op, least recently used dropped first; an op
  whose captures are not reused (``4 x capacity`` captures, fewer replays than
  captures) stops capturing. The layers of a model share one op per kind, so a
  training step holds a key per layer and use (a Llama block: five AllGather-GEMM
  calls forward and two backward); the capacity covers a few hundred of them, since
  a graph that the LRU drops before its key comes round again is never replayed.

A replay writes what the eager call would have written, into the caller's
tensors: ``out=`` and the returned tensors are the caller's, never the graph's.
What a call makes inside the captured part (the MoE ops' routing) is in the
graph's memory, which every replay rewrites: ``last_outputs`` is what the
enqueue returned while captured, for the op to copy out.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..producers.pipeline import own_capture


def tensor_key(t):
    """What a captured call depends on of tensor ``t``: where it is and how it is laid out."""
    if t is None:
        return None
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def call_key(args, *tensors):
    """A call's key: its other arguments (a dict of keyword overrides, or anything hashable) and each tensor's
    ``tensor_key``. The checked path and ``hit`` build it alike, so a call finds the graph it was captured as."""
    if isinstance(args, dict):
        args = tuple(sorted(args.items())) if args else ()
    return (args, *(tensor_key(t) for t in tensors))


class _Held:
    """A captured call: its graph and what its enqueue returned while captured."""

    __slots__ = ("graph", "outputs")

    def __init__(self):
        self.graph, self.outputs = None, None

    def keep(self, outputs) -> None:
        self.outputs = outputs

    def replay(self) -> None:
        self.graph.replay()


class ReplayCache:
    """Per-op cache of captured calls; see the module docstring for when a call replays."""

    SEEN_LIMIT = 4096  # sightings remembered (keys, least recent dropped)

    def __init__(self, ctx, enabled: bool = True, capacity: int = 512, after: int = 2):
        self.ctx = ctx
        self.enabled = bool(enabled) and ctx.backend == "cuda"
        self._broken = False  # a capture failed on this rank: it stays eager (``on`` does not change)
        self.capacity = capacity
        self.after = after  # sightings of a key (this call included) before it is captured
        self._graphs: OrderedDict = OrderedDict()
        self._seen: OrderedDict = OrderedDict()
        self._shape_of: dict = {}  # a held graph's key -> its call's shape key
        self._prepared: set = set()  # shape keys that ran eagerly in this workspace generation
        self._generation = getattr(ctx, "generation", 0)
        self._stream = None
        self.stats = {"replays": 0, "captures": 0, "dropped": 0}
        self.last_outputs = None  # what the replayed graph's enqueue returned while captured (its memory)

    @property
    def active(self) -> bool:
        """Whether any graph is held (else ``hit`` cannot replay, and an op skips building a key for it)."""
        return bool(self._graphs)

    def clear(self) -> None:
        self.stats["dropped"] += len(self._graphs)
        self._graphs.clear()
        self.last_outputs = None
        self._shape_of.clear()
        self._seen.clear()
        self._prepared.clear()

    def on(self) -> bool:
        """Whether calls can replay at all (enabled, no producer jitter): the same on every rank, unlike whether a
        given call finds its graph (a capture that failed on one rank stops its captures, not this)."""
        return self.enabled and self.ctx.producer_jitter_s <= 0

    def known(self, key) -> bool:
        """Whether a call with ``key`` replays or will once captured: its graph is held, or its key was seen."""
        return key is not None and self._usable() and (key in self._graphs or key in self._seen)

    def drop_shapes(self, shapes) -> None:
        """Drop the graphs of calls of these shape keys (``run``'s ``shape_key``)."""
        for key in [k for k, s in self._shape_of.items() if s in shapes]:
            self._shape_of.pop(key)
            if self._graphs.pop(key, None) is not None:
                self.stats["dropped"] += 1

    def _usable(self) -> bool:
        if not self.on() or self._broken:
            return False
        if self.ctx.generation != self._generation:
            self.clear()
            self._generation = self.ctx.generation
        return not self._caller_capturing()

    @staticmethod
    def _caller_capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()

    def hit(self, key) -> bool:
        """Replay the graph held for ``key`` and return True; False (nothing enqueued) when there is none or
        replay is off for this call. The op has not checked the call: a held key passed its checks before."""
        if not self._graphs or not self._usable():
            return False
        g = self._graphs.get(key)
        if g is None:
            return False
        self._replay_held(key, g)
        return True

    def will_replay(self, key, shape_key) -> bool:
        """Whether a call with ``key`` will run as a replay (of a graph held, or captured by this call)."""
        return key is not None and self._usable() and self._decide(key, shape_key)

    def _decide(self, key, shape_key) -> bool:
        if key in self._graphs:
            return True
        if self.stats["captures"] >= 4 * self.capacity and self.stats["replays"] < self.stats["captures"]:
            return False  # keys do not repeat here: captures would be pure cost
        return shape_key in self._prepared and self._seen.get(key, 0) + 1 >= self.after

    def unprepared(self, shape_key) -> bool:
        """Whether replay is usable for this call and ``shape_key`` has not run the overlap eagerly in the current
        workspace generation. The eager rule then runs the overlap once more (OverlapOp.eager_fallback): after
        another buffer's allocation dropped every graph, a shape the rule sends to NCCL would otherwise never
        run eagerly again, so never be prepared, never captured, and stay on NCCL for good."""
        return self._usable() and shape_key not in self._prepared

    def saw(self, key, shape_key) -> None:
        """Count a sighting of ``key`` by a call that did not enqueue the op (an eager call the op's eager rule
        sent to NCCL): its next sighting captures, once its shape and layout (``shape_key``) have run the
        overlap eagerly in this generation, so the graph's kernels are built."""
        if key is not None and self._usable() and shape_key in self._prepared:
            self._count(key)

    def _count(self, key) -> None:
        self._seen[key] = self._seen.pop(key, 0) + 1
        while len(self._seen) > self.SEEN_LIMIT:
            self._seen.popitem(last=False)

    def run(self, key, shape_key, enqueue) -> bool:
        """Enqueue the call: ``enqueue()`` itself, or a replay of its graph. Returns whether it replayed."""
        usable = key is not None and self._usable()
        replay = usable and self._decide(key, shape_key)
        if not replay:
            enqueue()
            if usable:
                if self.ctx.generation != self._generation:  # this call allocated: other graphs hold old addresses
                    self.clear()
                    self._generation = self.ctx.generation
                self._prepared.add(shape_key)
                self._count(key)
            return False
        g = self._graphs.get(key)
        if g is None:
            self._shape_of[key] = shape_key
            held = self._capture(key, enqueue)
            held.replay()  # (the capture ran nothing: this replay does the work)
            self.last_outputs = held.outputs
        else:
            self._replay_held(key, g)
        return True

    def _replay_held(self, key, g) -> None:
        self._graphs.move_to_end(key)
        self.stats["replays"] += 1
        g.replay()  # on the caller's current stream
        self.last_outputs = g.outputs

    def _capture(self, key, enqueue):
        """Capture the call (``_graph_of``) and keep it with what ``enqueue`` returned, least recently used graphs
        dropped beyond capacity."""
        g = _Held()
        g.graph = self._graph_of(lambda: g.keep(enqueue()))
        self._seen.pop(key, None)
        self._graphs[key] = g
        self.stats["captures"] += 1
        while len(self._graphs) > self.capacity:
            self._shape_of.pop(self._graphs.popitem(last=False)[0], None)
            self.stats["dropped"] += 1
        return g

    def _graph_of(self, enqueue) -> torch.cuda.CUDAGraph:
        """Capture ``enqueue()`` on a side stream that follows the caller's (nothing runs: the replay that
        follows does the work). No device synchronisation, no gc: this is an eager call, not a setup step. Each
        graph has its own memory pool: what the call allocates inside it stays reserved while the graph is held.
        A call that stops on the host inside the capture faults the Context as its eager run would
        (producers.pipeline.own_capture): the peers make the call and wait for this rank's part."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.ctx.device)
        caller = torch.cuda.current_stream(self.ctx.device)
        self._stream.wait_stream(caller)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self._stream), own_capture():
            g.capture_begin(capture_error_mode="thread_local")
            try:
                enqueue()
            except BaseException:
                try:
                    g.capture_end()
                except Exception:  # noqa: BLE001 - the enqueue's error is the one to report
                    pass
                self._broken = True  # something in the call cannot be captured: stay eager from now on
                raise
            g.capture_end()
        caller.wait_stream(self._stream)
        return g
