#!/usr/bin/env bash
# Run the GPU part of the test suite, every case (--full), on every GPU of this machine (skips what needs more GPUs).
#   bash scripts/gpu_check.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}" NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
unset TRITON_INTERPRET
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
[ "$gpus" -ge 2 ] || { echo "gpu_check: needs at least 2 GPUs, found $gpus" >&2; exit 1; }
worlds="cuda:2"
[ "$gpus" -ge 4 ] && worlds="$worlds,cuda:4"
[ "$gpus" -ge 8 ] && worlds="$worlds,cuda:8"
export TRITON_OVERLAP_TEST_BACKENDS="${TRITON_OVERLAP_TEST_BACKENDS:-$worlds}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m pytest tests -q -rs --full "$@"
