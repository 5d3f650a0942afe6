#!/usr/bin/env bash
# Launch a triton_overlap script (tutorial, benchmark, tuning) on every GPU of this machine, or on the host backend
# without GPUs.
set -euo pipefail
help() {
  cat <<'TXT'
usage: bash scripts/launch.sh [-n NPROC] SCRIPT [ARGS...]

Runs SCRIPT with torchrun, one process per rank:
  GPUs:     one process per GPU (or NPROC; CUDA_VISIBLE_DEVICES picks GPUs), NVLink multicast off
            (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1) unless set otherwise
  no GPUs:  2 processes (or NPROC) on the host backend, kernels in Triton's interpreter
            (TRITON_OVERLAP_BACKEND=host forces it where GPUs exist)
PYTHON picks the interpreter (default python3).
TXT
}
usage() { help >&2; exit 2; }
case "${1:-}" in -h|--help) help; exit 0 ;; esac
nproc=""
while getopts "n:h" opt; do
  case "$opt" in
    n) nproc="$OPTARG" ;;
    h) help; exit 0 ;;
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
