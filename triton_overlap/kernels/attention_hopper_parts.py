"""The warp-specialized attention forward's partitions (kernels.attention_hopper, whose module doc describes the
schedule): the loader, which hands out tiles and issues the TMA loads, and the compute warpgroups, with the tile
arithmetic and the online softmax they share."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

import triton
import triton.language as tl

from .attention_device import key_span, wait_every_chunk, wait_kv, zigzag_pos
from .gluon_shims import barrier, tma_load, tma_store

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
def load_partition(p, CAUSAL: gl.constexpr, CLOCK: gl.constexpr, SPLIT: gl.constexpr, NWG: gl.constexpr):
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
def compute_partition(p, o_desc, o_smem, lse_ptr, sm_scale, CAUSAL: gl.constexpr, WG: gl.constexpr, SPLIT: gl.constexpr,
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
