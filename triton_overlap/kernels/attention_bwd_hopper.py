"""The context-parallel attention backward for Hopper (sm_90), warp-specialized in Gluon: dK, dV and dQ in one kernel.

Same grid, protocol and dK/dV results as kernels.attention_bwd's ``cp_attention_dkdv`` (its module doc): one
program per (block of 128 keys of a source rank, batch x K/V head, source), peers' blocks first (and where one
head's blocks are few, a few heads' blocks interleaved: ``heads_interleaved``); it waits for its
block's chunk, runs over this rank's query rows of the group's query heads that see the block (causal blocks
nobody sees skipped, the diagonal ones masked), stores the float32 dK/dV partial into the owner's receive slot and
bumps the owner's counter once; with the query heads split over SPLIT programs, the last of them sums their
partials first (``_store_block``). What differs: dQ is added up here too, in float32 (atomic) into a buffer of this
rank's rows, so no second kernel computes S and dP again (five products per pair of blocks instead of seven).

* the loader (the default partition, 4 warps) loads the block's K and V once, then Q and dO of each query block
  in the compute partitions' order into a ring of stages (``ready`` / ``empty`` mbarriers);
* two compute partitions (a warpgroup each, 64 of the block's keys, on wgmma): S^T = K Q^T and dP^T = V dO^T,
  then P^T and dS^T in registers, which are the register operands of dV += P^T dO and dK += dS^T Q. Each writes its
  dS^T rows into a shared [keys, queries] buffer (two, alternating), and once both have, each computes half of
  dQ's columns, dS K over all 128 keys, writes it to shared memory and has TMA add it into the float32 buffer
  (an element-wise atomic reduction that runs while the warpgroup goes on to the next query block; docs/decisions.md
  has what it saved over atomics from registers).

``launch_bwd_ws`` runs it inside kernels.attention_bwd_frame's ``single_pass``: a small Triton kernel before it
(delta = rowsum(dO * O), the float32 buffer zeroed) and one after it (dQ = the buffer times the softmax scale, in
q's dtype). dQ's float32 sum takes its terms in the order the reductions land, so its last bits may differ between
calls; dK and dV are summed in a fixed order. Only for NVIDIA sm_90 with 16-bit operands, D of 64 or 128, and
shapes whose blocks never straddle a zigzag half (``usable``); elsewhere the op takes kernels.attention_bwd's two
kernels, and on the host backend the same single pass in Triton (its dK/dV kernel with ``DQ_ACC``)."""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .attention_bwd_frame import single_pass, zero_tickets
from .attention_device import wait_kv, zigzag_pos
from .attention_hopper import head_desc
from .cached_launch import launch
from .capability import gluon_available, is_hopper
from .gluon_shims import barrier, shared_layout, tma_atomic_add, tma_load
from .signal import error_code, waiter

#: The registers a compute thread may hold (setmaxnreg); the loader's four warps keep what is left.
COMPUTE_REGS = 240
#: Keys per program (the compute warpgroups take half the keys each).
BLOCK_N = 128
#: (query rows per step, stages of the Q / dO ring) by D (``tiles``)
TILES = {128: (64, 3), 64: (128, 2)}
#: launch_bwd splits each block's query heads over programs (``SPLIT``) until they fill every SM at least this many
#: times (one program fits an SM), where blocks x K/V heads x sources fall short (MQA, few K/V heads per GPU, short
#: shards); docs/decisions.md has the measurements behind the figure.
MIN_WAVES = 7
#: lse and delta pieces in shared memory (1-D, as TMA loads them)
ROWS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _program(rank, world, SPLIT: gl.constexpr, INTERLEAVE: gl.constexpr, BLOCK_N: gl.constexpr):
    """This program's key block and share: (first local key row, batch x K/V head, source rank, which of the SPLIT
    shares of the group's query heads). Within a source, launch order takes INTERLEAVE
    (batch x K/V head x share) units at a time, their key blocks interleaved from the first: the programs on the
    GPU at once read few query heads (from L2), and each unit's longest causal blocks start early enough that the
    last wave is not held up by them."""
    src = (rank + 1 + gl.program_id(2)) % world  # peers' blocks first, our own last
    n = gl.num_programs(0)
    lin = gl.program_id(1) * n + gl.program_id(0)  # the launch order within a source
    grp = lin // (n * INTERLEAVE)
    width = gl.minimum(gl.num_programs(1) - grp * INTERLEAVE, INTERLEAVE)  # the last group may be narrower
    w = lin - grp * (n * INTERLEAVE)
    blk = w // width
    unit = grp * INTERLEAVE + w % width
    return blk * BLOCK_N, unit // SPLIT, src, unit % SPLIT


@gluon.jit
def _rows(n0, src, qh, rank, world, C, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Local rows of query half ``qh`` against the key block at ``n0`` of ``src``: rows from the first returned
    see some of its keys, rows below the second see only some (masked); the block lies in one zigzag half."""
    if CAUSAL:
        k_first = zigzag_pos(n0, src, world, C)
        q0 = (rank + qh * (2 * world - 1 - 2 * rank)) * C  # the half's first position
        need = gl.minimum(gl.maximum(k_first - q0, 0), C)
        masked = gl.minimum(gl.maximum(k_first + BLOCK_N - 1 - q0, 0), C)
        masked = gl.minimum(need + (masked - need + BLOCK_M - 1) // BLOCK_M * BLOCK_M, C)
    else:
        need = C * 0
        masked = C * 0
    return need, masked


@gluon.jit
def _load(p, CAUSAL: gl.constexpr, SPLIT: gl.constexpr, INTERLEAVE: gl.constexpr, CLOCK: gl.constexpr):
    """The loader partition: K and V of the block once (after its chunk's flag), then Q and dO of every query
    block in the compute partitions' order."""
    (q_desc, do_desc, k_desc, v_desc, kw_desc, vw_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
     k_smem, v_smem, kv_bar, ready, empty, ds_smem, ds_full, ds_free, done, flags_ptr, waiter, world, S_LOCAL, HQ,
     HKV, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK) = p
    err_ptr, budget, rank, op = waiter
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    NSTAGE: gl.constexpr = q_smem.type.shape[0]
    n0, bhk, src, part = _program(rank, world, SPLIT, INTERLEAVE, BLOCK_N)
    b = bhk // HKV
    hk = bhk % HKV
    C = S_LOCAL // 2
    wait_kv(flags_ptr, waiter, src, n0, n0 + BLOCK_N, M_PER_CHUNK, CHUNKS_PER_RANK, CLOCK)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    if src == rank:  # our own K/V, read in place
        tma_load(k_desc, [b * S_LOCAL + n0, hk * HEAD_D], kv_bar, k_smem)
        tma_load(v_desc, [b * S_LOCAL + n0, hk * HEAD_D], kv_bar, v_smem)
    else:  # a peer's, from its slot in the workspace
        tma_load(kw_desc, [(b * world + src) * S_LOCAL + n0, hk * HEAD_D], kv_bar, k_smem)
        tma_load(vw_desc, [(b * world + src) * S_LOCAL + n0, hk * HEAD_D], kv_bar, v_smem)
    j = 0
    heads = GROUP // SPLIT
    for g in range(part * heads, part * heads + heads):
        col = (hk * GROUP + g) * HEAD_D
        lrow0 = (b * HQ + hk * GROUP + g) * S_LOCAL
        for qh in range(0, 2):
            need, masked = _rows(n0, src, qh, rank, world, C, CAUSAL, BLOCK_M, BLOCK_N)
            for m in range(need, C, BLOCK_M):
                s = j % NSTAGE
                mbarrier.wait(empty.index(s), ((j // NSTAGE) & 1) ^ 1)  # a fresh barrier counts as released
                mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
                tma_load(q_desc, [b * S_LOCAL + qh * C + m, col], ready.index(s), q_smem.index(s))
                tma_load(do_desc, [b * S_LOCAL + qh * C + m, col], ready.index(s), do_smem.index(s))
                tma_load(lse_desc, [lrow0 + qh * C + m], ready.index(s), lse_smem.index(s))
                tma_load(delta_desc, [lrow0 + qh * C + m], ready.index(s), delta_smem.index(s))
                j += 1


@gluon.jit
def _compute(p, dq_desc, dq_smem, recv_ptrs, counter_ptrs, part_ptr, ticket_ptr, sm_scale, CAUSAL: gl.constexpr,
             SPLIT: gl.constexpr, INTERLEAVE: gl.constexpr, WG: gl.constexpr):
    """Compute warpgroup WG (0 or 1): keys [64 WG, 64 WG + 64) of the block against every query block in the
    loader's order; dQ columns [D/2 WG, D/2 WG + D/2) of each query block over all 128 keys. Then its dK/dV rows
    into the owner's slot and the owner's counter bumped once for the block (``_store_block``)."""
    (q_desc, do_desc, k_desc, v_desc, kw_desc, vw_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
     k_smem, v_smem, kv_bar, ready, empty, ds_smem, ds_full, ds_free, done, flags_ptr, waiter, world, S_LOCAL, HQ,
     HKV, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK) = p
    err_ptr, budget, rank, op = waiter
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    NSTAGE: gl.constexpr = q_smem.type.shape[0]
    KEYS: gl.constexpr = BLOCK_N // 2
    HALF: gl.constexpr = HEAD_D // 2
    # S^T, dP^T [keys, queries]; dK, dV [keys, D]; dQ's half [queries, D / 2]
    LS: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                 instr_shape=[16, BLOCK_M, 16])
    LD: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                 instr_shape=[16, HEAD_D, 16])
    LQ: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                 instr_shape=[16, HALF, 16])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=LD, k_width=2)
    dtype: gl.constexpr = q_desc.dtype
    n0, bhk, src, part = _program(rank, world, SPLIT, INTERLEAVE, BLOCK_N)
    b = bhk // HKV
    hk = bhk % HKV
    C = S_LOCAL // 2
    qk_scale = sm_scale * LOG2E
    k_rows = k_smem.slice(WG * KEYS, KEYS)
    v_rows = v_smem.slice(WG * KEYS, KEYS)
    k_cols = k_smem.slice(WG * HALF, HALF, dim=1)
    # on a diagonal block a key is seen by a query at or after its position: positions run on within a block
    # (neither straddles a zigzag half), so key r, query c is seen where r - c <= (first query - first key)
    k_first = zigzag_pos(n0 + WG * KEYS, src, world, C)
    r_off = gl.arange(0, KEYS, layout=gl.SliceLayout(1, LS))
    c_off = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, LS))
    dq_buf = dq_smem.index(WG)  # this warpgroup's half of dQ on its way to the float32 buffer
    zero_s = gl.zeros([KEYS, BLOCK_M], gl.float32, LS)
    zero_q = gl.zeros([BLOCK_M, HALF], gl.float32, LQ)
    dk = gl.zeros([KEYS, HEAD_D], gl.float32, LD)
    dv = gl.zeros([KEYS, HEAD_D], gl.float32, LD)
    mbarrier.wait(kv_bar, 0)
    j = 0
    heads = GROUP // SPLIT
    for g in range(part * heads, part * heads + heads):
        h = hk * GROUP + g
        for qh in range(0, 2):
            need, masked = _rows(n0, src, qh, rank, world, C, CAUSAL, BLOCK_M, BLOCK_N)
            for m in range(need, C, BLOCK_M):
                s = j % NSTAGE
                mbarrier.wait(ready.index(s), (j // NSTAGE) & 1)
                qs = q_smem.index(s)
                dos = do_smem.index(s)
                st = warpgroup_mma(k_rows, qs.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                dpt = warpgroup_mma(v_rows, dos.permute((1, 0)), zero_s, use_acc=False, is_async=True)
                st = warpgroup_mma_wait(1, deps=(st, ))
                lse2 = lse_smem.index(s).load(gl.SliceLayout(0, LS)) * LOG2E
                pt = gl.exp2(st * qk_scale - lse2[None, :])
                if m < masked:  # the diagonal: keys after a row's position are not seen
                    diff = zigzag_pos(qh * C + m, rank, world, C) - k_first
                    pt = gl.where(r_off[:, None] <= c_off[None, :] + diff, pt, 0.0)
                dpt = warpgroup_mma_wait(0, deps=(dpt, ))
                delta = delta_smem.index(s).load(gl.SliceLayout(0, LS))
                ds = (pt * (dpt - delta[None, :])).to(dtype)
                dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), LA), dos, dv, is_async=True)
                dk = warpgroup_mma(gl.convert_layout(ds, LA), qs, dk, is_async=True)
                # dS^T into the shared buffer; once both warpgroups have written theirs, dQ's half
                d = j % 2
                mbarrier.wait(ds_free.index(d), ((j // 2) & 1) ^ 1)
                ds_smem.index(d).slice(WG * KEYS, KEYS).store(ds)
                fence_async_shared()
                barrier()
                mbarrier.arrive(ds_full.index(d))
                mbarrier.wait(ds_full.index(d), (j // 2) & 1)
                dq = warpgroup_mma(ds_smem.index(d).permute((1, 0)), k_cols, zero_q, use_acc=False, is_async=True)
                dq, dv, dk = warpgroup_mma_wait(0, deps=(dq, dv, dk))
                mbarrier.arrive(ds_free.index(d))
                mbarrier.arrive(empty.index(s))
                # dQ's half into the float32 buffer: through shared memory, added by TMA while the next block runs
                tma.store_wait(0)  # the previous block's addition has read the buffer
                barrier()
                dq_buf.store(dq)
                fence_async_shared()
                barrier()
                tma_atomic_add(dq_desc, [b * S_LOCAL + qh * C + m, h * HEAD_D + WG * HALF], dq_buf)
                j += 1
    tma.store_wait(0)
    _store_block(dk * sm_scale, dv, n0, b, hk, src, part, done, recv_ptrs, counter_ptrs, part_ptr, ticket_ptr, err_ptr,
                 rank, S_LOCAL, HKV, SPLIT, WG, KEYS, LD)


@gluon.jit
def _store_block(dk, dv, n0, b, hk, src, part, done, recv_ptrs, counter_ptrs, part_ptr, ticket_ptr, err_ptr, rank,
                 S_LOCAL, HKV, SPLIT: gl.constexpr, WG: gl.constexpr, KEYS: gl.constexpr, LD: gl.constexpr):
    """Warpgroup WG's dK/dV rows of the block into the owner's receive slot [W, 2, B, S, Hkv, D] (slot [rank]),
    then the owner's counter bumped once for the block. With SPLIT shares of the query heads, each warpgroup of
    the block's SPLIT programs first leaves its rows in the block's scratch [SPLIT, 2, BLOCK_N, D]; the last of
    the 2 x SPLIT to arrive sums the shares in a fixed order (the sum does not depend on who is last) and stores
    the whole block."""
    HEAD_D: gl.constexpr = dk.type.shape[1]
    BLOCK_N: gl.constexpr = 2 * KEYS
    nb = gl.num_programs(1) // (HKV * SPLIT)  # B
    slot = S_LOCAL * HKV * HEAD_D
    rows = gl.arange(0, KEYS, layout=gl.SliceLayout(1, LD))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, LD))
    at = (rank * 2 * nb + b) * slot + (n0 + rows)[:, None] * (HKV * HEAD_D) + hk * HEAD_D + cols[None, :]
    base = gl.load(recv_ptrs + src).to(gl.pointer_type(gl.float32))
    counter = gl.load(counter_ptrs + src).to(gl.pointer_type(gl.int32)) + rank
    if SPLIT == 1:
        ok = error_code(err_ptr) == 0  # nothing goes into a peer after a fault (its call may disagree)
        gl.store(base + at + WG * KEYS * (HKV * HEAD_D), dk, mask=ok)
        gl.store(base + at + WG * KEYS * (HKV * HEAD_D) + nb * slot, dv, mask=ok)  # the dV half follows dK's
        barrier()  # every thread's stores come before the arrive / the release below
        if WG == 1:
            mbarrier.arrive(done)
        else:
            mbarrier.wait(done, 0)  # warpgroup 1 has stored its rows
            if ok:
                gl.atomic_add(counter, 1, sem="release", scope="sys")
    else:
        unit = (gl.program_id(2) * (gl.num_programs(1) // SPLIT) + b * HKV + hk) * gl.num_programs(0) + n0 // BLOCK_N
        tile = rows[:, None] * HEAD_D + cols[None, :]
        scratch = part_ptr + unit * (SPLIT * 2 * BLOCK_N * HEAD_D)
        mine = scratch + part * (2 * BLOCK_N * HEAD_D) + WG * KEYS * HEAD_D
        gl.store(mine + tile, dk)
        gl.store(mine + BLOCK_N * HEAD_D + tile, dv)
        barrier()  # every thread's stores come before the ticket
        last = gl.atomic_add(ticket_ptr + unit, 1, sem="acq_rel", scope="gpu") == 2 * SPLIT - 1
        ok = error_code(err_ptr) == 0
        if last:
            for piece in gl.static_range(4):  # (dK, dV) x (rows of warpgroup 0, of warpgroup 1), one at a time
                acc = gl.zeros([KEYS, HEAD_D], gl.float32, LD)
                for s in range(0, SPLIT):
                    acc += gl.load(scratch + s * (2 * BLOCK_N * HEAD_D) + piece * KEYS * HEAD_D + tile, volatile=True)
                gl.store(base + at + piece % 2 * KEYS * (HKV * HEAD_D) + piece // 2 * nb * slot, acc, mask=ok)
            barrier()  # every thread's stores come before the release below
            if ok:
                gl.atomic_add(counter, 1, sem="release", scope="sys")


@gluon.jit
def cp_attention_bwd_ws(q_desc, do_desc, k_desc, v_desc, kw_desc, vw_desc, lse_desc, delta_desc, dq_desc, recv_ptrs,
                        counter_ptrs, part_ptr, ticket_ptr, flags_ptr, waiter, world, S_LOCAL, HQ, HKV, GROUP,
                        M_PER_CHUNK, CHUNKS_PER_RANK, sm_scale, CAUSAL: gl.constexpr,
                        SPLIT: gl.constexpr, INTERLEAVE: gl.constexpr, NSTAGE: gl.constexpr, CLOCK: gl.constexpr,
                        COMPUTE_REGS: gl.constexpr):
    """``q_desc``/``do_desc``: Q and dO as [B * S_LOCAL, HQ * D] in [BLOCK_M, D] blocks; ``k_desc``/``v_desc``:
    our K/V as [B * S_LOCAL, HKV * D] in [BLOCK_N, D] blocks; ``kw_desc``/``vw_desc``: the gathered workspaces as
    [B * world * S_LOCAL, HKV * D], same blocks. Grid (S_LOCAL / BLOCK_N, B * HKV * SPLIT, world); with SPLIT > 1,
    ``part_ptr``: float32 scratch [world * B * HKV * S_LOCAL / BLOCK_N, SPLIT, 2, BLOCK_N, D] and ``ticket_ptr``:
    int32 zeros, one per block (``_store_block``). ``dq_desc``: the float32 dQ buffer [B, S_LOCAL, HQ, D] (zeroed) as
    [B * S_LOCAL, HQ * D] in [BLOCK_M, D / 2] blocks,
    ``delta_ptr``: rowsum(dO * O) [B, HQ, S_LOCAL]. The other arguments are kernels.attention_bwd's
    cp_attention_dkdv's of the same name. Launched with 4 warps (the loader); two compute warpgroups of
    COMPUTE_REGS registers a thread join them."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NSTAGE] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NSTAGE] + do_desc.block_type.shape, do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [NSTAGE] + lse_desc.block_type.shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NSTAGE] + delta_desc.block_type.shape, delta_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], q_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSTAGE):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both compute warpgroups read every stage
    for i in gl.static_range(2):
        mbarrier.init(ds_full.index(i), count=2)
        mbarrier.init(ds_free.index(i), count=2)
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(done, count=1)
    p = (q_desc, do_desc, k_desc, v_desc, kw_desc, vw_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
         delta_smem, k_smem, v_smem, kv_bar, ready, empty, ds_smem, ds_full, ds_free, done, flags_ptr, waiter, world,
         S_LOCAL, HQ, HKV, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK)
    gl.warp_specialize([
        (_load, (p, CAUSAL, SPLIT, INTERLEAVE, CLOCK)),
        (_compute, (p, dq_desc, dq_smem, recv_ptrs, counter_ptrs, part_ptr, ticket_ptr, sm_scale, CAUSAL, SPLIT,
                    INTERLEAVE, 0)),
        (_compute, (p, dq_desc, dq_smem, recv_ptrs, counter_ptrs, part_ptr, ticket_ptr, sm_scale, CAUSAL, SPLIT,
                    INTERLEAVE, 1)),
    ], [4, 4], [COMPUTE_REGS, COMPUTE_REGS])


# ---------------------------------------------------------------------------------------------------- launcher
def usable(ctx, q, k, v, kw, vw, dq, docs) -> bool:
    """Whether this backward can run: the cuda backend on compute capability 9.0 with Gluon; 16-bit q/k/v, D of 64
    or 128; no packed documents; each zigzag half of the shard whole blocks of keys; q, k, v, dq and the workspaces
    contiguous (they are read as 2-D tensors)."""
    S, D = q.shape[1], q.shape[3]
    return (is_hopper(ctx) and docs is None and q.dtype in (torch.bfloat16, torch.float16) and D in (64, 128)
            and S % (2 * BLOCK_N) == 0 and all(t.is_contiguous() for t in (q, k, v, kw, vw, dq))
            and gluon_available())


def tiles(D: int) -> tuple:
    """(query rows per step, stages of the Q / dO ring) at head dim ``D``: 64 rows at D = 128 (the registers of two
    [64, 64] float32 products beside dK and dV); 128 at D = 64, where a step's products are half as long and the
    per-step synchronisation would otherwise weigh twice as much, in two stages to fit shared memory
    (docs/decisions.md)."""
    return TILES[128 if D > 64 else 64]


def heads_interleaved(blocks: int, units: int, sms: int) -> int:
    """How many of the launch's ``units`` (batch x K/V head x share, ``blocks`` key blocks each) ``_program``
    interleaves: 1 where a unit's blocks fill at least half of the ``sms``, so one unit's causal blocks, longest
    first, spread over the GPU and its programs share their query heads in L2; below that, the fewest (a power of
    two, at most ``units``) whose blocks together fill every SM, so that no unit's longest blocks start late
    enough to hold up the last wave (docs/decisions.md)."""
    g = 1
    if 2 * blocks < sms:
        while g * blocks < sms and 2 * g <= units:
            g *= 2
    return g


def launch_bwd_ws(ctx, q, k, v, kw, vw, dout, out, lse, dq, recv_ptrs, counter_ptrs, flags, m_per_chunk,
                  chunks_per_rank, scale, causal, rank: int, world: int, op: int, scratch) -> int:
    """The backward on this kernel (``usable`` holds), arguments as kernels.attention_bwd.launch_bwd's (``dout``
    and ``out`` contiguous); ``scratch``: its BackwardScratch (``scratch.split``: over how many programs each
    block's query heads are shared, a divisor of the group). Returns the count each owner waits for per source."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, S, Hq, D = q.shape
    Hkv = k.shape[2]

    bm, stages = tiles(D)

    def rows(t):  # float32 [b, h, s] as bm-row pieces of the 1-D [b * h * s]
        return TensorDescriptor(t.view(-1), [t.numel()], [1], [bm], ROWS_LAYOUT)

    n = S // BLOCK_N
    split = scratch.split
    interleave = heads_interleaved(n, B * Hkv * split, ctx.num_compute_units())
    half = [bm, D // 2]  # each compute warpgroup's piece of dQ

    def kernel(delta, acc):
        dq_desc = TensorDescriptor(acc.view(B * S, Hq * D), [B * S, Hq * D], [Hq * D, 1], half,
                                   shared_layout(half, gl.float32))
        zero_tickets(scratch)
        launch(cp_attention_bwd_ws, (n, B * Hkv * split, world), (
            head_desc(q, [bm, D]), head_desc(dout, [bm, D]), head_desc(k, [BLOCK_N, D]),
            head_desc(v, [BLOCK_N, D]), head_desc(kw, [BLOCK_N, D]), head_desc(vw, [BLOCK_N, D]),
            rows(lse.contiguous()), rows(delta), dq_desc, recv_ptrs, counter_ptrs, scratch.part, scratch.ticket,
            flags, waiter(ctx, op, rank), world, S, Hq, Hkv, Hq // Hkv, m_per_chunk, chunks_per_rank, scale,
        ), dict(CAUSAL=causal, SPLIT=split, INTERLEAVE=interleave, NSTAGE=stages, CLOCK=ctx.clock,
                COMPUTE_REGS=COMPUTE_REGS), num_warps=4)
        ctx.after_launch()

    single_pass(ctx, dout, out, dq, scale, kernel, scratch)
    return n * B * Hkv
