"""Device code the GEMM kernels share: kernels.gemm's persistent GEMMs and the Gluon GEMMs for Hopper
(kernels.gemm_warp_specialized, kernels.gemm_gather_hopper), which take the same tiles in the same order.

* tile orders: ``grouped_tile`` (GROUP_M m-tiles of the order at a time, for L2 reuse) and ``rs_tile`` (GEMM-RS
  with its reduction fused: peers' rows first, then this rank's, each grouped on its own);
* GEMM-RS's own rows (REDUCE_OWN): ``own_chunks_ready`` waits for every peer's partials of a tile's chunks,
  ``reduce_own`` adds them and the bias to the tile and stores the output; ``publish`` bumps an owner's counters
  once a tile of its rows is stored;
* ``reset_at_exit``: the last program out zeroes the flags (RESET_AT_EXIT);
* ``fence_async_proxy``: a tile that waited on a flag orders that acquire before its TMA loads.

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
