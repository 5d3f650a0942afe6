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
dtypes, devices, and the addresses themselves), and a call with this key passed
them when it was captured. The rest of a call's host work is then
one key and one dictionary lookup. Rules:

* never on the host backend, never while the caller is capturing (the call
  then joins the caller's graph), never with producer jitter (a testing aid
  that must vary per call); on hip it is off until it has run on an AMD GPU;
* a key is captured only after a call of its shape key (shapes, B's strides,
  bias or not, overrides: the op's ``shape_key``) ran the overlap eagerly in the current workspace
  generation (workspaces allocated and agreed on, kernels compiled, plans
  built: capturing must not need a collective or a compile), and where the op
  says what the call enqueues is built (``run``'s ``capturable``: AllGatherGEMM's
  in-place launch is specialised on where the shard lies); a call the eager
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

Rebinding (ops that set ``OverlapOp.REBIND``): a graph is bound to the
addresses it was captured with, and a training step's activations rarely come
back at the same addresses (the allocator's reuse depends on timing), so their
keys never repeat. Such an op's cache also keys calls by layout alone
(``layout_of``: shapes, strides, dtypes, device, each address modulo 16, and
which of the call's tensors overlap which, at what distance) and rewrites a
held graph's addresses for the call at hand (context.graphs.GraphPatch: kernel
parameters, TMA descriptors' base addresses, copies, memsets) before replaying
it. That is correct only if the addresses are all that differ between two
calls of a layout, which a host computation could break (a value derived from
an address, or from the distance between two), so it is checked, tensor by
tensor. A layout's sighting ``after`` is captured as its graph, a reference
that replays for no call until it is checked. A later call where some tensor
sits elsewhere is captured too and compared, node by node and word by word,
with the layout's graph rewritten to that call's addresses. Equal: a tensor
that moved by a distance no other moved by is verified alone, tensors that
moved by one distance are verified as a group (rebound only while they move
together: a value derived from the distance between two of them looked
unchanged). Different, or a graph with a node that cannot be rewritten: the
layout replays by exact keys only, as above. A call replays the layout's graph
rebound when each of its tensors is where that graph was captured or verified
as above; a call at the reference's own addresses before any check goes by its
exact key. In a training step a weight verifies when the next layer's call
(same layout, other weights) is checked, so a layout is typically captured
twice and rebound from then on. While the cache captures a call,
``capturing`` is true, and ``rebinding`` too where the graph is a layout's, so
that an op can choose what it enqueues: AllGatherGEMM copies its shard into the
workspace for a layout's graph rather than describe both with one descriptor
whose stride is the distance between them. An op whose layout graphs launch
other kernels than its eager calls says when they are built (``ready``).

A replay writes what the eager call would have written, into the caller's
tensors: ``out=`` and the returned tensors are the caller's, never the graph's.
What a call makes inside the captured part (the MoE ops' routing) is in the
graph's memory, which every replay rewrites: ``last_outputs`` is what the
enqueue returned while captured, for the op to copy out.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..context.graphs import GraphPatch
from ..producers.pipeline import own_capture

#: a layout key keeps each address modulo this: every decision on alignment made here (16-byte TMA bases, Triton's
#: specialisation on divisibility by 16) sees the same bits in every call of the layout; tensors the allocator
#: hands out are all 0 here, so their layouts do not split by address
ALIGNMENT = 16


def tensor_key(t):
    """What a captured call depends on of tensor ``t``: where it is (address, device) and how it is laid out."""
    if t is None:
        return None
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device()


def layout_of(key):
    """A call's key without its addresses, and the byte ranges [lo, hi) of its tensors (in order, None skipped).
    The layout key holds each tensor's shape, strides, dtype, device and address modulo ALIGNMENT, and which of
    the call's tensors overlap which, at what distance: two calls of one layout differ in where their tensors
    are, not in how they relate."""
    args, *tensors = key
    layout, ranges = [], []
    for tk in tensors:
        if tk is None:
            layout.append(None)
            continue
        ptr, shape, stride, dtype, device = tk
        layout.append((shape, stride, dtype, device, ptr % ALIGNMENT))
        span = 1  # elements from the first to the last, inclusive; none in an empty tensor (its address means
        for size, step in zip(shape, stride):  # nothing: where a graph holds one, the check sees it differ)
            if size == 0:
                span = 0
                break
            span += (size - 1) * step
        ranges.append((ptr, ptr + span * dtype.itemsize))
    overlaps = tuple((i, j, ranges[i][0] - ranges[j][0]) for i in range(len(ranges)) for j in range(i)
                     if ranges[i][0] < ranges[j][1] and ranges[j][0] < ranges[i][1])
    return ("layout", args, tuple(layout), overlaps), ranges


def call_key(args, *tensors):
    """A call's key: its other arguments (a dict of keyword overrides, or anything hashable) and each tensor's
    ``tensor_key``. The checked path and ``hit`` build it alike, so a call finds the graph it was captured as."""
    if isinstance(args, dict):
        args = tuple(sorted(args.items())) if args else ()
    return (args, *(tensor_key(t) for t in tensors))


def _bases(ranges) -> tuple:
    """The tensors' addresses: each range's start."""
    return tuple(lo for lo, _ in ranges)


def _covers(held, ranges) -> bool:
    """Whether ``held``'s graph may be rebound to ``ranges``: each tensor is where it was captured, or has been
    verified alone, or moved with a group verified together (ReplayCache._check) by the same distance as the rest
    of that group. Not before a first check: until then the graph is only the layout's reference."""
    if not (held.verified or held.groups):
        return False
    moved = [lo - at for (lo, _), at in zip(ranges, held.captured)]
    return all(d == 0 or i in held.verified or any(i in g and all(moved[j] == d for j in g) for g in held.groups)
               for i, d in enumerate(moved))


class _Held:
    """A captured call: its graph, what its enqueue returned while captured, and where rebinding its GraphPatch
    (``refusal``: why it has none), the addresses it was captured at (``captured``), the tensors, by index, whose
    rewriting a check has confirmed alone (``verified``) and the groups it confirmed only together (``groups``:
    tensors that moved by one distance in that check)."""

    __slots__ = ("graph", "outputs", "patch", "refusal", "captured", "verified", "groups")

    def __init__(self):
        self.graph, self.outputs, self.patch, self.refusal = None, None, None, None
        self.captured, self.verified, self.groups = (), frozenset(), ()

    def keep(self, outputs) -> None:
        self.outputs = outputs

    def replay(self) -> None:
        self.graph.replay()


class ReplayCache:
    """Per-op cache of captured calls; see the module docstring for when a call replays."""

    SEEN_LIMIT = 4096  # sightings remembered (keys, least recent dropped)

    def __init__(self, ctx, enabled: bool = True, capacity: int = 512, after: int = 2, rebind: bool = False):
        self.ctx = ctx
        self.enabled = bool(enabled) and ctx.backend == "cuda"
        self.rebind = bool(rebind)  # calls are keyed by layout too, and held graphs rebound to their addresses
        self.capturing = False  # true while this cache captures a call
        self.rebinding = False  # true while it captures a layout's graph (its first, or a check)
        #: whether a call of this layout key can be captured for rebinding (the op's: its kernels are built)
        self.ready = lambda layout: True
        self._rebound: OrderedDict = OrderedDict()  # layout key -> its _Held graph (with a GraphPatch)
        self._fixed: set = set()  # layout keys replayed by exact keys only (no patch, a check failed, the driver)
        self._layouts: OrderedDict = OrderedDict()  # layout key -> sightings
        self.last_refusal = None  # why the last layout was left to exact keys
        self._last_layout = (None, None)  # (key, layout_of(key)) of the last key asked about
        self._broken = False  # a capture failed on this rank: it stays eager (``on`` does not change)
        self.capacity = capacity
        self.after = after  # sightings of a key (this call included) before it is captured
        self._graphs: OrderedDict = OrderedDict()
        self._seen: OrderedDict = OrderedDict()
        self._shape_of: dict = {}  # a held graph's key -> its call's shape key
        self._prepared: set = set()  # shape keys that ran eagerly in this workspace generation
        self._generation = getattr(ctx, "generation", 0)
        self._stream = None
        self.stats = {"replays": 0, "captures": 0, "dropped": 0, "rebound": 0}
        self.last_outputs = None  # what the replayed graph's enqueue returned while captured (its memory)

    @property
    def active(self) -> bool:
        """Whether any graph is held (else ``hit`` cannot replay, and an op skips building a key for it)."""
        return bool(self._graphs) or bool(self._rebound)

    def clear(self) -> None:
        self.stats["dropped"] += len(self._graphs) + len(self._rebound)
        self._graphs.clear()
        self._rebound.clear()
        self._fixed.clear()
        self._layouts.clear()
        self.last_outputs = None
        self._shape_of.clear()
        self._seen.clear()
        self._prepared.clear()

    def on(self) -> bool:
        """Whether calls can replay at all (enabled, no producer jitter): the same on every rank, unlike whether a
        given call finds its graph (a capture that failed on one rank stops its captures, not this)."""
        return self.enabled and self.ctx.producer_jitter_s <= 0

    def known(self, key) -> bool:
        """Whether a call with ``key`` replays or will once captured: its graph is held, or its key was seen (or,
        where rebinding, its layout's)."""
        if key is None or not self._usable():
            return False
        if key in self._graphs or key in self._seen:
            return True
        if not self.rebind:
            return False
        layout = self._layout_of(key)[0]
        return layout not in self._fixed and (layout in self._rebound or layout in self._layouts)

    def drop_shapes(self, shapes) -> None:
        """Drop the graphs of calls of these shape keys (``run``'s ``shape_key``)."""
        for key in [k for k, s in self._shape_of.items() if s in shapes]:
            self._shape_of.pop(key)
            if self._graphs.pop(key, None) is not None or self._rebound.pop(key, None) is not None:
                self.stats["dropped"] += 1

    def _usable(self) -> bool:
        if not self.on() or self._broken:
            return False
        if self.ctx.generation != self._generation:
            self.clear()
            self._generation = self.ctx.generation
        return not self._caller_capturing()

    def layout(self, key):
        """The layout key of a call's ``key`` (``layout_of``)."""
        return self._layout_of(key)[0]

    def _layout_of(self, key):
        """``layout_of(key)``, kept for the last key: one call asks for it several times (known, run, _count)."""
        if self._last_layout[0] is not key:
            self._last_layout = (key, layout_of(key))
        return self._last_layout[1]

    @staticmethod
    def _caller_capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()

    def hit(self, key) -> bool:
        """Replay the graph held for ``key`` and return True; False (nothing enqueued) when there is none or
        replay is off for this call. The op has not checked the call: a held key passed its checks before (where
        rebinding, a call of the same layout did: checks look at shapes, strides, dtypes, devices, alignment and
        how the call's tensors overlap, all of which the layout key holds)."""
        if not self.active or not self._usable():
            return False
        g = self._graphs.get(key)
        if g is not None:
            self._replay_held(key, g)
            return True
        if self._rebound:
            layout, ranges = self._layout_of(key)
            held = self._rebound.get(layout)
            if held is not None and _covers(held, ranges):
                return self._replay_rebound(layout, held, ranges)
        return False

    def will_replay(self, key, shape_key, capturable=None) -> bool:
        """Whether a call with ``key`` will run as a replay (of a graph held, or captured by this call; ``run``'s
        ``capturable`` likewise)."""
        return key is not None and self._usable() and (
            self.rebind and self._layout_replays(key, shape_key) or self._decide(key, shape_key, capturable))

    def _decide(self, key, shape_key, capturable=None) -> bool:
        """Whether the call replays by its exact key (``run`` has let the layout's path decide first)."""
        if key in self._graphs:
            return True
        if self._stopped():
            return False
        # (capturable last: the shape ran eagerly in this generation, so what the op looks up for it exists)
        return shape_key in self._prepared and self._seen.get(key, 0) + 1 >= self.after \
            and (capturable is None or capturable())

    def _layout_replays(self, key, shape_key) -> bool:
        """Whether ``_by_layout`` enqueues this call (a replay, or a capture replayed)."""
        layout, ranges = self._layout_of(key)
        held = self._rebound.get(layout)
        if held is not None and _covers(held, ranges):
            return True
        if not self._may_capture(layout, shape_key):
            return False
        if held is None:
            return self._layouts.get(layout, 0) + 1 >= self.after
        return _bases(ranges) != held.captured

    def _may_capture(self, layout, shape_key) -> bool:
        """Whether a call of ``layout`` may be captured for rebinding now."""
        return layout not in self._fixed and shape_key in self._prepared and not self._stopped() \
            and self.ready(layout)

    def _stopped(self) -> bool:
        """Whether captures stopped: many, and fewer replays than captures (keys do not repeat here)."""
        return self.stats["captures"] >= 4 * self.capacity and self.stats["replays"] < self.stats["captures"]

    def unprepared(self, shape_key) -> bool:
        """Whether replay is usable for this call and ``shape_key`` has not run the overlap eagerly in the current
        workspace generation. The eager rule then runs the overlap once more (OverlapOp.eager_fallback): after
        another buffer's allocation dropped every graph, a shape the rule sends to NCCL would otherwise never
        run eagerly again, so never be prepared, never captured, and stay on NCCL for good."""
        return self._usable() and shape_key not in self._prepared

    def saw(self, key, shape_key) -> None:
        """Count a sighting of ``key`` by a call that did not enqueue the op (an eager call the op's eager rule
        sent to NCCL): its next sighting captures, once its shape key has run the overlap eagerly in this
        generation, so the graph's kernels are built."""
        if key is not None and self._usable() and shape_key in self._prepared:
            self._count(key)

    def _count(self, key) -> None:
        self._seen[key] = self._seen.pop(key, 0) + 1
        while len(self._seen) > self.SEEN_LIMIT:
            self._seen.popitem(last=False)
        if self.rebind:
            layout = self._layout_of(key)[0]
            self._layouts[layout] = self._layouts.pop(layout, 0) + 1
            while len(self._layouts) > self.SEEN_LIMIT:
                self._layouts.popitem(last=False)

    def run(self, key, shape_key, enqueue, capturable=None) -> bool:
        """Enqueue the call: ``enqueue()`` itself, or a replay of its graph. Returns whether it replayed.
        ``capturable()``, asked only before a capture by the call's exact key: whether what the call would enqueue
        is built (the op's word: a shape that ran eagerly can still need another specialisation of a kernel for
        these addresses, which must not be compiled inside a capture); False: the call runs eagerly and builds
        it. None: capturable once its shape ran eagerly. (``ready`` answers the same for a layout's captures.)"""
        usable = key is not None and self._usable()
        if usable and self.rebind and key not in self._graphs and self._by_layout(key, shape_key, enqueue):
            return True
        replay = usable and self._decide(key, shape_key, capturable)
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

    def _by_layout(self, key, shape_key, enqueue) -> bool:
        """A rebinding op's call whose exact key has no graph. Its layout's graph replays rebound to the call's
        addresses where every tensor that moved since that graph's capture has been verified; where one has not,
        the call is captured and checked against the layout's graph rewritten to its addresses (equal: the moved
        tensors are verified; different: the layout is fixed). A layout's first capture comes at its sighting
        ``after``; a call at that graph's own addresses before any check goes by its exact key (its own capture,
        which an op may enqueue differently: AllGatherGEMM reads the shard in place there). False: nothing
        enqueued, the exact-key path goes on."""
        layout, ranges = self._layout_of(key)
        held = self._rebound.get(layout)
        if held is not None and _covers(held, ranges):
            return self._replay_rebound(layout, held, ranges)
        if not self._may_capture(layout, shape_key):
            return False
        if held is None:
            if self._layouts.get(layout, 0) + 1 < self.after:
                return False
            g = self._capture(None, enqueue, ranges)
            self._layouts.pop(layout, None)
            if g.patch is None:
                self._fix(layout, g.refusal)
                self._seen.pop(key, None)
                self._keep(key, g)  # (a graph of this call all the same)
                self._shape_of[key] = shape_key
            else:
                self._rebound[layout] = g
                self._shape_of[layout] = shape_key
                self._bound(self._rebound)
        elif _bases(ranges) == held.captured:
            return False  # (not yet checked, at its own addresses: the call's exact key decides)
        else:
            g = self._check(key, layout, held, ranges, shape_key, enqueue)
        g.replay()  # (the capture ran nothing: this replay does the work)
        self.last_outputs = g.outputs
        return True

    def _check(self, key, layout, held, ranges, shape_key, enqueue):
        """Capture this call and compare it with ``held`` rewritten to its addresses. Equal: a tensor that moved
        by a distance no other moved by is verified alone; tensors that moved by one distance are verified as a
        group, to be rebound only while they move together (a value derived from the distance between two of them
        looked unchanged). Different: the layout is fixed, and the capture kept as this call's graph. Returns the
        capture, for the caller to replay."""
        bases = _bases(ranges)
        self._rebound.move_to_end(layout)
        g = self._capture(None, enqueue, ranges)
        if g.patch is not None and g.patch.fingerprint(bases) == held.patch.fingerprint(bases):
            by_distance: dict = {}
            for i, (b, c) in enumerate(zip(bases, held.captured)):
                if b != c:
                    by_distance.setdefault(b - c, []).append(i)
            held.verified = held.verified | {m[0] for m in by_distance.values() if len(m) == 1}
            held.groups = held.groups + tuple(frozenset(m) for m in by_distance.values()
                                              if len(m) > 1 and frozenset(m) not in held.groups)
            return g
        self._unrebind(layout, g.refusal if g.patch is None else
                       "a capture at other addresses differs from the layout's graph rewritten to them")
        self._keep(key, g)
        self._shape_of[key] = shape_key
        return g

    def _replay_rebound(self, layout, held, ranges) -> bool:
        """Rebind the layout's graph to ``ranges`` and replay it; False (nothing enqueued, the layout no longer
        rebound) where the driver refuses the update."""
        try:
            held.patch.apply(_bases(ranges))
        except RuntimeError as e:
            self._unrebind(layout, f"updating the graph failed: {e}")
            return False
        self._rebound.move_to_end(layout)
        self.stats["replays"] += 1
        self.stats["rebound"] += 1
        held.replay()
        self.last_outputs = held.outputs
        return True

    def _unrebind(self, layout, why) -> None:
        """Drop ``layout``'s graph and fix the layout (``_fix``)."""
        self._rebound.pop(layout, None)
        self._shape_of.pop(layout, None)
        self.stats["dropped"] += 1
        self._fix(layout, why)

    def _fix(self, layout, why) -> None:
        """Replay ``layout``'s calls by exact keys only from now on; ``why`` goes to ``last_refusal``."""
        self._fixed.add(layout)
        self.last_refusal = why or "the graph holds nodes that cannot be rebound"

    def _replay_held(self, key, g) -> None:
        self._graphs.move_to_end(key)
        self.stats["replays"] += 1
        g.replay()  # on the caller's current stream
        self.last_outputs = g.outputs

    def _capture(self, key, enqueue, ranges=None):
        """Capture the call (``_graph_of``) with what ``enqueue`` returned, kept under ``key`` (None: not kept),
        least recently used graphs dropped beyond capacity; with ``ranges`` (a rebinding op's call), with its
        GraphPatch for those ranges (None where it has none)."""
        g = _Held()
        self.capturing, self.rebinding = True, ranges is not None
        try:
            g.graph = self._graph_of(lambda: g.keep(enqueue()))
        finally:
            self.capturing = self.rebinding = False
        self.stats["captures"] += 1
        if ranges is not None:
            found = self._patch_of(g.graph, ranges)
            if isinstance(found, str):
                g.refusal = found
            else:
                g.patch, g.captured = found, _bases(ranges)
        if key is not None:
            self._seen.pop(key, None)
            self._keep(key, g)
        return g

    def _keep(self, key, g) -> None:
        self._graphs[key] = g
        self._bound(self._graphs)

    def _bound(self, held: OrderedDict) -> None:
        """Drop ``held``'s least recently used graphs beyond ``capacity``."""
        while len(held) > self.capacity:
            self._shape_of.pop(held.popitem(last=False)[0], None)
            self.stats["dropped"] += 1

    def _patch_of(self, graph, ranges):
        """The graph's GraphPatch for ``ranges`` (context.graphs), or why it has none."""
        return GraphPatch.read(graph, ranges)

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
        g = torch.cuda.CUDAGraph(keep_graph=True) if self.rebind else torch.cuda.CUDAGraph()
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
        if self.rebind:
            g.instantiate()  # (keep_graph: the graph stays readable, and the exec exists before the first replay)
        return g
