"""Sweep configurations of an op on the GPUs at hand and store the best in a tuned table.

    bash scripts/launch.sh scripts/tune.py ag_gemm --shape 8192,4096,4096
    bash scripts/launch.sh scripts/tune.py gemm_rs --shape 8192,4096,4096
    bash scripts/launch.sh scripts/tune.py ag_gemm --shape 8192,4096,4096 --tiles-only   # GEMM tiles, any world size
    bash scripts/launch.sh scripts/tune.py ag_gemm_fp8 --shape 8192,4096,4096 --tiles-only   # fp8 tiles (tiles only)
    bash scripts/launch.sh scripts/tune.py cp_attention --shape 1,32768,32,8,128,1   # B,S,Hq,Hkv,D,causal
    ... --out PATH      (default: the user cache, triton_overlap.ops.tuned.user_cache())
    TRITON_OVERLAP_BACKEND=host bash scripts/launch.sh scripts/tune.py ... --dry-run
                        (host backend, two candidates a stage: checks the script; its times mean nothing)

What each sweep tries is triton_overlap.tuning's docstring; the ops read the table on their own
(triton_overlap.ops.tuned).
"""
from __future__ import annotations

import argparse

import torch.distributed as dist

from triton_overlap import Context, tuning
from triton_overlap.ops import tuned
from triton_overlap.torchrun import backend_name, init, say


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", choices=["ag_gemm", "ag_gemm_fp8", "gemm_rs", "cp_attention"])
    p.add_argument("--shape", required=True, help="M,K,N (GEMMs) or B,S,Hq,Hkv,D,causal (attention)")
    p.add_argument("--out", default=None, help="tuned table to write (default: the user cache)")
    p.add_argument("--dry-run", action="store_true", help="host backend, two candidates a stage")
    p.add_argument("--tiles-only", action="store_true",
                   help="GEMM ops: tile sizes of the GEMM alone, no communication (one GPU is enough), "
                        'stored under world size "any"')
    args = p.parse_args()
    if args.dry_run and backend_name() != "host":
        raise SystemExit("tune: --dry-run runs on the host backend: TRITON_OVERLAP_BACKEND=host bash scripts/launch.sh "
                         "scripts/tune.py ... --dry-run")
    if args.op == "ag_gemm_fp8" and not args.tiles_only:
        raise SystemExit("tune: ag_gemm_fp8 is tuned with --tiles-only (chunking stays the op's default)")
    init()
    shape = tuple(int(x) for x in args.shape.split(","))
    with Context(backend=backend_name(), timeout_s=60 if args.dry_run else 30) as ctx:
        if args.op == "cp_attention":
            us, cfg = tuning.tune_attention(ctx, shape, args.dry_run)
            world, shape = "any", shape[1:]  # attention tables are keyed (S, Hq, Hkv, D, causal)
        elif args.tiles_only:
            us, cfg = tuning.tune_tiles(ctx, args.op, shape, args.dry_run)
            world = "any"
        else:
            us, cfg = tuning.tune_gemm(ctx, args.op, shape, args.dry_run)
            world = ctx.world_size
        path = args.out or tuned.user_cache()
        if ctx.rank == 0:
            tuned.save(path, args.op, tuned.gpu_key(ctx), world, list(shape), cfg)
        say(f"tune: best {args.op} {shape} ({us:.1f} µs): {cfg}\ntune: written to {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
