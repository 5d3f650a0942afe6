"""Expert-parallel dispatch and combine: the routing and layouts, by kernels on the device (kernels.ep_routing,
kernels.routing, kernels.row_sums; ops.expert_parallel has the protocol): who sends what to whom (Traffic, read
from the counts every rank holds), this rank's route and packed rows, the expansion of received rows into expert
order, the two weighted sums of a combine, the handle a dispatch returns, the checks that need no
communication, and the fallback's exchanges through the process group."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels.ep_routing import launch_count, launch_expand, launch_pack, tiles
from ..kernels.row_sums import launch_gather_rows_sum
from ..plan import cdiv
from .checks import DTYPES, FP8
from .moe_routing import INDEX_DTYPES

#: a record's leading words: T_local, the smallest id, the largest id (then unique tokens per owner, pairs per expert)
HEAD = 3
#: a received row's metadata before its k layout rows, k weights and G scales: source rank, source token
META_HEAD = 2


@dataclass(frozen=True)
class Traffic:
    """Who sends what to whom in one dispatch, read from the counts table that every rank holds whole.

    ``tokens[s]``: rank s's T_local; ``bounds[s]``: its smallest and largest id (0, 0 without tokens); ``rows[s][d]``:
    the unique tokens s sends to d; ``experts[s][e]``: s's (token, choice) pairs for expert e."""

    world: int
    num_experts: int
    tokens: tuple
    bounds: tuple
    rows: tuple
    experts: tuple

    @classmethod
    def read(cls, table: list, world: int, num_experts: int) -> "Traffic":
        return cls(world, num_experts, tuple(rec[0] for rec in table), tuple((rec[1], rec[2]) for rec in table),
                   tuple(tuple(rec[HEAD:HEAD + world]) for rec in table),
                   tuple(tuple(rec[HEAD + world:HEAD + world + num_experts]) for rec in table))

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world

    def received(self, d: int) -> tuple:
        """Unique tokens rank d receives from each source."""
        return tuple(self.rows[s][d] for s in range(self.world))

    def recv_offset(self, s: int, d: int) -> int:
        """Where source s's block starts in rank d's receive buffer (sources in rank order)."""
        return sum(self.rows[q][d] for q in range(s))

    def send_offset(self, s: int, d: int) -> int:
        """Where rank s's block for owner d starts in s's send order (owners in rank order)."""
        return sum(self.rows[s][:d])

    def expanded(self, d: int) -> int:
        """The rows rank d's experts get: every (token, choice) pair routed to them."""
        el = self.experts_per_rank
        return sum(sum(self.experts[s][d * el:(d + 1) * el]) for s in range(self.world))

    def expert_rows(self, s: int, e: int) -> int:
        """Rows of expert e (global id) that come from source s."""
        return self.experts[s][e]

    def most_received(self) -> int:
        return max(sum(self.received(d)) for d in range(self.world))

    def most_sent(self) -> int:
        return max(sum(self.rows[s]) for s in range(self.world))

    def out_of_range(self) -> list:
        """(rank, smallest, largest) of the ranks whose ids leave [0, E)."""
        E = self.num_experts
        return [(s, lo, hi) for s, (lo, hi) in enumerate(self.bounds) if self.tokens[s] and (lo < 0 or hi >= E)]


@dataclass(frozen=True, eq=False)
class EPHandle:
    """What ``ep_dispatch`` returns on a rank, and what ``ep_combine`` takes back.

    ``tokens`` [R, H]: the rows this rank received, grouped by local expert in expert order, within an expert in
    (source rank, source token, choice j) order; ``counts`` int32 [E/W] rows per local expert and ``offsets`` int32
    [E/W + 1] their bounds (``torch._grouped_mm``'s ``offs`` are ``offsets[1:]``), on the device. Per row: ``source``
    (int32 rank), ``token`` (int32 index among the source's tokens), ``weights`` (float32, its top-k weight).
    ``received``: unique tokens from each source; ``sent``: unique tokens this rank sent to each owner;
    ``traffic``: every rank's counts (Traffic). What combine reads: ``slots`` int32 [U, topk], the row of d.tokens
    that each received token's choice j became (-1: that choice is another rank's) and ``slot_weights`` float32
    [U, topk] its weight; ``positions`` int32 [T_local, W], the row of this rank's send order (owner-major, then
    token order) that token t took for owner d (-1: not sent there). ``seq`` numbers the dispatch on its op (the
    same on every rank). ``scales`` float32 [R, G]: for fp8 rows, each row's scales as its sender passed them
    (None for 16-bit rows). ``projected`` [R, N]: with the dispatch's ``expert_weight`` w, each row @ w[its local
    expert], in d.tokens' order (ops.ep_experts), else None."""

    tokens: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    source: torch.Tensor
    token: torch.Tensor
    weights: torch.Tensor
    received: tuple
    sent: tuple
    traffic: Traffic
    slots: torch.Tensor
    slot_weights: torch.Tensor
    positions: torch.Tensor
    rank: int
    num_tokens: int
    seq: int
    scales: torch.Tensor | None = None
    projected: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """R: the rows this rank's experts get."""
        return self.tokens.shape[0]

    @property
    def num_experts(self) -> int:
        return self.traffic.num_experts


@dataclass(frozen=True, eq=False)
class Route:
    """This rank's routing on the device (kernels.ep_routing): ``record`` int32 (see Traffic), ``ids`` [T, k] the
    caller's ids made contiguous, and what ep_pack reads: ``base`` int32 [blocks, W], ``base_e`` int32 [blocks, E]."""

    record: torch.Tensor
    ids: torch.Tensor
    base: torch.Tensor
    base_e: torch.Tensor


@dataclass(frozen=True, eq=False)
class Sent:
    """This rank's packed rows (owner-major, token order; None where pack pushed them to the owners), their
    metadata int32 [S, 2 + 2k + G] (pack; None likewise), each token's
    position in them per owner (int32 [T, W], -1: not sent there), ``offsets`` int32 [E/W + 1]: this rank's
    experts' first rows in its own expert-sorted layout, and ``counts`` int32 [E/W] their rows
    (kernels.ep_routing.ep_dest)."""

    rows: torch.Tensor
    meta: torch.Tensor
    positions: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor


def capacity(rows: int) -> int:
    """The rows a receive buffer grows to for ``rows``: at least 64, rounded up to an eighth of the power of two
    below it (a few distinct sizes per doubling, at most 1/8 spare)."""
    step = 1 << max(3, max(rows, 64).bit_length() - 4)
    return cdiv(max(rows, 64), step) * step


def check_dispatch(ctx, x, topk_ids, topk_weights, num_experts, scales=None) -> None:
    """ValueError, before anything is launched, for what needs no communication."""
    op, W = "ep_dispatch", ctx.world_size
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{op}: num_experts must be a positive int, got {num_experts!r}")
    if num_experts % W:
        raise ValueError(f"{op}: num_experts = {num_experts} is not divisible by the world size {W} (rank r owns "
                         f"experts [r*E/W, (r+1)*E/W))")
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.device != ctx.device:
            raise ValueError(f"{op}: {name} is on {t.device}, the Context is on {ctx.device}")
    if x.dtype not in DTYPES + (FP8,):
        raise ValueError(f"{op}: x must be float16, bfloat16 or float8_e4m3fn, got {x.dtype}")
    if x.dtype == FP8:
        if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.dim() != 2
                or scales.shape[0] != x.shape[0] or scales.shape[1] < 1 or scales.device != ctx.device):
            got = (f"{scales.dtype} {tuple(scales.shape)} on {scales.device}" if isinstance(scales, torch.Tensor)
                   else type(scales).__name__)
            raise ValueError(f"{op}: float8_e4m3fn x needs scales, float32 [T_local, G] = [{x.shape[0]}, G >= 1] on "
                             f"{ctx.device} (per-token groups, e.g. G = H / 128), got {got}")
    elif scales is not None:
        raise ValueError(f"{op}: scales are for float8_e4m3fn x, got x of {x.dtype}")
    if x.shape[1] == 0:
        raise ValueError(f"{op}: x must have a hidden size of at least 1, got shape {tuple(x.shape)}")
    if topk_ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1:
        raise ValueError(f"{op}: topk_ids must be [T_local, topk] with T_local = {x.shape[0]} (x's rows) and "
                         f"topk >= 1, got {tuple(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{op}: topk_weights must be float32 {tuple(topk_ids.shape)} (topk_ids' shape), got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")


def check_combine(ctx, y, d, out, weight=None) -> None:
    """``y`` [R, N] (or, with the down projection's ``weight`` [E/W, N, N_out], its input) for handle ``d``, and
    ``out`` [T_local, N or N_out] (ValueError, before any launch)."""
    op = "ep_combine"
    if not isinstance(d, EPHandle):
        raise ValueError(f"{op}: d must be the EPHandle ep_dispatch returned, got {type(d).__name__}")
    if d.rank != ctx.rank or d.traffic.world != ctx.world_size:
        raise ValueError(f"{op}: d was made by rank {d.rank} of {d.traffic.world}, this is rank {ctx.rank} of "
                         f"{ctx.world_size}")
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"{op}: y must be a torch.Tensor, got {type(y).__name__}")
    if y.dim() != 2 or y.shape[0] != d.num_rows or y.shape[1] == 0:
        raise ValueError(f"{op}: y must be [R, N] with R = {d.num_rows} (the rows d.tokens holds) and N >= 1, got "
                         f"{tuple(y.shape)}")
    if y.dtype not in DTYPES:
        raise ValueError(f"{op}: y must be float16 or bfloat16, got {y.dtype}")
    if y.device != ctx.device:
        raise ValueError(f"{op}: y is on {y.device}, the Context is on {ctx.device}")
    if weight is not None:
        el = d.traffic.experts_per_rank
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.shape[0] != el \
                or weight.shape[1] != y.shape[1] or weight.shape[2] == 0:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"{op}: expert_weight must be [E/W, K, N] = [{el}, {y.shape[1]}, N] (this rank's "
                             f"experts, K the width of y), got {got}")
        if weight.dtype != y.dtype or weight.device != y.device:
            raise ValueError(f"{op}: expert_weight must be {y.dtype} on {y.device} as y is, got {weight.dtype} on "
                             f"{weight.device}")
    shape = (d.num_tokens, y.shape[1] if weight is None else weight.shape[2])
    if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != y.dtype
                            or out.device != y.device):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{op}: out must be {y.dtype} {shape} on {y.device}, got {got}")


#: device -> int32 [cap + 1, 3] rows (0, b, 0): kernels.routing's group table of one group of b blocks, kept
#: on the device and sliced per call
_GROUPS: dict = {}


def one_group(blocks: int, device) -> torch.Tensor:
    """kernels.routing's groups table [[0, blocks, 0]] for scan_counts: a view of a table kept on the device, so a
    call with a new number of tokens copies nothing from the host."""
    key = str(device)
    found = _GROUPS.get(key)
    if found is None or found.shape[0] <= blocks:
        cap = max(64, 1 << blocks.bit_length())
        b = torch.arange(cap + 1, dtype=torch.int32, device=device)
        found = _GROUPS[key] = torch.stack([torch.zeros_like(b), b, torch.zeros_like(b)], 1).contiguous()
    return found[blocks:blocks + 1]


def route_tokens(topk_ids: torch.Tensor, num_experts: int, world: int, ticket: torch.Tensor | None = None) -> Route:
    """This rank's record, by kernels.ep_routing on the caller's stream, with no host synchronisation. ``ticket``:
    an int32 [1] tensor at zero, owned by the caller's op (no other launch uses it meanwhile), which lets a call of
    few tokens count in one launch (kernels.ep_routing.launch_count); None: three."""
    T = topk_ids.shape[0]
    ids = topk_ids.contiguous()
    dev = ids.device
    E = num_experts
    nb = cdiv(T, tiles()[0])
    sizes = (nb * (2 + world), nb * E, nb * E, HEAD + world + E, nb * world)
    scratch = torch.empty(sum(sizes), dtype=torch.int32, device=dev)
    part, hist, base_e, record, base = torch.split(scratch, sizes)
    part, hist, base_e, base = part.view(nb, 2 + world), hist.view(nb, E), base_e.view(nb, E), base.view(nb, world)
    launch_count(ids, part, hist, base_e, one_group(nb, dev), record, base, T, E, world, ticket)
    return Route(record, ids, base, base_e)


def meta_width(k: int, G: int) -> int:
    """The int32 words of a sent row's metadata: its head, k layout rows, k weights and G scales."""
    return META_HEAD + 2 * k + G


def pack(x, route: Route, weights, rank: int, table: torch.Tensor, S: int, scales=None, push=None,
         gather=None) -> Sent:
    """This rank's ``S`` unique (token, owner) rows, owner-major and in token order within an owner, and their
    metadata: [this rank, token, each choice's row in the owner's expert-sorted layout (-1: another owner's), each
    choice's weight (float32 bits), then the token's ``scales`` (float32 bits) where given] (kernels.ep_routing.
    ep_pack); ``table`` int32 [W, record] every rank's record on the device. fp8 rows travel as their bytes.
    ``push``: None (into new tensors, Sent.rows and Sent.meta), or the symmetric receive buffers and the Context's
    error word (rows, meta, cap, err): straight into every owner's, at this rank's block there, unless any rank's ids
    are out of range, any owner would receive more than ``cap`` rows or ``err`` holds a fault (then nothing moves;
    Sent.rows and Sent.meta are None either way). ``gather``: None, or the owners' symmetric gather indexes (int32,
    each at least as long as its owner's layout): each choice's row in its owner's receive buffer, stored at its
    layout row there (kernels.ep_routing.ep_pack's GATHER)."""
    T, k = route.ids.shape
    W, E = route.base.shape[1], route.base_e.shape[1]
    dev = x.device
    G = 0 if scales is None else scales.shape[1]
    x = x.view(torch.uint8) if x.dtype == FP8 else x
    if push is None:
        rows = torch.empty((S, x.shape[1]), dtype=x.dtype, device=dev)
        meta = torch.empty((S, meta_width(k, G)), dtype=torch.int32, device=dev)
        target = None
    else:
        rows, meta, cap, err = push
        target = (rows.ptrs, meta.ptrs, cap)
        rows, meta = rows.local, meta.local
    positions = torch.empty((T, W), dtype=torch.int32, device=dev)
    EL = E // W
    dest = torch.empty(E + 2 * EL + 1, dtype=torch.int32, device=dev)
    offsets, counts = dest[E:E + EL + 1], dest[E + EL + 1:]
    sbits = None if scales is None else scales.contiguous().view(torch.int32)
    launch_pack(x if x.stride(1) == 1 else x.contiguous(), route.ids, weights.contiguous().view(torch.int32), sbits,
                route.record, route.base, route.base_e, table, dest[:E], offsets, counts, rows, meta, positions, E, W,
                rank, target, None if push is None else err, None if gather is None else gather.ptrs)
    if push is not None:  # (the rows went to the owners)
        rows = meta = None
    return Sent(rows, meta, positions, offsets, counts)


def expand(rows: torch.Tensor, meta: torch.Tensor, R: int, sent: Sent, k: int, dtype) -> tuple:
    """The received unique rows ``rows`` [U, H] (sources in rank order, each in token order) and their ``meta``,
    expanded to the ``R`` (row, choice) pairs of this rank's experts in its expert-sorted layout, each copied to the
    row its metadata names (kernels.ep_routing.ep_expand): (tokens, counts, offsets, source, token, weights, slots,
    slot_weights, scales) (EPHandle); ``sent``: pack's (its offsets and counts); ``dtype`` the rows' (fp8:
    ``rows`` holds their bytes, and the metadata's columns past the weights are each row's scales)."""
    dev, U = rows.device, rows.shape[0]
    G = meta.shape[1] - META_HEAD - 2 * k
    tokens = torch.empty((R, rows.shape[1]), dtype=rows.dtype, device=dev)
    small = torch.empty(3 * R + 2 * U * k + R * G, dtype=torch.int32, device=dev)
    source, token, weights, slots, slot_weights, scales = torch.split(small, (R, R, R, U * k, U * k, R * G))
    launch_expand(rows, meta, tokens, source, token, weights, slots, slot_weights, scales.view(R, G) if G else None,
                  k)
    return (tokens.view(dtype), sent.counts, sent.offsets, source, token, weights.view(torch.float32), slots.view(U, k),
            slot_weights.view(torch.float32).view(U, k), scales.view(torch.float32).view(R, G) if G else None)


def owner_partials(ctx, y: torch.Tensor, d: EPHandle) -> torch.Tensor:
    """[U, N] in y's dtype: for each received unique row, Σ over its choices j among this rank's experts (in j
    order) of weight · y, summed in float32 and rounded once (kernels.row_sums: the same bits on every call)."""
    partials = torch.empty((sum(d.received), y.shape[1]), dtype=y.dtype, device=y.device)
    launch_gather_rows_sum(ctx, y, d.slots, d.slot_weights, partials)
    return partials


def sum_partials(ctx, back: torch.Tensor, d: EPHandle, out: torch.Tensor) -> None:
    """``out`` [T_local, N] = the sum in float32, in owner rank order, of the partials ``back`` [S, N] (owner-major,
    as this rank sent its rows) of each token, rounded once."""
    if out.stride(-1) == 1:
        launch_gather_rows_sum(ctx, back, d.positions, None, out)
    else:
        staged = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        launch_gather_rows_sum(ctx, back, d.positions, None, staged)
        out.copy_(staged)


def counts_by_group(ctx, record: torch.Tensor) -> tuple:
    """Every rank's record through the process group's all_to_all_single (the fallback's counts): (the table as
    lists, the table on the device)."""
    W = ctx.world_size
    table = torch.empty((W, record.numel()), dtype=torch.int32, device=record.device)
    dist.all_to_all_single(table, record.unsqueeze(0).expand(W, -1).contiguous(), group=ctx.group)
    return table.tolist(), table


def rows_by_group(ctx, sent: Sent, traffic: Traffic) -> tuple:
    """The fallback's rows and metadata through all_to_all_single, into the receive layout (sources in rank
    order): (rows, meta)."""
    r = ctx.rank
    received, sends = list(traffic.received(r)), list(traffic.rows[r])
    U = sum(received)
    rows = torch.empty((U, sent.rows.shape[1]), dtype=sent.rows.dtype, device=sent.rows.device)
    meta = torch.empty((U, sent.meta.shape[1]), dtype=torch.int32, device=sent.meta.device)
    dist.all_to_all_single(rows, sent.rows, received, sends, group=ctx.group)
    dist.all_to_all_single(meta, sent.meta, received, sends, group=ctx.group)
    return rows, meta


def combine_by_group(ctx, y: torch.Tensor, d: EPHandle, out: torch.Tensor) -> None:
    """The fallback's combine: the owner's partials (owner_partials) back to their sources through
    all_to_all_single, then the sums into ``out``."""
    partials = owner_partials(ctx, y, d)
    back = torch.empty((sum(d.sent), y.shape[1]), dtype=y.dtype, device=y.device)
    dist.all_to_all_single(back, partials, list(d.sent), list(d.received), group=ctx.group)
    sum_partials(ctx, back, d, out)


__all__ = ["EPHandle", "Route", "Sent", "Traffic", "capacity", "check_combine", "check_dispatch", "combine_by_group",
           "counts_by_group", "expand", "meta_width", "owner_partials", "pack", "route_tokens", "rows_by_group",
           "sum_partials"]
