"""What every overlapped op shares: its Context and config, the fallback rule, the ranks' agreement on shapes,
eager replay, and the state it keeps on the Context."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import replace

import torch

from .replay import ReplayCache, call_key
from .tuned import gpu_key, lookup

FALLBACKS = ("auto", "never", "always")
#: calls of an op between the ranks' agreements on whether its small eager calls replay (OverlapOp.tick)
AGREE_EVERY = 16


def eager_host_bound(interpreted: bool, world: int, flop: float, min_flop_per_peer: float,
                     capturing: bool | None = None) -> bool:
    """Whether an eager call of ``flop`` GEMM FLOPs is too short to pay for the host's cost of an overlapped call:
    under ``min_flop_per_peer x (W - 1)`` FLOPs, never where kernels are ``interpreted`` (the host backend), never
    while a CUDA graph is being captured (``capturing=None``: ask torch)."""
    if interpreted or world < 2 or flop >= min_flop_per_peer * (world - 1):
        return False
    if capturing is None:
        capturing = torch.cuda.is_current_stream_capturing()
    return not capturing


def with_overrides(cfg, overrides: dict):
    """``cfg`` with the fields a call overrides (a value of None leaves its field as it is)."""
    kw = {k: v for k, v in overrides.items() if v is not None}
    return replace(cfg, **kw) if kw else cfg  # (dataclasses.replace costs tens of µs: only when asked)


@functools.lru_cache(maxsize=64)
def with_tiles(cfg, tiles):
    """``cfg`` with ``tiles``' block sizes and stages (a GEMM kernel's own tiles, kernels.gemm_operands.GemmTiles),
    made once per pair: dataclasses.replace costs µs on every call."""
    return replace(cfg, block_m=tiles.block_m, block_n=tiles.block_n, block_k=tiles.block_k,
                   num_stages=tiles.num_stages)


@functools.lru_cache(maxsize=None)
def _field_names(config_cls) -> tuple:
    return tuple(sorted(f.name for f in dataclasses.fields(config_cls)))


def agree_across_ranks(op: str, ctx, key: tuple, seen: set) -> None:
    """Check once per distinct ``key`` that every rank passes the same key (a collective). ``seen`` is cleared past
    256 keys (keys that change every call, such as packed documents' boundaries, would grow it without end; agreeing
    again is correct, and every rank clears at the same call)."""
    if key in seen:
        return
    if len(seen) >= 256:
        seen.clear()
    everyone = ctx.gather_object(key, f"{op}: agreeing on shapes")
    if any(k != key for k in everyone):
        raise ValueError(f"{op}: ranks disagree on shapes/dtypes: "
                         + ", ".join(f"rank {r}: {k}" for r, k in enumerate(everyone)))
    seen.add(key)


#: the methods of an op that a user (or a layer) calls: each is one call (ControlPlane.begin_call)
ENTRY_POINTS = ("__call__", "forward", "backward", "dispatch", "combine")


def _counted(method):
    """``method`` of an op, counted as a call (ControlPlane.begin_call, end_call; not while torch.compile traces:
    the custom op's call at run time counts). Where the outermost call raises on the host and the Context is not
    faulted (nothing was launched: a call that stops mid-way faults it), the peers are told (Faults.refuse): those
    waiting for this rank in the call's exchange raise too; if a peer launched the call instead, the Context
    faults, so that this rank's next call never meets the peer's launch of this one."""
    @functools.wraps(method)
    def entry(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return method(self, *args, **kwargs)
        faults = self.ctx.faults
        control = faults.control
        outer = control.begin_call()
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            if outer and not faults.faulted and not self.ctx.closed:
                fault = faults.refuse(e)
                if fault is not None:
                    raise fault from e
            raise
        finally:
            control.end_call(outer)
    return entry


class OverlapOp:
    """The base of every op: a Context, a config (the caller's, else tuned, else the defaults), a fallback rule,
    the ranks' agreement on shapes, and eager replay (ops.replay).

    ``fallback``: "auto" (the op's own rule for when the overlap cannot pay: small shapes, one rank, short eager
    calls), "never" (always overlap) or "always" (always the plain torch.distributed + torch path).
    ``name``: the prefix of the op's symmetric workspaces and the key of the state it keeps on the Context: ops
    with the same name on one Context share both. ``replay``: an eager call that repeats an earlier one's tensors
    and arguments replays a CUDA graph of it (one graph launch instead of the host's enqueueing; ops with REBIND
    also for the same call on tensors elsewhere, the graph's addresses rewritten: ops.replay); False: every call
    is enqueued anew (always on a group that spans hosts).
    """

    KIND = "?"  # the op's name in error messages and tuned tables
    #: whether the op overlaps on a group that spans hosts (producers.link), else it takes its torch.distributed path
    ACROSS_HOSTS = False
    #: eager_host_bound's threshold for this op (docs/decisions.md says where each figure comes from)
    EAGER_MIN_FLOP_PER_PEER = 0.0
    #: whether the op's graphs are rebound to new tensors' addresses (ops.replay: calls keyed by layout too)
    REBIND = False
    #: the config class whose fields a call's keywords may override (None: the op takes no such keywords)
    CONFIG = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        for name in ENTRY_POINTS:
            if name in cls.__dict__:
                setattr(cls, name, _counted(cls.__dict__[name]))

    def __init__(self, ctx, config=None, *, fallback: str = "auto", name: str | None = None, replay: bool = True):
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.ctx = ctx
        self.name = name or self.KIND
        self.user_config = config
        self.fallback = fallback
        self.op = ctx.op_id(self.KIND)
        # across hosts a call's exchanges go through the process group: it is enqueued anew every time
        self.replays = ReplayCache(ctx, enabled=replay and ctx.num_hosts == 1, rebind=self.REBIND)
        ctx.on_close(self.replays.clear)
        self._configs: dict = {}  # (shape, variant) -> the config found for it
        self.last_path = None  # "overlap" or "fallback": what the last call took
        self._checked: set = set()  # the sets of call keywords found good (check_overrides)
        # the eager rule's agreement on replays (tick): calls counted, of them with a key this rank had seen,
        # whether small eager calls overlap (as the ranks last agreed), and the shapes the rule found small
        self._ticks, self._known, self._small_replays, self._small_shapes = 0, 0, True, set()
        self._counted_since = ctx.resets  # the reset the counts start from (ctx.reset() starts them anew)

    def check_overrides(self, overrides: dict) -> tuple:
        """A call's keywords must name fields of the op's config (TypeError) and hold values it takes (ValueError),
        checked on every path before any launch: a call that falls back to torch never reads them. Each set of
        keywords is checked once. Returns them as sorted (name, value) pairs, the form call keys hold."""
        if not overrides:
            return ()
        key = tuple(sorted(overrides.items()))
        try:
            if key in self._checked:
                return key
        except TypeError:  # (a value that cannot be hashed: checked every time)
            pass
        known = _field_names(self.CONFIG)
        unknown = sorted(k for k in overrides if k not in known)
        if unknown:
            raise TypeError(f"{self.KIND}: unexpected keyword argument(s) {', '.join(map(repr, unknown))}; a "
                            f"call's keywords override fields of {self.CONFIG.__name__}: {', '.join(known)}")
        base = self.user_config if isinstance(self.user_config, self.CONFIG) else self.CONFIG.defaults(self.ctx)
        with_overrides(base, overrides)  # the config's own checks
        try:
            if len(self._checked) >= 64:
                self._checked.clear()
            self._checked.add(key)
        except TypeError:
            pass
        return key

    @classmethod
    def shared(cls, ctx):
        """The op the functional form (``ag_gemm(...)``, ``gemm_rs(...)``, ``cp_attention(...)``) uses on ``ctx``:
        one per Context and kind, with the defaults."""
        return ctx.cached(("functional op", cls.KIND), lambda: cls(ctx))

    def buffers(self) -> dict:
        """This rank's workspaces and staging buffers as the last overlapped call used them, by name. A call must
        never read what an earlier one left there, and tests fill them with garbage between calls to show it."""
        return dict(self.state.get("buffers", {}))

    @property
    def state(self) -> dict:
        """What this op keeps between calls (plans, the buffers it used, shapes seen), owned by the Context and
        shared by the ops of the same name, which share workspaces too."""
        return self.ctx.cached(("op state", self.name), dict)

    # --------------------------------------------------------------------------------------------- config
    def default_config(self, shape, variant: str = ""):
        raise NotImplementedError

    def from_table(self, found: dict, base):
        """The config a tuned entry makes of the defaults (an entry may name some fields only). Entries written
        before ``gemm`` replaced ``gluon`` and ``warp_specialized`` still read: a field given as None keeps its
        default, and those two map onto ``gemm``."""
        found = {k: v for k, v in found.items() if v is not None}
        for old in ("gluon", "warp_specialized"):
            if old in found:
                found.setdefault("gemm", "gluon" if found.pop(old) else "triton")
        return replace(base, **found)

    def config_for(self, shape, variant: str = ""):
        """The caller's config if one was given, else the tuned one for this GPU, world size and shape (entries
        under ``KIND + variant``; ops.tuned), else the defaults."""
        if self.user_config is not None:
            return self.user_config
        key = (tuple(shape), variant)
        cfg = self._configs.get(key)
        if cfg is None:
            base = self.default_config(shape, variant)
            found = lookup(self.KIND + variant, gpu_key(self.ctx), self.ctx.world_size, key[0])
            cfg = self._configs[key] = self.from_table(found, base) if found else base
        return cfg

    # ------------------------------------------------------------------------------------ calls and ranks
    def agree(self, key: tuple) -> None:
        """Every rank passes the same ``key`` (shapes, dtypes): checked once per key (a collective)."""
        agree_across_ranks(self.KIND, self.ctx, key, self.state.setdefault("agreed", set()))

    def call_header(self, descriptor: tuple, dims=(), op: int | None = None):
        """The header this op's call publishes at its barrier (Context.call), kept per descriptor; ``op``: the op id
        it names (None: this op's; ops with calls of two kinds, such as a dispatch and a combine, name each)."""
        headers = self.state.setdefault("headers", {})
        got = headers.get(descriptor)
        if got is None:
            got = headers[descriptor] = self.ctx.call(self.op if op is None else op, descriptor, dims)
        return got

    def overlap_possible(self) -> bool:
        """Whether the overlapped path can run on this Context: within one host always; on a group that spans hosts
        for ops with a path between hosts (ACROSS_HOSTS), where every host has the same number of ranks. Otherwise
        the op takes its torch.distributed path (with ``fallback="never"`` it raises ValueError)."""
        ctx = self.ctx
        if ctx.num_hosts == 1 or (self.ACROSS_HOSTS and ctx.topology.uniform):
            return True
        if self.fallback == "never":
            why = ("its hosts have different numbers of ranks, and the path between hosts pairs each rank with the "
                   "rank at its local index on every other host" if self.ACROSS_HOSTS
                   else "this op overlaps within one host only")
            raise ValueError(ctx.across_hosts(self.KIND, why) + '; fallback="never" asks for the overlap')
        return False

    def warm(self, key) -> bool:
        """Whether a call with ``key`` (a shape and layout) has been enqueued before; marks it. A shape's first call
        builds its kernels, so it enqueues the copies before the consumer (producers.pipeline's consumer_first)."""
        seen = self.state.setdefault("warm", set())
        was = key in seen
        seen.add(key)
        return was

    def tick(self) -> None:
        """Count a call, at its start (``replayed`` and ``seen`` count those whose key this rank knew). Every
        AGREE_EVERY calls, where the op replays (fallback="auto", ReplayCache.on), the ranks agree
        (a host exchange) whether the eager rule's small calls overlap: yes while at least half of every rank's
        last calls repeated a key it had seen (they replay, or will once captured), else they take NCCL and the
        graphs of small shapes are dropped, so that no rank replays one; ``ctx.reset()`` starts the counts anew
        (a call that faulted may have been counted on some ranks only). Whether a key repeats depends on the
        rank's addresses; the ranks' paths must not (docs/decisions.md, A model step on 2 GPUs)."""
        if self.fallback != "auto" or not self.replays.on():
            return
        if self._counted_since != self.ctx.resets:  # a reset: the ranks' counts may differ, start them in step
            self._ticks, self._known, self._small_replays, self._small_shapes = 0, 0, True, set()
            self._counted_since = self.ctx.resets
        self._ticks += 1
        if self._ticks % AGREE_EVERY == 0:
            rates = self.ctx.gather_object(self._known / AGREE_EVERY, f"{self.KIND}: agreeing on replays")
            self._known = 0
            self._small_replays = min(rates) >= 0.5
            if not self._small_replays:
                self.replays.drop_shapes(self._small_shapes)

    def seen(self, key) -> None:
        """Count this call's ``key`` for the next agreement (tick) if this rank has seen it before."""
        if self.fallback == "auto" and self.replays.known(key):
            self._known += 1

    def eager_fallback(self, shape_key, flop: float) -> bool:
        """The eager rule (eager_host_bound) for a call of ``flop`` FLOPs. The first call of each shape takes the
        overlap anyway: it allocates the workspaces and builds the kernels, which cannot happen inside a CUDA-graph
        capture, so a later capture of the shape finds them ready. So does the first call of a shape after a
        workspace allocation dropped the replay cache's graphs (ReplayCache.unprepared). Where this op replays
        (ReplayCache.on), a small call overlaps (replayed or eagerly) or takes NCCL as the ranks last agreed
        (tick), never by whether its own key has a graph: that depends on the addresses the rank's allocator
        handed out, and a rank that took NCCL while its peer replayed would leave the two out of step. Every rank
        takes the same branch: allocations are collective, so generations change on all alike, and the rest
        depends on shapes, settings and the agreement only."""
        ran = self.state.setdefault("ran overlap", set())
        if shape_key not in ran or self.replays.unprepared(shape_key):
            ran.add(shape_key)
            return False
        if not eager_host_bound(self.ctx.interpreted, self.ctx.world_size, flop, self.EAGER_MIN_FLOP_PER_PEER):
            return False
        if not self.replays.on():
            return True
        self._small_shapes.add(shape_key)
        return not self._small_replays

    def enqueue(self, key, shape_key, fn, capturable=None) -> None:
        """Enqueue a call: ``fn()``, or a replay of the graph captured of it (ReplayCache.run, ``capturable`` too)."""
        self.replays.run(key, shape_key, fn, capturable)

    def replayed(self, key) -> bool:
        """Replay the graph held for ``key``, before any check (a held key passed the checks when captured)."""
        if self.replays.active and self.replays.hit(key):
            self._known += 1
            return True
        return False


__all__ = ["OverlapOp", "agree_across_ranks", "call_key", "eager_host_bound", "with_overrides"]
