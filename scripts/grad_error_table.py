"""Relative gradient error of cp_attention against full-sequence float32 attention, by world size.

    python scripts/grad_error_table.py [--backend host] [--worlds 2 3 4 8]

Uses the test harness's rank pools; prints a markdown table.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from harness import get_pool  # noqa: E402
from test_cp_attention import _grad_case  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="host")
    p.add_argument("--worlds", type=int, nargs="*", default=[2, 3, 4, 8])
    p.add_argument("--case", default="1,96,8,2,64,1,bfloat16,2", help="B,S,Hq,Hkv,D,causal,dtype,chunks_per_rank")
    a = p.parse_args()
    B, S, Hq, Hkv, D, causal, dtype, cpr = a.case.split(",")
    case = (int(B), int(S), int(Hq), int(Hkv), int(D), bool(int(causal)), dtype, int(cpr))
    print(f"case B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} causal={bool(int(causal))} {dtype}, backend {a.backend}\n")
    print("| W | dq | dk | dv |\n|---|---|---|---|")
    for w in a.worlds:
        errs = get_pool(a.backend, w).run(_grad_case, *case)
        worst = {n: max(e[n] for e in errs) for n in "qkv"}
        print(f"| {w} | {worst['q']:.2e} | {worst['k']:.2e} | {worst['v']:.2e} |", flush=True)
