#!/usr/bin/env bash
# One batch of GPU work on a machine with NVIDIA GPUs: the GPU test suite, benchmarks, tuning, tutorials.
# Logs and results go to $OUT (default ./gpu-batch-out).
#   bash dev/gpu_batch.sh PARTS      PARTS: comma-separated, from tests,shared,bench,tune,tutorials,compile
# tests      the GPU test suite on every GPU (scripts/gpu_check.sh); PYTEST_K selects tests
# shared     scripts/gpu_tier.sh: two ranks on GPU 0 (tests/harness.py "cuda-shared"), the protocol where one GPU is
#            lent; SHARED_PARTS picks its parts (default all, up to 36 minutes; one part is at most 9)
# bench      benchmarks/bench.py for each op in BENCH_OPS (default: ag_gemm gemm_rs cp_attention), results in $OUT
# tune       TUNE="op shape [flags];..." through scripts/tune.py into $OUT/tuned.json, which later parts use
# tutorials  every tutorial (or TUTORIALS) through the launcher
# compile    dev/compile_check.py with this machine's Triton
# BENCH_ITERS sets bench.py's --iters, BENCH_FLAGS adds flags (e.g. --virtual-hosts 2); PACK=1 packs $OUT/results into $OUT/results.tar at the end (one file to fetch)
set -uo pipefail
parts="${1:?usage: bash dev/gpu_batch.sh tests,shared,bench,tune,tutorials,compile}"
want() { [[ ",$parts," == *",$1,"* ]]; }
OUT="${OUT:-gpu-batch-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; \
  python3 -m pip show cuda-bindings 2>/dev/null | head -2; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if want compile; then
  timeout "${COMPILE_TIMEOUT:-300}" python3 dev/compile_check.py 2>&1 | grep -v -e leaked -e nanobind | tee "$OUT/compile.log" | tail -5
fi
if want tests; then
  timeout "${TEST_TIMEOUT:-330}" bash scripts/gpu_check.sh --tb=short ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/tests.log" | tail -25
fi
if want shared; then
  bash scripts/gpu_tier.sh "${SHARED_PARTS:-all}" --tb=short ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
    | tee "$OUT/tests_shared.log" | grep -E '^gpu_tier|passed|failed|^(FAILED|ERROR)' | tail -40
fi
if want tune; then
  export TRITON_OVERLAP_TUNED="$OUT/tuned.json"
  IFS=';' read -ra jobs <<< "${TUNE:-cp_attention 1,32768,32,8,128,1}"
  for job in "${jobs[@]}"; do
    read -r op shape flags <<< "$job"
    # shellcheck disable=SC2086 # flags (e.g. --tiles-only) split on purpose
    timeout "${TUNE_TIMEOUT:-200}" bash scripts/launch.sh scripts/tune.py "$op" --shape "$shape" $flags 2>&1 \
      | tee -a "$OUT/tune.log" | grep -E "^tune|best|skipped" | tail -8
  done
fi
if want bench; then
  for op in ${BENCH_OPS:-ag_gemm gemm_rs cp_attention}; do
    timeout "${BENCH_TIMEOUT:-240}" bash scripts/launch.sh benchmarks/bench.py "$op" --out "$OUT/results" \
      ${BENCH_ITERS:+--iters "$BENCH_ITERS"} ${BENCH_FLAGS:-} 2>&1 \
      | tee "$OUT/bench_$op.log" | grep -E '^\||geometric' | tail -12
  done
fi
if want tutorials; then
  for t in ${TUTORIALS:-tutorials/[0-9]*.py}; do
    echo "== $t" >> "$OUT/tutorials.log"
    timeout "${TUTORIAL_TIMEOUT:-90}" bash scripts/launch.sh "$t" >> "$OUT/tutorials.log" 2>&1
    echo "== $t exit $?" | tee -a "$OUT/tutorials.log"
  done
  tail -40 "$OUT/tutorials.log"
fi
if [ "${PACK:-0}" = 1 ] && [ -d "$OUT/results" ]; then
  tar -C "$OUT" -cf "$OUT/results.tar" results && rm -r "$OUT/results"
fi
