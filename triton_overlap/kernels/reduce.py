"""The ReduceScatter consumer: sum W partial row blocks in float32 as they land.

Each tile of this rank's [M_LOCAL, N] output waits, for every peer, on the
counters of the chunks its rows cover (bounded waits), then adds the W
partials ``recv[s]`` (this rank's own partial sits in slot ``rank``) and the
bias, and stores the output dtype.
"""
import triton
import triton.language as tl

from .signal import wait_flag


@triton.jit
def reduce_partials(recv_ptr, out_ptr, bias_ptr, counters_ptr, expected_ptr, err_ptr, budget, rank, world, op,
                    M_LOCAL, N, M_PER_CHUNK, CHUNKS_PER_RANK, stride_om,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    NUM_PROGRAMS: tl.constexpr, CLOCK: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M_LOCAL, BLOCK_M) * num_pid_n
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        pid_m = tile // num_pid_n
        pid_n = tile % num_pid_n
        row0 = pid_m * BLOCK_M
        j_first = row0 // M_PER_CHUNK
        j_last = (tl.minimum(row0 + BLOCK_M, M_LOCAL) - 1) // M_PER_CHUNK
        for s in range(0, world):
            if s != rank:  # our own partial came from our own GEMM, earlier on this stream
                for j in range(j_first, j_last + 1):
                    wait_flag(counters_ptr + s * CHUNKS_PER_RANK + j, tl.load(expected_ptr + j), err_ptr, budget, rank,
                              op, s * CHUNKS_PER_RANK + j, CLOCK)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M_LOCAL) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, world):
            acc += tl.load(recv_ptr + s * M_LOCAL * N + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
