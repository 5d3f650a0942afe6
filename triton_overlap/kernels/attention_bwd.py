"""Flash-attention backward for context parallelism.

* ``cp_attention_dq``: one program per (block of local queries, batch x query
  head) runs over every rank's K/V (its own first, each peer's chunk after
  its flag) and accumulates dQ in float32.
* ``cp_attention_dkdv``: one program per (block of a source rank's K/V, batch
  x K/V head, source), sources ordered peers first and ourselves last. It runs
  over this rank's queries of all the group's query heads (so GQA/MQA sum
  over the group here), and stores the float32 partial dK/dV straight into
  the owner's receive slot for this rank, then bumps the owner's counter.
* ``reduce_dkdv`` (per owner): waits for every source's count and sums the W
  partials.

Causal masks use global zigzag positions as in the forward. No block is
skipped in backward yet (masked blocks contribute zeros), so every K/V flag
is waited for before the kernels end.
"""
import triton
import triton.language as tl

from .attention import kv_base, wait_kv, zigzag_pos
from .signal import add_release, wait_flag


@triton.jit
def cp_attention_dq(
    q_ptr, k_ptr, v_ptr, kws_ptr, vws_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, flags_ptr, err_ptr, budget,
    rank, world, op, S_LOCAL, HQ, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK, sm_scale,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sw_b, sw_s, sw_h,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
    CLOCK: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP
    C = S_LOCAL // 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    m_ok = offs_m < S_LOCAL
    row = b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :]  # q, do and dq share the layout
    q = tl.load(q_ptr + row, mask=m_ok[:, None], other=0.0)
    do = tl.load(do_ptr + row, mask=m_ok[:, None], other=0.0)
    if DOT_F32:  # host backend: Triton's interpreter multiplies bf16 operands as raw bits
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + bh * S_LOCAL + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(delta_ptr + bh * S_LOCAL + offs_m, mask=m_ok, other=0.0)
    q_pos = zigzag_pos(offs_m, rank, world, C)
    dq = tl.zeros((BLOCK_M, HEAD_D), tl.float32)
    for step in range(0, world):
        src = (rank - step + world) % world
        kb = kv_base(k_ptr, kws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, sw_s, sw_h)
        vb = kv_base(v_ptr, vws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, sw_s, sw_h)
        stride_s = tl.where(src == rank, sk_s, sw_s)
        for n0 in range(0, S_LOCAL, BLOCK_N):
            wait_kv(flags_ptr, err_ptr, budget, rank, op, src, n0, S_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK,
                     BLOCK_N, CLOCK)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < S_LOCAL
            kt = tl.load(kb + offs_n[None, :] * stride_s + offs_d[:, None], mask=n_ok[None, :], other=0.0)
            vt = tl.load(vb + offs_n[None, :] * stride_s + offs_d[:, None], mask=n_ok[None, :], other=0.0)
            if DOT_F32:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            keep = m_ok[:, None] & n_ok[None, :]
            if CAUSAL:
                keep = keep & (zigzag_pos(offs_n, src, world, C)[None, :] <= q_pos[:, None])
            s = tl.dot(q, kt) * sm_scale
            p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, vt)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
    tl.store(dq_ptr + row, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def cp_attention_dkdv(
    q_ptr, k_ptr, v_ptr, kws_ptr, vws_ptr, do_ptr, lse_ptr, delta_ptr, recv_ptrs, counter_ptrs, flags_ptr,
    err_ptr, budget, rank, world, op, S_LOCAL, HQ, HKV, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK, sm_scale,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sw_b, sw_s, sw_h,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
    CLOCK: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    src = (rank + 1 + tl.program_id(2)) % world  # peers' blocks first, our own last
    b = bhk // HKV
    hk = bhk % HKV
    C = S_LOCAL // 2
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    n_ok = offs_n < S_LOCAL
    wait_kv(flags_ptr, err_ptr, budget, rank, op, src, n0, S_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK, BLOCK_N, CLOCK)
    kb = kv_base(k_ptr, kws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, sw_s, sw_h)
    vb = kv_base(v_ptr, vws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, sw_s, sw_h)
    stride_s = tl.where(src == rank, sk_s, sw_s)
    k = tl.load(kb + offs_n[:, None] * stride_s + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    v = tl.load(vb + offs_n[:, None] * stride_s + offs_d[None, :], mask=n_ok[:, None], other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    k_pos = zigzag_pos(offs_n, src, world, C)
    dk = tl.zeros((BLOCK_N, HEAD_D), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_D), tl.float32)
    for g in range(0, GROUP):  # every query head that reads this K/V head
        h = hk * GROUP + g
        for m0 in range(0, S_LOCAL, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < S_LOCAL
            row = b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :]
            q = tl.load(q_ptr + row, mask=m_ok[:, None], other=0.0)
            do = tl.load(do_ptr + row, mask=m_ok[:, None], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(lse_ptr + (b * HQ + h) * S_LOCAL + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(delta_ptr + (b * HQ + h) * S_LOCAL + offs_m, mask=m_ok, other=0.0)
            keep = n_ok[:, None] & m_ok[None, :]
            if CAUSAL:
                keep = keep & (k_pos[:, None] <= zigzag_pos(offs_m, rank, world, C)[None, :])
            st = tl.dot(k, tl.trans(q)) * sm_scale  # [BLOCK_N, BLOCK_M]: scores transposed
            pt = tl.where(keep, tl.exp(st - lse[None, :]), 0.0)
            dv += tl.dot(pt.to(do.dtype), do)
            dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(q.dtype), q)
    # the partials go straight to the owner of this K/V: slot [rank] of its receive buffer [W, 2, B, S, Hkv, D]
    base = tl.load(recv_ptrs + src).to(tl.pointer_type(tl.float32))
    slot = S_LOCAL * HKV * HEAD_D
    at = (((rank * 2) * (tl.num_programs(1) // HKV)) * slot + b * slot + offs_n[:, None] * (HKV * HEAD_D)
          + hk * HEAD_D + offs_d[None, :])
    half = (tl.num_programs(1) // HKV) * slot  # distance from the dK half to the dV half of a slot
    tl.store(base + at, dk * sm_scale, mask=n_ok[:, None])
    tl.store(base + at + half, dv, mask=n_ok[:, None])
    tl.debug_barrier()  # every thread's stores come before the release below
    counters = tl.load(counter_ptrs + src).to(tl.pointer_type(tl.int32))
    add_release(counters + rank, 1)


@triton.jit
def reduce_dkdv(recv_ptr, dk_ptr, dv_ptr, counters_ptr, expected, err_ptr, budget, rank, world, op, N_ELEM,
                BLOCK: tl.constexpr, CLOCK: tl.constexpr):
    """dK, dV (this rank's own K/V) = sum over the W slots; slot s holds [dK | dV] partials from rank s."""
    pid = tl.program_id(0)
    for s in range(0, world):
        wait_flag(counters_ptr + s, expected, err_ptr, budget, rank, op, s, CLOCK)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N_ELEM
    dk = tl.zeros((BLOCK,), tl.float32)
    dv = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, world):
        dk += tl.load(recv_ptr + s * 2 * N_ELEM + offs, mask=ok, other=0.0)
        dv += tl.load(recv_ptr + (s * 2 + 1) * N_ELEM + offs, mask=ok, other=0.0)
    tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=ok)
    tl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=ok)
