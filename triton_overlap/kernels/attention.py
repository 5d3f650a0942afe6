"""Flash-attention forward that folds in remote K/V chunks the moment they land.

One program per (block of BLOCK_M local queries, batch x query head). It runs
over the K/V of every rank in arrival order, its own first (read in place),
then each peer's from the workspace, chunk by chunk: one wait on a chunk's
flag, then a loop over the chunk's key blocks.

Causal masking uses global positions (zigzag: local index i of rank s sits at
s*C + i for i < C, and at (2W-1-s)*C + i - C after). For each half of a
source's keys the kernel works out, from the first and last query position of
its block, which keys every row sees (an unmasked loop that Triton can
pipeline), which keys some rows see (a masked loop), and which none sees
(skipped: neither waited for nor read). Program (0, 0) still waits for every
flag before the kernel ends, so the caller can reset them.

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
def wait_kv(flags_ptr, err_ptr, budget, rank, op, src, n0, n1, M_PER_CHUNK, CHUNKS_PER_RANK, CLOCK: tl.constexpr):
    """Wait for the flags of every chunk of ``src`` that local key rows [n0, n1) touch (none for our own)."""
    if src != rank:
        for j in range(n0 // M_PER_CHUNK, (n1 - 1) // M_PER_CHUNK + 1):
            c = src * CHUNKS_PER_RANK + j
            wait_flag(flags_ptr + c, 1, err_ptr, budget, rank, op, c, CLOCK)


@triton.jit
def pos_span(pos, ok):
    """First and last position among the rows of a block that are in range."""
    return tl.min(tl.where(ok, pos, 1 << 30), axis=0), tl.max(tl.where(ok, pos, -1), axis=0)


@triton.jit
def unmasked_end(c0, c1, full_end, BLOCK_N: tl.constexpr):
    """End of the whole blocks from c0 that every query row sees (at most c1)."""
    return c0 + tl.maximum(tl.minimum(c1, full_end) - c0, 0) // BLOCK_N * BLOCK_N


@triton.jit
def key_span(src, world, C, hh, q_first, q_last, CAUSAL: tl.constexpr):
    """For key half ``hh`` of ``src``: how many of its keys (from the half's start) some row of the
    query block sees, and how many every row sees."""
    if CAUSAL:
        kpos0 = tl.where(hh == 0, src, 2 * world - 1 - src) * C
        need = tl.minimum(tl.maximum(q_last - kpos0 + 1, 0), C)
        full = tl.minimum(tl.maximum(q_first - kpos0 + 1, 0), C)
    else:
        need = C
        full = C
    return need, full


@triton.jit
def _fold(acc, m_i, l_i, q, q_pos, kb, vb, s_s, lo, hi, src, world, C, qk_scale,
          MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
          DOT_F32: tl.constexpr):
    """Online softmax over key rows [lo, hi). Unmasked: every row sees every key, and (hi - lo) is a
    multiple of BLOCK_N. Masked: bounds and, if causal, positions are checked per element."""
    offs_d = tl.arange(0, HEAD_D)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            n_ok = offs_n < hi
            k = tl.load(kb + offs_n[None, :] * s_s + offs_d[:, None], mask=n_ok[None, :], other=0.0)
            v = tl.load(vb + offs_n[:, None] * s_s + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k = tl.load(kb + offs_n[None, :] * s_s + offs_d[:, None])
            v = tl.load(vb + offs_n[:, None] * s_s + offs_d[None, :])
        if DOT_F32:  # host backend: Triton's interpreter multiplies bf16 operands as raw bits
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k)
        if MASKED:
            keep = n_ok[None, :]
            if CAUSAL:
                keep = keep & (zigzag_pos(offs_n, src, world, C)[None, :] <= q_pos[:, None])
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet stay at zero
            p = tl.exp2(s - m_use[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            m_use = m_new
            p = tl.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def cp_attention_fwd(
    q_ptr, k_ptr, v_ptr, kws_ptr, vws_ptr, o_ptr, lse_ptr, flags_ptr, err_ptr, budget, rank, world, op,
    S_LOCAL, HQ, GROUP, M_PER_CHUNK, CHUNKS_PER_RANK, sm_scale,
    sq_b, sq_s, sq_h, sk_b, sk_h, sw_b, sw_h, s_s, so_b, so_s, so_h,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
    CLOCK: tl.constexpr, DOT_F32: tl.constexpr,
):
    """``s_s``: the sequence stride of k, v and the workspaces (the same: all are [.., S, Hkv, D] contiguous)."""
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
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = zigzag_pos(offs_m, rank, world, C)
    q_first, q_last = pos_span(q_pos, m_ok)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 instead of exp

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_D), tl.float32)

    for step in range(0, world):
        src = (rank - step + world) % world  # arrival order: our own K/V, then peers as they push to us
        kb = kv_base(k_ptr, kws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, s_s, sw_h)
        vb = kv_base(v_ptr, vws_ptr, src, rank, b, hk, S_LOCAL, sk_b, sk_h, sw_b, s_s, sw_h)
        # our own keys in one piece per half; a peer's chunk by chunk, in the order they arrive
        piece = tl.where(src == rank, C, M_PER_CHUNK)
        for hh in range(0, 2):
            need, full = key_span(src, world, C, hh, q_first, q_last, CAUSAL)
            h0 = hh * C
            for c0 in range(h0, h0 + need, piece):
                c1 = tl.minimum(c0 + piece, h0 + need)
                wait_kv(flags_ptr, err_ptr, budget, rank, op, src, c0, c1, M_PER_CHUNK, CHUNKS_PER_RANK, CLOCK)
                f1 = unmasked_end(c0, c1, h0 + full, BLOCK_N)
                acc, m_i, l_i = _fold(acc, m_i, l_i, q, q_pos, kb, vb, s_s, c0, f1, src, world, C, qk_scale,
                                      False, CAUSAL, BLOCK_N, HEAD_D, DOT_F32)
                acc, m_i, l_i = _fold(acc, m_i, l_i, q, q_pos, kb, vb, s_s, f1, c1, src, world, C, qk_scale,
                                      True, CAUSAL, BLOCK_N, HEAD_D, DOT_F32)

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
