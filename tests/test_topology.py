"""Which ranks share a host: a Context finds it (hostname and boot id, or TRITON_OVERLAP_VIRTUAL_HOSTS blocks) and
maps only its own host's peers; on a group that spans hosts AllGather-GEMM, GEMM-ReduceScatter, context-parallel
attention, the tensor-parallel MoE ops and expert-parallel dispatch / combine move data between hosts through the
process group (the op tests' own cases, run under virtual hosts), the AllReduce ops take their torch.distributed
path, faults name the peer on the other host; one Context per host's group (the 2-D mesh) overlaps as on one
machine."""
import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist

import contract
import triton_overlap as to
from refs import TOL, rand, rel_err, shm_files
from test_ag_gemm import AG_GEMM, AGCase
from test_cp_attention import CP_ATTENTION, CPCase
from test_expert_parallel import EPCase, ep_matches_reference, ep_silent_peer
from test_nn_ep_moe import GPU_CASES as EP_LAYER_GPU, HOST_CASES as EP_LAYER_HOST, ep_moe_layer_case
from test_gemm_rs import GEMM_RS, RSCase
from test_moe import AG_MOE, RS_MOE, MoECase
from triton_overlap.context.topology import VIRTUAL_HOSTS_ENV, Topology
from triton_overlap.plan import ChunkLayout, gather_schedule, scatter_schedule


def _one_host():
    with to.Context(timeout_s=30) as ctx:
        assert ctx.num_hosts == 1 and ctx.local_ranks == list(range(ctx.world_size))
        return ctx.topology.names[0]


def test_one_host(pool):
    names = pool.run(_one_host)
    assert len(set(names)) == 1 and "virtual" not in names[0], names


def _blocks(n: int):
    W = dist.get_world_size()
    return [[g for g in range(W) if g * n // W == h] for h in range(n)]


def _across_hosts(n: int):
    """A Context on the whole group, split into n virtual hosts: it maps only its own host's peers, small GEMM calls
    and the AllReduce take their torch.distributed path and are right, the overlap runs between hosts of one size
    and refuses clearly between hosts of different sizes."""
    W, r = dist.get_world_size(), dist.get_rank()
    mine = next(b for b in _blocks(n) if r in b)
    os.environ[VIRTUAL_HOSTS_ENV] = str(n)
    before = shm_files()
    try:
        with to.Context(timeout_s=30) as ctx:
            assert ctx.num_hosts == n and ctx.local_ranks == mine
            dev = ctx.device
            buf = ctx.symmetric("topo.buf", (5,), torch.float32)
            for p in range(W):
                if p in mine:
                    assert buf.peer(p).shape == (5,)
                else:
                    with pytest.raises(ValueError, match="another host"):
                        buf.peer(p)
            shards = [rand((7, 32), torch.bfloat16, dev, "xh", i) for i in range(W)]
            w = rand((32, 19), torch.bfloat16, dev, "xh-w")
            ag = to.AllGatherGEMM(ctx)
            got = ag(shards[r], w)
            assert ag.last_path == "fallback" or n == 1  # (one host: a shard this small falls back anyway)
            assert rel_err(got, torch.cat(shards).float() @ w.float()) < TOL[torch.bfloat16]
            parts = [(rand((3 * W, 16), torch.bfloat16, dev, "xh-a", i), rand((16, 11), torch.bfloat16, dev, "xh-b", i))
                     for i in range(W)]
            full = sum(a.float() @ b.float() for a, b in parts)
            got = to.gemm_rs(*parts[r], ctx=ctx)
            assert rel_err(got, full[3 * r:3 * (r + 1)]) < TOL[torch.bfloat16]
            xs = [rand((1001,), torch.float32, dev, "xh-x", i) for i in range(W)]
            ar = to.AllReduce(ctx)
            assert rel_err(ar(xs[r]), sum(x.double() for x in xs)) < 1e-6
            got = to.gemm_ar(parts[r][0], parts[r][1], ctx=ctx)
            assert rel_err(got, full) < 2 * TOL[torch.bfloat16]
            ctx.barrier()  # among this host's ranks
            if n > 1:
                assert ar.last_path == "fallback"
                never = to.AllGatherGEMM(ctx, fallback="never", name="xh.never")
                if ctx.topology.uniform:  # the path between hosts
                    got = never(shards[r], w)
                    assert never.last_path == "overlap"
                    assert rel_err(got, torch.cat(shards).float() @ w.float()) < TOL[torch.bfloat16]
                    to.ContextParallelAttention(ctx)
                else:  # hosts of different sizes: no counterparts to pair
                    for make in (lambda: never(shards[r], w), lambda: to.ContextParallelAttention(ctx)):
                        with pytest.raises(ValueError, match=f"spans {n} hosts.*different numbers of ranks"):
                            make()
            ctx.check()
            ctx.reset()  # bounded, through the store: works across hosts too
            assert rel_err(ar(xs[r]), sum(x.double() for x in xs)) < 1e-6
    finally:
        os.environ.pop(VIRTUAL_HOSTS_ENV, None)
    assert shm_files() <= before, shm_files() - before
    return ctx.num_hosts


def test_wire_tags_never_repeat_through_the_store():
    """A key that a faulted exchange left in the store is never taken by a later exchange: through the store a tag
    keeps the whole reset count (it wrapped at 64 resets); over NCCL, a new communicator at every reset, tags wrap
    within NCCL's 31 bits and differ within one reset."""
    from triton_overlap.producers.link import wire_tag
    seqs = (1, 2, 0xFFFFFF)
    through_store = {wire_tag(r, q, nccl=False) for r in range(200) for q in seqs}
    assert len(through_store) == 200 * len(seqs)
    over_nccl = [wire_tag(r, q, nccl=True) for r in range(200) for q in seqs]
    assert all(0 < t < 1 << 31 for t in over_nccl)
    assert len({wire_tag(5, q, nccl=True) for q in range(1, 5000)}) == 4999


def test_wire_keys_left_by_a_fault_are_dropped():
    """Through the store, a receive taken in time deletes what it took; one that gave up leaves its sender's data
    in the store, which keeps it as long as the process group: reset() and close() drop what this rank sent
    (wire.drop_left, once every rank's work has ended)."""
    from triton_overlap.context import wire as wires

    store = dist.HashStore()
    a, b = (wires.Wire("group", store, r, (0, 1), 0.5, False) for r in (0, 1))
    x, got = torch.arange(6, dtype=torch.float32), torch.zeros(6)
    wires.wire_exchange(a, [(x, 1)], [], 7, "taken")
    wires.wire_exchange(b, [], [(got, 0)], 7, "taken")
    assert torch.equal(got, x) and not store.check(list(a.sent[0]))
    wires.wire_exchange(a, [(x, 1)], [], 8, "left")  # (its receiver gave up before it came)
    left = list(a.sent[-1])
    assert store.check(left)
    wires.drop_left(a)
    assert not store.check(left) and not a.sent
    with pytest.raises(TimeoutError, match="no answer in 0.5 s from ranks \\[0\\]"):
        wires.wire_exchange(b, [], [(got, 0)], 8, "left")


def test_wire_end_is_bounded(monkeypatch):
    """Ending the wire's NCCL communicator waits at most the timeout: NCCL (2.26 and later) ends one only after
    every CUDA graph that captured its operations is destroyed, and a caller's graph may still hold it. Without
    NCCL there is nothing to end."""
    import threading

    from triton_overlap.context import wire as wires

    release, ended = threading.Event(), []

    def held(group):  # an abort that waits for a graph to go
        release.wait(10)
        ended.append(group)

    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", held)
    wire = wires.Wire("comm", None, 0, (0, 1), 0.2, True)
    t0 = time.monotonic()
    assert wires.end(wire) is False and 0.15 < time.monotonic() - t0 < 5
    release.set()  # the graph is destroyed: the ending goes on and completes
    for _ in range(100):
        if ended:
            break
        time.sleep(0.05)
    assert ended == ["comm"]
    assert wires.end(wires.Wire("comm", None, 0, (0, 1), 5.0, True)) is True  # (released: it ends at once)
    assert wires.end(wires.Wire("gloo", None, 0, (0, 1), 0.0, False)) is True
    assert "destroy the graphs" in wires.HELD_WIRE.format(0, 1.0)


def _held_wire():
    """A Context across 2 virtual hosts whose wire does not end in time (as where a CUDA graph holds NCCL's
    communicator), also where a fault ended it before: reset() warns, naming the cause, and the Context works after
    it; close() frees everything and then raises, naming the cause."""
    from triton_overlap.context import context as context_module

    os.environ[VIRTUAL_HOSTS_ENV] = "2"
    end = context_module.wires.end
    context_module.wires.end = lambda wire: False
    try:
        ctx = to.Context(timeout_s=30)
        assert ctx.wire is not None
        assert ctx.end_wire(ctx.wire) is False  # a fault's Watch ends it first: reset() must still say so
        with pytest.warns(UserWarning, match=f"rank {ctx.rank}: the communicator between hosts did not end"):
            ctx.reset()
        xs = [rand((17,), torch.float32, ctx.device, "held", i) for i in range(ctx.world_size)]
        assert rel_err(to.AllReduce(ctx)(xs[ctx.rank]), sum(x.double() for x in xs)) < 1e-6
        with pytest.raises(to.ContextError, match="destroy the graphs.*resources are freed"):
            ctx.close()
        ctx.close()  # (closed: nothing more to do)
    finally:
        context_module.wires.end = end
        os.environ.pop(VIRTUAL_HOSTS_ENV, None)
    return True


def test_held_wire_is_named(pool):
    if pool.world != 2:
        pytest.skip("once, at W = 2")
    assert all(pool.run(_held_wire))


@pytest.mark.parametrize("hosts", [1, 2, 3])
def test_across_hosts(pool, hosts):
    if pool.world < hosts:
        pytest.skip(f"needs {hosts} ranks")
    assert pool.run(_across_hosts, hosts) == [hosts] * pool.world


def _per_host_groups(n: int):
    """The 2-D mesh: one Context per host's group (every rank makes every block's group: new_group is collective);
    each is a one-host Context and overlaps."""
    r = dist.get_rank()
    blocks = _blocks(n)
    os.environ[VIRTUAL_HOSTS_ENV] = str(n)
    groups = []
    try:
        groups = [dist.new_group(b) for b in blocks]
        mine = next(h for h, b in enumerate(blocks) if r in b)
        block = blocks[mine]
        with to.Context(groups[mine], timeout_s=30) as ctx:
            assert ctx.num_hosts == 1 and ctx.world_size == len(block) and ctx.rank == block.index(r)
            assert ctx.local_ranks == list(range(len(block)))
            dev = ctx.device
            shards = [rand((7, 32), torch.bfloat16, dev, "topo", mine, i) for i in range(ctx.world_size)]
            w = rand((32, 19), torch.bfloat16, dev, "topo-w", mine)
            op = to.AllGatherGEMM(ctx, fallback="never" if ctx.world_size > 1 else "auto")
            got = op(shards[ctx.rank], w)
            ctx.check()
            assert rel_err(got, torch.cat(shards).float() @ w.float()) < TOL[torch.bfloat16]
        return len(block)
    finally:
        os.environ.pop(VIRTUAL_HOSTS_ENV, None)
        for b, g in zip(blocks, groups):
            if r in b:
                dist.destroy_process_group(g)


def test_one_context_per_host(pool):
    W = pool.world
    want = [sum(1 for g in range(W) if g * 2 // W == r * 2 // W) for r in range(W)]  # each rank's block
    assert pool.run(_per_host_groups, 2) == want


def _bad_setting(value: str):
    os.environ[VIRTUAL_HOSTS_ENV] = value
    try:
        with pytest.raises(ValueError, match=VIRTUAL_HOSTS_ENV):
            to.Context(timeout_s=30)
    finally:
        os.environ.pop(VIRTUAL_HOSTS_ENV, None)
    with to.Context(timeout_s=30) as ctx:  # nothing was left half made
        return ctx.num_hosts


@pytest.mark.parametrize("value", ["0", "two", "99"])
def test_bad_virtual_hosts(pool, value):
    assert pool.run(_bad_setting, value) == [1] * pool.world


def test_tile_orders_between_hosts():
    """Across hosts the AllGather consumer takes its own host's chunks first and the other hosts' chunk by chunk;
    the ReduceScatter producer computes the other hosts' owners' rows first (they take the network)."""
    layout = ChunkLayout(4, 8, 4)  # 4 ranks of 8 rows, 2 chunks each; 4-row tiles: tile t is chunk t
    one_host, two_hosts = [(0, 1, 2, 3)], [(0, 1), (2, 3)]
    assert gather_schedule(layout, 0, one_host, num_streams=1, block_m=4).tile_order == (0, 1, 6, 7, 4, 5, 2, 3)
    sched = gather_schedule(layout, 0, two_hosts, num_streams=1, block_m=4)
    order = sched.tile_order
    assert order[:4] == (0, 1, 2, 3) and set(order[4:6]) == {4, 6} and set(order[6:]) == {5, 7}
    assert sched.copy_streams == ((1,),) and sched.counterparts == (2,) and sched.num_streams == 2
    sched = scatter_schedule(layout, 0, two_hosts, copy=False, block_m=4, n_tiles=1, fused=True)
    order = sched.tile_order
    assert set(order[:4]) == {4, 5, 6, 7} and order[4:6] == (2, 3) and order[6:] == (0, 1)
    assert sched.copy and sched.remote == (2, 3) and sched.copy_streams == (((1, 0), (1, 1)),)


@pytest.mark.parametrize("hosts", [((0, 1), (2, 3)), ((0, 1, 2), (3, 4, 5)), ((0, 1), (2, 3), (4, 5))],
                         ids=["2x2", "2x3", "3x2"])
def test_partials_summed_within_the_host(hosts):
    """GEMM-RS's schedule with the host's partials summed before they cross: every partial of every rank reaches
    its owner exactly once, directly within the host or through one sum per host; each rank sends one partial per
    other host (1 / L of the direct path's), and reduces only its host's ranks and its counterparts."""
    W, L = sum(map(len, hosts)), len(hosts[0])
    layout = ChunkLayout(W, 10, 4)  # 3 chunks per rank, the last of 2 rows
    cpr = layout.chunks_per_rank
    crossing = {True: 0, False: 0}
    for in_host in (True, False):
        reached = {}  # (source, owner, chunk) -> how: "own", "copy", "forwarded by f", "direct"
        for r in range(W):
            s = scatter_schedule(layout, r, hosts, copy=True, num_streams=2, block_m=4, n_tiles=1, fused=False,
                                 reduce_in_host=in_host)
            local = next(h for h in hosts if r in h)
            assert s.reduce_after_join and s.local == local  # (across hosts, never beside the exchanges)
            if not in_host:
                assert s.counterparts == () and s.sources == tuple(range(W))
                for d in s.remote:
                    for j in range(cpr):
                        reached[r, d, j] = "direct"
                crossing[False] += len(s.remote) * cpr
            else:
                mine = tuple(h[local.index(r)] for h in hosts if h != local)
                assert s.counterparts == mine and s.sources == tuple(sorted(local + mine))
                for k, d in enumerate(mine):
                    assert s.forwarder(d) == r and s.other_host(d) == k
                crossing[True] += len(mine) * cpr
            moved = [step for stream in s.copy_streams for step in stream]
            assert len(moved) == len(set(moved))
            for d, j in moved:
                reached[r, d, j] = "copy" if d in local else f"forwarded by {s.forwarder(d)}"
            for d in local:
                if d != r:
                    assert all((d, j) in moved for j in range(cpr))
            if in_host:  # the forwarder sums its host's partials for its counterparts: every rank of the host
                for d in s.counterparts:
                    for q in local:
                        for j in range(cpr):
                            reached.setdefault((q, d, j), "own" if q == r else None)
        for src in range(W):
            for d in range(W):
                for j in range(cpr):
                    how = reached.get((src, d, j), "own" if src == d else None)
                    assert how is not None, (in_host, src, d, j)
                    if how.startswith("forwarded by"):
                        f = int(how.split()[-1])
                        assert f in next(h for h in hosts if src in h) and d in scatter_schedule(
                            layout, f, hosts, copy=True, block_m=4, n_tiles=1, fused=False,
                            reduce_in_host=True).counterparts
    assert crossing[False] == L * crossing[True]
    with pytest.raises(ValueError, match="cannot be fused"):
        scatter_schedule(layout, 0, hosts, copy=True, block_m=4, n_tiles=1, fused=True, reduce_in_host=True)
    # one rank per host, or hosts of different sizes: the partials cross directly
    for hs in (((0,), (1,)), ((0, 1), (2,))):
        s = scatter_schedule(ChunkLayout(len(sum(hs, ())), 10, 4), 0, hs, copy=True, block_m=4, n_tiles=1,
                             fused=False, reduce_in_host=True)
        assert s.counterparts == () and len(s.sources) == len(sum(hs, ()))


def test_topology_from_keys():
    t = Topology.from_keys(["b", "b", "a", "b", "a"])
    assert t.hosts == ((0, 1, 3), (2, 4)) and t.num_hosts == 2
    assert t.local_ranks(4) == [2, 4] and t.host_of(3) == 0
    assert t.remote_ranks(4) == (0, 1, 3) and t.remote_ranks(0) == (2, 4)
    assert Topology.from_keys(["x", "x"]).remote_ranks(0) == ()
    assert t.describe() == "ranks 0, 1, 3 on b; ranks 2, 4 on a"
    assert Topology.from_keys(["x"] * 3).describe() == "ranks 0-2 on x"


def _under_hosts(n: int, fn, *args):
    """``fn(*args)`` (an op test's case, a fault case) on a Context split into ``n`` virtual hosts."""
    os.environ[VIRTUAL_HOSTS_ENV] = str(n)
    try:
        return fn(*args)
    finally:
        os.environ.pop(VIRTUAL_HOSTS_ENV, None)


def _layouts(world: int):
    """The virtual-host splits with hosts of one size: one rank per host, and two per host where W is even (2 hosts
    of 2 at W = 4, 3 of 2 at W = 6)."""
    return [world] + ([world // 2] if world % 2 == 0 and world >= 4 else [])


# (body, its arguments on the host backend, on GPUs (cuda-shared)): the op tests' own checks (poisoned outputs and
# workspaces, odd sizes, producer delays) against their float32 references, the ops' specs and cases run by the
# contract's bodies
BETWEEN_HOSTS = {
    "ag push": (contract.matches_reference,
                (AG_GEMM, AGCase(m_local=37, k=48, n=40, bias=True, m_per_chunk=16, iters=2)),
                (AG_GEMM, AGCase(m_local=4091, k=1024, n=1536, bias=True, m_per_chunk=512, iters=2))),
    "ag transposed, delays": (contract.matches_reference,
                              (AG_GEMM, AGCase(m_local=29, k=64, n=33, dtype="float16", transposed=True, m_per_chunk=7,
                                               streams=1, jitter=0.003, iters=2)),
                              (AG_GEMM, AGCase(m_local=4091, k=512, n=1000, dtype="float16", transposed=True,
                                               m_per_chunk=1000, streams=1, jitter=0.001, iters=2))),
    "rs fused, delays": (contract.matches_reference,
                         (GEMM_RS, RSCase(m=32 * 24, k=64, n=33, dtype="float16", transposed=True, m_per_chunk=7,
                                          iters=2, scatter="copy", jitter=0.003)),
                         (GEMM_RS, RSCase(m=8192, k=1024, n=1536, bias=True, m_per_chunk=512, iters=2, scatter="copy",
                                          jitter=0.0005))),
    "rs reduction kernel": (contract.matches_reference,
                            (GEMM_RS, RSCase(m=37 * 24, k=48, n=40, bias=True, m_per_chunk=16, iters=2, scatter="store",
                                             fuse=False)),
                            (GEMM_RS, RSCase(m=8184, k=512, n=1000, dtype="float16", transposed=True, m_per_chunk=1000,
                                             iters=2, scatter="store", fuse=False))),
    "cp forward": (contract.matches_reference,
                   (CP_ATTENTION, CPCase(S=96, Hq=4, Hkv=1, D=64, iters=2, jitter=0.005)),
                   (CP_ATTENTION, CPCase(S=4096, Hq=32, Hkv=8, D=128, iters=2))),
    "cp backward": (contract.gradients_match,
                    (CP_ATTENTION, CPCase(S=48, Hq=4, Hkv=1, D=64)),
                    (CP_ATTENTION, CPCase(S=4096, Hq=16, Hkv=4, D=128))),
    "cp backward, kept K/V": (contract.gradients_match,
                              (CP_ATTENTION, CPCase(B=2, S=48, Hq=4, Hkv=2, D=64, causal=False, dtype="float16",
                                                    keep_kv=True)),
                              (CP_ATTENTION, CPCase(S=4096, Hq=16, Hkv=4, D=128, chunks_per_rank=4, keep_kv=True))),
    "moe ag, tokens": (contract.matches_reference,
                       (AG_MOE, MoECase(m_local=13, k=40, n=24, m_per_chunk=5, iters=2, jitter=0.003)),
                       (AG_MOE, MoECase(m_local=777, k=768, n=512, experts=64, topk=8, routing="even"))),
    "moe ag, rows sent": (contract.matches_reference,
                          (AG_MOE, MoECase(m_local=13, k=32, n=24, experts=6, topk=3, m_per_chunk=4, iters=2,
                                           send_rows=True)),
                          (AG_MOE, MoECase(m_local=1021, k=1024, n=768, experts=8, topk=2, m_per_chunk=256,
                                           send_rows=True))),
    "moe rs": (contract.matches_reference,
               (RS_MOE, MoECase(m_local=13, k=40, n=24, m_per_chunk=5, iters=2)),
               (RS_MOE, MoECase(m_local=600, k=512, n=384, experts=256, topk=4, m_per_chunk=160))),
    "ep dispatch and combine": (ep_matches_reference,
                                (EPCase(tokens=13, hidden=40, experts=8, topk=2, iters=2, jitter=0.003),),
                                (EPCase(tokens=509, hidden=1024, experts=16, topk=4, iters=2, jitter=0.001),)),
    "ep, only rank 0 receives": (ep_matches_reference,  # (exchanges with nothing to move, between hosts too)
                                 (EPCase(tokens=11, hidden=16, experts=8, topk=2, routing="first", empty=0),),
                                 (EPCase(tokens=384, hidden=2048, experts=32, topk=4, routing="first", empty=0,
                                         n=1024),)),
    "ep layer, forward and backward": (ep_moe_layer_case, (EP_LAYER_HOST["empty_experts"],), (EP_LAYER_GPU["bf16"],)),
}


@pytest.mark.parametrize("what", list(BETWEEN_HOSTS))
def test_ops_between_hosts(pool, what):
    fn, host_args, gpu_args = BETWEEN_HOSTS[what]
    layouts = _layouts(pool.world)
    if pool.backend == "host" and pool.world >= 4:  # one rank per host runs at W = 2 and 3 (CI time)
        layouts = [n for n in layouts if n < pool.world]
    if pool.backend == "host" and pool.world == 3 and what.startswith("ep"):
        pytest.skip("EP between hosts on the host backend: 2 hosts of 1 and of 2 (W = 2, 4; CI time)")
    if pool.backend == "host" and pool.world == 3 and list(BETWEEN_HOSTS).index(what) % 2 == 0:
        pytest.skip("the host backend at W = 3 (hosts of 2 and 1) runs every other op (CI time); W = 2 and 4 run all")
    for n in layouts:
        pool.run(_under_hosts, n, fn, *(host_args if pool.backend == "host" else gpu_args))


def _held_for_link(n: int, fn, *args):
    """As _under_hosts, on Contexts that hold consumers for the exchanges between hosts (Context.holds_for_link, on
    GPUs where NCCL carries them): gathers hold their consumer, GEMM-RS sums the partials after the join. Returns
    whether a gather (or an all-to-all between hosts) held its consumer and how many separate reductions ran."""
    from triton_overlap.ops import gemm_reduce_scatter as rs
    from triton_overlap.producers import exchange, gather

    init, make, reduce = to.Context.__init__, gather.Gather.__init__, rs.launch_reduce
    make_a2a = exchange.AllToAll.__init__
    seen = {"held": False, "reductions": 0}

    def ctx_init(self, *a, **k):
        init(self, *a, **k)
        self.holds_for_link = self.num_hosts > 1

    def gather_init(self, *a, **k):
        make(self, *a, **k)
        seen["held"] |= self.hold_consumer

    def a2a_init(self, *a, **k):
        make_a2a(self, *a, **k)
        seen["held"] |= self.hold_consumer

    def counted(*a, **k):
        seen["reductions"] += 1
        return reduce(*a, **k)

    to.Context.__init__, gather.Gather.__init__, rs.launch_reduce = ctx_init, gather_init, counted
    exchange.AllToAll.__init__ = a2a_init
    try:
        _under_hosts(n, fn, *args)
    finally:
        to.Context.__init__, gather.Gather.__init__, rs.launch_reduce = init, make, reduce
        exchange.AllToAll.__init__ = make_a2a
    return seen["held"], seen["reductions"]


@pytest.mark.parametrize("what", ["ag push", "rs fused, delays", "cp forward", "cp backward",
                                  "ep dispatch and combine"])
def test_ops_between_hosts_held_for_link(pool, what):
    """The order kept where NCCL carries the exchanges between hosts, on the host backend: the same cases, correct,
    with the gathers' and EP's consumers held and GEMM-RS's reduction (fused where the case asks for it) after the
    join."""
    if pool.backend != "host":
        pytest.skip("GPUs whose group spans hosts over NCCL take this order in test_ops_between_hosts")
    if pool.world != 2:
        pytest.skip("run once on the host backend, at W = 2")
    fn, args, _ = BETWEEN_HOSTS[what]
    held, reductions = zip(*pool.run(_held_for_link, 2, fn, *args))
    assert all(held) == (not what.startswith("rs")) and any(held) == all(held)
    if what.startswith("rs"):
        assert all(n > 0 for n in reductions), reductions


def _counting_sums(n: int, fn, *args):
    """As _under_hosts, returning how many within-host sums of partials this rank ran (GEMM-RS's chunks,
    attention's dK/dV)."""
    from triton_overlap.ops import context_parallel_attention as cp
    from triton_overlap.producers import scatter

    original, seen = scatter.launch_sum_forwarded, [0]

    def counted(*a, **k):
        seen[0] += 1
        return original(*a, **k)

    scatter.launch_sum_forwarded = cp.launch_sum_forwarded = counted
    try:
        _under_hosts(n, fn, *args)
    finally:
        scatter.launch_sum_forwarded = cp.launch_sum_forwarded = original
    return seen[0]


@pytest.mark.parametrize("what", ["rs reduction kernel", "cp backward"])
@pytest.mark.parametrize("in_host", [True, False], ids=["summed_in_host", "direct"])
def test_partials_between_hosts(pool, in_host, what):
    """Two hosts of W / 2 ranks: GEMM-RS and attention's backward are right with the host's partials for each
    owner on the other host summed before they cross (every rank sums its share) and with each rank's partials
    crossing directly (no sum)."""
    if pool.world < 4 or pool.world % 2:
        pytest.skip("needs two hosts of two ranks or more")
    fn, host_args, gpu_args = BETWEEN_HOSTS[what]
    *spec, case = host_args if pool.backend == "host" else gpu_args
    sums = pool.run(_counting_sums, 2, fn, *spec, dataclasses.replace(case, in_host=in_host))
    assert all(n > 0 for n in sums) if in_host else sums == [0] * pool.world, sums


def _forwarder_starved(T: float):
    """Two hosts of two ranks, the host's partials summed before they cross: rank 1 leaves out its copies into its
    forwarder's slots (rank 0's) for one call. Rank 0 gives up within the timeout, naming rank 1 and the chunk (its
    sum's wait; on GPUs possibly its reduction's, naming rank 2's sum that its own sum holds back); rank 2, whose
    sums from rank 0 never come, names rank 0; after reset() calls are right again, the same op taking the direct
    path and the sums by turns."""
    from triton_overlap.producers import scatter

    init = scatter.Scatter.__init__
    case = RSCase(m=8 * 24, k=32, n=24, m_per_chunk=4, scatter="copy")

    def starved(self, ctx, schedule, *a, **k):
        if ctx.rank == 1:
            schedule = dataclasses.replace(schedule, copy_streams=tuple(
                tuple(step for step in stream if step[0] in schedule.local) for stream in schedule.copy_streams))
        init(self, ctx, schedule, *a, **k)

    os.environ[VIRTUAL_HOSTS_ENV] = "2"
    try:
        with to.Context(timeout_s=T) as ctx:
            op = to.GEMMReduceScatter(ctx, fallback="never")
            contract.correct(GEMM_RS, op, ctx, case)
            call = GEMM_RS.inputs(ctx, case, 1)
            scatter.Scatter.__init__ = starved
            msg = ""
            t0 = time.monotonic()
            try:
                op(*call.args, **call.kwargs)
                ctx.check()
            except to.ContextError as e:
                msg = str(e)
            finally:
                scatter.Scatter.__init__ = init
            elapsed = time.monotonic() - t0
            ctx.reset()
            for tag, in_host in ((2, False), (3, True), (4, False)):
                contract.correct(GEMM_RS, op, ctx, dataclasses.replace(case, in_host=in_host), tag=tag)
    finally:
        os.environ.pop(VIRTUAL_HOSTS_ENV, None)
    return msg, elapsed


def test_forwarder_starved(pool):
    if pool.world != 4:
        pytest.skip("two hosts of two ranks")
    T = contract.timeout_for(pool)
    results = pool.run(_forwarder_starved, T)
    (m0, t0), (m2, _) = results[0], results[2]
    # rank 0's sum waits for rank 1's chunk, and its reduction for rank 2's sum, which rank 0's own sum holds back
    # (it precedes the exchange): both waits start together, and on GPUs either may give up first
    starved_by = ("chunk 0 of rank 1",) if pool.backend == "host" else ("chunk 0 of rank 1", "of rank 2")
    assert "gemm_rs" in m0 and any(s in m0 for s in starved_by) and not contract.relayed(m0), m0
    assert T * contract.EARLIEST <= t0, (t0, m0)
    assert "rank 0" in m2, m2


def _guarded_exchange(T: float):
    """Two hosts of two ranks: each rank sends its counterpart data along with its error word (Link.exchange's
    ``guarded``), rank 0's word holding a fault (a wait of its own that gave up, as a sum of partials would leave
    it). Its counterpart, rank 2, raises the fault relayed from rank 0 before the data is read; rank 3's data from
    rank 1 lands intact. After reset() the same exchange is clean on every rank."""
    from triton_overlap.kernels import signal as sig
    from triton_overlap.producers.link import link

    os.environ[VIRTUAL_HOSTS_ENV] = "2"
    try:
        with to.Context(timeout_s=T) as ctx:
            op, msgs, got = ctx.op_id("gemm_rs"), [], []
            dist.barrier()  # every rank is past its set-up, whose last check would see rank 0's fault relayed
            for faulty in (True, False):
                ln, r = link(ctx), ctx.rank
                (c,) = ln.counterparts
                if faulty and r == 0:
                    word = [0] * sig.ERR_WORDS
                    word[sig.ERR_CODE], word[sig.ERR_RANK], word[sig.ERR_OP] = int(sig.ERR_TIMEOUT), 0, op
                    word[sig.ERR_PEER], word[sig.ERR_WHAT], word[sig.ERR_OWN_CODE] = 1, 3, int(sig.ERR_TIMEOUT)
                    ctx.err.copy_(torch.tensor(word, dtype=torch.int32))
                x = torch.full((5,), 10 * r + int(faulty), dtype=torch.float32, device=ctx.device)
                y = torch.full((5,), -1.0, dtype=torch.float32, device=ctx.device)
                caller, s = ctx.current_stream(), ctx.streams(1)[0]
                s.wait_stream(caller)
                msg = ""
                try:
                    ln.exchange(s, [(x, c)], [(y, c)], "test data", op, {c: 0}, guarded=True)
                    caller.wait_stream(s)
                    ctx.check()
                except to.ContextError as e:
                    msg = str(e)
                msgs.append(msg)
                got.append(y.cpu().tolist())
                ctx.reset()
    finally:
        os.environ.pop(VIRTUAL_HOSTS_ENV, None)
    return msgs, got


def test_guarded_exchange(pool):
    if pool.world != 4:
        pytest.skip("two hosts of two ranks")
    results = pool.run(_guarded_exchange, contract.timeout_for(pool))
    msgs = [m for m, _ in results]
    assert "chunk 3 of rank 1" in msgs[0][0] and not contract.relayed(msgs[0][0]), msgs[0]
    assert "rank 2: rank 0 faulted" in msgs[2][0] and "gemm_rs" in msgs[2][0], msgs[2]
    assert results[3][1][0] == [11.0] * 5, results[3]
    assert all(m[1] == "" for m in msgs), msgs
    assert [got[1] for _, got in results] == [[10.0 * c] * 5 for c in (2, 3, 0, 1)], results


# The fault tests' cases (the contract's fault bodies with AllGather-GEMM's call), one rank per host: a peer on
# another host that never makes a repeated call is named within the timeout (the exchange of call headers between
# hosts waits for it); ranks whose calls differ are told at once, naming both shapes (the headers are compared on the
# device); a peer that brings an unagreed shape while the others repeat one is named by each side. After reset(),
# calls are correct again.
FAULTS = {"peer absent": (contract.peer_absent, True), "calls differ": (contract.shapes_disagree, "repeated"),
          "shapes mixed": (contract.shapes_disagree, "mixed")}


@pytest.mark.parametrize("what", list(FAULTS))
def test_faults_between_hosts(pool, what):
    fn, case = FAULTS[what]
    pool.run(_under_hosts, pool.world, fn, AG_GEMM, case, contract.timeout_for(pool))


@pytest.mark.parametrize("what", ["counts", "rows", "partials"])
def test_ep_faults_between_hosts(pool, what):
    """Expert-parallel dispatch and combine, one rank per host: a peer that never sends its counts, rows or partials
    through the Link is named by the others' bounded exchange (the rank, the op, the peer and its block), and after
    reset() the calls are right again."""
    if pool.backend == "host" and pool.world != 2:
        pytest.skip("W = 2 on the host backend")
    times = pool.run(_under_hosts, pool.world, ep_silent_peer, what, contract.timeout_for(pool))
    contract.timed_all_but_rank_1(times)
