"""Sweep configurations of an op on the GPUs at hand and store the best in a tuned table.

    bash scripts/launch.sh scripts/tune.py ag_gemm --shape 8192,4096,4096
    bash scripts/launch.sh scripts/tune.py gemm_rs --shape 8192,4096,4096
    bash scripts/launch.sh scripts/tune.py ag_gemm --shape 8192,4096,4096 --tiles-only   # GEMM tiles, any world size
    bash scripts/launch.sh scripts/tune.py ag_gemm_fp8 --shape 8192,4096,4096 --tiles-only   # fp8 tiles (tiles only)
    bash scripts/launch.sh scripts/tune.py cp_attention --shape 1,32768,32,8,128,1   # B,S,Hq,Hkv,D,causal
    bash scripts/launch.sh scripts/tune.py moe --shape 4096,4096,7168,8,2,zipf
        # tokens per rank, K, N, experts, top-k[, routing balanced|zipf]: ag_moe_gemm and moe_gemm_rs, each with
        # a weight shard [E, K, N]; stored under moe_table_shape (T = tokens per rank x W, K, N, E, topk)
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
from triton_overlap.ops.moe_config import moe_table_shape
from triton_overlap.torchrun import backend_name, init, say


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", choices=["ag_gemm", "ag_gemm_fp8", "gemm_rs", "cp_attention", "moe"])
    p.add_argument("--shape", required=True, help="M,K,N (GEMMs), B,S,Hq,Hkv,D,causal (attention) or "
                                                  "T_per_rank,K,N,E,topk[,balanced|zipf] (moe)")
    p.add_argument("--out", default=None, help="tuned table to write (default: the user cache)")
    p.add_argument("--dry-run", action="store_true", help="host backend, two candidates a stage")
    p.add_argument("--tiles-only", action="store_true",
                   help="GEMM ops and moe: tile sizes of the GEMM alone, no communication (one GPU is enough), "
                        'stored under world size "any"')
    args = p.parse_args()
    if not args.dry_run and backend_name() == "host":
        raise SystemExit("tune: needs GPUs (times on the host backend mean nothing, and its interpreted sweeps take "
                         "hours); --dry-run checks the script there")
    if args.dry_run and backend_name() != "host":
        raise SystemExit("tune: --dry-run runs on the host backend: TRITON_OVERLAP_BACKEND=host bash scripts/launch.sh "
                         "scripts/tune.py ... --dry-run")
    if args.op == "ag_gemm_fp8" and not args.tiles_only:
        raise SystemExit("tune: ag_gemm_fp8 is tuned with --tiles-only (chunking stays the op's default)")
    fields = args.shape.split(",")
    routing = fields.pop() if args.op == "moe" and len(fields) == 6 else "balanced"
    shape = tuple(int(x) for x in fields)
    if args.op == "moe" and (len(shape) != 5 or routing not in tuning.MOE_ROUTINGS or not 1 <= shape[4] <= shape[3]):
        raise SystemExit(f"tune: moe --shape is T_per_rank,K,N,E,topk[,routing] with 1 <= topk <= E, routing one "
                         f"of {tuning.MOE_ROUTINGS}; got {args.shape!r}")
    init()
    with Context(backend=backend_name(), timeout_s=60 if args.dry_run else 30) as ctx:
        if args.op == "moe":
            tune_moe(ctx, shape, routing, args)
        else:
            tune_op(ctx, shape, args)
    dist.destroy_process_group()


def tune_op(ctx, shape, args):
    """One op's sweep (triton_overlap.tuning), written under its name."""
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


def tune_moe(ctx, shape, routing, args):
    """Both MoE ops (tuning.tune_moe, or the grouped GEMM's tiles alone with --tiles-only, stored for both under
    world size "any"), each under its own name at moe_table_shape."""
    if args.tiles_only:
        us, cfg = tuning.tune_moe_tiles(ctx, shape, routing, args.dry_run)
        found, world = {op: (us, cfg) for op in ("ag_moe_gemm", "moe_gemm_rs")}, "any"
    else:
        found, world = tuning.tune_moe(ctx, shape, routing, args.dry_run), ctx.world_size
    key = list(moe_table_shape(shape[0] * ctx.world_size, *shape[1:]))
    path = args.out or tuned.user_cache()
    for op, (us, cfg) in found.items():
        if ctx.rank == 0:
            tuned.save(path, op, tuned.gpu_key(ctx), world, key, cfg)
        say(f"tune: best {op} {key} ({us:.1f} µs): {cfg}")
    say(f"tune: written to {path}")


if __name__ == "__main__":
    main()
