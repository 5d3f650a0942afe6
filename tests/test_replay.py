"""Eager calls replayed from the op's own CUDA graphs (ops.replay): same results as enqueued calls, graphs
captured on a key's second sighting, dropped when a workspace moves, and ranks that replay working with
ranks that do not (the protocol lives on the device)."""
import math

import pytest
import torch

import triton_overlap as to
from refs import GRAD_TOL, TOL, attention, attention_problem, poison, rand, rel_err
from triton_overlap.ops.replay import ReplayCache, call_key, layout_of


@pytest.fixture
def gpu_pool(pool):
    if pool.backend == "host":
        pytest.skip("CUDA graphs need a GPU")
    return pool


def test_replay_off_on_host_backend_and_with_jitter():
    class Ctx:
        backend, producer_jitter_s, generation = "host", 0.0, 0
    assert not ReplayCache(Ctx()).enabled
    Ctx.backend = "cuda"
    cache = ReplayCache(Ctx())
    assert cache.enabled
    Ctx.producer_jitter_s = 0.01
    assert not cache.will_replay(("k",), ("s",))
    ran = []
    assert cache.run(("k",), ("s",), lambda: ran.append(1)) is False and ran == [1]


class _FakeGraph:
    def __init__(self, enqueue):
        self.enqueue, self.replays = enqueue, 0

    def replay(self):
        self.replays += 1
        self.enqueue()


def _cpu_cache(**kw):
    """A ReplayCache whose graphs are recorded calls instead of CUDA graphs (its decisions run anywhere)."""
    class Ctx:
        backend, producer_jitter_s, generation = "cuda", 0.0, 0
    cache = ReplayCache(Ctx(), **kw)
    cache._caller_capturing = lambda: False
    cache._graph_of = _FakeGraph
    return cache


def test_replay_decisions():
    """When a call is enqueued, captured or replayed: a key's second sighting after its shape ran eagerly is
    captured, later ones replay; a new generation (a workspace moved) drops everything; the cache holds at most
    ``capacity`` graphs; an op whose keys never repeat stops capturing."""
    cache = _cpu_cache(capacity=2)
    ran = []
    go = lambda key, shape="s": cache.run(key, shape, lambda: ran.append(key))  # noqa: E731
    assert [go("a"), go("a"), go("a")] == [False, True, True] and ran == ["a"] * 3  # a replay enqueues the same work
    assert cache.stats == {"replays": 1, "captures": 1, "dropped": 0, "rebound": 0}
    assert not cache.will_replay("b", "other shape")  # never ran eagerly: no capture even when seen often
    assert go("b", "t") is False and go("b", "t") is True and go("c", "t") is False and go("c", "t") is True
    assert cache.stats["dropped"] == 1 and "a" not in cache._graphs  # capacity 2: the least recent went
    cache.ctx.generation += 1  # a workspace moved: all graphs and sightings go
    assert go("b", "t") is False and not cache._graphs and go("b", "t") is True
    lonely = _cpu_cache(capacity=1)
    for i in range(4):  # each key twice, never again: captures that are never replayed
        lonely.run(i, "s", lambda: None)
        lonely.run(i, "s", lambda: None)
    assert lonely.stats["captures"] == 4 and not lonely.will_replay(99, "s")
    lonely.run(99, "s", lambda: None)
    assert lonely.run(99, "s", lambda: None) is False  # stopped capturing
    assert lonely.stats["captures"] == 4


def test_replay_waits_until_the_call_is_built():
    """A call whose launch the op says is not built (run's ``capturable``: AllGatherGEMM's in-place launch for where
    the shard lies) runs eagerly where it would be captured, its sightings counted; once built, it is captured; a
    held graph replays without asking."""
    cache = _cpu_cache()
    asked = []

    def go(built):
        return cache.run("a", "s", lambda: None, capturable=lambda: asked.append(built) or built)

    assert go(False) is False and asked == []  # the first sighting runs eagerly: nothing to capture yet
    assert go(False) is False and go(False) is False and asked == [False, False]
    assert cache.stats["captures"] == 0
    assert go(True) is True and cache.stats["captures"] == 1
    assert go(False) is True and asked == [False, False, True] and cache.stats["replays"] == 1


def test_ag_gemm_says_capturable_where_its_capture_launch_is_built(monkeypatch):
    """AllGatherGEMM's word to the cache (``_placement_built``) agrees with the launch its capture of a call by the
    call's exact key takes (``_reads_shard_in_place``): the in-place launch is specialised on where the shard lies
    against the workspace (here: one descriptor can span the two, or not), so a placement no eager call ran is
    capturable only once the layout's copying launch is built, and its capture copies."""
    from types import SimpleNamespace

    from triton_overlap.ops.all_gather_gemm import AllGatherGEMM

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (no CUDA here)
    ws = torch.empty(64, 16, dtype=torch.bfloat16)
    buf = torch.empty(32 * 16 + 1, dtype=torch.bfloat16)
    spanned, apart = buf[:512].view(32, 16), buf[1:].view(32, 16)  # the second 2 bytes off: no descriptor spans it
    op = SimpleNamespace(state={}, replays=SimpleNamespace(rebinding=False, capturing=False),
                         _workspace=lambda a: SimpleNamespace(local=ws))

    def capturable(a):
        return AllGatherGEMM._placement_built(op, "layout", a)

    def in_place(a, capturing=False, rebinding=False):
        op.replays.capturing, op.replays.rebinding = capturing, rebinding
        return AllGatherGEMM._reads_shard_in_place(op, "layout", a, ws)

    assert not capturable(spanned) and not capturable(apart)
    assert in_place(spanned)  # the layout's first eager call reads in place: that launch is built
    assert capturable(spanned) and not capturable(apart)  # (apart: its in-place launch was never built)
    assert in_place(spanned, capturing=True)
    assert not in_place(apart)  # the layout's second eager call builds the copying launch
    assert capturable(apart) and not in_place(apart, capturing=True)  # captured, it copies: built
    assert capturable(spanned) and in_place(spanned, capturing=True)
    assert not in_place(spanned, capturing=True, rebinding=True)  # a layout's graph always copies


class _FakePatch:
    """A GraphPatch stand-in: the bases it is bound to, the rebinds applied, and a fingerprint set by the test."""

    def __init__(self, ranges, tag="same", fail=False):
        self.bases, self.applied, self.tag, self.fail = tuple(lo for lo, _ in ranges), [], tag, fail

    def fingerprint(self, bases):
        return self.tag

    def apply(self, bases):
        if self.fail and tuple(bases) != self.bases:
            raise RuntimeError("cuGraphExecKernelNodeSetParams failed")
        if tuple(bases) != self.bases:
            self.applied.append(tuple(bases))
        self.bases = tuple(bases)


def _rebind_cache(tags=None, **kw):
    """A rebinding ReplayCache on fake graphs; ``tags``: the fingerprints its captures get, in order (default all
    equal), or None for a graph without a patch."""
    cache = _cpu_cache(rebind=True, **kw)
    made = []
    tags = list(tags) if tags is not None else None

    def patch_of(graph, ranges):
        tag = tags.pop(0) if tags else "same"
        made.append("a node that cannot be rewritten" if tag is None else _FakePatch(ranges, tag))
        return made[-1]
    cache._patch_of = patch_of
    return cache, made


def _call(*tensors, args=()):
    return call_key(args, *tensors)


def test_layout_key():
    """``layout_of``: what a call's key holds without the addresses (shapes, strides, dtypes, devices, address
    modulo 16, how the call's tensors overlap) and its tensors' byte ranges."""
    a, b = torch.empty(64, 32), torch.empty(64, 32)
    la, ra = layout_of(_call(a, None))
    lb, rb = layout_of(_call(b, None))
    assert la == lb and ra != rb and ra == [(a.data_ptr(), a.data_ptr() + a.numel() * 4)]
    assert layout_of(_call(a.t(), None))[0] != la  # strides
    assert layout_of(_call(a.half(), None))[0] != la  # dtype
    assert layout_of(_call(a[:, 1:], None))[0] != layout_of(_call(a[:, :-1], None))[0]  # 4 bytes off alignment
    assert layout_of(_call(a, args=(("block", 64),)))[0] != layout_of(_call(a))[0]  # arguments
    # overlaps: the same tensor twice, a view inside another, two tensors apart
    assert layout_of(_call(a, a))[0] == layout_of(_call(b, b))[0] != layout_of(_call(a, b))[0]
    assert layout_of(_call(a, a[8:]))[0] != layout_of(_call(a, a[16:]))[0]
    empty = a[0:0]
    assert layout_of(_call(empty, b))[1][0] == (empty.data_ptr(), empty.data_ptr())  # an empty tensor: no bytes


def test_rebind_decisions():
    """A rebinding op whose calls never repeat their addresses: the first call runs eagerly, the second is
    captured (the layout's graph), the third is captured and compared with that graph rewritten to its
    addresses; equal, every later call of the layout replays the layout's graph rebound (``hit`` too, the ops'
    unchecked path). A new generation drops it all."""
    cache, made = _rebind_cache()
    ran, keep = [], []

    def go(*shape):
        t = torch.empty(*shape)
        keep.append(t)
        return cache.run(_call(t), ("s", shape), lambda: ran.append(shape))

    assert [go(8, 4), go(8, 4), go(8, 4)] == [False, True, True]
    assert cache.stats == {"replays": 0, "captures": 2, "dropped": 0, "rebound": 0}  # (captures replay uncounted)
    assert len(cache._rebound) == 1 and cache.last_refusal is None
    assert [go(8, 4) for _ in range(3)] == [True] * 3
    assert cache.stats["rebound"] == 3 and cache.stats["captures"] == 2
    held = next(iter(cache._rebound.values()))
    assert held.patch.applied == [(t.data_ptr(),) for t in keep[3:]]
    t = torch.empty(8, 4)
    keep.append(t)
    assert cache.hit(_call(t)) and held.patch.bases == (t.data_ptr(),) and cache.stats["rebound"] == 4
    assert cache.known(_call(torch.empty(8, 4))) and not cache.known(_call(torch.empty(4, 8)))
    assert cache.hit(_call(keep[1])) and cache.stats["rebound"] == 5  # the layout graph's own addresses
    assert go(4, 8) is False  # another layout: its own first call
    cache.ctx.generation += 1
    assert go(8, 4) is False and not cache._rebound and not cache.active


def test_rebind_verifies_each_tensor():
    """A tensor that sat at the same address in the two captures compared is not verified (a value derived from
    it would have looked unchanged): a call that moves it is captured and checked again before the layout's graph
    replays rebound for it; tensors that moved by the same distance are verified as a group only. Until its first
    check the layout's graph is a reference only: a call at its addresses goes by its exact key."""
    cache, _ = _rebind_cache()
    w0, w1, keep = torch.empty(8, 4), torch.empty(8, 4), []

    def go(w, *, x=None):
        x = torch.empty(4, 4) if x is None else x
        keep.append(x)
        return cache.run(_call(x, w), "s", lambda: None)

    go(w0)  # eager
    x1 = torch.empty(4, 4)
    go(w0, x=x1)  # the layout's graph
    assert cache.stats["captures"] == 1 and not cache.known(_call(torch.empty(2, 2), w0))
    assert go(w0, x=x1) is False  # its own addresses before any check: its exact key, seen once (eager)
    assert go(w0) is True and cache.stats["captures"] == 2  # x moved: checked, x verified, w not
    held = next(iter(cache._rebound.values()))
    assert held.verified == {0}
    assert go(w0) is True and cache.stats == {"replays": 1, "captures": 2, "dropped": 0, "rebound": 1}
    assert go(w1) is True and cache.stats["captures"] == 3 and cache.stats["rebound"] == 1  # w moved: checked
    assert held.verified == {0, 1}
    assert go(w1) is True and go(w0) is True and cache.stats["rebound"] == 3 and cache.stats["captures"] == 3
    # two tensors that moved by the same distance are verified as a group: rebound while they move together,
    # checked again when they move apart
    cache, _ = _rebind_cache()
    base = torch.empty(256)
    at = lambda i, j: _call(base[i:i + 8], base[j:j + 8])  # noqa: E731
    cache.run(at(0, 16), "s", lambda: None)
    cache.run(at(0, 16), "s", lambda: None)  # the layout's graph
    cache.run(at(32, 48), "s", lambda: None)  # both moved by 32 elements: checked
    held = next(iter(cache._rebound.values()))
    assert held.verified == frozenset() and held.groups == (frozenset({0, 1}),) and cache.stats["captures"] == 2
    assert cache.run(at(64, 80), "s", lambda: None) and cache.stats["rebound"] == 1  # together again
    assert cache.run(at(96, 144), "s", lambda: None) and cache.stats["captures"] == 3  # apart: checked
    assert held.verified == {0, 1} and cache.stats["rebound"] == 1
    assert cache.run(at(128, 200), "s", lambda: None) and cache.stats["rebound"] == 2


def test_rebind_refused():
    """A layout whose second capture differs from its candidate rebound to it (an address-derived value), or
    whose graph has no patch, is left to exact keys: never rebound, its repeating keys still captured and
    replayed; ``last_refusal`` says why. A driver error while rebinding drops the layout and the call runs
    eagerly."""
    for tags in (["first", "second"], [None]):
        cache, _ = _rebind_cache(tags)
        keep, ran = [], []
        for _ in range(4):
            t = torch.empty(8, 4)
            keep.append(t)
            cache.run(_call(t), "s", lambda: ran.append(1))
        assert cache.stats["rebound"] == 0 and not cache._rebound and len(cache._fixed) == 1
        assert cache.last_refusal is not None
        captures = cache.stats["captures"]
        assert cache.run(_call(keep[-1]), "s", lambda: None) is True  # its key's second sighting: captured
        assert cache.stats["captures"] == captures + 1 and cache.hit(_call(keep[-1]))
        assert cache.stats["rebound"] == 0
    cache, made = _rebind_cache()
    keep = [torch.empty(8, 4) for _ in range(4)]
    for t in keep[:3]:
        cache.run(_call(t), "s", lambda: None)
    assert len(cache._rebound) == 1
    next(iter(cache._rebound.values())).patch.fail = True
    ran = []
    assert cache.run(_call(keep[3]), "s", lambda: ran.append(1)) is False and ran == [1]
    assert not cache._rebound and "updating the graph failed" in cache.last_refusal


def test_replay_keeps_what_the_call_returned():
    """``last_outputs``: what the replayed call's enqueue returned while captured (an op copies it out of the
    graph's memory), for the graph just captured and for one held."""
    cache = _cpu_cache()
    assert cache.run("k", "s", lambda: "made") is False and cache.last_outputs is None
    assert cache.run("k", "s", lambda: "made") is True and cache.last_outputs == "made"
    cache.last_outputs = None
    assert cache.hit("k") and cache.last_outputs == "made"


def test_replay_hit():
    """``hit`` (the unchecked path of a held key) replays only a held key, and not after a workspace moved or
    while the caller captures; it enqueues nothing when it does not replay."""
    cache = _cpu_cache()
    ran = []
    assert not cache.active and cache.hit("a") is False and ran == []
    cache.run("a", "s", lambda: ran.append("a"))
    assert cache.hit("a") is False and ran == ["a"]  # seen once: not held yet
    cache.run("a", "s", lambda: ran.append("a"))  # captured (and replayed)
    assert cache.active and cache.hit("a") is True and ran == ["a"] * 3
    assert cache.hit("b") is False and ran == ["a"] * 3
    assert cache.stats["replays"] == 1
    cache._caller_capturing = lambda: True  # inside the caller's capture the call must join the caller's graph
    assert cache.hit("a") is False
    cache._caller_capturing = lambda: False
    cache.ctx.generation += 1
    assert cache.hit("a") is False and not cache.active and ran == ["a"] * 3


def test_replay_counts_calls_sent_to_nccl():
    """A key whose calls the eager rule sends to NCCL (``saw``) is captured on its next sighting, but only once
    its shape and layout ran the overlap eagerly (kernels built); an unprepared layout is never captured."""
    cache = _cpu_cache()
    ran = []
    cache.saw("k1", "s")  # layout "s" never ran eagerly: not counted
    assert cache.will_replay("k1", "s") is False
    cache.run("k0", "s", lambda: ran.append("k0"))  # the layout's first call ran the overlap
    cache.saw("k1", "s")  # a new key of that layout, sent to NCCL
    assert cache.will_replay("k1", "s") is True  # its second sighting captures
    cache.run("k1", "s", lambda: ran.append("k1"))
    assert cache.stats["captures"] == 1 and cache.hit("k1") is True
    assert cache.will_replay("k2", "t") is False
    cache.saw("k2", "t")
    assert cache.will_replay("k2", "t") is False  # layout "t" never ran


def test_replay_unprepared_after_a_new_generation():
    """``unprepared`` (which makes the eager rule run the overlap once more): true for a layout that has not run
    eagerly in the current generation, false once it has, true again after a workspace moved; never true with
    replay off (the eager rule then stays as it was)."""
    cache = _cpu_cache()
    assert cache.unprepared("s")
    cache.run("k", "s", lambda: None)
    assert not cache.unprepared("s") and cache.unprepared("t")
    cache.ctx.generation += 1
    assert cache.unprepared("s")
    cache.run("k", "s", lambda: None)
    assert not cache.unprepared("s")
    assert not _cpu_cache(enabled=False).unprepared("s")


def test_replay_agreement_sets_the_small_calls_path_on_every_rank(monkeypatch):
    """The eager rule's small calls (OverlapOp.eager_fallback, tick): they overlap until the ranks agree, every
    AGREE_EVERY calls, that their keys do not repeat on some rank (under half of its calls had a key it had seen);
    they then take NCCL on every rank, and the graphs of small shapes are dropped so that no rank replays one;
    once every rank's keys repeat again they overlap again. A key this rank knows never decides its call's path.
    ctx.reset() starts the count anew."""
    from triton_overlap.ops.base import AGREE_EVERY, OverlapOp

    class Ctx:
        backend, producer_jitter_s, generation, num_hosts, interpreted, world_size = "cuda", 0.0, 0, 1, False, 2
        peer_rate, resets = 1.0, 0

        def __init__(self):
            self.store, self.exchanges = {}, 0

        def op_id(self, kind):
            return 0

        def on_close(self, fn):
            pass

        def cached(self, key, make):
            return self.store.setdefault(key, make())

        def gather_object(self, obj, what):
            self.exchanges += 1
            return [obj, self.peer_rate]

    class Small(OverlapOp):
        KIND, EAGER_MIN_FLOP_PER_PEER = "small", 1e12

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU build has no CUDA)
    ctx = Ctx()
    op = Small(ctx)
    op.replays._caller_capturing = lambda: False
    op.replays._graph_of = _FakeGraph
    assert op.eager_fallback("s", 1e9) is False  # a shape's first call overlaps (it prepares the shape)
    op.replays.run("k", "s", lambda: None)
    op.replays.run("k", "s", lambda: None)  # captured
    assert op.replays.active
    assert op.eager_fallback("s", 1e9) is False  # small, and the ranks have not agreed yet: overlap
    assert op.eager_fallback("s", 1e13) is False  # large: always overlap
    for _ in range(AGREE_EVERY):  # every call with a key this rank knows
        op.tick()
        op.seen("k")
    assert ctx.exchanges == 1 and op.eager_fallback("s", 1e9) is False
    ctx.peer_rate = 0.25  # the peer's keys stopped repeating
    for _ in range(AGREE_EVERY):
        op.tick()
        op.seen("k")
    assert ctx.exchanges == 2 and op.eager_fallback("s", 1e9) is True  # NCCL, on this rank too
    assert not op.replays.active and op.replayed("k") is False  # the small shape's graph dropped
    assert op.eager_fallback("s", 1e13) is False
    ctx.peer_rate = 1.0
    for _ in range(AGREE_EVERY):
        op.tick()
    assert op.eager_fallback("s", 1e9) is True  # this rank's keys were not known in that window: still NCCL
    op.replays.saw("k", "s")  # a call sent to NCCL counts its key's sighting: the key is known from then on
    for _ in range(AGREE_EVERY):
        op.tick()
        op.seen("k")
    assert ctx.exchanges == 4 and op.eager_fallback("s", 1e9) is False
    never = Small(ctx, fallback="never")
    for _ in range(AGREE_EVERY):
        never.tick()
    assert ctx.exchanges == 4  # only fallback="auto" agrees
    ctx.peer_rate = 0.25
    for _ in range(AGREE_EVERY - 1):
        op.tick()
    ctx.resets += 1  # ctx.reset(): the count starts anew
    for _ in range(AGREE_EVERY - 1):
        op.tick()
    assert ctx.exchanges == 4
    op.tick()
    assert ctx.exchanges == 5 and op.eager_fallback("s", 1e9) is True


def _ag_rs(m_local, k, n, replay_ranks):
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        on = r in replay_ranks
        ag = to.AllGatherGEMM(ctx, fallback="never", replay=on)
        rs = to.GEMMReduceScatter(ctx, fallback="never", replay=on)
        a = torch.empty((m_local, k), dtype=torch.bfloat16, device=dev)
        big = torch.empty((m_local * W, k), dtype=torch.bfloat16, device=dev)
        w = rand((k, n), torch.bfloat16, dev, "w", r)  # AG: each rank its own columns
        w_rs = rand((k, n), torch.bfloat16, dev, "w_rs")  # RS: one weight, the reference sums the inputs
        bias = rand((n,), torch.bfloat16, dev, "b", r)
        out = torch.empty((m_local * W, n), dtype=torch.bfloat16, device=dev)
        gathered = None
        rs_out = torch.empty((m_local, n), dtype=torch.bfloat16, device=dev)
        iters = 8
        for i in range(iters):
            shards = [rand((m_local, k), torch.bfloat16, dev, "a", i, s) for s in range(W)]
            a.copy_(shards[r])  # new values, same address: the key repeats
            poison(out)
            got, gathered = ag(a, w, bias, out=out, return_gathered=True)
            full = torch.cat(shards)
            err = rel_err(got, full.float() @ w.float() + bias.float())
            assert err < TOL[torch.bfloat16], f"rank {r} ag call {i}: rel err {err:.2e}"
            assert torch.equal(gathered.cpu(), full.cpu()), f"rank {r} ag call {i}: gathered rows differ"
            parts = [rand((m_local * W, k), torch.bfloat16, dev, "rs", i, s) for s in range(W)]
            big.copy_(parts[r])
            poison(rs_out)
            rs(big, w_rs, out=rs_out)
            ref = (sum(p.float() for p in parts) @ w_rs.float())[r * m_local:(r + 1) * m_local]
            err = rel_err(rs_out, ref)
            assert err < TOL[torch.bfloat16], f"rank {r} rs call {i}: rel err {err:.2e}"
        ctx.check()
        if on:
            # RS: call 1 enqueued, call 2 captured as its layout's candidate, call 3 captured, the rest replayed. AG the
            # same one call later: RS's first call allocated its buffers after AG's first, which drops what AG knew
            # (AG's call 2 is enqueued again).
            # The gathered copy is outside the graph: a fresh tensor per call does not make a new key.
            # (call 2 is captured as its layout's candidate, kept to check a call at other addresses against)
            assert rs.replays.stats == {"replays": iters - 3, "captures": 2, "dropped": 0, "rebound": 0}, \
                rs.replays.stats
            assert ag.replays.stats == {"replays": iters - 4, "captures": 2, "dropped": 0, "rebound": 0}, \
                ag.replays.stats
            # another output tensor: a new key of the same layout, captured and checked against the layout's first
            # capture rebound to it; the next call at other addresses replays that graph rebound
            other = torch.empty_like(rs_out)
            caps = rs.replays.stats["captures"]
            rs(big, w_rs, out=other)
            assert rs.replays.stats["captures"] == caps + 1 and rs.replays.last_refusal is None
            assert torch.equal(other.cpu(), rs_out.cpu())
            third = poison(torch.empty_like(rs_out))
            rs(big, w_rs, out=third)
            assert rs.replays.stats["captures"] == caps + 1 and rs.replays.stats["rebound"] == 1
            assert torch.equal(third.cpu(), rs_out.cpu()) and torch.equal(other.cpu(), rs_out.cpu())
        else:
            rs(big, w_rs, out=rs_out)
            rs(big, w_rs, out=rs_out)
            assert rs.replays.stats["captures"] == 0
        # a larger shape grows the workspaces: every graph of the op holds old addresses and is dropped
        gen = ctx.generation
        a2 = rand((2 * m_local, k), torch.bfloat16, dev, "a2", r)
        ag(a2, w)
        assert ctx.generation > gen
        ag.replays._usable()
        assert not ag.replays._graphs
        for i in range(3):  # the first shape again, on the new workspace: enqueued, captured, replayed
            poison(out)
            got = ag(a, w, bias, out=out)
            assert rel_err(got, full.float() @ w.float() + bias.float()) < TOL[torch.bfloat16], f"after growth {i}"
        ctx.check()
        return True


@pytest.mark.parametrize("replay_ranks", [(0, 1, 2, 3), (0,)], ids=["all", "rank0"])
def test_gemm_ops_replay(gpu_pool, replay_ranks):
    assert all(gpu_pool.run(_ag_rs, 1024, 512, 768, replay_ranks))


def _fresh_tensors(m_local, k, n, calls):
    """Calls whose tensors never come back at the same addresses (a training step's activations), two weights in
    turn (two layers sharing one op): the rebinding ops capture one call, check a later one against it, and replay
    the rest rebound to each call's tensors. Every result right on poisoned outputs, and every earlier output still
    right after the later calls (a graph that kept an old address would write there)."""
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        bf16 = torch.bfloat16
        ag = to.AllGatherGEMM(ctx, fallback="never")
        rs = to.GEMMReduceScatter(ctx, fallback="never")
        ws = [rand((k, n), bf16, dev, "w", r, j) for j in range(2)]
        ws_rs = [rand((k, n), bf16, dev, "w_rs", j) for j in range(2)]
        kept = []
        for i in range(calls):
            shards = [rand((m_local, k), bf16, dev, "a", i, s) for s in range(W)]
            a, w = shards[r].clone(), ws[i % 2]
            out = poison(torch.empty((m_local * W, n), dtype=bf16, device=dev))
            assert ag(a, w, out=out) is out
            ref = torch.cat(shards).float() @ w.float()
            assert rel_err(out, ref) < TOL[bf16], f"rank {r} ag call {i}: rel err {rel_err(out, ref):.2e}"
            parts = [rand((m_local * W, k), bf16, dev, "rs", i, s) for s in range(W)]
            x, w2 = parts[r].clone(), ws_rs[i % 2]
            y = poison(torch.empty((m_local, n), dtype=bf16, device=dev))
            rs(x, w2, out=y)
            ref_rs = (sum(p.float() for p in parts) @ w2.float())[r * m_local:(r + 1) * m_local]
            assert rel_err(y, ref_rs) < TOL[bf16], f"rank {r} rs call {i}: rel err {rel_err(y, ref_rs):.2e}"
            kept.append((a, out, ref, x, y, ref_rs))  # alive: no later call gets these addresses
        for i, (_, out, ref, _, y, ref_rs) in enumerate(kept):
            assert rel_err(out, ref) < TOL[bf16] and rel_err(y, ref_rs) < TOL[bf16], f"call {i}'s output changed"
        ctx.check()
        # RS: call 1 eager, 2 captured, 3 captured and checked, the rest rebound. AG one call later: RS's first call
        # allocated its buffers, which dropped what AG knew. (One more check where two tensors happened to move by
        # the same distance: neither is verified by it.)
        assert rs.replays.last_refusal is None and ag.replays.last_refusal is None, \
            (rs.replays.last_refusal, ag.replays.last_refusal)
        assert rs.replays.stats["rebound"] >= calls - 4, rs.replays.stats
        assert ag.replays.stats["rebound"] >= calls - 5, ag.replays.stats
        return True


def test_fresh_tensors_replay_rebound(gpu_pool):
    assert all(gpu_pool.run(_fresh_tensors, 512, 256, 384, 9))


#: three residual bf16 SwiGLU layers against float32 on the same bf16-rounded weights: torch's own bf16 stack is
#: 6e-3 off on outputs and 8e-3 on gradients at these sizes; a graph that wrote stale or misplaced rows is off by
#: the MLP's share of each row, tens of percent
STACK_TOL, STACK_GRAD_TOL = 2e-2, 4e-2


def _training_steps(m_local, dim, hidden, layers, steps):
    """Training steps through a stack of residual TPMLP layers (one AllGather-GEMM and one GEMM-RS op shared by
    all, as a model holds them), new inputs every step (earlier steps' inputs and outputs kept alive, so that those
    never come back at an address): each op's calls of a layout (forward and backward) are captured, checked
    and then replayed rebound, layer after layer (each with its own weights) and step after step. Every step's
    output, input gradient and down projections' weight gradients against the unsharded float32 stack."""
    from torch import nn
    from triton_overlap.nn import TPMLP

    with to.Context(timeout_s=60) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        S, n = m_local * W, hidden // W
        rows = slice(r * m_local, (r + 1) * m_local)
        full = []
        for i in range(layers):
            lins = [nn.Linear(a, b, bias=False) for a, b in ((dim, hidden), (dim, hidden), (hidden, dim))]
            with torch.no_grad():
                for j, (lin, a) in enumerate(zip(lins, (dim, dim, hidden))):
                    lin.weight.copy_(rand(lin.weight.shape, torch.bfloat16, "cpu", "layer", i, j) / a ** 0.5)
            full.append(lins)
        stack = nn.Sequential(*(TPMLP.from_full(*lins, ctx, dtype=torch.bfloat16, device=dev, fallback="never")
                                for lins in full))
        ref = [[lin.to(dev) for lin in lins] for lins in full]
        kept = []
        for step in range(steps):
            x_full = rand((S, 1, dim), torch.bfloat16, dev, "x", step).float()
            gy = rand((S, 1, dim), torch.float32, dev, "gy", step)
            x_ref = x_full.clone().requires_grad_()
            y_ref = x_ref
            for gate, up, down in ref:
                y_ref = y_ref + down(nn.functional.silu(gate(y_ref)) * up(y_ref))
            (y_ref * gy).sum().backward()
            x = x_full[rows].to(torch.bfloat16).requires_grad_()
            y = x
            for mlp in stack:
                y = y + mlp(y)
            (y.float() * gy[rows]).sum().backward()
            where = f"rank {r} step {step}"
            assert rel_err(y, y_ref[rows]) < STACK_TOL, f"{where}: output {rel_err(y, y_ref[rows]):.2e}"
            assert rel_err(x.grad, x_ref.grad[rows]) < STACK_GRAD_TOL, \
                f"{where}: input gradient {rel_err(x.grad, x_ref.grad[rows]):.2e}"
            for i, (mlp, (_, _, down)) in enumerate(zip(stack, ref)):
                err = rel_err(mlp.down.weight.grad, down.weight.grad[:, r * n:(r + 1) * n])
                assert err < STACK_GRAD_TOL, f"{where}: layer {i}'s down weight gradient {err:.2e}"
            for p in [*stack.parameters(), *(lin.weight for lins in ref for lin in lins)]:
                p.grad = None
            kept.append((x, y))
        ctx.check()
        ag, rs = stack[0].gate_up.ops
        assert ag is stack[-1].down.ops[0] and rs is stack[-1].down.ops[1], "the layers do not share their ops"
        for op in (ag, rs):
            assert op.replays.last_refusal is None, (op.name, op.replays.last_refusal)
            # per op, two layouts (forward, backward) of `layers` calls a step; each eager, captured, checked, then
            # rebound, from its first step without a workspace allocation (which drops every graph) at the latest
            assert op.replays.stats["rebound"] >= steps * layers, (op.name, op.replays.stats)
        return True


def test_training_steps_replay_rebound(gpu_pool):
    assert all(gpu_pool.run(_training_steps, 256, 256, 768, 3, 5))


def _small_shape_auto(m_local, k, n):
    """fallback="auto" on a shape under the eager threshold: repeated tensors overlap by replay; a call
    with tensors not seen before overlaps too (captured and checked, then rebound), until the ranks agree that keys
    do not repeat (test_replay_agreement_sets_the_small_calls_path_on_every_rank): whether a call finds its graph
    depends on the rank's addresses, and the ranks' paths must agree."""
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        ag = to.AllGatherGEMM(ctx)
        a = rand((m_local, k), torch.bfloat16, dev, "a", r)
        w = rand((k, n), torch.bfloat16, dev, "w")
        full = torch.cat([rand((m_local, k), torch.bfloat16, dev, "a", s) for s in range(W)])
        ref = full.float() @ w.float()
        out = torch.empty((m_local * W, n), dtype=torch.bfloat16, device=dev)

        def repeat(calls):
            """``calls`` calls with the same tensors, each checked; their paths."""
            paths = []
            for _ in range(calls):
                poison(out)
                ag(a, w, out=out)
                paths.append(ag.last_path)
                assert rel_err(out, ref) < TOL[torch.bfloat16]
            return paths

        paths = repeat(4)
        assert paths == ["overlap"] * 4, paths
        assert ag.replays.stats["replays"] >= 1, ag.replays.stats
        # new outputs every call: overlapped, eagerly or captured and checked (the Gluon GEMM's launch that copies
        # the shard, which graphs rebound to other tensors take, is built by an eager call first), then replayed
        # rebound to each output
        outs = [poison(torch.empty_like(out)) for _ in range(5)]
        for o in outs:
            ag(a, w, out=o)
            assert ag.last_path == "overlap"
        assert all(rel_err(o, ref) < TOL[torch.bfloat16] for o in outs)
        assert ag.replays.stats["rebound"] >= 1 and ag.replays.last_refusal is None, \
            (ag.replays.stats, ag.replays.last_refusal)
        # another buffer's allocation drops every graph: the shape runs the overlap eagerly once more, then its
        # repeating calls are captured again
        captures, rebound = ag.replays.stats["captures"], ag.replays.stats["rebound"]
        ctx.symmetric("test.other", (4096,), torch.int32)
        paths = repeat(3)
        assert paths == ["overlap"] * 3, paths
        assert ag.replays.stats["captures"] > captures and ag.replays.stats["rebound"] == rebound, ag.replays.stats
        ctx.check()
        return True


def test_small_shape_replays_instead_of_falling_back(gpu_pool):
    if gpu_pool.world == 1:
        pytest.skip('at W = 1 fallback="auto" always takes torch.matmul: there is no overlap to replay')
    assert all(gpu_pool.run(_small_shape_auto, 1024, 512, 768))


def _unchecked_path(m_local, k):
    """Once a key is held, calls take ops.replay's unchecked path: a call that differs only in what the key holds
    (strides of a view at the same address, an output allocated per call) must not replay the wrong graph, and
    bad input must still raise ValueError."""
    with to.Context(timeout_s=30) as ctx:
        W, r, dev = ctx.world_size, ctx.rank, ctx.device
        ag = to.AllGatherGEMM(ctx, fallback="never")
        rs = to.GEMMReduceScatter(ctx, fallback="never")
        a = rand((m_local, k), torch.bfloat16, dev, "a", r)
        full = torch.cat([rand((m_local, k), torch.bfloat16, dev, "a", s) for s in range(W)])
        w = rand((k, k), torch.bfloat16, dev, "w")  # square: w.t() has w's address and shape, not its strides
        for i in range(3):  # out allocated by the op each call (the allocator usually hands back the same block)
            got = ag(a, w)
            assert rel_err(got, full.float() @ w.float()) < TOL[torch.bfloat16], f"ag call {i}"
            del got
        out = torch.empty((m_local * W, k), dtype=torch.bfloat16, device=dev)
        for i in range(3):  # an output of the caller's: the key repeats whatever the allocator does
            poison(out)
            ag(a, w, out=out)
            assert rel_err(out, full.float() @ w.float()) < TOL[torch.bfloat16], f"ag call {i} with out="
        assert ag.replays.stats["replays"] >= 1, ag.replays.stats
        got = ag(a, w.t())
        assert rel_err(got, full.float() @ w.float().t()) < TOL[torch.bfloat16], "ag with w.t()"
        with pytest.raises(ValueError, match="out must be"):
            ag(a, w, out=torch.empty((m_local, k), dtype=torch.bfloat16, device=dev))
        with pytest.raises(ValueError, match="inner dimensions"):
            ag(a, w[: k // 2])
        big = rand((m_local * W, k), torch.bfloat16, dev, "big")  # the same on every rank: the sum is W x
        ref = (W * (big.float() @ w.float()))[r * m_local:(r + 1) * m_local]
        rs_out = torch.empty((m_local, k), dtype=torch.bfloat16, device=dev)
        # an output of the caller's: the key repeats whatever the allocator does (eager, the layout's reference,
        # the key's own capture, replayed)
        for i in range(4):
            poison(rs_out)
            assert rs(big, w, out=rs_out) is rs_out
            assert rel_err(rs_out, ref) < TOL[torch.bfloat16], f"rs call {i}"
        assert rs.replays.stats["replays"] >= 1, rs.replays.stats
        for i in range(2):  # out allocated by the op: replayed or not (the allocator decides), right either way
            assert rel_err(rs(big, w), ref) < TOL[torch.bfloat16], f"rs call {i}, out allocated"
        got = rs(big, w.t())
        ref_t = (W * (big.float() @ w.float().t()))[r * m_local:(r + 1) * m_local]
        assert rel_err(got, ref_t) < TOL[torch.bfloat16], "rs with w.t()"
        with pytest.raises(ValueError, match="not divisible"):
            rs(big[1:], w)
        ctx.check()
        return True


def test_unchecked_replay_path(gpu_pool):
    if gpu_pool.world == 1:
        pytest.skip("at W = 1 one rank's rows are the whole output and every row count divides: its bad inputs "
                    "are good ones")
    assert all(gpu_pool.run(_unchecked_path, 512, 256))


def _cp(B, S, Hq, Hkv, D, causal):
    with to.Context(timeout_s=30) as ctx:
        dev = ctx.device
        op = to.ContextParallelAttention(ctx)
        W = ctx.world_size
        S_local = S // W
        q = torch.empty((B, S_local, Hq, D), dtype=torch.bfloat16, device=dev)
        k = torch.empty((B, S_local, Hkv, D), dtype=torch.bfloat16, device=dev)
        v = torch.empty_like(k)
        out, lse = torch.empty_like(q), torch.empty((B, Hq, S_local), dtype=torch.float32, device=dev)
        scale = 1.0 / math.sqrt(D)
        for i in range(5):
            full = [rand((B, S, h, D), torch.bfloat16, dev, name, i) for name, h in (("q", Hq), ("k", Hkv), ("v", Hkv))]
            ref_out, ref_lse = attention(*full, causal, scale)
            for dst, src in zip((q, k, v), full):
                dst.copy_(to.zigzag.shard(src, ctx))
            poison(out), poison(lse)
            op(q, k, v, causal=causal, out=out, lse=lse)
            err = rel_err(out, to.zigzag.shard(ref_out, ctx))
            assert err < TOL[torch.bfloat16], f"call {i}: out rel err {err:.2e}"
            lse_err = rel_err(lse, to.zigzag.shard(ref_lse, ctx, dim=2))
            assert lse_err < 1e-3, f"call {i}: lse rel err {lse_err:.2e}"
        ctx.check()
        assert op.replays.stats == {"replays": 3, "captures": 1, "dropped": 0, "rebound": 0}, op.replays.stats
        return True


@pytest.mark.parametrize("causal", [True, False])
def test_cp_attention_replay(gpu_pool, causal):
    assert all(gpu_pool.run(_cp, 1, 1024, 8, 2, 128, causal))


def _cp_backward(S, Hq, Hkv, D, causal, keep_kv):
    """The backward (ContextParallelAttention.backward, as autograd calls it), CALLS calls on the same tensors with
    new q, k, v in them, each after its forward: every call's gradients match the float32 reference, and the
    backward was captured and then replayed in at least a third of the calls. A call replays where its tensors sit
    where an earlier call's did; the gradients it returns are new tensors, which the caching allocator places among
    this loop's own temporaries: on 2 ranks dk and dv settle only after 4-5 calls, into two places taken in turn
    (two keys, two captures, replayed from the seventh to ninth call on).
    After each call its gradients are poisoned and freed, so the next call's land in poisoned memory: a replay that
    skipped an element shows as NaN. ``keep_kv``: backward reads the K/V that forward kept, copied with forward's
    outputs into the same buffers every call (where the kept copies land is the allocator's choice), else it
    gathers them again."""
    with to.Context(timeout_s=30) as ctx:
        dev = ctx.device
        op = to.ContextParallelAttention(ctx)
        B, scale = 1, 1.0 / math.sqrt(D)
        refs = []
        for i in range(CALLS):  # every reference first: the calls below then allocate alike each time
            inputs, want = attention_problem(dev, B, S, Hq, Hkv, D, causal, torch.bfloat16, ("bwd replay", i))
            refs.append(([to.zigzag.shard(t, ctx) for t in inputs], [to.zigzag.shard(g, ctx) for g in want[1:]]))
        q, k, v, dout = (torch.empty_like(t) for t in refs[0][0])
        out, lse = torch.empty_like(q), torch.empty((B, Hq, q.shape[1]), dtype=torch.float32, device=dev)
        kept = [torch.empty((B, ctx.world_size * q.shape[1], Hkv, D), dtype=k.dtype, device=dev) for _ in "kv"]
        for i, (inputs, grads) in enumerate(refs):
            for dst, src in zip((q, k, v, dout), inputs):
                dst.copy_(src)
            if keep_kv:
                for dst, src in zip((out, lse, *kept), op.forward(q, k, v, causal, scale, keep=True)):
                    dst.copy_(src)
                saved = (out, lse, *kept)
            else:
                op(q, k, v, causal=causal, out=out, lse=lse)
                saved = (out, lse, None, None)
            got = op.backward(q, k, v, saved[0], saved[1], dout, causal, scale, *saved[2:])
            for name, g, want in zip("qkv", got, grads):
                err = rel_err(g, want)
                assert err < GRAD_TOL[torch.bfloat16], f"call {i}: d{name} rel err {err:.2e}"
                poison(g)
            del got, saved
        ctx.check()
        stats = dict(op.backward_replays.stats)
        assert stats["captures"] >= 1 and stats["replays"] >= CALLS // 3, stats
        return stats


CALLS = 16


@pytest.mark.parametrize("keep_kv", [False, True], ids=["gathered_again", "kept"])
def test_cp_attention_backward_replay(gpu_pool, keep_kv):
    assert all(gpu_pool.run(_cp_backward, 1024, 8, 2, 128, True, keep_kv))
