"""Which ranks share a host: a Context finds it (hostname and boot id, or TRITON_OVERLAP_VIRTUAL_HOSTS blocks),
refuses a group that spans hosts with a clear error before it maps any memory, and works on each host's own group
(the 2-D mesh: one Context per host-local group)."""
import os

import pytest
import torch
import torch.distributed as dist

import triton_overlap as to
from refs import TOL, rand, rel_err
from triton_overlap.context.topology import VIRTUAL_HOSTS_ENV, Topology


def _shm():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _one_host():
    with to.Context(timeout_s=30) as ctx:
        assert ctx.num_hosts == 1 and ctx.local_ranks == list(range(ctx.world_size))
        return ctx.topology.names[0]


def test_one_host(pool):
    names = pool.run(_one_host)
    assert len(set(names)) == 1 and "virtual" not in names[0], names


def _virtual_hosts(n: int):
    W, r = dist.get_world_size(), dist.get_rank()
    blocks = [[g for g in range(W) if g * n // W == h] for h in range(n)]
    os.environ[VIRTUAL_HOSTS_ENV] = str(n)
    groups = []
    try:
        if n > 1:  # the whole group spans hosts: refused on every rank before any memory is mapped
            before = _shm()
            with pytest.raises(ValueError, match=f"spans {n} hosts") as info:
                to.Context(timeout_s=30)
            msg = str(info.value)
            assert "on virtual host 0" in msg and f"on virtual host {n - 1}" in msg and "one host" in msg, msg
            assert _shm() <= before
        # one Context per host: every rank makes every block's group (new_group is collective)
        groups = [dist.new_group(b) for b in blocks]
        mine = next(h for h, b in enumerate(blocks) if r in b)
        block = blocks[mine]
        with to.Context(groups[mine], timeout_s=30) as ctx:
            assert ctx.num_hosts == 1 and ctx.world_size == len(block) and ctx.rank == block.index(r)
            assert ctx.local_ranks == list(range(len(block)))
            dev = ctx.device
            shards = [rand((7, 32), torch.bfloat16, dev, "topo", mine, i) for i in range(ctx.world_size)]
            w = rand((32, 19), torch.bfloat16, dev, "topo-w", mine)
            got = to.ag_gemm(shards[ctx.rank], w, ctx=ctx)
            ctx.check()
            assert rel_err(got, torch.cat(shards).float() @ w.float()) < TOL[torch.bfloat16]
        return len(block)
    finally:
        os.environ.pop(VIRTUAL_HOSTS_ENV, None)
        for b, g in zip(blocks, groups):
            if r in b:
                dist.destroy_process_group(g)


@pytest.mark.parametrize("hosts", [1, 2])
def test_virtual_hosts(pool, hosts):
    if pool.world < hosts:
        pytest.skip(f"needs {hosts} ranks")
    W = pool.world
    want = [sum(1 for g in range(W) if g * hosts // W == r * hosts // W) for r in range(W)]  # each rank's block
    assert pool.run(_virtual_hosts, hosts) == want


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


def test_topology_from_keys():
    t = Topology.from_keys(["b", "b", "a", "b", "a"])
    assert t.hosts == ((0, 1, 3), (2, 4)) and t.num_hosts == 2
    assert t.local_ranks(4) == [2, 4] and t.host_of(3) == 0
    assert t.describe() == "ranks 0, 1, 3 on b; ranks 2, 4 on a"
    assert Topology.from_keys(["x"] * 3).describe() == "ranks 0-2 on x"
