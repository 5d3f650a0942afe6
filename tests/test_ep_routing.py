"""Expert-parallel routing kernels (kernels.ep_routing, through ops.ep_routing's route_tokens, pack and expand)
against a plain-torch version of the same layouts, element for element: the record every rank exchanges, the packed
rows with their metadata and positions, and the received rows expanded into expert order. Integer results and
copied rows, so equality is exact. Each rank of the pool runs every case on its device (the host backend: Triton's
interpreter)."""
import torch

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


def ref_pack(x, ids, weights, rank, E, W):
    """(rows, meta, positions) in the send order: owner-major, then token order."""
    T, k = ids.shape
    el = E // W
    c = ids.long().clamp(0, E - 1)
    bits = weights.contiguous().view(torch.int32)
    rows, meta, positions = [], [], torch.full((T, W), -1, dtype=torch.int32)
    for d in range(W):
        for t in range(T):
            owner = c[t] // el
            if (owner == d).any():
                positions[t, d] = len(rows)
                rows.append(x[t])
                local = torch.where(owner == d, c[t] - d * el, el)
                meta.append(torch.cat([torch.tensor([rank, t]), local, bits[t].long()]))
    H = x.shape[1]
    return (torch.stack(rows) if rows else x.new_empty(0, H),
            torch.stack(meta).to(torch.int32) if meta else torch.empty(0, META_HEAD + 2 * k, dtype=torch.int32),
            positions)


def ref_expand(rows, meta, el, k):
    U = rows.shape[0]
    local = meta[:, META_HEAD:META_HEAD + k].long().clamp(0, el).reshape(-1)
    order = torch.sort(local, stable=True).indices
    R = int((local < el).sum())
    order = order[:R]
    counts = torch.bincount(local[order], minlength=el)[:el]
    slots = torch.full((U * k,), -1, dtype=torch.int64)
    slots[order] = torch.arange(R)
    w = meta[:, META_HEAD + k:].contiguous().view(torch.float32)
    return dict(tokens=rows[order // k], counts=counts, offsets=torch.cat([torch.zeros(1, dtype=torch.int64),
                                                                              counts.cumsum(0)]),
                source=meta[order // k, 0], token=meta[order // k, 1], weights=w.reshape(-1)[order],
                slots=slots.view(U, k), slot_weights=w), R


def _ids(T, k, E, kind, g):
    if kind == "one":
        return torch.full((T, k), E - 1)
    if kind == "skewed":
        return torch.randint(0, max(1, E // 3), (T, k), generator=g)
    return torch.randint(0, E, (T, k), generator=g)


# (world, rank, tokens, topk, experts, hidden, routing)
CASES = [(2, 0, 13, 2, 4, 24, "random"), (3, 1, 37, 8, 12, 40, "random"), (4, 3, 5, 6, 256, 17, "skewed"),
         (2, 1, 0, 2, 8, 16, "random"), (8, 5, 29, 3, 16, 8, "random"), (2, 0, 9, 1, 2, 70, "one"),
         (1, 0, 20, 4, 6, 33, "random"), (4, 0, 64, 5, 300, 9, "random")]


def _cases_match():
    dev = _device()
    # the record's smallest and largest ids clamp into int32 (an int64 id past it still reads out of range)
    wide = route_tokens(torch.tensor([[0, 1 << 40], [-(1 << 40), 3]], device=dev), 4, 2).record
    assert wide[:3].tolist() == [2, -(1 << 31), (1 << 31) - 1]
    g = torch.Generator().manual_seed(5)
    done = 0
    for W, rank, T, k, E, H, kind in CASES:
        el = E // W
        received_rows, received_meta = [], []
        for dtype in (torch.int64, torch.int32):
            for s in range(W):  # every source's tokens: this rank's own, and what the others would send it
                ids = _ids(T, k, E, kind, g).to(dtype)
                x = torch.randn(T, H, generator=g).to(torch.bfloat16)
                weights = torch.rand(T, k, generator=g)
                route = route_tokens(ids.to(dev), E, W)
                want = ref_record(ids, E, W)
                assert torch.equal(route.record.cpu().long(), want), (W, rank, T, k, E, s, dtype)
                S = int(want[3:3 + W].sum())
                sent = pack(x.to(dev), route, weights.to(dev), s, el, S)
                r_rows, r_meta, r_pos = ref_pack(x, ids, weights, s, E, W)
                case = (W, rank, T, k, E, H, kind, s, dtype)
                assert torch.equal(sent.rows.cpu(), r_rows), case
                assert torch.equal(sent.meta.cpu(), r_meta), case
                assert torch.equal(sent.positions.cpu(), r_pos), case
                if dtype == torch.int64:
                    n = int(want[3 + rank])
                    first = int(want[3:3 + rank].sum())
                    received_rows.append(r_rows[first:first + n])
                    received_meta.append(r_meta[first:first + n])
        rows, meta = torch.cat(received_rows), torch.cat(received_meta)
        if meta.shape[0]:  # stale metadata (a wait that gave up) is clamped into [0, el]
            meta[0, META_HEAD] = -7
            meta[-1, META_HEAD + k - 1] = el + 5
        want, R = ref_expand(rows, meta, el, k)
        got = expand(rows.to(dev), meta.to(dev), R, el, k)
        names = ("tokens", "counts", "offsets", "source", "token", "weights", "slots", "slot_weights")
        for name, value in zip(names, got):
            assert value.device == dev, name
            ref = want[name]
            if value.dtype.is_floating_point:
                assert value.dtype == ref.dtype and torch.equal(value.cpu(), ref), (name, W, rank, T, k, E)
            else:
                assert value.dtype == torch.int32 and torch.equal(value.cpu().long(), ref.long()), (name, W, T, k, E)
        done += 1
    return done


def test_ep_routing_kernels_match_torch(pool):
    assert pool.run(_cases_match) == [len(CASES)] * pool.world
