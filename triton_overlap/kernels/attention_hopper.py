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
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

import triton
import triton.language as tl

from .attention_device import key_span, wait_every_chunk, wait_kv, zigzag_pos
from .cached_launch import launch
from .capability import gluon_available, is_hopper
from .gluon_shims import barrier, shared_layout, tma_load, tma_store
from .signal import waiter

#: The registers a compute thread may hold (setmaxnreg), by the number of compute warpgroups; the loader's four
#: warps keep what is left (24).
COMPUTE_REGS = {2: 240, 3: 160}
#: The query rows of one compute warpgroup (one wgmma M): a tile holds this times the compute warpgroups.
WG_ROWS = 64


@triton.jit
def half_tile(j, C, BLOCK_M: tl.constexpr):
    """Query tile ``j`` of one (batch, head), later positions first, for zigzag halves of ``C`` rows: (its first
    row, its first row within its half). Each half is cut into BLOCK_M-row tiles from its end (query_tiles of them
    in all), so where BLOCK_M does not divide the half, the half's first tile starts before it."""
    n_h = tl.cdiv(C, BLOCK_M)
    hh = tl.where(j < n_h, 1, 0)
    m0 = hh * C + C - (j % n_h + 1) * BLOCK_M
    return m0, tl.maximum(m0, hh * C)


@gluon.jit
def _key_blocks(src, world, C, hh, q_first, q_last, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key half ``hh`` of ``src``: (blocks some row of the query block sees, blocks every row sees)."""
    need, full = key_span(src, world, C, hh, q_first, q_last, CAUSAL)
    return gl.cdiv(need, BLOCK_N), full // BLOCK_N


@gluon.jit
def _post_tile(sched, qb, t):
    """The loader tells the compute partitions which tile Q buffer ``qb`` holds (before Q's barrier completes)."""
    sched.index(qb).store(gl.full([1], t, gl.int32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0])))


@gluon.jit
def _tile_of(sched, qb):
    """The tile Q buffer ``qb`` holds (after Q's barrier completed)."""
    return gl.max(sched.index(qb).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), axis=0)


@gluon.jit
def _unit(u, n_tiles, N_SPLIT, PARTS, blocks):
    """Work unit ``u``: (its tile, its part (-1: the whole tile), the first key block of the tile's walk it takes and
    the one after its last). The tiles before the last ``N_SPLIT`` are whole; each of those is ``PARTS`` units, part
    p taking blocks [p * blocks // PARTS, (p + 1) * blocks // PARTS) of the ``blocks`` every tile reads (not
    causal). ``blocks`` is at least any tile's count, so a whole tile's walk is not cut short."""
    base = n_tiles - N_SPLIT
    whole = u < base
    part = gl.where(whole, -1, (u - base) % PARTS)
    return (gl.where(whole, u, base + (u - base) // PARTS), part, gl.where(whole, 0, part * blocks // PARTS),
            gl.where(whole, blocks, (part + 1) * blocks // PARTS))


@gluon.jit
def _query_block(t, rank, world, S_LOCAL, HQ, BH, TAIL, BLOCK_M: gl.constexpr):
    """Tile ``t``'s query block: (its first row, its first row within its zigzag half, batch x head, batch, head,
    half the shard, the zigzag positions of those rows and of its last). A half holds ``query_tiles`` tiles, cut
    from its end: where BLOCK_M does not divide the half, the rows of its first tile before the half's start belong
    to the other half (or the batch before, or lie before the tensor) and are neither used nor written. Tiles run
    over the blocks of one (batch, head) before the next, the blocks of later positions (which see more keys)
    first; the last ``TAIL`` (batch, head)s go together, every one's block at a position before any one's next
    (tail_heads), so no long tile starts last."""
    C = S_LOCAL // 2
    n_m = 2 * gl.cdiv(C, BLOCK_M)
    t0 = (BH - TAIL) * n_m
    j = gl.where(t < t0, t % n_m, (t - t0) // TAIL)
    bh = gl.where(t < t0, t // n_m, BH - TAIL + (t - t0) % TAIL)
    m0, lo = half_tile(j, C, BLOCK_M)
    return (m0, lo, bh, bh // HQ, bh % HQ, C, zigzag_pos(lo, rank, world, C),
            zigzag_pos(m0 + BLOCK_M - 1, rank, world, C))


@gluon.jit
def _load_block(desc, ready, empty, bufs, g, row, col):
    """Key block ``g``'s K (or V) rows from ``row`` into its stage, once the compute warpgroups have released it."""
    STAGES: gl.constexpr = bufs.type.shape[0]
    s = g % STAGES
    mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)  # a fresh barrier counts as released
    mbarrier.expect(ready.index(s), desc.block_type.nbytes)
    tma_load(desc, [row, col], ready.index(s), bufs.index(s))


@gluon.jit
def _load(p, CAUSAL: gl.constexpr, CLOCK: gl.constexpr, SPLIT: gl.constexpr, NWG: gl.constexpr):
    """The loader partition: for each of this program's tiles, Q, then every key block's K and V in the order the
    compute partitions take them."""
    (q_desc, k_desc, v_desc, kw_desc, vw_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
     v_empty, turn, sched, tile_ptr, flags_ptr, waiter, world, S_LOCAL, HQ, BH, TAIL, GROUP, M_PER_CHUNK,
     CHUNKS_PER_RANK, p_desc, part_lse_ptr, N_SPLIT, PARTS) = p
    rank = waiter[2]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = NWG * ROWS
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    n_tiles = 2 * gl.cdiv(S_LOCAL // 2, BLOCK_M) * BH
    n_units = n_tiles + N_SPLIT * (PARTS - 1)
    g = 0  # key blocks loaded so far (all tiles): the stage and phase of the rings
    it = 0  # units so far: Q's buffer and phase
    u = gl.atomic_add(tile_ptr, 1, sem="relaxed")
    while u < n_units:
        if SPLIT:
            t, part, k0, k1 = _unit(u, n_tiles, N_SPLIT, PARTS, world * S_LOCAL // BLOCK_N)
        else:
            t = u
        m0, lo, bh, b, h, C, q_first, q_last = _query_block(t, rank, world, S_LOCAL, HQ, BH, TAIL, BLOCK_M)
        col = h // GROUP * HEAD_D  # the K/V head's columns
        qb = it % 2
        mbarrier.wait(q_empty.index(qb), ((it // 2) & 1) ^ 1)  # a fresh barrier counts as released
        _post_tile(sched, qb, u)
        # each compute warpgroup's rows (those before the tile's half are computed on and not kept; before the
        # tensor, its first rows are read instead)
        mbarrier.expect(q_ready.index(qb), NWG * q_desc.block_type.nbytes)
        for w in gl.static_range(NWG):
            tma_load(q_desc, [gl.maximum(b * S_LOCAL + m0 + w * ROWS, 0), h * HEAD_D], q_ready.index(qb),
                      q_smem.index(qb * NWG + w))
        f = 0  # the tile's key blocks walked so far (this unit loads those in [k0, k1))
        for step in range(0, world):
            src = (rank - step + world) % world
            for hh in range(0, 2):
                nb, nf = _key_blocks(src, world, C, hh, q_first, q_last, CAUSAL, BLOCK_N)
                waited = hh * C  # a peer's rows below this have been waited for
                for i in range(0, nb):
                    if SPLIT:
                        take = (f >= k0) & (f < k1)
                    else:
                        take = True
                    if take:
                        n0 = hh * C + i * BLOCK_N
                        if n0 + BLOCK_N > waited:
                            wait_kv(flags_ptr, waiter, src, n0, n0 + BLOCK_N, M_PER_CHUNK, CHUNKS_PER_RANK, CLOCK)
                            waited = ((n0 + BLOCK_N - 1) // M_PER_CHUNK + 1) * M_PER_CHUNK
                        if src == rank:  # our own K/V, read in place
                            _load_block(k_desc, k_ready, k_empty, k_smem, g, b * S_LOCAL + n0, col)
                            _load_block(v_desc, v_ready, v_empty, v_smem, g, b * S_LOCAL + n0, col)
                        else:  # a peer's, from its slot in the workspace
                            _load_block(kw_desc, k_ready, k_empty, k_smem, g, (b * world + src) * S_LOCAL + n0, col)
                            _load_block(vw_desc, v_ready, v_empty, v_smem, g, (b * world + src) * S_LOCAL + n0, col)
                        g += 1
                    f += 1
        it += 1
        u = gl.atomic_add(tile_ptr, 1, sem="relaxed")
    qb = it % 2  # no units left: the compute partitions stop at this buffer
    mbarrier.wait(q_empty.index(qb), ((it // 2) & 1) ^ 1)
    _post_tile(sched, qb, n_units)
    mbarrier.arrive(q_ready.index(qb))
    # the last program out zeroes the tile counter for the next launch (every program has taken its last)
    if gl.atomic_add(tile_ptr + 1, 1, sem="acq_rel") == gl.num_programs(0) - 1:
        gl.store(tile_ptr, 0)
        gl.store(tile_ptr + 1, 0)
    if CAUSAL:
        if gl.program_id(0) == 0:
            wait_every_chunk(flags_ptr, waiter, world, CHUNKS_PER_RANK, CLOCK)


@gluon.jit
def _advance(step, hh, i, nb, nf, rank, world, C, q_first, q_last, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key block after block ``i`` of half ``hh`` of the ``step``-th source (``nb`` blocks there, the first
    ``nf`` unmasked): its (step, half, index) and its half's (nb, nf). Past the last block, step is ``world``."""
    i += 1
    while (i >= nb) & (step < world):
        hh += 1
        if hh == 2:
            hh = 0
            step += 1
        i = 0
        nb = 0
        if step < world:
            nb, nf = _key_blocks((rank - step + world) % world, world, C, hh, q_first, q_last, CAUSAL, BLOCK_N)
    return step, hh, i, nb, nf


@gluon.jit
def _to16(x, dtype: gl.constexpr):
    """float32 x in ``dtype`` (bf16 or fp16), two neighbouring elements an instruction (cvt.rn.*x2.f32), so each
    32-bit register of the P V operand comes out of one conversion. With .to(), LLVM moves the conversion of the
    loop-carried P past the loop's phi as one conversion an element, and ptxas packs the pairs with their halves
    swapped and a byte permute after each: 32 extra instructions a thread every block (docs/decisions.md)."""
    if dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=gl.float16,
                                         is_pure=True, pack=2)


@gluon.jit
def _softmax(s, m_i, l_i, q_pos, masked, n0, src, world, C, qk_scale, BLOCK_N: gl.constexpr, LS: gl.constexpr,
             CAUSAL: gl.constexpr):
    """Online softmax of one block's S: (P, the factor for the output so far, the new running max and sum). Only
    a masked block compares positions (not causal, none is: that code is not built)."""
    if CAUSAL:
        if masked:
            kpos = zigzag_pos(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LS)), src, world, C)
            sm = gl.where(kpos[None, :] <= q_pos[:, None], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sm, axis=1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet stay at zero
            p = gl.exp2(sm - m_use[:, None])
        else:
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            m_use = m_new
            p = gl.exp2(s * qk_scale - m_use[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_use = m_new
        p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _walk_start(u, n_tiles, N_SPLIT, PARTS, rank, world, S_LOCAL, HQ, BH, TAIL, CAUSAL: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ROWS: gl.constexpr, WG: gl.constexpr,
                LS: gl.constexpr, SPLIT: gl.constexpr):
    """Unit ``u`` (_unit) for the compute partition: (its tile's query block as _query_block gives it, this
    warpgroup's first row, whether its rows are the tile's (not before the tile's half), the zigzag positions of
    its rows, the unit's key blocks less one, the first key block's (step, half, index) and its half's (nb, nf),
    which only a causal walk reads (to mask), and the unit's slot among the parts (-1: a whole tile))."""
    if SPLIT:
        t, part, k0, k1 = _unit(u, n_tiles, N_SPLIT, PARTS, world * S_LOCAL // BLOCK_N)
    else:
        t = u
    m0, lo, bh, b, h, C, q_first, q_last = _query_block(t, rank, world, S_LOCAL, HQ, BH, TAIL, BLOCK_M)
    r0 = m0 + WG * ROWS
    keep = r0 >= lo
    q_pos = zigzag_pos(r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, LS)), rank, world, C)
    total = 0
    for step in range(0, world):
        for hh in range(0, 2):
            nb, nf = _key_blocks((rank - step + world) % world, world, C, hh, q_first, q_last, CAUSAL, BLOCK_N)
            total += nb
    nb, nf = _key_blocks(rank, world, C, 0, q_first, q_last, CAUSAL, BLOCK_N)
    zero = rank * 0  # (a tensor: _advance changes it)
    step, hh, i, nb, nf = _advance(zero, zero, zero - 1, nb, nf, rank, world, C, q_first, q_last, CAUSAL, BLOCK_N)
    left = total - 1
    slot = rank * 0 - 1
    if SPLIT:  # a part starts at block k0 (not causal: no block is masked, so its place is not needed)
        split = part >= 0
        slot = gl.where(split, (t - (n_tiles - N_SPLIT)) * PARTS + part, -1)
        left = gl.minimum(total, k1) - k0 - 1
    return bh, b, h, C, q_first, q_last, r0, keep, q_pos, left, step, hh, i, nb, nf, slot


@gluon.jit
def _epilogue(acc, m_i, l_i, o_desc, o_smem, lse_ptr, p_desc, part_lse_ptr, slot, r0, keep, b, h, bh, S_LOCAL,
              LS: gl.constexpr, LO: gl.constexpr, WG: gl.constexpr, NWG: gl.constexpr, SPLIT: gl.constexpr):
    """A finished unit's rows of O (the accumulator over the softmax sum) and their lse, through this warpgroup's
    shared buffer and a TMA store that runs on while the warpgroup goes on; a part's (``slot`` >= 0) to its slot
    of the parts (``p_desc``, ``part_lse_ptr``), for merge_parts."""
    ROWS: gl.constexpr = acc.type.shape[0]
    HEAD_D: gl.constexpr = acc.type.shape[1]
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / gl.convert_layout(l_safe, gl.SliceLayout(1, LO))[:, None]).to(o_desc.dtype)
    buf = o_smem.index(WG)
    tma.store_wait(0)  # the previous tile's store has read the buffer
    barrier()
    buf.store(out)
    fence_async_shared()
    barrier()
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453  # back from base 2 to natural log
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LS))
    if keep:  # (else the rows lie before the tile's half: not the tile's)
        if SPLIT:
            if slot >= 0:
                tma_store(p_desc, [(slot * NWG + WG) * ROWS, 0], buf)
                gl.store(part_lse_ptr + (slot * NWG + WG) * ROWS + rows, lse)
            else:
                tma_store(o_desc, [b * S_LOCAL + r0, h * HEAD_D], buf)
                gl.store(lse_ptr + bh * S_LOCAL + r0 + rows, lse)
        else:
            tma_store(o_desc, [b * S_LOCAL + r0, h * HEAD_D], buf)
            gl.store(lse_ptr + bh * S_LOCAL + r0 + rows, lse)


@gluon.jit
def _compute(p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL: gl.constexpr, WG: gl.constexpr, SPLIT: gl.constexpr,
             NWG: gl.constexpr, Q_REGS: gl.constexpr):
    """Compute warpgroup WG (0 to NWG - 1): for each of this program's tiles, rows [64 WG, 64 WG + 64) of the query
    block against every key block in the loader's order, then their O and lse. Iteration g issues S of block g + 1,
    rescales O and issues P V of block g, then runs the softmax of block g + 1 while that P V runs; no wgmma is in
    flight across iterations (so ptxas keeps them asynchronous). The warpgroups take turns, in order, to issue
    their products (``turn``), so one's softmax runs while the others' products do.

    A tile's last iteration runs on into the next tile: block g + 1 is the next tile's first (its Q from the other
    buffer), whose softmax starts from an empty state (the factor for the output so far is zero, so the
    accumulator starts afresh at its P V). With two warpgroups that softmax runs while block g's P V does, and the
    finished tile's O and lse are stored after it; with three (160 registers a thread) they are stored first, once
    block g's P V is done. So the tensor cores do not wait for a tile's first S."""
    (q_desc, k_desc, v_desc, kw_desc, vw_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
     v_empty, turn, sched, tile_ptr, flags_ptr, waiter, world, S_LOCAL, HQ, BH, TAIL, GROUP, M_PER_CHUNK,
     CHUNKS_PER_RANK, p_desc, part_lse_ptr, N_SPLIT, PARTS) = p
    rank = waiter[2]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = NWG * ROWS
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    LS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                 instr_shape=[16, BLOCK_N, 16])
    LO: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                 instr_shape=[16, HEAD_D, 16])
    LP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=LO, k_width=2)
    LQ: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=LS, k_width=2)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, LS)
    if WG == NWG - 1:
        mbarrier.arrive(turn.index(0))  # warpgroup 0 issues first
    n_tiles = 2 * gl.cdiv(S_LOCAL // 2, BLOCK_M) * BH
    n_units = n_tiles + N_SPLIT * (PARTS - 1)
    mbarrier.wait(q_ready.index(0), 0)
    t = _tile_of(sched, 0)
    if t < n_units:  # (a program may find every unit taken)
        bh, b, h, C, q_first, q_last, r0, keep, q_pos, left, step, hh, i, nb, nf, slot = _walk_start(
            t, n_tiles, N_SPLIT, PARTS, rank, world, S_LOCAL, HQ, BH, TAIL, CAUSAL, BLOCK_M, BLOCK_N, ROWS, WG, LS,
            SPLIT)
        qb = 0  # this tile's Q buffer
        it = 0  # tiles taken so far less one
        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, LS))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, LS))
        acc = gl.zeros([ROWS, HEAD_D], gl.float32, LO)
        # the first tile's block 0: its S, then its softmax
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_smem.index(WG), k_smem.index(0).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(0))
        pf, alpha, m_i, l_i = _softmax(s, m_i, l_i, q_pos, i >= nf, hh * C + i * BLOCK_N,
                                       (rank - step + world) % world, world, C, qk_scale, BLOCK_N, LS, CAUSAL)
        p16 = gl.convert_layout(_to16(pf, v_smem.dtype), LP)  # P as the register operand of P V
        g0 = 0  # this tile's first block (all tiles' blocks counted)
        has_next = True
        while has_next:
            q_rows = q_smem.index(qb * NWG + WG)
            if Q_REGS:
                q_op = q_rows.load(LQ)
            else:
                q_op = q_rows
            # every block of the tile but its last
            for g in range(g0, g0 + left):
                if CAUSAL:  # (not causal, no block is masked: the softmax needs no block's place)
                    step, hh, i, nb, nf = _advance(step, hh, i, nb, nf, rank, world, C, q_first, q_last, CAUSAL,
                                                   BLOCK_N)
                sn = (g + 1) % STAGES
                st = g % STAGES
                mbarrier.wait(turn.index(WG), g & 1)
                # block g + 1's S
                mbarrier.wait(k_ready.index(sn), ((g + 1) // STAGES) & 1)
                s = warpgroup_mma(q_op, k_smem.index(sn).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                # block g's P V on the rescaled output
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, LO))[:, None]
                mbarrier.wait(v_ready.index(st), (g // STAGES) & 1)
                acc = warpgroup_mma(p16, v_smem.index(st), acc, is_async=True)
                mbarrier.arrive(turn.index((WG + 1) % NWG))
                s = warpgroup_mma_wait(1, deps=(s, ))
                mbarrier.arrive(k_empty.index(sn))
                # block g + 1's softmax while block g's P V runs
                pf, alpha, m_i, l_i = _softmax(s, m_i, l_i, q_pos, i >= nf, hh * C + i * BLOCK_N,
                                               (rank - step + world) % world, world, C, qk_scale, BLOCK_N, LS, CAUSAL)
                p16 = gl.convert_layout(_to16(pf, v_smem.dtype), LP)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(st))
            # the tile's last block g, and the next tile's first (after the last tile: a product nobody reads, so
            # that no branch holds a wgmma)
            g = g0 + left
            it += 1
            qn = it % 2
            mbarrier.wait(q_ready.index(qn), (it // 2) & 1)
            t = _tile_of(sched, qn)
            has_next = t < n_units
            sn = (g + 1) % STAGES
            st = g % STAGES
            mbarrier.wait(turn.index(WG), g & 1)
            mbarrier.wait(k_ready.index(sn), ((g + 1) // STAGES) & 1, pred=has_next)
            s = warpgroup_mma(q_smem.index(qn * NWG + WG), k_smem.index(sn).permute((1, 0)), zero_s,
                              use_acc=False, is_async=True)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, LO))[:, None]
            mbarrier.wait(v_ready.index(st), (g // STAGES) & 1)
            acc = warpgroup_mma(p16, v_smem.index(st), acc, is_async=True)
            mbarrier.arrive(turn.index((WG + 1) % NWG))
            s = warpgroup_mma_wait(1, deps=(s, ))
            mbarrier.arrive(k_empty.index(sn), pred=has_next)
            if NWG == 2:
                mbarrier.arrive(q_empty.index(qb))  # every product that reads the finished tile's Q is done
                m_done = m_i
                l_done = l_i
                done_r0 = r0
                done_keep = keep
                done_b = b
                done_h = h
                done_bh = bh
                done_slot = slot
                if has_next:
                    bh, b, h, C, q_first, q_last, r0, keep, q_pos, left, step, hh, i, nb, nf, slot = _walk_start(
                        t, n_tiles, N_SPLIT, PARTS, rank, world, S_LOCAL, HQ, BH, TAIL, CAUSAL, BLOCK_M, BLOCK_N,
                        ROWS, WG, LS, SPLIT)
                # the next tile's block 0, from an empty state
                pf, alpha, m_new, l_new = _softmax(s, gl.full([ROWS], float("-inf"), gl.float32,
                                                              gl.SliceLayout(1, LS)),
                                                   gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, LS)), q_pos,
                                                   i >= nf, hh * C + i * BLOCK_N, (rank - step + world) % world,
                                                   world, C, qk_scale, BLOCK_N, LS, CAUSAL)
                p16 = gl.convert_layout(_to16(pf, v_smem.dtype), LP)
                m_i = gl.where(has_next, m_new, m_i)
                l_i = gl.where(has_next, l_new, l_i)
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(st))
                _epilogue(acc, m_done, l_done, o_desc, o_smem, lse_ptr, p_desc, part_lse_ptr, done_slot, done_r0,
                          done_keep, done_b, done_h, done_bh, S_LOCAL, LS, LO, WG, NWG, SPLIT)
            else:
                # (three warpgroups: fewer registers a thread) the finished tile's O leaves before the next tile's
                # first softmax, so that no thread holds both tiles' state; the other warpgroups' products keep
                # the tensor cores busy meanwhile
                acc = warpgroup_mma_wait(0, deps=(acc, ))
                mbarrier.arrive(v_empty.index(st))
                mbarrier.arrive(q_empty.index(qb))
                _epilogue(acc, m_i, l_i, o_desc, o_smem, lse_ptr, p_desc, part_lse_ptr, slot, r0, keep, b, h, bh,
                          S_LOCAL, LS, LO, WG, NWG, SPLIT)
                if has_next:
                    bh, b, h, C, q_first, q_last, r0, keep, q_pos, left, step, hh, i, nb, nf, slot = _walk_start(
                        t, n_tiles, N_SPLIT, PARTS, rank, world, S_LOCAL, HQ, BH, TAIL, CAUSAL, BLOCK_M, BLOCK_N,
                        ROWS, WG, LS, SPLIT)
                m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, LS))
                l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, LS))
                pf, alpha, m_i, l_i = _softmax(s, m_i, l_i, q_pos, i >= nf, hh * C + i * BLOCK_N,
                                               (rank - step + world) % world, world, C, qk_scale, BLOCK_N, LS, CAUSAL)
                p16 = gl.convert_layout(_to16(pf, v_smem.dtype), LP)
            qb = qn
            g0 = g + 1
    tma.store_wait(0)


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
            (_load, (p, CAUSAL, CLOCK, SPLIT, NWG)),
            (_compute, (p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL, 0, SPLIT, NWG, Q_REGS)),
            (_compute, (p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL, 1, SPLIT, NWG, Q_REGS)),
        ], [4, 4], [COMPUTE_REGS, COMPUTE_REGS])
    else:
        gl.warp_specialize([
            (_load, (p, CAUSAL, CLOCK, SPLIT, NWG)),
            (_compute, (p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL, 0, SPLIT, NWG, Q_REGS)),
            (_compute, (p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL, 1, SPLIT, NWG, Q_REGS)),
            (_compute, (p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL, 2, SPLIT, NWG, Q_REGS)),
        ], [4, 4, 4], [COMPUTE_REGS, COMPUTE_REGS, COMPUTE_REGS])


@triton.jit
def merge_parts(part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, first_tile, S_LOCAL, HQ, PARTS, so_b, so_s, so_h,
                BLOCK_M: tl.constexpr, ROWS: tl.constexpr, HEAD_D: tl.constexpr):
    """ROWS rows (program id 1) of one split tile (``first_tile`` + program id 0, in the head-by-head order of
    _query_block with TAIL = 1): its PARTS parts' O ([PARTS * BLOCK_M, D] each tile, each normalised by its own
    softmax sum) and lse, summed with weights exp(lse_p - lse) in float32, into ``out`` ([B, S_LOCAL, HQ, D],
    strides ``so_*``) and ``lse`` ([B, HQ, S_LOCAL] contiguous); rows before the tile's half are not the tile's."""
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
    warpgroups, ptxas spills instead and it measured no faster or slower (docs/decisions.md)."""
    return not causal and D == 128 and nwg == 2


#: Whether a Context runs where this kernel can (the name ops.context_parallel_attention and tuning import).
hopper = is_hopper


def usable(ctx, q, k, v, kw, vw, docs, blocks, out=None) -> bool:
    """Whether this forward can run on this kernel with ``blocks`` (kernels.attention.Blocks): the cuda backend on
    compute capability 9.0 with Gluon; 16-bit q/k/v, D of 64 or 128; no packed documents; two compute warpgroups,
    or three at D = 64 (at D = 128 three would not fit their registers); each zigzag half of the shard whole
    blocks of keys and whole tiles of queries (128 rows), or with three warpgroups whole 64-row blocks (its first
    tile then starts before it); q, k, v, the workspaces and ``out`` (where given) contiguous (they are read and
    written as 2-D tensors)."""
    S, D = q.shape[1], q.shape[3]
    half = S // 2
    return (hopper(ctx) and docs is None and q.dtype in (torch.bfloat16, torch.float16)
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


_tile_counters: dict = {}


def tile_counter(device) -> torch.Tensor:
    """The forward's tile counter (``tile_ptr``) for launches on the current stream of ``device``: kernels on one
    stream run one after another, and each leaves the counter zeroed, so one per stream serves them all. (The op
    passes its own: its calls never overlap, wherever its captured graphs are replayed.)"""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    counter = _tile_counters.get(key)
    if counter is None:
        counter = _tile_counters[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


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
        head_desc(vw, [bn, D]), o_desc, lse, tile_counter(q.device) if tiles is None else tiles,
        flags, waiter(ctx, op, rank), world, S, Hq, B * Hq, tail_heads(B * Hq, per_head, programs) if causal
        else 1, Hq // Hkv, m_per_chunk, chunks_per_rank, scale, p_desc, part_lse, n_split, parts,
    ), dict(CAUSAL=causal, STAGES=blocks.num_stages, CLOCK=ctx.clock, COMPUTE_REGS=COMPUTE_REGS[nwg],
            SPLIT=n_split > 0, NWG=nwg, Q_REGS=q_in_registers(causal, D, nwg)), num_warps=4)
    ctx.after_launch()
    if n_split:
        launch(merge_parts, (n_split, nwg), (part_o, part_lse, out, lse, n_tiles - n_split, S, Hq, parts,
                                             out.stride(0), out.stride(1), out.stride(2)),
               dict(BLOCK_M=bm, ROWS=WG_ROWS, HEAD_D=D), num_warps=4)
