"""Flash-attention forward that folds in remote K/V chunks the moment they land.

One program per (block of BLOCK_M local queries, batch x query head). It runs
over the K/V of every rank in arrival order, its own first (read in place),
then each peer's from the workspace. Before a block of a peer's K/V it waits
for the flag of the chunk holding it. Causal masking uses global positions
(zigzag: local index i of rank s sits at s*C + i for i < C, and at
(2W-1-s)*C + i - C after), so whole blocks above the diagonal are skipped
without waiting for them and blocks on it are masked (program (0, 0) still
waits for every flag before the kernel ends, so the caller can reset them).
The running max, sum and accumulator stay in float32; lse is in natural log.
"""
import triton
import triton.language as tl

from .signal import wait_flag


@triton.jit
def zigzag_pos(idx, src, world, C):
    return tl.where(idx < C, src * C + idx, (2 * world - 1 - src) * C + idx - C)


@triton.jit
def kv_base(k_ptr, kws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, sw_s, sw_h):
    """Where source ``src``'s K (or V) block lives: our own tensor, or its slot in the gathered workspace."""
    if src == rank:
        base = k_ptr + b * sk_b + hk * sk_h
    else:
        base = kws_ptr + b * sw_b + hk * sw_h + (src * S_LOCAL) * sw_s
    return base


@triton.jit
def wait_kv(flags_ptr, err_ptr, budget, rank, op, src, n0, S_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK,
             BLOCK_N: tl.constexpr, CLOCK: tl.constexpr):
    if src != rank:
        j_hi = (tl.minimum(n0 + BLOCK_N, S_LOCAL) - 1) // M_PER_CHUNK
        for j in range(n0 // M_PER_CHUNK, j_hi + 1):
            c = src * CHUNKS_PER_RANK + j
            wait_flag(flags_ptr + c, 1, err_ptr, budget, rank, op, c, CLOCK)


@triton.jit
def cp_attention_fwd(
    q_ptr, k_ptr, v_ptr, kws_ptr, vws_ptr, o_ptr, lse_ptr, flags_ptr, err_ptr, budget, rank, world, op,
    S_LOCAL, HQ, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK, sm_scale,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sw_b, sw_s, sw_h, so_b, so_s, so_h,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
    CLOCK: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // GROUP  # grouped-query attention: K/V move and are read at Hkv heads
    C = S_LOCAL // 2

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    m_ok = offs_m < S_LOCAL
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    if DOT_F32:  # host backend: Triton's interpreter multiplies bf16 operands as raw bits
        q = q.to(tl.float32)
    q_pos = zigzag_pos(offs_m, rank, world, C)
    q_last = tl.max(tl.where(m_ok, q_pos, -1), axis=0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_D), tl.float32)

    for step in range(0, world):
        src = (rank - step + world) % world  # arrival order: our own K/V, then peers as they push to us
        for n0 in range(0, S_LOCAL, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < S_LOCAL
            k_pos = zigzag_pos(offs_n, src, world, C)
            k_first = tl.min(tl.where(n_ok, k_pos, 1 << 30), axis=0)
            needed = True
            if CAUSAL:
                needed = k_first <= q_last  # a block wholly above the diagonal is neither waited for nor read
            if needed:
                wait_kv(flags_ptr, err_ptr, budget, rank, op, src, n0, S_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK,
                        BLOCK_N, CLOCK)
                kb = kv_base(k_ptr, kws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, sw_s, sw_h)
                vb = kv_base(v_ptr, vws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, sw_s, sw_h)
                stride_s = tl.where(src == rank, sk_s, sw_s)
                k = tl.load(kb + offs_n[None, :] * stride_s + offs_d[:, None], mask=n_ok[None, :], other=0.0)
                v = tl.load(vb + offs_n[:, None] * stride_s + offs_d[None, :], mask=n_ok[:, None], other=0.0)
                if DOT_F32:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                s = tl.dot(q, k) * qk_scale
                keep = n_ok[None, :]
                if CAUSAL:
                    keep = keep & (k_pos[None, :] <= q_pos[:, None])
                s = tl.where(keep, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet stay at zero
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None])
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # back from base 2 to natural log
    tl.store(lse_ptr + bh * S_LOCAL + offs_m, lse, mask=m_ok)
    if CAUSAL:
        # chunks no program needed were never waited for; one program waits for them all, so when the
        # kernel ends every peer's flag write has landed and the caller may reset the flags
        if (pid_m == 0) & (bh == 0):
            for c in range(0, world * CHUNKS_PER_RANK):
                if c // CHUNKS_PER_RANK != rank:
                    wait_flag(flags_ptr + c, 1, err_ptr, budget, rank, op, c, CLOCK)
