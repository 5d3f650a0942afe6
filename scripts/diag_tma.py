"""Diagnostic: our persistent GEMM with tile loads through tensor descriptors (TMA) vs through pointers, vs cuBLAS.

    bash scripts/launch.sh -n 1 scripts/diag_tma.py [--json PATH]

For each benchmark GEMM shape (the AllGather-GEMM and GEMM-RS issue shapes, full M): cuBLAS (torch.matmul),
our GEMM alone with ``tma=False`` and ``tma=True`` (ops.common.plain_gemm, the benchmarks' "consumer alone"),
B as [K, N] rows and, for some, as ``weight.t()``; a few tile variants on the shapes under 90% of cuBLAS.
Each result is checked against torch.matmul (bf16; max relative error 2e-2) before it is timed. One GPU.
"""
import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton_overlap as to  # noqa: E402
from triton_overlap.launch import init, say  # noqa: E402
from triton_overlap.ops.common import default_config, desc_layout, plain_gemm  # noqa: E402
from triton_overlap.timing import time_dist  # noqa: E402

SHAPES = [(2048, 4096, 4096), (8192, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 14336), (8192, 8192, 3584),
          (4096, 8192, 1792), (16384, 7168, 8192), (8192, 1792, 8192)]
TRANSPOSED = set(SHAPES)
VARIANTS = {(4096, 8192, 1792): [dict(block_n=128), dict(block_m=256, block_n=128), dict(block_k=128, num_stages=3)],
            (8192, 4096, 4096): [dict(num_stages=3), dict(num_warps=4, block_n=128)],
            (2048, 4096, 4096): [dict(block_n=128), dict(num_stages=3)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    init()
    rows = []
    with to.Context() as ctx:
        base = default_config(ctx)
        for M, K, N in SHAPES:
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            layouts = ["kn"] + (["nk"] if (M, K, N) in TRANSPOSED else [])
            for lay in layouts:
                w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) if lay == "kn" else \
                    torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
                ref = torch.matmul(a, w)
                cublas = time_dist(lambda: torch.matmul(a, w), args.iters)
                cfgs = [("ptr", replace(base, tma=False)), ("tma", replace(base, tma=True))]
                cfgs += [(f"tma {v}", replace(base, tma=True, **v)) for v in VARIANTS.get((M, K, N), [])]
                for name, cfg in cfgs:
                    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                    run = plain_gemm(ctx, cfg, a, w, out)
                    path = desc_layout(ctx, cfg, a, None, w, M, False) or "pointers"
                    try:
                        run()
                    except Exception as e:  # e.g. out of shared memory for a variant
                        say(f"{M:6d} {K:6d} {N:6d} {lay} {name:34s} failed: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    torch.cuda.synchronize()
                    err = float(((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
                    us = time_dist(run, args.iters) if err < 2e-2 else None
                    rec = dict(M=M, K=K, N=N, b=lay, config=name, path=path, us=us, cublas_us=cublas, max_rel_err=err,
                               vs_cublas=(cublas / us) if us else None)
                    rows.append(rec)
                    say(f"{M:6d} {K:6d} {N:6d} {lay} {name:34s} {path:8s} "
                        + (f"{us:8.1f} µs  cuBLAS {cublas:8.1f} µs  ours/cuBLAS speed {cublas / us:.3f}" if us else
                           f"WRONG: max rel err {err:.2e}"))
                w = ref = None
            a = None
            torch.cuda.empty_cache()
    if args.json and int(os.environ.get("RANK", "0")) == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
