#!/usr/bin/env bash
# The test suite on one GPU: two ranks of the cuda backend sharing GPU 0 (TRITON_OVERLAP_TEST_BACKENDS=cuda-shared:2,
# tests/harness.py), every case (--full), in parts of at most 9 minutes each (docs/testing.md lists them).
#   bash scripts/gpu_tier.sh PART [pytest args...]     PART: 1..4, gemm, attention, core, rest, or all
# 1 gemm       test_ag_gemm, test_gemm_rs, test_moe
# 2 attention  test_cp_attention
# 3 core       test_context, test_faults, test_all_reduce, test_gemm_all_reduce, test_block, test_compile,
#              test_entry_points
# 4 rest       every other test file: test_nn, test_replay, test_topology, test_tutorials, test_tuning, test_report,
#              test_repository
# all          the four parts one after another (up to 36 minutes); its exit status is the first failing part's
# Each part is stopped after PART_TIMEOUT seconds (default 540; exit status 124); a hung call fails its test after
# TRITON_OVERLAP_TEST_TIMEOUT seconds (default here 180: past the tests' Context timeout of 120 s, so that a hung wait
# fails with its ContextError, naming rank, op, peer and chunk, before the pool is killed).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
part="${1:?usage: bash scripts/gpu_tier.sh 1|2|3|4|gemm|attention|core|rest|all [pytest args...]}"
shift
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}" NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
unset TRITON_INTERPRET
export TRITON_OVERLAP_TEST_BACKENDS="cuda-shared:2"
export TRITON_OVERLAP_TEST_TIMEOUT="${TRITON_OVERLAP_TEST_TIMEOUT:-180}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
[ "$gpus" -ge 1 ] || { echo "gpu_tier: needs a GPU, found none" >&2; exit 1; }

files() {
  case "$1" in
    1|gemm) echo tests/test_ag_gemm.py tests/test_gemm_rs.py tests/test_moe.py ;;
    2|attention) echo tests/test_cp_attention.py ;;
    3|core) echo tests/test_context.py tests/test_faults.py tests/test_all_reduce.py tests/test_gemm_all_reduce.py \
                 tests/test_block.py tests/test_compile.py tests/test_entry_points.py ;;
    4|rest) local f named=" $(files 1) $(files 2) $(files 3) " out=()  # every other test file
            for f in tests/test_*.py; do [[ "$named" == *" $f "* ]] || out+=("$f"); done
            echo "${out[@]}" ;;
    *) return 1 ;;
  esac
}

run_part() {
  local name=$1 rc=0 start=$SECONDS
  shift
  local paths
  paths=$(files "$name") || { echo "gpu_tier: no part $name (1..4, gemm, attention, core, rest, all)" >&2; return 2; }
  echo "gpu_tier: part $name: $paths"
  # shellcheck disable=SC2086 # the part's paths split on purpose
  timeout "${PART_TIMEOUT:-540}" "${PYTHON:-python3}" -m pytest $paths -q -rs --full "$@" || rc=$?
  echo "gpu_tier: part $name: exit $rc in $((SECONDS - start)) s$([ "$rc" -eq 124 ] && echo ', stopped at PART_TIMEOUT')"
  return "$rc"
}

if [ "$part" = all ]; then
  status=0
  for p in 1 2 3 4; do
    run_part "$p" "$@" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
  done
  exit "$status"
fi
run_part "$part" "$@"
