"""Relative error of cp_attention's output and gradients against full-sequence float32 attention, by world size.

    python scripts/grad_error_table.py [--backend host|cuda] [--worlds 1 2 4 8 16] [--case B,S,Hq,Hkv,D,causal,dtype]

Every rank's share of a world of W is run one after another on one device,
with the kernels the op runs (ops.cp_attention.forward_on_gathered and
backward_on_gathered: the same programs, with K/V already in place), and the
dK/dV partials are summed in float32 as the owners' reductions do. The
copies the op adds move bytes unchanged, so this is the op's arithmetic at
W ranks. W = 1 is the kernel on the whole sequence. Prints a markdown table.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from harness import get_pool  # noqa: E402
from test_cp_attention import grad_errors_by_world  # noqa: E402

CASES = {"host": "1,96,4,2,64,1,bfloat16", "cuda": "1,16384,8,2,128,1,bfloat16"}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="host", choices=["host", "cuda"])
    p.add_argument("--worlds", type=int, nargs="*", default=[1, 2, 3, 4, 8])
    p.add_argument("--case", default=None, help="B,S,Hq,Hkv,D,causal,dtype")
    a = p.parse_args()
    B, S, Hq, Hkv, D, causal, dtype = (a.case or CASES[a.backend]).split(",")
    case = (int(B), int(S), int(Hq), int(Hkv), int(D), bool(int(causal)), dtype)
    print(f"case B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} causal={bool(int(causal))} {dtype}, backend {a.backend}\n")
    rows = get_pool(a.backend, 1).run(grad_errors_by_world, a.worlds, *case)[0]
    print("| W | out | dq | dk | dv |\n|---|---|---|---|---|")
    for w, *errs in rows:
        print(f"| {w} | " + " | ".join(f"{e:.2e}" for e in errs) + " |", flush=True)
