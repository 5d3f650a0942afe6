"""Flash-attention backward for context parallelism.

* ``cp_attention_dq``: one program per (block of local queries, batch x query
  head) runs over every rank's K/V (its own first, each peer's chunk after
  its flag) and accumulates dQ in float32. It first stores its rows'
  ``delta`` (rowsum(dO * O)), which the dK/dV kernel after it reads.
* ``cp_attention_dkdv``: one program per (block of a source rank's K/V, batch
  x K/V head, source), sources ordered peers first and ourselves last. It runs
  over this rank's queries of all the group's query heads (so GQA/MQA sum
  over the group here), and stores the float32 partial dK/dV straight into
  the owner's receive slot for this rank, then bumps the owner's counter.
  Where a K/V head's blocks are too few programs for the GPU (MQA, few
  heads), each block's query heads are split over ``SPLIT`` programs: each
  stores its partial in a scratch slot, and the last to take the block's
  ticket sums the slots in a fixed order and does the store and the bump.
* ``reduce_dkdv`` (per owner): waits for every source's count and sums the W
  partials.
* The single pass (``single_pass``, kernels.attention_bwd_frame): delta and a
  zeroed float32 dQ buffer (``bwd_prologue``), one kernel that adds dQ up while
  it computes dK/dV, then dQ = the buffer times the scale (``bwd_epilogue``).
  On Hopper that kernel is kernels.attention_bwd_hopper's; on the host
  backend, where a config asks for it (``dkdv.warp_specialized``), it is
  ``cp_attention_dkdv`` with ``DQ_ACC``, which adds each block pair's dS K
  into the buffer by atomics: the same algorithm and protocol, so the host
  runs its tests.

Causal masks use global zigzag positions as in the forward, and the same
split: blocks every row sees run unmasked, blocks on the diagonal masked,
blocks nobody sees are skipped. ``cp_attention_dq`` waits for a chunk's flag
only when it reads it; ``cp_attention_dkdv`` waits for its own block's chunk
(every K/V block has a program), so every flag is seen before the kernels end.
Packed documents (VARLEN) as in the forward: a program's document and first
row come from a table, and it reads only that document's rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import cdiv
from .attention import Blocks, Documents, sequence_grid
from .attention_bwd_frame import BackwardScratch, single_pass, split_scratch, zero_tickets
from .attention_device import key_span, kv_base, piece, pieces, pos_span, segment, unmasked_end, wait_kv, zigzag_pos
from .cached_launch import launch
from .signal import WHAT_PARTIALS, add_release, error_code, wait_for, waiter

#: head_split_for: the dK/dV programs wanted per compute unit (docs/decisions.md)
HEAD_SPLIT_WAVES = 4


@triton.jit
def _dq_fold(dq, q, do, lse2, delta, q_pos, kb, vb, s_s, lo, hi, src, world, C, qk_scale,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
             DOT_F32: tl.constexpr):
    offs_d = tl.arange(0, HEAD_D)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            n_ok = offs_n < hi
            kt = tl.load(kb + offs_n[None, :] * s_s + offs_d[:, None], mask=n_ok[None, :], other=0.0)
            vt = tl.load(vb + offs_n[None, :] * s_s + offs_d[:, None], mask=n_ok[None, :], other=0.0)
        else:
            kt = tl.load(kb + offs_n[None, :] * s_s + offs_d[:, None])
            vt = tl.load(vb + offs_n[None, :] * s_s + offs_d[:, None])
        if DOT_F32:  # host backend: Triton's interpreter multiplies bf16 operands as raw bits
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        p = tl.exp2(tl.dot(q, kt) * qk_scale - lse2[:, None])
        if MASKED:
            keep = n_ok[None, :]
            if CAUSAL:
                keep = keep & (zigzag_pos(offs_n, src, world, C)[None, :] <= q_pos[:, None])
            p = tl.where(keep, p, 0.0)
        ds = p * (tl.dot(do, vt) - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
    return dq


@triton.jit
def cp_attention_dq(
    q_ptr, k_ptr, v_ptr, kws_ptr, vws_ptr, do_ptr, o_ptr, lse_ptr, delta_ptr, dq_ptr, flags_ptr, waiter, world,
    S_LOCAL, HQ, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK, sm_scale,
    sq_b, sq_s, sq_h, sk_b, sk_h, sw_b, sw_h, s_s, seg_ptr, cu_ptr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
    CLOCK: tl.constexpr, DOT_F32: tl.constexpr, VARLEN: tl.constexpr,
):
    rank = waiter[2]  # (waiter: kernels.signal.waiter's error word, budget, rank and op)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    seg0, S_DOC, m0 = segment(pid_m, seg_ptr, cu_ptr, S_LOCAL, BLOCK_M, VARLEN)
    C = S_DOC // 2
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    m_ok = offs_m < S_DOC
    rows = seg0 + offs_m
    row = b * sq_b + h * sq_h + rows[:, None] * sq_s + offs_d[None, :]  # q, do, o and dq share the layout
    q = tl.load(q_ptr + row, mask=m_ok[:, None], other=0.0)
    do = tl.load(do_ptr + row, mask=m_ok[:, None], other=0.0)
    o = tl.load(o_ptr + row, mask=m_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    tl.store(delta_ptr + bh * S_LOCAL + rows, delta, mask=m_ok)
    if DOT_F32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(lse_ptr + bh * S_LOCAL + rows, mask=m_ok, other=0.0) * 1.4426950408889634
    q_pos = zigzag_pos(offs_m, rank, world, C)
    q_first, q_last = pos_span(q_pos, m_ok)
    qk_scale = sm_scale * 1.4426950408889634
    dq = tl.zeros((BLOCK_M, HEAD_D), tl.float32)
    for step in range(0, world):
        src = (rank - step + world) % world
        kb = kv_base(k_ptr, kws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, s_s, sw_h) + seg0 * s_s
        vb = kv_base(v_ptr, vws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, s_s, sw_h) + seg0 * s_s
        for hh in range(0, 2):
            need, full = key_span(src, world, C, hh, q_first, q_last, CAUSAL)
            h0 = hh * C
            P, j0, j1 = pieces(src, rank, seg0, h0, h0 + need, M_PER_CHUNK)
            for j in range(j0, j1):
                c0, c1 = piece(j, P, seg0, h0, h0 + need)
                wait_kv(flags_ptr, waiter, src, seg0 + c0, seg0 + c1, M_PER_CHUNK, CHUNKS_PER_RANK, CLOCK)
                f1 = unmasked_end(c0, c1, h0 + full, BLOCK_N)
                dq = _dq_fold(dq, q, do, lse2, delta, q_pos, kb, vb, s_s, c0, f1, src, world, C, qk_scale,
                              False, CAUSAL, BLOCK_N, HEAD_D, DOT_F32)
                dq = _dq_fold(dq, q, do, lse2, delta, q_pos, kb, vb, s_s, f1, c1, src, world, C, qk_scale,
                              True, CAUSAL, BLOCK_N, HEAD_D, DOT_F32)
    tl.store(dq_ptr + row, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _dkdv_fold(dk, dv, k, v, k_pos, q_ptr, do_ptr, lse_ptr, delta_ptr, qrow0, lrow0, sq_s, lo, hi, rank, world, C,
               qk_scale, dq_acc_ptr, arow0, sa_s, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
               HEAD_D: tl.constexpr, DOT_F32: tl.constexpr, DQ_ACC: tl.constexpr):
    """Add the contributions of local query rows [lo, hi) of one head (q at ``qrow0``, lse at ``lrow0``). With
    DQ_ACC, also add those rows' dS K (unscaled) into the float32 dQ buffer (rows at ``arow0``, stride ``sa_s``)
    by atomics."""
    offs_d = tl.arange(0, HEAD_D)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        at = qrow0 + offs_m[:, None] * sq_s + offs_d[None, :]
        if MASKED:
            m_ok = offs_m < hi
            q = tl.load(q_ptr + at, mask=m_ok[:, None], other=0.0)
            do = tl.load(do_ptr + at, mask=m_ok[:, None], other=0.0)
            lse2 = tl.load(lse_ptr + lrow0 + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_ptr + lrow0 + offs_m, mask=m_ok, other=0.0)
        else:
            q = tl.load(q_ptr + at)
            do = tl.load(do_ptr + at)
            lse2 = tl.load(lse_ptr + lrow0 + offs_m) * 1.4426950408889634
            delta = tl.load(delta_ptr + lrow0 + offs_m)
        if DOT_F32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        pt = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]: transposed
        if MASKED:
            keep = m_ok[None, :]
            if CAUSAL:
                keep = keep & (k_pos[:, None] <= zigzag_pos(offs_m, rank, world, C)[None, :])
            pt = tl.where(keep, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do)
        dst = (pt * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)  # dS^T, as the products take it
        dk += tl.dot(dst, q)
        if DQ_ACC:
            acc_at = dq_acc_ptr + arow0 + offs_m[:, None] * sa_s + offs_d[None, :]
            dq_part = tl.dot(tl.trans(dst), k)
            if MASKED:
                tl.atomic_add(acc_at, dq_part, mask=m_ok[:, None], sem="relaxed")
            else:
                tl.atomic_add(acc_at, dq_part, sem="relaxed")
    return dk, dv


@triton.jit
def cp_attention_dkdv(
    q_ptr, k_ptr, v_ptr, kws_ptr, vws_ptr, do_ptr, lse_ptr, delta_ptr, recv_ptrs, counter_ptrs, flags_ptr,
    waiter, world, S_LOCAL, HQ, HKV, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK, sm_scale,
    sq_b, sq_s, sq_h, sk_b, sk_h, sw_b, sw_h, s_s, seg_ptr, cu_ptr, part_ptr, ticket_ptr, dq_acc_ptr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
    CLOCK: tl.constexpr, DOT_F32: tl.constexpr, VARLEN: tl.constexpr, SPLIT: tl.constexpr, DQ_ACC: tl.constexpr,
):
    err_ptr, budget, rank, op = waiter
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1) // SPLIT
    part = tl.program_id(1) % SPLIT  # which share of the group's query heads
    src = (rank + 1 + tl.program_id(2)) % world  # peers' blocks first, our own last
    b = bhk // HKV
    hk = bhk % HKV
    seg0, S_DOC, n0 = segment(pid_n, seg_ptr, cu_ptr, S_LOCAL, BLOCK_N, VARLEN)
    C = S_DOC // 2
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    n_ok = offs_n < S_DOC
    wait_kv(flags_ptr, waiter, src, seg0 + n0, seg0 + tl.minimum(n0 + BLOCK_N, S_DOC), M_PER_CHUNK, CHUNKS_PER_RANK,
            CLOCK)
    kb = kv_base(k_ptr, kws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, s_s, sw_h) + seg0 * s_s
    vb = kv_base(v_ptr, vws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, s_s, sw_h) + seg0 * s_s
    k = tl.load(kb + offs_n[:, None] * s_s + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    v = tl.load(vb + offs_n[:, None] * s_s + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    k_pos = zigzag_pos(offs_n, src, world, C)
    k_first, k_last = pos_span(k_pos, n_ok)
    qk_scale = sm_scale * 1.4426950408889634
    dk = tl.zeros((BLOCK_N, HEAD_D), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_D), tl.float32)
    heads = GROUP // SPLIT
    for g in range(part * heads, part * heads + heads):  # the query heads that read this K/V head (this share)
        h = hk * GROUP + g
        qrow0 = b * sq_b + h * sq_h + seg0 * sq_s
        lrow0 = (b * HQ + h) * S_LOCAL + seg0
        arow0 = ((b * S_LOCAL + seg0) * HQ + h) * HEAD_D  # the dQ buffer [B, S, Hq, D], contiguous
        for qh in range(0, 2):  # this rank's two query halves
            h0 = qh * C
            if CAUSAL:  # query rows of the half that see some / every key of the block
                qpos0 = tl.where(qh == 0, rank, 2 * world - 1 - rank) * C
                m_need = tl.minimum(tl.maximum(k_first - qpos0, 0), C)
                m_full = tl.minimum(tl.maximum(k_last - qpos0, 0), C)
            else:
                m_need = 0
                m_full = 0
            m1 = tl.minimum(m_need + (m_full - m_need + BLOCK_M - 1) // BLOCK_M * BLOCK_M, C)
            m2 = m1 + (C - m1) // BLOCK_M * BLOCK_M
            dk, dv = _dkdv_fold(dk, dv, k, v, k_pos, q_ptr, do_ptr, lse_ptr, delta_ptr, qrow0, lrow0, sq_s,
                                h0 + m_need, h0 + m1, rank, world, C, qk_scale, dq_acc_ptr, arow0, HQ * HEAD_D,
                                True, CAUSAL, BLOCK_M, HEAD_D, DOT_F32, DQ_ACC)
            dk, dv = _dkdv_fold(dk, dv, k, v, k_pos, q_ptr, do_ptr, lse_ptr, delta_ptr, qrow0, lrow0, sq_s,
                                h0 + m1, h0 + m2, rank, world, C, qk_scale, dq_acc_ptr, arow0, HQ * HEAD_D,
                                False, CAUSAL, BLOCK_M, HEAD_D, DOT_F32, DQ_ACC)
            dk, dv = _dkdv_fold(dk, dv, k, v, k_pos, q_ptr, do_ptr, lse_ptr, delta_ptr, qrow0, lrow0, sq_s,
                                h0 + m2, h0 + C, rank, world, C, qk_scale, dq_acc_ptr, arow0, HQ * HEAD_D,
                                True, CAUSAL, BLOCK_M, HEAD_D, DOT_F32, DQ_ACC)
    dk = dk * sm_scale
    last = pid_n >= 0
    if SPLIT > 1:  # the last of the block's SPLIT programs sums their partials
        unit = (tl.program_id(2) * (tl.num_programs(1) // SPLIT) + bhk) * tl.num_programs(0) + pid_n
        tile = tl.arange(0, BLOCK_N)[:, None] * HEAD_D + offs_d[None, :]
        parts = part_ptr + unit * (SPLIT * 2 * BLOCK_N * HEAD_D)
        tl.store(parts + part * (2 * BLOCK_N * HEAD_D) + tile, dk)
        tl.store(parts + part * (2 * BLOCK_N * HEAD_D) + BLOCK_N * HEAD_D + tile, dv)
        tl.debug_barrier()  # every thread's stores come before the ticket
        last = tl.atomic_add(ticket_ptr + unit, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            dk = tl.zeros((BLOCK_N, HEAD_D), tl.float32)
            dv = tl.zeros((BLOCK_N, HEAD_D), tl.float32)
            for p in range(0, SPLIT):  # a fixed order whoever comes last: the sum is deterministic
                dk += tl.load(parts + p * (2 * BLOCK_N * HEAD_D) + tile, volatile=True)
                dv += tl.load(parts + p * (2 * BLOCK_N * HEAD_D) + BLOCK_N * HEAD_D + tile, volatile=True)
    # the partials go straight to the owner of this K/V: slot [rank] of its receive buffer [W, 2, B, S, Hkv, D]
    base = tl.load(recv_ptrs + src).to(tl.pointer_type(tl.float32))
    slot = S_LOCAL * HKV * HEAD_D
    nb = tl.num_programs(1) // (HKV * SPLIT)  # B
    at = (rank * 2 * nb + b) * slot + (seg0 + offs_n)[:, None] * (HKV * HEAD_D) + hk * HEAD_D + offs_d[None, :]
    if last & (error_code(err_ptr) == 0):  # nothing goes into a peer after a fault (its call may disagree)
        tl.store(base + at, dk, mask=n_ok[:, None])
        tl.store(base + at + nb * slot, dv, mask=n_ok[:, None])  # the dV half of the slot follows the dK half
        tl.debug_barrier()  # every thread's stores come before the release below
        counters = tl.load(counter_ptrs + src).to(tl.pointer_type(tl.int32))
        add_release(counters + rank, 1)


@triton.jit
def reduce_dkdv(recv_ptr, dk_ptr, dv_ptr, counters_ptr, expected, waiter, sources_ptr, num_sources, N_ELEM,
                BLOCK: tl.constexpr, CLOCK: tl.constexpr):
    """dK, dV (this rank's own K/V) = sum over the slots of the ``num_sources`` ranks in ``sources_ptr``; slot s
    holds [dK | dV] partials from rank s (or, summed within its host, from rank s's host)."""
    pid = tl.program_id(0)
    for i in range(0, num_sources):
        s = tl.load(sources_ptr + i)
        wait_for(counters_ptr + s, expected, waiter, s, WHAT_PARTIALS, CLOCK)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N_ELEM
    dk = tl.zeros((BLOCK,), tl.float32)
    dv = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, num_sources):
        s = tl.load(sources_ptr + i).to(tl.int64)
        dk += tl.load(recv_ptr + s * 2 * N_ELEM + offs, mask=ok, other=0.0)
        dv += tl.load(recv_ptr + (s * 2 + 1) * N_ELEM + offs, mask=ok, other=0.0)
    tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=ok)
    tl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------------- launchers
def backward_scratch(ctx, q, k, v, kw, vw, dq, flags, dkdv_blocks: Blocks, world=None,
                     docs_dkdv: Documents | None = None, head_split: int | None = None) -> BackwardScratch:
    """The scratch and path of a launch_bwd with these arguments (its docstring says what they are)."""
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    world = ctx.world_size if world is None else world
    group = Hq // Hkv
    if head_split is not None and (head_split < 1 or group % head_split):
        raise ValueError(f"cp_attention: head_split {head_split} does not divide the {group} query heads of a "
                         "K/V head")
    path, block_n, waves = "two kernels", dkdv_blocks.block_n, HEAD_SPLIT_WAVES
    if dkdv_blocks.warp_specialized:
        from . import attention_bwd_hopper as ws
        if ws.usable(ctx, q, k, v, kw, vw, dq, docs_dkdv):
            path, block_n, waves = "hopper", ws.BLOCK_N, ws.MIN_WAVES
        elif ctx.interpreted and docs_dkdv is None and q.is_contiguous():
            path = "single pass"
    n = sequence_grid(S, block_n, docs_dkdv, flags)[0]
    # (interpreted, on the CPU: no compute units to fill, so no split unless asked for)
    split = 1 if not n else head_split or (1 if ctx.interpreted else head_split_for(ctx, n * B * Hkv * world, group,
                                                                                     waves))
    part, ticket = split_scratch(flags, world * B * Hkv * n, split, block_n, D)
    return BackwardScratch(path, split, torch.empty((B, Hq, S), dtype=torch.float32, device=q.device),
                           None if path == "two kernels" else
                           torch.empty((B, S, Hq, D), dtype=torch.float32, device=q.device), part, ticket)


def launch_bwd(ctx, q, k, v, kw, vw, dout, out, lse, dq, recv_ptrs, counter_ptrs, flags, m_per_chunk,
               chunks_per_rank, scale, causal, dq_blocks: Blocks, dkdv_blocks: Blocks, rank=None, world=None,
               docs_dq: Documents | None = None, docs_dkdv: Documents | None = None, op: int = 0,
               head_split: int | None = None, scratch: BackwardScratch | None = None) -> int:
    """dQ into ``dq``; float32 dK/dV partials into every owner's receive slot [W, 2, B, S, Hkv, D] for this rank,
    each block bumping the owner's counter for this rank. ``out``: the forward's output (for delta).
    ``docs_dq`` / ``docs_dkdv``: packed documents' tables for the two kernels' blocks (B = 1), else None.
    ``head_split``: over how many dK/dV programs each K/V block's query heads are split (None: head_split_for).
    With ``dkdv_blocks.warp_specialized``, where kernels.attention_bwd_hopper can run, its single kernel computes dQ,
    dK and dV instead of the two (``head_split`` None: chosen for it with its MIN_WAVES).
    ``scratch``: backward_scratch's for the same arguments (None: allocated here).
    Returns the count each owner waits for per source."""
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    if not (k.stride(1) == kw.stride(1) == v.stride(1) == vw.stride(1)):
        raise ValueError("cp_attention: k, v and the workspaces must share a sequence stride")
    # the dQ kernel addresses q, dout, out and dq alike
    dout, out = (t if t.stride() == q.stride() else torch.empty_like(q).copy_(t) for t in (dout, out))
    if dq.stride() != q.stride():
        raise ValueError("cp_attention: dq must have q's strides")
    rank = ctx.rank if rank is None else rank
    world = ctx.world_size if world is None else world
    if scratch is None:
        scratch = backward_scratch(ctx, q, k, v, kw, vw, dq, flags, dkdv_blocks, world, docs_dkdv, head_split)
    common = (waiter(ctx, op, rank), world, S)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(2), kw.stride(0), kw.stride(2), k.stride(1))
    meta = dict(CAUSAL=causal, HEAD_D=D, CLOCK=ctx.clock, DOT_F32=ctx.interpreted)

    def dkdv(delta, dq_acc=None):
        """The dK/dV kernel (with dq_acc, adding dQ up too); the count each owner waits for per source."""
        n, seg, cu = sequence_grid(S, dkdv_blocks.block_n, docs_dkdv, flags)
        if n:
            split = scratch.split
            zero_tickets(scratch)
            launch(cp_attention_dkdv, (n, B * Hkv * split, world), (
                q, k, v, kw, vw, dout, lse, delta, recv_ptrs, counter_ptrs, flags, *common, Hq, Hkv, Hq // Hkv,
                m_per_chunk, chunks_per_rank, scale, *strides, seg, cu, scratch.part, scratch.ticket,
                flags if dq_acc is None else dq_acc),
                dict(BLOCK_M=dkdv_blocks.block_m, BLOCK_N=dkdv_blocks.block_n, VARLEN=docs_dkdv is not None,
                     SPLIT=split, DQ_ACC=dq_acc is not None, **meta),
                num_warps=dkdv_blocks.num_warps, num_stages=dkdv_blocks.num_stages)
            ctx.after_launch()
        return n * B * Hkv

    if scratch.path == "hopper":
        from . import attention_bwd_hopper as ws
        return ws.launch_bwd_ws(ctx, q, k, v, kw, vw, dout, out, lse, dq, recv_ptrs, counter_ptrs, flags,
                                m_per_chunk, chunks_per_rank, scale, causal, rank, world, op, scratch)
    if scratch.path == "single pass":  # the same single pass in Triton's interpreter: the dK/dV kernel adds dQ up
        return single_pass(ctx, dout, out, dq, scale, dkdv, scratch)
    delta = scratch.delta  # written by the dQ kernel
    n, seg, cu = sequence_grid(S, dq_blocks.block_m, docs_dq, flags)
    if n:
        launch(cp_attention_dq, (n, B * Hq), (
            q, k, v, kw, vw, dout, out, lse, delta, dq, flags, *common, Hq, Hq // Hkv,
            m_per_chunk, chunks_per_rank, scale, *strides, seg, cu),
            dict(BLOCK_M=dq_blocks.block_m, BLOCK_N=dq_blocks.block_n, VARLEN=docs_dq is not None, **meta),
            num_warps=dq_blocks.num_warps, num_stages=dq_blocks.num_stages)
        ctx.after_launch()
    return dkdv(delta)


def head_split_for(ctx, programs: int, group: int, waves: int = HEAD_SPLIT_WAVES) -> int:
    """Over how many dK/dV programs to split each K/V block's ``group`` query heads: the fewest (a divisor of
    ``group``) that give the GPU ``waves`` programs per compute unit, where ``programs`` (blocks x heads x sources)
    fall short (backward_scratch takes 1 where kernels are interpreted)."""
    want = waves * ctx.num_compute_units()
    split = 1
    while programs * split < want and split < group:
        split = next(d for d in range(split + 1, group + 1) if group % d == 0)
    return split


def launch_reduce_dkdv(ctx, recv, dk, dv, counters, expected: int, op: int = 0, sources: tuple | None = None) -> None:
    """dK, dV = the sum of the partials in ``recv`` (this rank's receive slots) of ``sources`` (None: every rank),
    once each source's count in ``counters`` has reached ``expected``."""
    n = dk.numel()
    block = 1024 if ctx.interpreted else 2048
    sources = tuple(range(ctx.world_size)) if sources is None else tuple(sources)
    ranks = ctx.cached(("reduce sources", sources), lambda: torch.tensor(sources, dtype=torch.int32,
                                                                         device=ctx.device))
    launch(reduce_dkdv, (cdiv(n, block),), (recv, dk, dv, counters, expected, waiter(ctx, op), ranks, len(sources),
                                           n), dict(BLOCK=block, CLOCK=ctx.clock))
    ctx.after_launch()
