#!/usr/bin/env bash
# The test suite on one GPU: two ranks of the cuda backend sharing GPU 0 (TRITON_OVERLAP_TEST_BACKENDS=cuda-shared:2,
# tests/harness.py), every case (--full), in parts of at most 9 minutes each (docs/testing.md lists them).
#   bash scripts/gpu_tier.sh PART [pytest args...]     PART: 1..10, or its name, or all
# 1 gemm        test_ag_gemm, test_gemm_rs
# 2 attention   test_cp_attention but its backward-only cases
# 3 backward    test_cp_attention's backward-only cases (Hopper and single-pass backward, their timeouts)
# 4 core        test_context, test_faults, test_all_reduce, test_gemm_all_reduce, test_block, test_compile,
#               test_entry_points
# 5 layers      test_nn, test_nn_moe, test_nn_ep_moe, test_expert_parallel, test_model_bench, test_all_reduce_rmsnorm
# 6 rest        every other test file: test_checkpoints, test_replay, test_topology, test_tuning, the EP routing
#               and low-latency tests, the benchmarks' and report's tests, test_repository
# 7 moe         test_moe
# 8 tutorials   test_tutorials (every tutorial through the launcher)
# 9 styles      test_parallel_styles (parallelize_module's linear and norm styles in Hugging Face models)
# 10 moe_styles test_parallel_moe (MoEParallel in Hugging Face models, hf_plan on MoE models, generate)
# all           the ten parts one after another (up to 90 minutes); its exit status is the first failing part's
# GPU_TIER_BACKENDS: other configurations for the same parts, e.g. cuda:8 where eight GPUs are lent (conftest.py).
# Each part is stopped after PART_TIMEOUT seconds (default 540; exit status 124); a hung call fails its test after
# TRITON_OVERLAP_TEST_TIMEOUT seconds (default here 180: past the tests' Context timeout of 120 s, so that a hung wait
# fails with its ContextError, naming rank, op, peer and chunk, before the pool is killed).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
part="${1:?usage: bash scripts/gpu_tier.sh 1..10|gemm|attention|backward|core|layers|rest|moe|tutorials|styles|moe_styles|all [pytest args...]}"
shift
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}" NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
unset TRITON_INTERPRET
export TRITON_OVERLAP_TEST_BACKENDS="${GPU_TIER_BACKENDS:-cuda-shared:2}"
export TRITON_OVERLAP_TEST_TIMEOUT="${TRITON_OVERLAP_TEST_TIMEOUT:-180}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
[ "$gpus" -ge 1 ] || { echo "gpu_tier: needs a GPU, found none" >&2; exit 1; }

BACKWARD="hopper_backward or single_pass_backward or backward_wait"

files() {  # the part's test files, then its -k expression if it has one (after a "|")
  case "$1" in
    1|gemm) echo tests/test_ag_gemm.py tests/test_gemm_rs.py ;;
    2|attention) echo "tests/test_cp_attention.py|not ($BACKWARD)" ;;
    3|backward) echo "tests/test_cp_attention.py|$BACKWARD" ;;
    4|core) echo tests/test_context.py tests/test_faults.py tests/test_all_reduce.py tests/test_gemm_all_reduce.py \
                 tests/test_block.py tests/test_compile.py tests/test_entry_points.py ;;
    5|layers) echo tests/test_nn.py tests/test_nn_moe.py tests/test_nn_ep_moe.py tests/test_expert_parallel.py \
                   tests/test_model_bench.py tests/test_all_reduce_rmsnorm.py ;;
    6|rest) local f out=() named
            named=" $(files 1) tests/test_cp_attention.py $(files 4) $(files 5) $(files 7) $(files 8) $(files 9)"
            named+=" $(files 10) "
            for f in tests/test_*.py; do [[ "$named" == *" $f "* ]] || out+=("$f"); done
            echo "${out[@]}" ;;
    7|moe) echo tests/test_moe.py ;;
    8|tutorials) echo tests/test_tutorials.py ;;
    9|styles) echo tests/test_parallel_styles.py ;;
    10|moe_styles) echo tests/test_parallel_moe.py ;;
    *) return 1 ;;
  esac
}

run_part() {
  local name=$1 rc=0 start=$SECONDS spec paths select
  shift
  spec=$(files "$name") || {
    echo "gpu_tier: no part $name (1..10, gemm, attention, backward, core, layers, rest, moe, tutorials, styles," \
         "moe_styles, all)" >&2
    return 2
  }
  paths=${spec%%|*}
  select=()
  [[ "$spec" == *"|"* ]] && select=(-k "${spec#*|}")
  echo "gpu_tier: part $name: $paths${select:+ -k \"${spec#*|}\"}"
  # shellcheck disable=SC2086 # the part's paths split on purpose
  timeout "${PART_TIMEOUT:-540}" "${PYTHON:-python3}" -m pytest $paths "${select[@]}" -q -rs --full "$@" || rc=$?
  echo "gpu_tier: part $name: exit $rc in $((SECONDS - start)) s$([ "$rc" -eq 124 ] && echo ', stopped at PART_TIMEOUT')"
  return "$rc"
}

if [ "$part" = all ]; then
  status=0
  for p in 1 2 3 4 5 6 7 8 9 10; do
    run_part "$p" "$@" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
  done
  exit "$status"
fi
run_part "$part" "$@"
