"""AllReduce for small messages (decode-time tensor parallelism): the sum over ranks of a tensor, in one kernel.

Small messages are latency-bound: one kernel launch in which every rank stores its input into every peer's
receive slot as words that carry the call number, and sums the W slots as their words arrive (kernels.all_reduce,
kernels.tagged_exchange). No barrier, no host
synchronisation and no host-side call number, so it can be captured in a CUDA graph and replayed. Above
``one_shot_max_bytes`` the op hands the message to the process group (NCCL on GPUs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels.all_reduce import one_shot_all_reduce, two_shot_all_reduce
from ..kernels.capability import capability
from ..kernels.cached_launch import launch
from ..kernels.signal import waiter
from ..kernels.tagged_exchange import TAGGED_HEADER_WORDS
from ..plan import cdiv
from .base import OverlapOp

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: algorithm="auto": the one-shot kernel up to this many bytes, the two-shot up to TWO_SHOT_MAX_BYTES, then the
#: process group (docs/decisions.md: the two-shot lost to NCCL wherever the one-shot did, so it is not picked);
#: at W = 2 the one-shot up to ONE_SHOT_MAX_BYTES_W2 (measured ahead of NCCL there)
ONE_SHOT_MAX_BYTES = 128 << 10
ONE_SHOT_MAX_BYTES_W2 = 2 << 20
TWO_SHOT_MAX_BYTES = 128 << 10
ALGORITHMS = ("auto", "one_shot", "two_shot")
#: elements per block (the two-shot: one flag per block and peer; the one-shot's small and large messages)
BLOCK = 1024
#: the largest launch (programs x warps) of the one-shot kernels made a programmatic dependent (dependent_launch)
PDL_MAX_WARPS = 256
#: elements per block of the one-shot's mid-sized messages, one warp a program (one_shot_tiling)
SMALL_BLOCK = 256


def one_shot_tiling(n: int, units: int) -> tuple[int, int, int]:
    """The one-shot's (elements a block, programs, warps a program) for ``n`` elements, as measured fastest back to
    back at W = 2 (docs/decisions.md): one program of 8 warps up to BLOCK elements (one program counts the call
    without an atomic); a program of 8 warps per block of BLOCK up to 4 blocks; then a program of one warp per block
    of SMALL_BLOCK while that is a program per compute unit at most; above, blocks of BLOCK, a program of 4 warps per
    block up to a program per compute unit. Never more programs than compute units: every program waits on its
    blocks from every peer, so all must be resident at once."""
    if n <= 4 * BLOCK:
        return BLOCK, max(1, min(cdiv(n, BLOCK), units)), 8
    if cdiv(n, SMALL_BLOCK) <= units:
        return SMALL_BLOCK, cdiv(n, SMALL_BLOCK), 1
    return BLOCK, max(1, min(cdiv(n, BLOCK), units)), 4


def dependent_launch(ctx, warps: int) -> tuple[dict, dict]:
    """The one-shot kernels' constexprs and launch options that launch them as programmatic dependents of the
    kernel before them on the stream (kernels.slot_exchange.open_call), so that each call's launch overlaps the
    kernel before it: CUDA on compute capability 9.0 and later, launches of at most PDL_MAX_WARPS ``warps`` in
    all (docs/decisions.md has the measurements)."""
    if ctx.backend == "cuda" and warps <= PDL_MAX_WARPS and capability(ctx.device.index)[0] >= 9:
        return {"PDL": True}, {"launch_pdl": True}
    return {}, {}


def pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def slot_elements(ctx, name: str, n: int, dtype: torch.dtype) -> int:
    """Elements per slot of the [2, W, cap] buffer ``name`` for a call of ``n`` elements of ``dtype``: the whole
    buffer's slot while it is large enough, else the power of two that fits ``n`` (at least BLOCK; the buffer
    grows). So slots keep their places in the buffer until it grows, and a peer storing the next call's parts
    (the other half) never overlaps this call's, whatever the sizes and dtypes of the two calls."""
    element = torch.empty((), dtype=dtype).element_size()
    have = ctx.symmetric_nbytes(name) // (2 * ctx.world_size * element)
    return max(BLOCK, pow2_at_least(n), have)


@dataclass(frozen=True)
class Exchange:
    """One call's symmetric buffers for the slot exchange (kernels.slot_exchange), as the AllReduce kernels take
    them: ``data`` [2, W, cap] slots, ``flags`` [W, blocks] (one per block and sender), ``header`` [2, W, 4] (each
    sender's call header per half), ``state`` [2] (the call count, the programs out)."""
    data: object
    flags: object
    header: object
    state: object
    cap: int
    blocks: int

    def args(self) -> tuple:
        """The kernels' buffer arguments: data_ptrs, flag_ptrs, header_ptrs, local_data, local_flags, local_header,
        state_ptr."""
        return (self.data.ptrs, self.flags.ptrs, self.header.ptrs, self.data.local, self.flags.local,
                self.header.local, self.state.local)


def exchange_buffers(ctx, name: str, n: int, dtype: torch.dtype, blocks: int) -> Exchange:
    """The buffers ``name``.slots/.flags/.header/.state for a call of ``n`` elements of ``dtype`` in ``blocks``
    blocks (grown collectively on a size's first call; the flags' row is the power of two that holds the blocks)."""
    W = ctx.world_size
    cap = slot_elements(ctx, f"{name}.slots", n, dtype)
    blocks = pow2_at_least(blocks)
    return Exchange(ctx.symmetric(f"{name}.slots", (2, W, cap), dtype),
                    ctx.symmetric(f"{name}.flags", (W, blocks), torch.int32),
                    ctx.symmetric(f"{name}.header", (2, W, 4), torch.int32),
                    ctx.symmetric(f"{name}.state", (2,), torch.int32), cap, blocks)


@dataclass(frozen=True)
class TaggedExchange:
    """One call's symmetric buffers for the tagged exchange (kernels.tagged_exchange): ``words`` [2, W, cap] int64
    slots, ``header`` [2, W, TAGGED_HEADER_WORDS] int64 (each sender's tagged call header per half), ``state`` [2]
    (the call count, the programs out)."""
    words: object
    header: object
    state: object
    cap: int

    def args(self) -> tuple:
        """The kernels' buffer arguments: word_ptrs, header_ptrs, local_words, local_header, state_ptr."""
        return self.words.ptrs, self.header.ptrs, self.words.local, self.header.local, self.state.local


def values_per_word(dtype: torch.dtype) -> int:
    """How many values of ``dtype`` (16 or 32 bits) one tagged word carries: its 4 data bytes' worth."""
    return 4 // torch.empty((), dtype=dtype).element_size()


def word_io(size: int, *tensors: torch.Tensor) -> bool:
    """Whether the tagged kernels may read and write ``tensors`` (16-bit) 32 bits at a time, 16 bytes an access
    (kernels.tagged_exchange.load_bits' WORD_IO): every one 16-byte aligned, ``size`` (the elements of a block's
    limit: the message or a row) a multiple of 8, so every block's and row's start is aligned too."""
    return size % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)


def tagged_buffers(ctx, name: str, words: int) -> TaggedExchange:
    """The buffers ``name``.words/.tagged_header/.state for a call of ``words`` tagged words a sender (grown
    collectively on a size's first call, kept in place until then: slot_elements)."""
    W = ctx.world_size
    cap = slot_elements(ctx, f"{name}.words", words, torch.int64)
    return TaggedExchange(ctx.symmetric(f"{name}.words", (2, W, cap), torch.int64),
                          ctx.symmetric(f"{name}.tagged_header", (2, W, TAGGED_HEADER_WORDS.value), torch.int64),
                          ctx.symmetric(f"{name}.state", (2,), torch.int32), cap)


def process_group_only(op: OverlapOp) -> bool:
    """Whether ``op``'s fallback rule sends every call to the process group: "always", "auto" at W = 1, or a group
    the kernels cannot span (``overlap_possible``; with "never" that raises ValueError)."""
    if op.fallback == "always" or op.fallback == "auto" and op.ctx.world_size == 1:
        return True
    return not op.overlap_possible()


def process_group_sum(ctx, x: torch.Tensor) -> torch.Tensor:
    """Sum the contiguous ``x`` over ranks in place through the process group (gloo sums CPU half types in
    float32)."""
    if ctx.device.type == "cpu" and x.dtype != torch.float32:
        acc = x.float()
        dist.all_reduce(acc, group=ctx.group)
        x.copy_(acc)
    else:
        dist.all_reduce(x, group=ctx.group)
    return x


class AllReduce(OverlapOp):
    """Reusable AllReduce bound to a Context: holds its symmetric receive slots and flags.

    ``op(x, out=None)`` returns the sum over ranks of ``x`` (float32, float16 or bfloat16, any shape and size),
    summed in float32, with ``x``'s shape and dtype; ``x`` is not modified, and every rank gets the same bits.

    ``algorithm="auto"`` takes the one-shot kernel up to ``one_shot_max_bytes`` (None: ONE_SHOT_MAX_BYTES_W2 at
    W = 2, ONE_SHOT_MAX_BYTES elsewhere), the two-shot kernel up to
    ``two_shot_max_bytes`` (each rank sums 1/W of the blocks and sends the sums: less traffic, one more wait), and
    above that, for W = 1 or on a group that spans hosts, the process group's all_reduce (NCCL on GPUs);
    ``"one_shot"`` or ``"two_shot"`` always that kernel. ``fallback="always"`` always takes the process group;
    ``"never"`` never does (sizes beyond ``two_shot_max_bytes`` take the two-shot kernel; across hosts it raises).

    The receive slots grow to the largest message seen (2 x W x its size per rank, twice that for the one-shot's
    tagged words, collectively, on a size's first call); make one eager call at the largest size before capturing
    calls in a CUDA graph.
    """

    KIND = "all_reduce"

    def __init__(self, ctx, *, algorithm: str = "auto", fallback: str = "auto",
                 one_shot_max_bytes: int | None = None, two_shot_max_bytes: int = TWO_SHOT_MAX_BYTES,
                 name: str | None = None):
        super().__init__(ctx, None, fallback=fallback, name=name, replay=False)  # one launch: nothing to replay
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if one_shot_max_bytes is None:
            one_shot_max_bytes = ONE_SHOT_MAX_BYTES_W2 if ctx.world_size == 2 else ONE_SHOT_MAX_BYTES
        self.algorithm = algorithm
        self.one_shot_max_bytes = int(one_shot_max_bytes)
        self.two_shot_max_bytes = int(two_shot_max_bytes)
        self.last_algorithm = None  # "one_shot", "two_shot" or "process group": what the last call took

    def default_config(self, shape, variant=""):
        return None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        ctx = self.ctx
        ctx.ensure_usable()
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"all_reduce: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in DTYPES:
            raise ValueError(f"all_reduce: x must be float32, float16 or bfloat16, got {x.dtype}")
        if x.device != ctx.device:
            raise ValueError(f"all_reduce: x is on {x.device}, the Context is on {ctx.device}")
        if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device
                                or not out.is_contiguous()):
            raise ValueError(f"all_reduce: out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)} on "
                             f"{x.device}, got {'a non-contiguous ' if not out.is_contiguous() else ''}{out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
        if out is not None and out.numel() and out.data_ptr() == x.data_ptr():
            raise ValueError("all_reduce: out must not be x (the input is not modified)")
        self.agree((tuple(x.shape), str(x.dtype)))
        out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
        n = x.numel()
        if n == 0:
            self.last_path = "overlap"
            return out
        kind = self._pick(x.numel() * x.element_size())
        self.last_algorithm = kind
        if kind == "process group":
            self.last_path = "fallback"
            out.copy_(x)  # the process group sums in place; x is not modified
            return self._sum_in_place(out)
        self.last_path = "overlap"
        if kind == "two_shot":
            self._launch(x.contiguous(), out, n)
        else:
            self._launch_one_shot(x.contiguous(), out, n)
        return out

    def _pick(self, nbytes: int) -> str:
        """"one_shot", "two_shot" or "process group" for a message of ``nbytes``."""
        if process_group_only(self):
            return "process group"
        if self.algorithm != "auto":
            return self.algorithm
        if nbytes <= self.one_shot_max_bytes:
            return "one_shot"
        if nbytes <= self.two_shot_max_bytes or self.fallback == "never":
            return "two_shot"
        return "process group"

    def _launch_one_shot(self, x, out, n) -> None:
        ctx = self.ctx
        pack = values_per_word(x.dtype)
        block, programs, warps = one_shot_tiling(n, ctx.num_compute_units())
        pdl, pdl_option = dependent_launch(ctx, programs * warps)
        ex = tagged_buffers(ctx, self.name, cdiv(n, block) * (block // pack))
        self.state["buffers"] = {"slots": ex.words.local}
        call = self.call_header((n, x.dtype), (n,))
        launch(one_shot_all_reduce, (programs,), (x, out, *ex.args(), n, ex.cap, waiter(ctx, self.op), ctx.world_size,
                                                  call.fingerprint),
               dict(BLOCK=block, PACK=pack, WORD_IO=word_io(n, x, out), BLOCK_W=pow2_at_least(ctx.world_size),
                    CLOCK=ctx.clock, ONE_PROGRAM=programs == 1, **pdl), num_warps=warps, **pdl_option)
        ctx.after_launch()

    def _launch(self, x, out, n) -> None:
        """The two-shot kernel."""
        ctx = self.ctx
        ex = exchange_buffers(ctx, self.name, n, x.dtype, cdiv(n, BLOCK))
        self.state["buffers"] = {"slots": ex.data.local}
        call = self.call_header((n, x.dtype), (n,))
        programs = max(1, min(cdiv(n, BLOCK), ctx.num_compute_units()))
        launch(two_shot_all_reduce, (programs,), (x, out, *ex.args(), n, ex.cap, ex.blocks, waiter(ctx, self.op),
                                                  ctx.world_size, call.fingerprint),
               dict(BLOCK=BLOCK, BLOCK_W=pow2_at_least(ctx.world_size), CLOCK=ctx.clock), num_warps=4)
        ctx.after_launch()

    def takes_process_group(self, nbytes: int) -> bool:
        """Whether a call of ``nbytes`` goes to the process group (for callers that can then sum in place)."""
        return self._pick(nbytes) == "process group"

    def sum_in_place(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the contiguous ``x`` over ranks in place through the process group: what a call above the kernels'
        range does, without the copy that keeps a caller's input unmodified. For callers that own ``x`` (GEMM +
        AllReduce's partial product)."""
        self.ctx.ensure_usable()
        self.agree((tuple(x.shape), str(x.dtype)))
        self.last_path, self.last_algorithm = "fallback", "process group"
        return self._sum_in_place(x)

    def _sum_in_place(self, x):
        return process_group_sum(self.ctx, x)


def all_reduce(x: torch.Tensor, *, ctx, out: torch.Tensor | None = None) -> torch.Tensor:
    """Functional form of AllReduce: the sum over ranks of ``x``; one op per Context, kept by the Context."""
    return AllReduce.shared(ctx)(x, out=out)


__all__ = ["AllReduce", "all_reduce"]
