#!/usr/bin/env bash
# Nsight Compute on one launch of each GEMM-RS kernel variant (scripts/profile_rs_gemm.py: one GPU, rank 0 of two,
# every wait already satisfied): warp-state and per-instruction stall samples, exported as CSV to $OUT.
# Usage: SHAPE=8192,1792,8192 VARIANTS="plain scatter fused" bash scripts/ncu_rs.sh
set -uo pipefail
OUT="${OUT:-.out}"; mkdir -p "$OUT"
shape="${SHAPE:-8192,1792,8192}"
python3 scripts/profile_rs_gemm.py --shape "$shape" 2>&1 | tee "$OUT/profile_rs_times.log"
for v in ${VARIANTS:-plain scatter fused}; do
  ncu --clock-control none --kernel-name regex:persistent_gemm --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy \
    -f -o "$OUT/rs_$v" python3 scripts/profile_rs_gemm.py --variant "$v" --shape "$shape" --launches 3 \
    > "$OUT/ncu_$v.log" 2>&1
  tail -3 "$OUT/ncu_$v.log"
  ncu -i "$OUT/rs_$v.ncu-rep" --page details --csv > "$OUT/rs_${v}_details.csv" 2>&1
  ncu -i "$OUT/rs_$v.ncu-rep" --page source --csv --print-source sass > "$OUT/rs_${v}_sass.csv" 2>&1
  wc -l "$OUT/rs_${v}_details.csv" "$OUT/rs_${v}_sass.csv"
  rm -f "$OUT/rs_$v.ncu-rep"
done
