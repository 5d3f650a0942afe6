#!/usr/bin/env bash
# What one call on a lent multi-GPU machine runs: environment, GPU test suite, benchmarks.
# Logs and results go to $OUT (default ./.out). Usage: bash scripts/device_session.sh [tests,shared,tune,bench,diag,gradtable,tutorial | all]
set -uo pipefail
what="${1:-all}"  # comma-separated parts, or all
want() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
OUT="${OUT:-.out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; \
  python3 -m pip show cuda-bindings 2>/dev/null | head -2; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if want tests; then
  timeout "${TEST_TIMEOUT:-330}" bash scripts/gpu_check.sh --tb=short ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/tests.log" | tail -25
fi
# shared (not in all): one GPU lent, SHARED_W ranks share it (tests/harness.py "cuda-shared"): the protocol only
if [[ ",$what," == *",shared,"* ]]; then
  TRITON_OVERLAP_TEST_BACKENDS="cuda-shared:${SHARED_W:-2}" PYTHONPATH=. timeout "${TEST_TIMEOUT:-330}" \
    python3 -m pytest tests -q -rs --tb=short ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/tests_shared.log" | tail -25
fi
if want tune; then  # TUNE="op shape [flags];op shape [flags]"; the table goes to $OUT/tuned.json, used by later parts
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
    timeout "${BENCH_TIMEOUT:-240}" bash scripts/launch.sh scripts/bench.py "$op" 2>&1 | tee "$OUT/bench_$op.log" \
      | grep -E '^\||geometric' | tail -12
  done
  tar czf "$OUT/results.tgz" -C benchmarks results  # one file: the device tool returns at most 8
fi
if want diag; then  # DIAGS="scripts/diag_rs.py --shapes ...;scripts/diag_small.py ...": each through the launcher
  IFS=';' read -ra jobs <<< "${DIAGS:-scripts/diag_rs.py}"
  for job in "${jobs[@]}"; do
    echo "== $job" >> "$OUT/diag.log"
    # shellcheck disable=SC2086 # the job's arguments split on purpose
    timeout "${DIAG_TIMEOUT:-240}" bash scripts/launch.sh $job 2>&1 | grep -v -e OMP_NUM_THREADS -e '^\*\*\*' \
      | tee -a "$OUT/diag.log" | tail -40
  done
fi
if want gradtable; then  # cp_attention error by simulated world size, on one GPU (GRAD_WORLDS, GRAD_CASE)
  timeout "${GRAD_TIMEOUT:-200}" python3 scripts/grad_error_table.py --backend cuda --worlds ${GRAD_WORLDS:-1 2 4 8 16} \
    ${GRAD_CASE:+--case "$GRAD_CASE"} 2>&1 | grep -v Warning | tee "$OUT/grad_table.md" | tail -9
fi
if want tutorial; then
  for t in ${TUTORIALS:-tutorials/[0-9]*.py}; do
    echo "== $t" >> "$OUT/tutorials.log"
    timeout "${TUTORIAL_TIMEOUT:-90}" bash scripts/launch.sh "$t" >> "$OUT/tutorials.log" 2>&1
    echo "== $t exit $?" | tee -a "$OUT/tutorials.log"
  done
  tail -40 "$OUT/tutorials.log"
fi
