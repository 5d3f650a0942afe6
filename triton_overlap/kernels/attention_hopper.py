"""The context-parallel attention forward for Hopper (sm_90), warp-specialized in Gluon.

Same algorithm, protocol and results as kernels.attention's ``cp_attention_fwd`` (its module doc): a tile is a
block of BLOCK_M local queries of one (batch, query head); K/V of every rank in arrival order, our own first; causal
blocks that no row sees are skipped, neither waited for nor read; a float32 online softmax. What differs is the
schedule, which plain Triton does not express on sm_90:

* the grid is persistent, one program per SM. Tiles are handed out in order through an atomic counter, one at a
  time to whichever program's loader asks next (as the hardware hands out a grid's blocks, so work stays balanced
  when causal tiles differ in length): one (batch, head)'s query blocks before the next, the blocks of later
  positions (which see more keys) first, so the programs at work at once share K/V heads in L2. The loader passes
  each tile's index to the compute partitions through shared memory, beside its Q; the last program out zeroes
  the counter for the next launch;
* not causal, every tile is as long as the next, so the last round of the grid would hold only the tiles left
  over. The last ``N_SPLIT`` tiles are handed out in ``PARTS`` parts instead, each a run of the tile's key blocks
  (tail_split); a part leaves its rows' normalised O (in O's dtype) and lse in the Context's tail_buffers, and
  ``merge_parts`` sums a tile's parts weighted by their lse, in float32, after the kernel;
* the loader (the default partition, 4 warps) issues the TMA loads: each tile's Q into one of two buffers, then K
  and V block by block into two rings of stages (``ready`` / ``empty`` mbarriers) that run on from tile to tile, so
  the next tile's Q and first blocks land while the compute warps finish the last one. It waits for a peer's chunk
  flag before its first block that reads the chunk, so the compute warps never spin on a flag;
* two or three compute partitions (``NWG``; a warpgroup each, 64 of the tile's query rows, on wgmma) read the
  same stages. Each issues S = Q K^T of the next block asynchronously, rescales O and issues P V of the current
  block, then runs the next block's softmax while that P V runs; P stays in registers (the A operand of the P V
  wgmma), and so, not causal at D = 128, do the warpgroup's rows of Q for S (``q_in_registers``). They take
  turns to issue their products, so one's softmax runs while the others' products do. A tile's last block runs
  into the next tile's first (its S issued beside the last P V), and O leaves through shared memory by a TMA
  store, so the tensor cores do not wait at tile boundaries. The loader keeps 24 registers a
  thread (setmaxnreg), so a compute thread may hold 240 with two compute warpgroups and 160 with three. Three
  (192-row tiles, at D = 64 only) keep more softmaxes in flight where the exponentials weigh as much as the
  products; with two, the next tile's first softmax also runs while the last P V does, which three have not the
  registers for (they store the finished tile's O first).

Only for NVIDIA sm_90 with 16-bit operands, D of 64 or 128, shapes whose blocks never straddle a zigzag half and
contiguous tensors (``usable``): every block of keys it reads lies in one chunk that has been waited for. Where
the tile's rows do not divide a zigzag half, the half's first tile starts before it; those rows are computed on
and never written. Elsewhere
(other GPUs, packed documents, odd sizes, the host backend, where Gluon does not run) the op takes
kernels.attention's kernel.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

import triton
import triton.language as tl

from .attention_hopper_parts import COMPUTE_REGS, WG_ROWS, compute_partition, half_tile, load_partition
from .cached_launch import launch
from .capability import gluon_available, is_hopper
from .gluon_shims import shared_layout
from .signal import waiter


@gluon.jit
def cp_attention_fwd_ws(q_desc, k_desc, v_desc, kw_desc, vw_desc, o_desc, lse_ptr, tile_ptr, flags_ptr, waiter,
                        world, S_LOCAL, HQ, BH, TAIL, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK, sm_scale,
                        p_desc, part_lse_ptr, N_SPLIT, PARTS, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                        CLOCK: gl.constexpr, COMPUTE_REGS: gl.constexpr, SPLIT: gl.constexpr, NWG: gl.constexpr,
                        Q_REGS: gl.constexpr = False):
    """``q_desc``: Q as [B * S_LOCAL, HQ * D] in [64, D] blocks (a compute warpgroup's rows); ``k_desc``/
    ``v_desc``: our K/V as [B * S_LOCAL, Hkv * D] in [BLOCK_N, D] blocks; ``kw_desc``/``vw_desc``: the gathered
    workspaces as [B * world * S_LOCAL, Hkv * D], same blocks; ``o_desc``: O as [B * S_LOCAL, HQ * D] in [64, D]
    blocks; ``BH``: batch x query heads; ``TAIL``: how many of them close the order together (tail_heads);
    ``tile_ptr``: two int32, zero at launch (the next unit to hand out, the programs done), which the last program
    out zeroes again. ``N_SPLIT``, ``PARTS``: the last N_SPLIT tiles go in PARTS parts (not causal only), whose O
    goes to ``p_desc`` ([N_SPLIT * PARTS * 64 * NWG, D], O's dtype and blocks) and lse to ``part_lse_ptr``
    ([N_SPLIT * PARTS * BLOCK_M], float32); ``SPLIT``: N_SPLIT > 0 (else none of the parts' code is built);
    ``Q_REGS``: Q in registers for S (q_in_registers). The
    other arguments are kernels.attention's of the same name. Launched with 4 warps: the loader; ``NWG`` (2 or 3)
    compute warpgroups of COMPUTE_REGS registers a thread join them."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * NWG] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NWG, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # each Q's tile
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [NWG] + o_desc.block_type.shape, o_desc.layout)  # O, by group
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NWG)  # every compute warpgroup reads every stage
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=NWG)
    for i in gl.static_range(NWG):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NWG)
    p = (q_desc, k_desc, v_desc, kw_desc, vw_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
         v_ready, v_empty, turn, sched, tile_ptr, flags_ptr, waiter, world, S_LOCAL, HQ, BH, TAIL, GROUP,
         M_PER_CHUNK, CHUNKS_PER_RANK, p_desc, part_lse_ptr, N_SPLIT, PARTS)
    if NWG == 2:
        gl.warp_specialize([
            (load_partition, (p, CAUSAL, CLOCK, SPLIT, NWG)),
            (compute_partition, (p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL, 0, SPLIT, NWG, Q_REGS)),
            (compute_partition, (p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL, 1, SPLIT, NWG, Q_REGS)),
        ], [4, 4], [COMPUTE_REGS, COMPUTE_REGS])
    else:
        gl.warp_specialize([
            (load_partition, (p, CAUSAL, CLOCK, SPLIT, NWG)),
            (compute_partition, (p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL, 0, SPLIT, NWG, Q_REGS)),
            (compute_partition, (p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL, 1, SPLIT, NWG, Q_REGS)),
            (compute_partition, (p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL, 2, SPLIT, NWG, Q_REGS)),
        ], [4, 4, 4], [COMPUTE_REGS, COMPUTE_REGS, COMPUTE_REGS])


@triton.jit
def merge_parts(part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, first_tile, S_LOCAL, HQ, PARTS, so_b, so_s, so_h,
                BLOCK_M: tl.constexpr, ROWS: tl.constexpr, HEAD_D: tl.constexpr):
    """ROWS rows (program id 1) of one split tile (``first_tile`` + program id 0, in the head-by-head order of
    attention_hopper_parts' tile order with TAIL = 1): its PARTS parts' O ([PARTS * BLOCK_M, D] each tile, each
    normalised by its own softmax sum) and lse, summed with weights exp(lse_p - lse) in float32, into ``out``
    ([B, S_LOCAL, HQ, D], strides ``so_*``) and ``lse`` ([B, HQ, S_LOCAL] contiguous); rows before the tile's half
    are not the tile's."""
    s = tl.program_id(0)
    w = tl.program_id(1)
    t = first_tile + s
    C = S_LOCAL // 2
    n_m = 2 * tl.cdiv(C, BLOCK_M)
    bh = t // n_m
    m0, lo = half_tile(t % n_m, C, BLOCK_M)
    r0 = m0 + w * ROWS
    if r0 >= lo:
        rows = tl.arange(0, ROWS)
        cols = tl.arange(0, HEAD_D)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        for p in range(0, PARTS):
            m = tl.maximum(m, tl.load(part_lse_ptr + (s * PARTS + p) * BLOCK_M + w * ROWS + rows))
        m_use = tl.where(m == float("-inf"), 0.0, m)  # (rows no key reached: zero weights, out 0, lse -inf)
        acc = tl.zeros([ROWS, HEAD_D], tl.float32)
        den = tl.zeros([ROWS], tl.float32)
        for p in range(0, PARTS):
            row = (s * PARTS + p) * BLOCK_M + w * ROWS + rows
            wt = tl.exp(tl.load(part_lse_ptr + row) - m_use)
            den += wt
            acc += wt[:, None] * tl.load(part_o_ptr + row[:, None] * HEAD_D + cols[None, :]).to(tl.float32)
        o = acc / tl.where(den == 0.0, 1.0, den)[:, None]
        b = bh // HQ
        h = bh % HQ
        tl.store(out_ptr + b * so_b + (r0 + rows)[:, None] * so_s + h * so_h + cols[None, :],
                 o.to(out_ptr.dtype.element_ty))
        tl.store(lse_ptr + bh * S_LOCAL + r0 + rows, m_use + tl.log(den))


#: Parts a split tile goes in (tail_split), at most; each at least TAIL_MIN_BLOCKS key blocks.
TAIL_PARTS = 4
TAIL_MIN_BLOCKS = 8


def tail_split(n_tiles: int, programs: int, blocks: int, causal: bool) -> tuple[int, int]:
    """(N_SPLIT, PARTS): how many of the last tiles go in parts, and in how many, for ``n_tiles`` tiles of
    ``blocks`` key blocks each on ``programs`` programs (one per SM). Not causal, every tile is as long as the next:
    where the tiles do not fill the grid's rounds evenly, the last round would hold only the tiles left over while
    the other programs idle. The last round's worth of tiles (``programs``, or every tile) is cut into parts, so
    the work that starts last is a part, not a tile (docs/decisions.md). Causal tiles differ in length and are
    ordered longest first (tail_heads): none is split."""
    parts = TAIL_PARTS
    while parts > 1 and blocks // parts < TAIL_MIN_BLOCKS:
        parts //= 2
    if causal or parts == 1 or n_tiles % programs == 0:
        return 0, 1
    return min(n_tiles, programs), parts


def tail_buffers(ctx, programs: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The split tiles' O (flat, ``dtype``) and float32 lse, room for ``programs`` tiles of TAIL_PARTS parts (a tile
    of the most rows, at any D: 128 x 128 elements of O at D = 128, 192 rows of lse at D = 64 with three compute
    warpgroups): one pair per Context and dtype, since its ops' calls run one after another (each kernel's parts
    are merged, on its stream, before the next kernel starts); never reallocated, since captured graphs hold their
    addresses."""
    def make():
        tiles = programs * TAIL_PARTS
        return (torch.empty(tiles * 128 * 128, dtype=dtype, device=ctx.device),
                torch.empty(tiles * WG_ROWS * max(COMPUTE_REGS), dtype=torch.float32, device=ctx.device))

    return ctx.cached(("attention tail parts", programs, dtype), make)


# ---------------------------------------------------------------------------------------------------- launcher
def q_in_registers(causal: bool, D: int, nwg: int) -> bool:
    """Whether the compute warpgroups hold their rows of Q in registers for S = Q K^T (the wgmma's A operand)
    instead of reading them from shared memory at every product (a fifth of what a key block's products read from
    there): not causal at D = 128 with two warpgroups, where the registers are free; causal, and with three
    warpgroups, ptxas spills instead (docs/decisions.md)."""
    return not causal and D == 128 and nwg == 2


def usable(ctx, q, k, v, kw, vw, docs, blocks, out=None) -> bool:
    """Whether this forward can run on this kernel with ``blocks`` (kernels.attention.Blocks): the cuda backend on
    compute capability 9.0 with Gluon; 16-bit q/k/v, D of 64 or 128; no packed documents; two compute warpgroups,
    or three at D = 64 (at D = 128 three would not fit their registers); each zigzag half of the shard whole
    blocks of keys and whole tiles of queries (128 rows), or with three warpgroups whole 64-row blocks (its first
    tile then starts before it); q, k, v, the workspaces and ``out`` (where given) contiguous (they are read and
    written as 2-D tensors)."""
    S, D = q.shape[1], q.shape[3]
    half = S // 2
    return (is_hopper(ctx) and docs is None and q.dtype in (torch.bfloat16, torch.float16)
            and D in (64, 128) and blocks.block_n in (64, 128)
            and (blocks.warp_groups == 2 or (blocks.warp_groups == 3 and D == 64))
            and S % 2 == 0 and half % (2 * WG_ROWS if blocks.warp_groups == 2 else WG_ROWS) == 0
            and half % blocks.block_n == 0
            and all(t.is_contiguous() for t in (q, k, v, kw, vw)) and (out is None or out.is_contiguous())
            and gluon_available())


def head_desc(t, block):
    """A TMA descriptor of 16-bit ``t`` [b, s, h, D] (contiguous) read as the 2-D [b * s, h * D], in ``block``
    blocks of the default shared layout."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    flat = t.view(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])
    return TensorDescriptor(flat, list(flat.shape), [flat.stride(0), 1], block,
                            shared_layout(block, gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16))


def query_tiles(S: int, block_m: int) -> int:
    """The query tiles of one (batch, head) of a shard of ``S`` rows: each zigzag half cut into ``block_m``-row
    tiles from its end (half_tile), the first one short where ``block_m`` does not divide the half."""
    return 2 * -(-(S // 2) // block_m)


#: The tiles the closing (batch, head)s hold together, in rounds of the grid (tail_heads).
TAIL_ROUNDS = 4


def tail_heads(bh: int, blocks: int, programs: int) -> int:
    """How many of the ``bh`` (batch, head)s, ``blocks`` query blocks each, close the tile order together: enough
    for TAIL_ROUNDS tiles a program. Heads in turn keep the programs at work on few K/V heads (L2), but a causal
    head's blocks run longest first, so the last head's longest tiles would start last and the other programs idle
    while they finish; the closing heads go block by block across heads, longest first, so the tiles that start last
    are the shortest (docs/decisions.md). Not causal, every tile is as long as the next: the launch passes 1 (the
    order head by head)."""
    return max(1, min(bh, -(-TAIL_ROUNDS * programs // blocks)))


def tile_counter(ctx) -> torch.Tensor:
    """The forward's tile counter (``tile_ptr``) for launches on the current stream, kept by ``ctx``: kernels on one
    stream run one after another, and each leaves the counter zeroed, so one per stream serves them all. (The op
    passes its own: its calls never overlap, wherever its captured graphs are replayed.) ``reset()`` and ``close()``
    free it with the rest of what the Context keeps: a graph captured with it must be captured again after them."""
    key = ("attention_hopper tile counter", torch.cuda.current_stream(ctx.device).cuda_stream)
    return ctx.cached(key, lambda: torch.zeros(2, dtype=torch.int32, device=ctx.device))


def launch_fwd_ws(ctx, q, k, v, kw, vw, out, lse, flags, m_per_chunk, chunks_per_rank, scale, causal, blocks,
                  rank: int, world: int, op: int, tiles=None) -> None:
    """The forward on this kernel (``usable`` holds), arguments as kernels.attention.launch_fwd's. ``tiles``: two
    int32 zeros (left zeroed) that no other launch uses at the same time; None: ``tile_counter``'s."""
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    nwg, bn = blocks.warp_groups, blocks.block_n
    bm = WG_ROWS * nwg
    per_head = query_tiles(S, bm)
    n_tiles, sms = per_head * B * Hq, ctx.num_compute_units()
    n_split, parts = tail_split(n_tiles, sms, world * S // bn, causal)
    programs = min(n_tiles + n_split * (parts - 1), sms)
    o_desc = head_desc(out, [WG_ROWS, D])
    if n_split:
        part_o, part_lse = tail_buffers(ctx, sms, q.dtype)
        part_o = part_o[:n_split * parts * bm * D].view(1, -1, 1, D)  # [1, rows, 1, D] for head_desc
        p_desc = head_desc(part_o, [WG_ROWS, D])
    else:
        part_o, part_lse, p_desc = out, lse, o_desc  # (not read without parts)
    launch(cp_attention_fwd_ws, (programs, ), (
        head_desc(q, [WG_ROWS, D]), head_desc(k, [bn, D]), head_desc(v, [bn, D]), head_desc(kw, [bn, D]),
        head_desc(vw, [bn, D]), o_desc, lse, tile_counter(ctx) if tiles is None else tiles,
        flags, waiter(ctx, op, rank), world, S, Hq, B * Hq, tail_heads(B * Hq, per_head, programs) if causal
        else 1, Hq // Hkv, m_per_chunk, chunks_per_rank, scale, p_desc, part_lse, n_split, parts,
    ), dict(CAUSAL=causal, STAGES=blocks.num_stages, CLOCK=ctx.clock, COMPUTE_REGS=COMPUTE_REGS[nwg],
            SPLIT=n_split > 0, NWG=nwg, Q_REGS=q_in_registers(causal, D, nwg)), num_warps=4)
    ctx.after_launch()
    if n_split:
        launch(merge_parts, (n_split, nwg), (part_o, part_lse, out, lse, n_tiles - n_split, S, Hq, parts,
                                             out.stride(0), out.stride(1), out.stride(2)),
               dict(BLOCK_M=bm, ROWS=WG_ROWS, HEAD_D=D), num_warps=4)
