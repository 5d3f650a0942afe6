"""The MoE ops' routing kernels (kernels.routing, through AllGatherMoEGEMM.route and MoEGEMMReduceScatter.route)
against a plain-torch sort of the same pairs, element for element: the permutation both ways, the experts' offsets,
what the grouped GEMM reads per row and the tile tables; then the tables' properties on their own (every pair in
exactly one tile of one expert, tiles in the order of the chunks they need). Integer results, so equality is exact.
Each rank of the pool runs every case on its device (the host backend: Triton's interpreter)."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import triton_overlap as to
from triton_overlap.ops.all_gather_moe import AllGatherMoESchedule
from triton_overlap.ops.moe_reduce_scatter import MoEReduceScatterSchedule
from triton_overlap.ops.moe_routing import (arrival_segments, count_ids, destination_segments, num_slots,
                                            sort_pairs)
from triton_overlap.plan import ChunkLayout


def tile_table(counts: torch.Tensor, block_m: int, slots: int) -> torch.Tensor:
    """Reference: ``counts`` [B, E] rows of each (block, expert) group laid out block-major; int64 [B, slots, 3]:
    each block's tiles (expert, first row, end row) in expert order, then empty slots (0, 0, 0)."""
    B, E = counts.shape
    out = torch.zeros(B, slots, 3, dtype=torch.int64)
    start = 0
    for b in range(B):
        s = 0
        for e in range(E):
            n = int(counts[b, e])
            for first in range(start, start + n, block_m):
                out[b, s] = torch.tensor([e, first, min(first + block_m, start + n)])
                s += 1
            start += n
        assert s <= slots
    return out


def ag_reference(layout, rank, arriving, ids, E, bm, sorted_output, lag=-1):
    """AllGather-MoE's routing by torch: (order, position, offsets, src, dst, pos, table); ``lag`` as
    kernels.routing.sort_segments takes it (the tiles' lanes in expert order)."""
    T, topk = ids.shape
    pairs = T * topk
    pos = torch.zeros(layout.num_chunks, dtype=torch.int64)
    for i, c in enumerate(arriving, start=1):
        pos[c] = i
    experts = ids.reshape(-1).long().cpu()
    token = torch.arange(pairs) // topk
    chunk = (token // layout.m_local) * layout.chunks_per_rank + (token % layout.m_local) // layout.m_per_chunk
    cpos = pos[chunk]
    order, position = sort_pairs(experts, E, cpos, layout.num_chunks + 1)
    counts = count_ids(experts, E)
    table = tile_table(counts.view(1, -1), bm, num_slots(pairs, E, bm))[0]
    sorted_pos = cpos[order]
    used = table[:, 2] > table[:, 1]
    need = torch.where(used, sorted_pos[(table[:, 2] - 1).clamp(min=0)], layout.num_chunks + 1)
    if lag >= 0:  # a tile waits for its lane: min(its place in expert order // lag, the last arrival position)
        lanes = len(arriving)
        slot = torch.arange(table.shape[0])
        lane = torch.full_like(slot, lanes) if lag == 0 else (slot // lag).clamp(max=lanes)
        need = torch.where(used, torch.maximum(need, lane), need)
    table = table[torch.sort(need, stable=True).indices]
    dst = torch.arange(pairs) if sorted_output else order
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    return order, position, offsets, order // topk, dst, sorted_pos, table


def rs_reference(m_local, dests, ids, E, bm, remap):
    """MoE-ReduceScatter's routing by torch: (src, position, table)."""
    T, topk = ids.shape
    W = len(dests)
    dest_pos = torch.zeros(W, dtype=torch.int64)
    for i, d in enumerate(dests):
        dest_pos[d] = i
    experts = ids.reshape(-1).long().cpu()
    dest = dest_pos[torch.arange(T * topk) // topk // m_local]
    order, position = sort_pairs(dest, W, experts, E)
    counts = count_ids(dest * E + experts, W * E).view(W, E)
    table = tile_table(counts, bm, num_slots(m_local * topk, E, bm)).view(-1, 3)
    return order if remap is None else remap.long().cpu()[order], position, table


def _device() -> torch.device:
    """The pool rank's device: its GPU, else the CPU (the host backend)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _ids(T, topk, E, kind, g, dtype):
    if kind == "one":
        ids = torch.full((T, topk), E - 1)
    elif kind == "skewed":  # a third of the experts take everything; the rest get no rows
        ids = torch.randint(0, max(1, E // 3), (T, topk), generator=g)
    else:
        ids = torch.randint(0, E, (T, topk), generator=g)
    return ids.to(dtype)


# (world, rank, m_local, m_per_chunk, topk, experts, block_m, routing)
CASES = [(2, 0, 13, 5, 2, 4, 16, "random"), (3, 1, 48, 24, 2, 3, 16, "random"), (4, 3, 7, 7, 8, 256, 16, "random"),
         (2, 1, 33, 8, 1, 1, 16, "random"), (3, 2, 20, 6, 4, 64, 32, "skewed"), (2, 0, 9, 4, 3, 5, 16, "one"),
         (1, 0, 70, 70, 2, 6, 16, "random"), (4, 1, 40, 13, 6, 37, 64, "skewed"), (2, 1, 11, 3, 5, 2, 16, "random"),
         (3, 0, 30, 4, 3, 300, 32, "random")]


def _kernels_match_torch(block):
    """Every case, int64 and int32 ids, both ops and both layouts; ``block``: the pairs a program takes (None: the
    backend's; 128, the GPUs', in the interpreter too)."""
    from triton_overlap.ops import moe_routing

    if block is not None:
        moe_routing.block_size = lambda: block
    try:
        return _all_cases()
    finally:
        from triton_overlap.kernels.routing import block_size

        moe_routing.block_size = block_size


def _all_cases():
    """This pool rank's share of CASES (every W-th, each case's draws seeded by its index): every case runs once."""
    dev = _device()
    done = 0
    for i, (W, rank, m_local, mpc, topk, E, bm, kind) in enumerate(CASES):
        if i % dist.get_world_size() != dist.get_rank():
            continue
        g = torch.Generator().manual_seed(3 + i)
        layout = ChunkLayout(W, m_local, mpc)
        cfg = to.MoEGEMMConfig(block_m=bm, block_n=16, block_k=16, block_c=16)
        others = [c for c in range(layout.num_chunks) if c // layout.chunks_per_rank != rank]
        arriving = [others[i] for i in torch.randperm(len(others), generator=g).tolist()]
        for dtype in (torch.int64, torch.int32):
            ids = _ids(W * m_local, topk, E, kind, g, dtype)
            # AllGather-MoE
            sched = AllGatherMoESchedule(cfg, None, layout, arrival_segments(layout, rank, arriving, dev),
                                         torch.tensor([rank] + arriving, dtype=torch.int32, device=dev))
            for sorted_output in (False, True):
                routing, (src, dst, pos, _), table = to.AllGatherMoEGEMM.route(sched, ids.to(dev), E, sorted_output)
                order, position, offsets, r_src, r_dst, r_pos, r_table = ag_reference(layout, rank, arriving, ids, E,
                                                                                     bm, sorted_output)
                case = (W, rank, m_local, mpc, topk, E, bm, kind, dtype, sorted_output)
                for name, got, want in (("src", src, r_src), ("dst", dst, r_dst), ("pos", pos, r_pos),
                                        ("table", table, r_table)):
                    assert got.dtype == torch.int32 and torch.equal(got.cpu().long(), want), (name, case)
                if sorted_output:
                    assert routing.order.dtype == torch.int64 and torch.equal(routing.order.cpu(), order), case
                    assert torch.equal(routing.position.cpu().long(), position.long()), case
                    assert torch.equal(routing.offsets.cpu().long(), offsets), case
                else:
                    assert routing is None
            # the tiles in expert order, held back to their lanes (MoEGEMMConfig.tile_lag): 0 is expert order
            slots, chunks = num_slots(ids.numel(), E, bm), len(arriving)
            for tile_lag in (0.0, 0.3) if dtype == torch.int64 else ():
                lagged = replace(sched, cfg=replace(cfg, tile_lag=tile_lag))
                _, (src, dst, pos, _), table = to.AllGatherMoEGEMM.route(lagged, ids.to(dev), E, False, (W, 16, 2))
                lag = lagged.cfg.lag_tiles(slots, chunks, W, topk, 16, 2)
                want = ag_reference(layout, rank, arriving, ids, E, bm, False, lag)
                for name, got, ref in (("src", src, want[3]), ("dst", dst, want[4]), ("pos", pos, want[5]),
                                       ("table", table, want[6])):
                    assert torch.equal(got.cpu().long(), ref), (name, tile_lag, W, rank, E)
            # MoE-ReduceScatter: destinations in a shuffled order, with and without a sorted layout's positions
            dests = torch.randperm(W, generator=g).tolist()
            rs = MoEReduceScatterSchedule(cfg, SimpleNamespace(layout=layout), None,
                                          destination_segments(m_local, dests, dev), None, None)
            remap = torch.randperm(ids.numel(), generator=g).to(torch.int32)
            strided = torch.stack([remap, -remap], 1)[:, 0]  # the same values, not contiguous
            for given in (None, SimpleNamespace(position=remap.to(dev)), SimpleNamespace(position=strided.to(dev))):
                (src, position), table = to.MoEGEMMReduceScatter.route(rs, ids.to(dev), E, given)
                r_src, r_position, r_table = rs_reference(m_local, dests, ids, E, bm, None if given is None else remap)
                for name, got, want in (("src", src, r_src), ("position", position, r_position),
                                        ("table", table, r_table)):
                    assert got.dtype == torch.int32 and torch.equal(got.cpu().long(), want.long()), (name, W, dests)
            done += 1
    return done


@pytest.mark.parametrize("block", [None, 128], ids=["backend_block", "gpu_block"])
def test_routing_kernels_match_torch(pool, block):
    if block is not None and pool.backend != "host":
        pytest.skip("the GPUs' block size is the backend's there")
    if pool.backend == "host" and pool.world != 2:
        pytest.skip("on the host backend at W = 2 only: the cases' worlds are their own (1 to 4), whatever the pool's")
    assert sum(pool.run(_kernels_match_torch, block)) == 2 * len(CASES)


def test_tile_table_reference_bounds_and_covers():
    """The reference's tables (and so the kernels'): each (block, expert) group's rows cut into block_m tiles that
    cover them exactly once, in expert order, within the fixed number of slots (ceil(rows / block_m) + min(E,
    rows)), the rest empty; routings from empty experts to all on one expert."""
    g = torch.Generator().manual_seed(0)
    for B, E, rows, bm in ((1, 4, 37, 16), (3, 7, 20, 8), (1, 256, 44, 16), (2, 1, 9, 16), (1, 5, 64, 16)):
        for kind in ("random", "one", "sparse"):
            if kind == "one":
                counts = torch.zeros(B, E, dtype=torch.int64)
                counts[:, -1] = rows
            else:
                hi = E if kind == "random" else max(1, E // 3)
                counts = torch.stack([torch.bincount(torch.randint(0, hi, (rows,), generator=g), minlength=E)
                                      for _ in range(B)])
            table = tile_table(counts, bm, num_slots(rows, E, bm))
            starts = (counts.reshape(-1).cumsum(0) - counts.reshape(-1)).reshape(B, E)
            for b in range(B):
                seen = []
                for e, first, end in table[b].tolist():
                    if end > first:
                        assert end - first <= bm and starts[b, e] <= first and end <= starts[b, e] + counts[b, e]
                        seen += list(range(first, end))
                assert seen == list(range(int(starts[b, 0]), int(starts[b, 0]) + rows)), (B, E, rows, kind)


def _orders_tiles():
    """AllGather-MoE's tables (rank 1 of 3, two chunks a rank): every pair in exactly one tile, a tile's rows of one
    expert, rows of an expert in chunk-arrival order (this rank's first), tiles ordered by the last chunk they need
    (all-local tiles first), the chunks a tile waits for those of its rows. MoE-ReduceScatter's: each destination's
    slots hold its own tokens' pairs only, in the order of ``dests`` (this rank last)."""
    dev = _device()
    W, m_local, topk, E = 3, 48, 2, 3
    layout = ChunkLayout(W, m_local, 24)
    cfg = to.MoEGEMMConfig(block_m=16, block_n=16, block_k=16, block_c=16)
    at = [2, 0, 1, 4, 5]  # chunks 2 and 3 (rank 1's) here; then rank 0's, then rank 2's, at positions 1 to 4
    sched = AllGatherMoESchedule(cfg, None, layout, arrival_segments(layout, 1, at[1:], dev),
                                 torch.tensor(at, dtype=torch.int32, device=dev))
    ids = torch.randint(0, E, (W * m_local, topk), generator=torch.Generator().manual_seed(1))
    _, (src, dst, rowpos, _), table = to.AllGatherMoEGEMM.route(sched, ids.to(dev), E, False)
    src, dst, rowpos, table = src.cpu(), dst.cpu(), rowpos.cpu(), table.cpu()
    seen, needs = [], []
    for e, first, end in table.tolist():
        if end == first:
            needs.append(99)
            continue
        pairs = dst[first:end].long()
        assert (ids.reshape(-1)[pairs] == e).all() and (src[first:end].long() == pairs // topk).all()
        tok_chunks = {int(t) // m_local * 2 + int(t) % m_local // 24 for t in src[first:end]}
        assert {at[int(p)] for p in rowpos[first:end] if p} == tok_chunks - {2, 3}  # what the tile waits for
        assert (rowpos[first:end][1:] >= rowpos[first:end][:-1]).all()
        needs.append(int(rowpos[end - 1]))
        seen += pairs.tolist()
    assert sorted(seen) == list(range(W * m_local * topk)) and needs == sorted(needs) and needs[0] == 0
    # MoE-ReduceScatter at rank 1: destinations 2, 0, then 1
    rs = MoEReduceScatterSchedule(cfg, SimpleNamespace(layout=layout), None, destination_segments(m_local, [2, 0, 1],
                                                                                                   dev), None, None)
    (src, _), table = to.MoEGEMMReduceScatter.route(rs, ids.to(dev), E, None)
    src, table = src.cpu(), table.cpu()
    slots = table.shape[0] // W
    for q, dest in enumerate((2, 0, 1)):
        for e, first, end in table[q * slots:(q + 1) * slots].tolist():
            pairs = src[first:end].long()
            assert (pairs // topk // m_local == dest).all() and (ids.reshape(-1)[pairs] == e).all()
    return True


def test_routing_orders_tiles(pool):
    if pool.backend == "host" and pool.world != 2:
        pytest.skip("the same on every rank: once, at W = 2 on the host backend")
    assert all(pool.run(_orders_tiles))
