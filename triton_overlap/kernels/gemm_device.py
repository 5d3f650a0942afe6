"""Device code the GEMM kernels share: kernels.gemm's persistent GEMMs and the Gluon GEMMs for Hopper
(kernels.gemm_warp_specialized, kernels.gemm_gather_hopper), which take the same tiles in the same order.

* tile orders: ``grouped_tile`` (GROUP_M m-tiles of the order at a time, for L2 reuse) and ``rs_tile`` (GEMM-RS
  with its reduction fused: peers' rows first, then this rank's, each grouped on its own);
* GEMM-RS's own rows (REDUCE_OWN): ``own_chunks_ready`` waits for every peer's partials of a tile's chunks,
  ``reduce_own`` adds them and the bias to the tile and stores the output; ``publish`` bumps an owner's counters
  once a tile of its rows is stored;
* ``reset_at_exit``: the last program out zeroes the flags (RESET_AT_EXIT);
* ``fence_async_proxy``: a tile that waited on a flag orders that acquire before its TMA loads;
* kernels.gemm's K loops (``k_loop_desc`` through descriptors, ``k_loop_ptr`` through pointers), its plain tile
  store (``store_plain``, ``column_halves``) and AMD's program renumbering (``remap_xcd``).

Plain Triton (``@triton.jit``): the Gluon kernels call them as they are.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .signal import add_release, wait_for


@triton.jit
def grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile ``tile`` of a grouped order over ``num_pid_m`` x ``num_pid_n`` tiles, GROUP_M m-tiles at a time:
    (index into the tile order, pid_n)."""
    width = GROUP_M * num_pid_n
    group = tile // width
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    vm = first_m + (tile % width) % group_size
    pid_n = (tile % width) // group_size
    return vm, pid_n


@triton.jit
def rs_tile(tile, num_pid_m, num_pid_n, split_m, GROUP_M: tl.constexpr):
    """REDUCE_OWN's tile order: the ``split_m`` m-tiles of peers' rows first, then ours, each grouped on its own
    (GROUP_M). Returns (index into the tile order, pid_n)."""
    if tile < split_m * num_pid_n:
        vm, pid_n = grouped_tile(tile, split_m, num_pid_n, GROUP_M)
    else:
        vm, pid_n = grouped_tile(tile - split_m * num_pid_n, num_pid_m - split_m, num_pid_n, GROUP_M)
        vm += split_m
    return vm, pid_n


@triton.jit
def own_chunks_ready(flags_ptr, expected_ptr, c_first, c_last, CHUNKS_PER_RANK, world, waiter, CLOCK: tl.constexpr):
    """REDUCE_OWN: wait until every peer's counter of our chunks c_first..c_last has reached its expected count
    (``flags_ptr``: [world * CHUNKS_PER_RANK], peer s's counter of our chunk j at s * CHUNKS_PER_RANK + j)."""
    rank = waiter[2]
    for c in range(c_first, c_last + 1):
        j = c % CHUNKS_PER_RANK
        want = tl.load(expected_ptr + j)
        for s in range(0, world):
            if s != rank:
                wait_for(flags_ptr + s * CHUNKS_PER_RANK + j, want, waiter, s, j, CLOCK)


@triton.jit
def reduce_own(acc, c_ptr, out_ptr, bias_ptr, local, out_rows, cols, N, M, M_LOCAL, rank, world, stride_cm, stride_cn,
               stride_om, HAS_BIAS: tl.constexpr, ALIGN_C: tl.constexpr):
    """REDUCE_OWN's epilogue for ``acc`` (this rank's partial of rows ``local`` of its own block, columns ``cols``):
    add the peers' partials from this rank's receive slots and the bias, store the output dtype."""
    col_ok = cols < N
    for s in range(0, world):
        if s != rank:
            part = c_ptr + (s * M_LOCAL + local)[:, None] * stride_cm + cols[None, :] * stride_cn
            acc += tl.load(part, mask=col_ok[None, :], other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    o_rows = out_ptr + local * stride_om
    if ALIGN_C:
        o_rows = tl.multiple_of(o_rows, 16)
    tl.store(o_rows[:, None] + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(out_rows[:, None] < M) & col_ok[None, :])


@triton.jit
def publish(counter_ptrs, c_first, c_last, rank, CHUNKS_PER_RANK, LOCAL_COUNTERS: tl.constexpr):
    """Bump the owner's counter of chunks c_first..c_last (none if c_last < c_first) for one stored tile."""
    tl.debug_barrier()  # every thread's stores of the tile come before the release below
    for c in range(c_first, c_last + 1):
        counters = tl.load(counter_ptrs + c // CHUNKS_PER_RANK).to(tl.pointer_type(tl.int32))
        # LOCAL_COUNTERS: counters, and the stores they publish, on this GPU
        add_release(counters + rank * CHUNKS_PER_RANK + c % CHUNKS_PER_RANK, 1, LOCAL_COUNTERS)


@triton.jit
def reset_at_exit(tick_ptr, flags_ptr, n, NUM_PROGRAMS: tl.constexpr):
    """RESET_AT_EXIT: each program counts itself out in ``tick_ptr[1]``; the last one zeroes the ``n`` flags
    (every one has been waited on, and peers write the next call's only after the next barrier) and both ticks.
    Returns whether this program was the last."""
    tl.debug_barrier()  # (every thread of this program is past its waits)
    last = tl.atomic_add(tick_ptr + 1, 1, sem="acq_rel", scope="gpu") == NUM_PROGRAMS - 1
    if last:
        for c in range(0, n):
            tl.store(flags_ptr + c, 0)
        tl.store(tick_ptr, 0)
        tl.store(tick_ptr + 1, 0)
    return last


@triton.jit
def fence_async_proxy(CLOCK: tl.constexpr):
    """Order this thread's earlier acquire (generic proxy) before its later TMA loads (async proxy); CUDA only
    (CLOCK 1), a no-op elsewhere."""
    if CLOCK == 1:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def remap_xcd(pid, NUM_PROGRAMS: tl.constexpr, NUM_XCDS: tl.constexpr):
    """AMD: workgroups are dealt round-robin to XCDs; renumber so that neighbouring
    program ids (neighbouring tiles, shared operands) share an XCD and its L2."""
    if NUM_XCDS == 1:
        out = pid
    else:
        per_xcd = NUM_PROGRAMS // NUM_XCDS
        out = tl.where(pid < per_xcd * NUM_XCDS, (pid % NUM_XCDS) * per_xcd + pid // NUM_XCDS, pid)
    return out


@triton.jit
def k_loop_desc(src, plane, row, b_desc, col, K, acc, BLOCK_K: tl.constexpr, B_KMAJOR: tl.constexpr,
                 DOT_F32: tl.constexpr, PLANES: tl.constexpr):
    """acc += A[row:row+BLOCK_M, :] @ B[:, col:col+BLOCK_N], both through descriptors (zero-filled at the edges);
    PLANES: ``src`` is 3-D, A is its plane ``plane``."""
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if PLANES:
            a = src.load([plane, row, k * BLOCK_K]).reshape(acc.shape[0], BLOCK_K)
        else:
            a = src.load([row, k * BLOCK_K])
        if B_KMAJOR:
            b = b_desc.load([col, k * BLOCK_K]).T
        else:
            b = b_desc.load([k * BLOCK_K, col])
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def k_loop_ptr(a_ptr, ws_ptr, b_ptr, rows, cols, col_ok, K, M_LOCAL, rank, stride_am, stride_wm, stride_bk,
                stride_bn, acc, GATHER: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                DOT_F32: tl.constexpr):
    """acc += A[rows, :] @ B[:, cols] through pointers (rows clamped in range, columns masked)."""
    offs_k = tl.arange(0, BLOCK_K)
    if GATHER:
        mine = (rows // M_LOCAL) == rank
        a_rows = tl.where(mine, a_ptr + (rows - rank * M_LOCAL) * stride_am, ws_ptr + rows * stride_wm)
    else:
        a_rows = a_ptr + rows * stride_am
    a_ptrs = a_rows[:, None] + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
        if DOT_F32:  # host backend: Triton's interpreter multiplies bf16 operands as raw bits
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def column_halves(tile):
    """A [M, N] tile's left and right [M, N // 2] halves."""
    return tl.split(tl.permute(tl.reshape(tile, (tile.shape[0], 2, tile.shape[1] // 2)), (0, 2, 1)))


@triton.jit
def store_plain(acc, c_ptr, c_desc, bias_ptr, row0, col0, out_rows, cols, col_ok, M, stride_cm, stride_cn,
                 HAS_BIAS: tl.constexpr, DESC_C: tl.constexpr):
    """acc (+ bias) into C[out_rows, cols]: through C's descriptor (DESC_C: a TMA store, clipped at the edges) or
    pointers (masked)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if DESC_C:  # two column halves (c_desc's block is [BLOCK_M, BLOCK_N // 2]): half the shared memory
        lo, hi = column_halves(acc.to(c_ptr.dtype.element_ty))
        c_desc.store([row0, col0], lo)
        c_desc.store([row0, col0 + acc.shape[1] // 2], hi)
    else:
        c_ptrs = c_ptr + out_rows[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(out_rows[:, None] < M) & col_ok[None, :])


@triton.jit
def work_item(it, slots, num_pid_n, GROUP_M: tl.constexpr):
    """Work item ``it`` as (slot, column tile): GROUP_M consecutive slots take each column tile in turn, so the
    programs running at once share B's column tiles (an expert's weight read about once per group, not once per
    tile of its rows) while the table's order (the slots) is kept group by group."""
    group = GROUP_M * num_pid_n
    first = (it // group) * GROUP_M
    rows = tl.minimum(slots - first, GROUP_M)
    return first + (it % group) % rows, (it % group) // rows
