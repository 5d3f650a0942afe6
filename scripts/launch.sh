#!/usr/bin/env bash
# Launch a triton_overlap script on every GPU of this machine, or on the host backend without GPUs.
#   bash scripts/launch.sh [-n NPROC] SCRIPT [ARGS...]
# GPUs: torchrun, one process per GPU (default), NVLink multicast off unless the user set otherwise.
# No GPUs (or TRITON_OVERLAP_BACKEND=host): 2 CPU processes (default), kernels in Triton's interpreter.
set -euo pipefail
usage() { echo "usage: bash scripts/launch.sh [-n NPROC] SCRIPT [ARGS...]" >&2; exit 2; }
nproc=""
while getopts "n:h" opt; do
  case "$opt" in
    n) nproc="$OPTARG" ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || usage
script="$1"; shift
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"

gpus=0
if [ "${TRITON_OVERLAP_BACKEND:-auto}" != "host" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then  # a subset of the GPUs, e.g. CUDA_VISIBLE_DEVICES=0,1
      gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
    fi
  elif command -v rocm-smi >/dev/null 2>&1; then
    gpus=$(rocm-smi --showid 2>/dev/null | grep -c '^GPU\[' || true)
  fi
fi

if [ "$gpus" -gt 0 ]; then
  export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
  export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
  export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
  unset TRITON_INTERPRET
  nproc="${nproc:-$gpus}"
  echo "launch: $nproc process(es) on $gpus GPU(s)" >&2
else
  export TRITON_INTERPRET=1
  export TRITON_OVERLAP_BACKEND=host
  nproc="${nproc:-2}"
  echo "launch: no GPU, $nproc process(es) on the host backend (Triton interpreter)" >&2
fi
exec "$python" -m torch.distributed.run --standalone --nproc-per-node "$nproc" "$script" "$@"
