"""Device code the attention kernels share, forward and backward, plain Triton and Gluon (kernels.attention,
kernels.attention_bwd, kernels.attention_hopper, kernels.attention_bwd_hopper):

* zigzag positions (``zigzag_pos``) and, for causal masks, which keys of a source's half a block of queries sees
  (``key_span``, ``pos_span``, ``unmasked_end``);
* where a source's K/V lives (``kv_base``: our own tensor or its slot in the workspace), and the pieces a source's
  keys are read in, split at its chunk boundaries (``pieces``, ``piece``);
* packed documents' segments (``segment``);
* the waits on K/V chunk flags (``wait_kv``, ``wait_every_chunk``), which take the kernel's ``waiter``
  (kernels.signal.waiter).

Plain Triton (``@triton.jit``): the Gluon kernels call them as they are.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .signal import wait_for


@triton.jit
def zigzag_pos(idx, src, world, C):
    """The global position of local row ``idx`` of rank ``src``'s shard (zigzag halves of ``C`` rows)."""
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
def wait_kv(flags_ptr, waiter, src, n0, n1, M_PER_CHUNK, CHUNKS_PER_RANK, CLOCK: tl.constexpr):
    """Wait for the flags of every chunk of ``src`` that local key rows [n0, n1) touch (none for our own)."""
    if src != waiter[2]:  # (the waiter's rank: ours)
        for j in range(n0 // M_PER_CHUNK, (n1 - 1) // M_PER_CHUNK + 1):
            wait_for(flags_ptr + src * CHUNKS_PER_RANK + j, 1, waiter, src, j, CLOCK)


@triton.jit
def segment(pid, seg_ptr, cu_ptr, S_LOCAL, BLOCK: tl.constexpr, VARLEN: tl.constexpr):
    """(first row of the document in the shard, its length, this program's first row within it): the
    whole shard is one document unless VARLEN, where the table names the document and the row."""
    if VARLEN:
        doc = tl.load(seg_ptr + 2 * pid)
        r0 = tl.load(seg_ptr + 2 * pid + 1)
        so = tl.load(cu_ptr + doc)
        length = tl.load(cu_ptr + doc + 1) - so
    else:
        so = 0
        length = S_LOCAL
        r0 = pid * BLOCK
    return so, length, r0


@triton.jit
def pieces(src, rank, so, lo, hi, M_PER_CHUNK):
    """Range of the pieces that key rows [lo, hi) of a document starting at row ``so`` are read in: our own in
    one, a peer's split at its chunk boundaries (each piece waits for its chunks). See ``piece``."""
    P = tl.where(src == rank, 1 << 30, M_PER_CHUNK)
    j0 = (so + lo) // P
    j1 = tl.where(hi > lo, (so + hi - 1) // P + 1, j0)
    return P, j0, j1


@triton.jit
def piece(j, P, so, lo, hi):
    """Rows [c0, c1) of piece ``j`` (document-relative)."""
    return tl.maximum(j * P - so, lo), tl.minimum((j + 1) * P - so, hi)


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
def wait_every_chunk(flags_ptr, waiter, world, CHUNKS_PER_RANK, CLOCK: tl.constexpr):
    """Wait for the flag of every peer's chunk. A causal forward skips the chunks no query block needs, so one
    program of it calls this: when the kernel ends every peer's flag write has landed and the caller may reset
    the flags."""
    for c in range(0, world * CHUNKS_PER_RANK):
        if c // CHUNKS_PER_RANK != waiter[2]:
            wait_for(flags_ptr + c, 1, waiter, c // CHUNKS_PER_RANK, c % CHUNKS_PER_RANK, CLOCK)
