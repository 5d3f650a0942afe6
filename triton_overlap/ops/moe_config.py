"""The tensor-parallel MoE ops' knobs (MoEGEMMConfig) and the operand checks they share."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .base import OverlapOp, call_key
from .checks import DTYPES
from .config import GEMMS, ChunkedGemmConfig, power_of_two, require


@dataclass(frozen=True)
class MoEGEMMConfig(ChunkedGemmConfig):
    """AllGather-MoE-GEMM's and MoE-GEMM-ReduceScatter's knobs: the grouped GEMM's tiles (``block_m`` rows of one
    expert by ``block_n`` columns, ``block_k`` deep), the chunking of each rank's tokens (ChunkedGemmConfig),
    ``block_c``: the tokens of one top-k combine tile (MoE-GEMM-ReduceScatter), ``gemm``: AllGather-MoE's
    grouped GEMM, "auto" (or "gluon"): on Hopper with 16-bit operands and 128-row tiles the warp-specialized Gluon
    kernel (kernels.grouped_gemm_hopper), where it can run, else kernels.grouped_gemm's; "triton": always the
    latter; ``send_rows``: AllGather-MoE's ranks send their tokens' rows, one per top-k choice, sorted by expert
    (ops.all_gather_moe, "Rows sent sorted": topk times the bytes, each tile's rows consecutive, read by TMA on
    Hopper) instead of the tokens, which each tile gathers row by row; None (the default): where the Gluon kernel
    reads rows by TMA and the weight shard has at least ROWS_MIN_N columns (docs/decisions.md, Tensor-parallel
    MoE); ``tile_lag``: AllGather-MoE's tile order where tokens are sent, the share of the grouped
    GEMM's time the peers' rows take to land: each tile runs at its place in expert order (an expert's tiles
    together, its weight read once while it is in L2) or once enough of the tiles that need no peer (this rank's,
    about 1/W of any stretch of the order) have run to fill the time until its last chunk is expected, whichever
    comes later (``lag_tiles``; 0: expert order; W * tile_lag at least the peers' chunks, ``inf`` among them: all
    of this rank's tiles first, then by arrival; None: estimated from the shapes, ``lag_estimate``);
    ``reduce_in_host``: MoE-GEMM-ReduceScatter's partials for an owner on another host summed within the host
    before they cross, as GEMMReduceScatterConfig's."""

    block_c: int = 64
    gemm: str = "auto"
    send_rows: bool | None = None
    tile_lag: float | None = None
    reduce_in_host: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.gemm not in GEMMS:
            raise ValueError(f"MoEGEMMConfig.gemm must be one of {GEMMS}, got {self.gemm!r}")
        require(self, ("block_c",), power_of_two(16), "a power of two >= 16")
        if self.send_rows not in (None, True, False):
            raise ValueError(f"MoEGEMMConfig.send_rows must be None, True or False, got {self.send_rows!r}")
        if self.tile_lag is not None and not self.tile_lag >= 0:
            raise ValueError(f"MoEGEMMConfig.tile_lag must be None or >= 0, got {self.tile_lag}")

    def lag_tiles(self, tiles: int, chunks: int, world: int, topk: int, n: int, elsize: int) -> int:
        """sort_segments' ``lag`` for a call whose tile table has ``tiles`` slots and ``chunks`` peer chunks
        arriving: the slots of expert order between two chunks' expected arrivals, ``world * share * tiles /
        chunks`` with ``share`` = ``tile_lag`` (else ``lag_estimate``), so that this rank's tiles among them (about
        1 / world) fill the time ``share`` of the GEMM's (slots, at least the tiles used, err on the late side); -1
        (by arrival alone) where that is the whole table, or no chunk arrives."""
        if chunks < 1:
            return -1
        share = lag_estimate(world, topk, n, elsize) if self.tile_lag is None else self.tile_lag
        if world * share >= chunks:
            return -1
        return math.ceil(world * share * tiles / chunks)

    def sends_rows(self, n: int, by_tma: bool) -> bool:
        """Whether AllGather-MoE sends rows sorted by expert (``send_rows``) for a weight shard of ``n`` columns,
        ``by_tma``: whether its grouped GEMM would read such rows by TMA."""
        return self.send_rows if self.send_rows is not None else by_tma and n >= ROWS_MIN_N

    @classmethod
    def defaults(cls, ctx) -> "MoEGEMMConfig":
        """Interpreter-sized tiles where kernels are interpreted (the host backend); on GPUs 128 x 256 tiles, 64 deep,
        in groups of 8 row tiles (the best of the sweep in docs/decisions.md on one H200, on every model shape
        there), one copy stream on CUDA."""
        if ctx.interpreted:
            return cls(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=1, num_stages=1, chunks_per_rank=2,
                       block_c=16)
        if ctx.backend == "hip":
            return cls(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=2, min_chunk_bytes=16 << 20)
        return cls(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3,
                   min_chunk_bytes=16 << 20, num_streams=1)


#: AllGather-MoE sends rows sorted by expert by default from this many columns of the weight shard (Mixtral-8x7B's
#: gate/up at W = 8; docs/decisions.md, Tensor-parallel MoE)
ROWS_MIN_N = 3584

#: the estimate's rates (H200 figures, rounded): the grouped GEMM's FLOP/s and the bytes a second a rank receives
LAG_GEMM_FLOPS, LAG_LINK_BYTES = 600e12, 300e9


def lag_estimate(world: int, topk: int, n: int, elsize: int) -> float:
    """The share of AllGather-MoE's grouped GEMM that runs while the peers' rows land: the (W - 1) / W of the T
    tokens' rows of ``elsize``-byte values over the link against the GEMM's 2 * T * topk * n FLOPs a row of K, at
    LAG_LINK_BYTES and LAG_GEMM_FLOPS (K and T cancel)."""
    return (world - 1) / world * elsize * LAG_GEMM_FLOPS / (LAG_LINK_BYTES * 2 * topk * n)


def moe_table_shape(tokens: int, k: int, n: int, experts: int, topk: int) -> tuple:
    """An MoE call's shape in the tuned tables (ops.tuned, under ``ag_moe_gemm`` / ``moe_gemm_rs`` by GPU and world
    size): ``(T, K, N, E, topk)``, with T the tokens of all ranks and ``w`` [E, K, N] the call's weight shard (for
    AllGatherMoEGEMM K is x's width and N the local columns; for MoEGEMMReduceScatter K is h's local width and N
    the output's). T leads, the way the dense ops' M does (the rows of the GEMM every rank runs: each rank's
    grouped GEMM covers the T * topk pairs of all ranks' tokens), so a shape without an entry takes the entry with
    the same K, N, E and topk whose T is nearest on a log scale, and a tiles-only entry (world size "any") is keyed
    by the GEMM it was timed on. E and topk stay exact: they set how many rows each expert gets, hence the tiles.
    The routing (balanced or skewed) is not in the key: an op cannot see it before it routes on the device, and a
    later tuning of the same shape replaces an earlier one."""
    return (tokens, k, n, experts, topk)


def check_moe_operands(op: str, ctx, a: torch.Tensor, w: torch.Tensor, a_name: str, a_dims: tuple) -> None:
    """``a`` (``a_name``) of one of the ``a_dims`` ranks and ``w`` [E, K, N] of the same 16-bit dtype on the
    Context's device, K matching ``a``'s last dimension (ValueError, before any launch). ``a`` may hold no tokens
    (its first dimension 0: the op returns an empty result); nothing else may be empty."""
    for name, t, dims in ((a_name, a, a_dims), ("w", w, (3,))):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() not in dims:
            want = " or ".join(f"{d}-D" for d in dims)
            raise ValueError(f"{op}: {name} must be {want}, got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{op}: {name} must be float16 or bfloat16, got {t.dtype}")
        if t.device != ctx.device:
            raise ValueError(f"{op}: {name} is on {t.device}, the Context is on {ctx.device}")
        if 0 in (t.shape[1:] if t is a else t.shape):
            raise ValueError(f"{op}: empty operand: {name} {tuple(t.shape)}")
    if a.dtype != w.dtype:
        raise ValueError(f"{op}: {a_name} and w have different dtypes ({a.dtype} vs {w.dtype})")
    if a.shape[-1] != w.shape[1]:
        raise ValueError(f"{op}: inner dimensions differ: {a_name} is {tuple(a.shape)}, w is {tuple(w.shape)} "
                         f"([E, K, N])")


def check_out(op: str, out, shape: tuple, dtype, device) -> None:
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or out.device != device):
        raise ValueError(f"{op}: out must be {dtype} {shape} on {device}, got {out.dtype} {tuple(out.shape)} on "
                         f"{out.device}")


class MoEOp(OverlapOp):
    """What both MoE ops share: their config class, ``check_routing`` (the ids' range and agreement across ranks,
    checked before launch at the cost of one device-to-host copy and a host exchange; False where the caller
    guarantees them, as TPMoE does), the last call's shape in the tuned tables and ``last_gemm``, the grouped GEMM
    kernel the last overlapped call ran.

    Eager replay (ops.replay) where ``check_routing`` is off: the routing is made on the device from the ids'
    values, so a captured call replays correctly on new ids at the same address; the host's part of a call (about
    ten kernel launches, the copies and their flags) becomes one graph launch (and, for a sorted call, three copies
    of its routing out of the graph's memory). With ``check_routing`` every call reads the ids' values on the host,
    so it runs as enqueued. The key holds the op's ``user_config`` besides the call's tensors and overrides. A
    held graph keeps what its call allocated (MoE-ReduceScatter's [T * topk, N] products, the routing tables), so
    an MoE op holds at most REPLAY_GRAPHS graphs: enough for the keys of one or two layers'
    forward and backward; a model whose MoE layers share one op and take more keys replays the most recent."""

    #: graphs an MoE op holds at most (ops.replay.ReplayCache's capacity), each with its call's scratch
    REPLAY_GRAPHS = 4
    CONFIG = MoEGEMMConfig

    ACROSS_HOSTS = True

    def __init__(self, ctx, config: MoEGEMMConfig | None = None, *, fallback: str = "auto",
                 check_routing: bool = True, name: str | None = None, replay: bool = True):
        super().__init__(ctx, config, fallback=fallback, name=name, replay=replay)
        self.replays.capacity = self.REPLAY_GRAPHS
        self.check_routing = check_routing
        self.last_table_shape = None
        self.last_gemm = None

    def default_config(self, shape, variant=""):
        return MoEGEMMConfig.defaults(self.ctx)

    def replay_key(self, args: tuple, *tensors):
        """A call's replay key (ops.replay.call_key of every tensor the enqueued work reads or writes), or None where
        the call runs as enqueued: ``check_routing`` on (its host read depends on the ids' values, no key's part;
        OverlapOp.replayed finds no graph for None)."""
        return None if self.check_routing else call_key(args, *tensors)

    def run_replayed(self, key, shape_key, enqueue):
        """``enqueue()`` (which returns what the call made: None, a MoERouting, a tensor or a tuple of them), or a
        replay of its graph (ReplayCache.run), whose outputs come back as replayed_outputs."""
        if key is None:
            return enqueue()
        made = []
        if self.replays.run(key, shape_key, lambda: made.append(enqueue()) or made[-1]):
            return self.replayed_outputs()
        return made[0]

    def replayed_outputs(self):
        """What the call just replayed made (run_replayed), its tensors copied out of the graph's memory, which the
        next replay rewrites."""
        return _copied(self.replays.last_outputs)


def _copied(made):
    if made is None:
        return None
    if isinstance(made, torch.Tensor):
        return made.clone()
    if isinstance(made, tuple):
        return tuple(map(_copied, made))
    return replace(made, order=made.order.clone(), position=made.position.clone(), offsets=made.offsets.clone())


__all__ = ["ROWS_MIN_N", "MoEGEMMConfig", "MoEOp", "check_moe_operands", "check_out", "lag_estimate",
           "moe_table_shape"]
