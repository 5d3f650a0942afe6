"""Chunk arithmetic on the device: the kernels' side of ``triton_overlap.plan``.

Rows belong to ranks in blocks of ``M_LOCAL`` rows, each block cut into chunks of ``M_PER_CHUNK`` rows; chunk ids
are global, ``src * CHUNKS_PER_RANK + j``.
"""
import triton
import triton.language as tl  # noqa: F401 - triton requires it visible from a module with jit functions


@triton.jit
def chunk_of_row(row, M_LOCAL, M_PER_CHUNK, CHUNKS_PER_RANK):
    return (row // M_LOCAL) * CHUNKS_PER_RANK + (row % M_LOCAL) // M_PER_CHUNK
