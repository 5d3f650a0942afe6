"""What both Hopper GEMMs in Gluon (kernels.gemm_warp_specialized, kernels.gemm_gather_hopper) take alike: their
tiles and pipeline, the warps and registers of the partition that stores the tiles, and the grid."""
from __future__ import annotations

from ..plan import cdiv
from .gemm_operands import GemmTiles

#: The kernels' tiles and pipeline: kernels.gemm's 128 x 256 tile, its float32 accumulator over two warpgroups (128
#: registers a thread), 3 stages of 128 x 64 + 64 x 256 bf16 (144 KiB) and the tile buffer the epilogue reads
#: (128 x 256 of the output dtype, 64 KiB).
TILES = GemmTiles(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, tma=True)
#: The epilogue partition's warps and the registers (setmaxnreg) a thread of it may use; the kernel-wide cap that
#: 12 warps leave (ptxas, sm_90a: 168 registers, no spills).
EPILOGUE_WARPS = 4
EPILOGUE_REGS = 152
SUB_M = 32
MAXNREG = 168


def programs(ctx, m: int, n: int, peer_stores: bool) -> int:
    """The grid for ``m`` x ``n``: a program per SM, at most one per tile. The copy variant leaves an SM for the
    barrier on its copy stream; the store variant (``peer_stores``) launches no barrier kernel."""
    spare = 0 if peer_stores else 1
    return max(1, min(ctx.num_compute_units() - spare, cdiv(m, TILES.block_m) * cdiv(n, TILES.block_n)))
