"""Expert-parallel routing kernels (kernels.ep_routing, through ops.ep_routing's route_tokens, pack and expand)
against a plain-torch version of the same layouts, element for element: the record every rank exchanges, the packed
rows with their metadata and positions, and the received rows expanded into expert order. Integer results and
copied rows, so equality is exact. Each rank of the pool runs every case on its device (the host backend: Triton's
interpreter)."""
import pytest
import torch
import torch.distributed as dist

from triton_overlap.ops.ep_routing import META_HEAD, expand, pack, route_tokens


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def ref_record(ids, E, W):
    T = ids.shape[0]
    wide = ids.long().clamp(-(1 << 31), (1 << 31) - 1)
    c = ids.long().clamp(0, E - 1)
    hit = torch.zeros(T, W, dtype=torch.bool)
    hit.scatter_(1, c // (E // W), True)
    bounds = [int(wide.min()), int(wide.max())] if T else [0, 0]
    return torch.tensor([T] + bounds + hit.sum(0).tolist() + torch.bincount(c.reshape(-1), minlength=E).tolist())


def ref_layout(all_ids, E, W):
    """{(source, token, choice): its row in the owner's layout}: an owner's pairs by (local expert, source, token,
    choice)."""
    rows = {}
    for d in range(W):
        pairs = []
        for s, ids in enumerate(all_ids):
            c = ids.long().clamp(0, E - 1)
            for t in range(ids.shape[0]):
                for j in range(ids.shape[1]):
                    if int(c[t, j]) // (E // W) == d:
                        pairs.append((int(c[t, j]), s, t, j))
        for p, (_, s, t, j) in enumerate(sorted(pairs)):
            rows[(s, t, j)] = p
    return rows


def ref_pack(x, ids, weights, rank, E, W, layout, scales=None):
    """(rows, meta, positions) in the send order: owner-major, then token order; fp8 rows as their bytes, the
    token's ``scales`` at the end of its metadata."""
    T, k = ids.shape
    c = ids.long().clamp(0, E - 1)
    bits = weights.contiguous().view(torch.int32)
    rows, meta, positions = [], [], torch.full((T, W), -1, dtype=torch.int32)
    for d in range(W):
        for t in range(T):
            owner = c[t] // (E // W)
            if (owner == d).any():
                positions[t, d] = len(rows)
                rows.append(x[t])
                dest = [layout[(rank, t, j)] if owner[j] == d else -1 for j in range(k)]
                extra = [] if scales is None else [scales[t].contiguous().view(torch.int32).long()]
                meta.append(torch.cat([torch.tensor([rank, t] + dest), bits[t].long()] + extra))
    H = x.shape[1]
    G = 0 if scales is None else scales.shape[1]
    rows = torch.stack(rows) if rows else x.new_empty(0, H)
    return (rows.view(torch.uint8) if rows.dtype == torch.float8_e4m3fn else rows,
            torch.stack(meta).to(torch.int32) if meta else torch.empty(0, META_HEAD + 2 * k + G, dtype=torch.int32),
            positions)


def ref_expand(rows, meta, counts, k):
    """What a dispatch returns from the received ``rows`` and ``meta`` (rows whose layout row is outside [0, R):
    none), and which layout rows some pair fills (where the metadata is stale, not all: those rows are not
    compared)."""
    U, R = rows.shape[0], int(counts.sum())
    dest = meta[:, META_HEAD:META_HEAD + k].long()
    slots = torch.where((dest >= 0) & (dest < R), dest, -1)
    w = meta[:, META_HEAD + k:META_HEAD + 2 * k].contiguous().view(torch.float32)
    sc = meta[:, META_HEAD + 2 * k:].contiguous().view(torch.float32)
    scales = torch.zeros(R, sc.shape[1])
    tokens = rows.new_zeros(R, rows.shape[1])
    source, token, weights = (torch.zeros(R, dtype=torch.int64) for _ in range(3))
    weights = torch.zeros(R)
    for u in range(U):
        for j in range(k):
            p = int(slots[u, j])
            if p >= 0:
                tokens[p], source[p], token[p], weights[p] = rows[u], meta[u, 0], meta[u, 1], w[u, j]
                scales[p] = sc[u]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    filled = torch.zeros(R, dtype=torch.bool)
    filled[slots[slots >= 0]] = True
    return dict(tokens=tokens, counts=counts, offsets=offsets, source=source, token=token, weights=weights,
                slots=slots, slot_weights=w, scales=scales if sc.shape[1] else None), R, filled


def _ids(T, k, E, kind, g):
    if kind == "one":
        return torch.full((T, k), E - 1)
    if kind == "skewed":
        return torch.randint(0, max(1, E // 3), (T, k), generator=g)
    return torch.randint(0, E, (T, k), generator=g)


# (world, rank, tokens of each rank (an int: that many, one more on odd ranks), topk, experts, hidden, routing);
# every case but the one with no tokens anywhere gives the checked rank rows to expand; 256 and 257 tokens: the most
# that the GPUs' blocks count in one launch, and one more
CASES = [(2, 0, 13, 2, 4, 24, "random"), (3, 1, 37, 8, 12, 40, "random"), (4, 0, 5, 6, 256, 17, "skewed"),
         (2, 1, 0, 2, 8, 16, "random"), (8, 5, 29, 3, 16, 8, "random"), (2, 1, 9, 1, 2, 70, "one"),
         (1, 0, 20, 4, 6, 33, "random"), (4, 0, 64, 5, 300, 9, "random"), (3, 0, (0, 11, 5), 7, 9, 65, "random"),
         (2, 1, 256, 2, 8, 16, "random")]


def _strided(ids, x, weights):
    """The same values in layouts a caller may pass: ids interleaved, x rows twice as far apart, weights
    column-major."""
    wide = torch.empty(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
    wide[:, :x.shape[1]] = x
    return (torch.stack([ids, ids], -1)[..., 0], wide[:, :x.shape[1]], weights.t().contiguous().t())


def _fp8(x, g):
    """fp8 e4m3 rows and per-token float32 scales [T, 3] (the values do not matter: they are moved, not read)."""
    return x.to(torch.float8_e4m3fn), torch.rand(x.shape[0], 3, generator=g)


def _kernels_match(gpu_tiles: bool):
    """Every case; ``gpu_tiles``: the GPUs' token block and column tile in the interpreter too."""
    from triton_overlap.kernels import ep_routing as kernels
    from triton_overlap.ops import ep_routing as ops

    if gpu_tiles:
        kernels.tiles = ops.tiles = lambda: kernels.GPU_TILES
    try:
        return _cases_match()
    finally:
        kernels.tiles = ops.tiles = kernels.backend_tiles


def _one_launch(ids, E, W, route) -> bool:
    """Whether route_tokens with a ticket counts ``ids`` as ``route`` did (the three launches), leaves the ticket at
    zero, and took kernels.ep_routing.ep_count_record where the tokens fill at most ONE_LAUNCH_BLOCKS blocks."""
    from triton_overlap.kernels import ep_routing as kernels

    ticket = torch.zeros(1, dtype=torch.int32, device=ids.device)
    launched, launch = [], kernels.launch
    kernels.launch = lambda fn, *args, **kw: launched.append(fn) or launch(fn, *args, **kw)
    try:
        one = route_tokens(ids, E, W, ticket)
    finally:
        kernels.launch = launch
    blocks = -(-ids.shape[0] // kernels.tiles()[0])
    took = kernels.ep_count_record in launched
    return (took == (1 <= blocks <= kernels.ONE_LAUNCH_BLOCKS) and int(ticket) == 0
            and all(torch.equal(a, b) for a, b in ((one.record, route.record), (one.base, route.base),
                                                   (one.base_e, route.base_e))))


def _cases_match():
    dev = _device()
    # the record's smallest and largest ids clamp into int32 (an int64 id past it still reads out of range)
    wide = route_tokens(torch.tensor([[0, 1 << 40], [-(1 << 40), 3]], device=dev), 4, 2).record
    assert wide[:3].tolist() == [2, -(1 << 31), (1 << 31) - 1]
    done = 0
    for i, (W, rank, T, k, E, H, kind) in enumerate(CASES):  # this pool rank's share: every case runs once
        if i % dist.get_world_size() != dist.get_rank():
            continue
        g = torch.Generator().manual_seed(5 + i)
        el = E // W
        tokens = T if isinstance(T, tuple) else tuple(T + s % 2 * (T > 0) for s in range(W))
        for dtype in (torch.int64, torch.int32):  # int32 ids: strided layouts, fp8 rows with scales
            all_ids = [_ids(tokens[s], k, E, kind, g).to(dtype) for s in range(W)]
            layout = ref_layout(all_ids, E, W)
            routes = [route_tokens(ids.to(dev), E, W) for ids in all_ids]
            table = torch.stack([r.record for r in routes])
            for ids, route in zip(all_ids, routes):  # the count in one launch (a ticket): the same record and bases
                assert _one_launch(ids.to(dev), E, W, route), (W, rank, T, k, E, dtype)
            received_rows, received_meta = [], []
            for s, (ids, route) in enumerate(zip(all_ids, routes)):  # each source: this rank and the others
                want = ref_record(ids, E, W)
                case = (W, rank, T, k, E, H, kind, s, dtype)
                assert torch.equal(route.record.cpu().long(), want), case
                x = torch.randn(ids.shape[0], H, generator=g).to(torch.bfloat16)
                weights = torch.rand(ids.shape[0], k, generator=g)
                scales = None
                given = (ids, x, weights) if dtype == torch.int64 else _strided(ids, x, weights)
                if dtype == torch.int32:
                    route = route_tokens(given[0].to(dev), E, W)
                    assert torch.equal(route.record, table[s]), case
                    x, scales = _fp8(x, g)
                    given = (given[0], x, given[2])
                sent = pack(given[1].to(dev), route, given[2].to(dev), s, table, int(want[3:3 + W].sum()),
                            None if scales is None else scales.to(dev))
                r_rows, r_meta, r_pos = ref_pack(x, ids, weights, s, E, W, layout, scales)
                assert torch.equal(sent.rows.cpu(), r_rows), case
                assert torch.equal(sent.meta.cpu(), r_meta), case
                assert torch.equal(sent.positions.cpu(), r_pos), case
                first, n = int(want[3:3 + rank].sum()), int(want[3 + rank])
                received_rows.append(r_rows[first:first + n])
                received_meta.append(r_meta[first:first + n])
                if s == rank:
                    mine = sent
            counts = sum(ref_record(ids, E, W)[3 + W + rank * el:3 + W + (rank + 1) * el] for ids in all_ids)
            assert torch.equal(mine.offsets.cpu().long(), torch.cat([torch.zeros(1, dtype=torch.int64),
                                                                     counts.cumsum(0)])), (W, rank, T, k, E)
            assert torch.equal(mine.counts.cpu().long(), counts), (W, rank, T, k, E)
            rows, meta = torch.cat(received_rows), torch.cat(received_meta)
            if meta.shape[0]:  # stale metadata (a wait that gave up): rows outside the layout are dropped
                meta[0, META_HEAD] = -7
                meta[-1, META_HEAD + k - 1] = 1 << 20
            want, R, filled = ref_expand(rows, meta, counts, k)
            assert R > 0 or sum(tokens) == 0, (W, rank, T, k, E)  # (the expansion compares something)
            fp8 = dtype == torch.int32
            got = expand(rows.to(dev), meta.to(dev), R, mine, k, torch.float8_e4m3fn if fp8 else torch.bfloat16)
            assert got[0].dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
            assert (got[8] is None) != fp8, "scales come back for fp8 rows only"
            got = (got[0].view(torch.uint8) if fp8 else got[0],) + tuple(got[1:8]) + ((got[8],) if fp8 else ())
            names = ("tokens", "counts", "offsets", "source", "token", "weights", "slots", "slot_weights", "scales")
            for name, value in zip(names, got):
                assert value.device == dev, name
                ref = want[name]
                if name in ("tokens", "source", "token", "weights", "scales"):
                    value, ref = value.cpu()[filled], ref[filled]
                if name == "tokens":  # (fp8 rows compared as their bytes)
                    assert value.dtype == ref.dtype and torch.equal(value, ref), (name, W, rank, T, k, E)
                elif value.dtype.is_floating_point:
                    assert value.dtype == ref.dtype and torch.equal(value.cpu(), ref), (name, W, rank, T, k, E)
                else:
                    assert value.dtype == torch.int32 and torch.equal(value.cpu().long(), ref.long()), (name, W, T)
        done += 1
    return done


@pytest.mark.parametrize("tiles", ["backend_tiles", "gpu_tiles"])
def test_ep_routing_kernels_match_torch(pool, tiles):
    if tiles == "gpu_tiles" and pool.backend != "host":
        pytest.skip("the GPUs' tiles are the backend's there")
    if pool.backend == "host" and pool.world != 2:
        pytest.skip("on the host backend at W = 2 only: the cases' worlds are their own, whatever the pool's")
    assert sum(pool.run(_kernels_match, tiles == "gpu_tiles")) == len(CASES)
