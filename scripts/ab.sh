#!/usr/bin/env bash
# Compare two versions of the code on the same machine: run a launcher job in OLD (a copy of the older tree, e.g.
# made with `git archive <commit> | tar -x -C ab_old`, then this tree's scripts/ copied in, so both run the same
# diag) and in this tree, one after the other, ROUNDS times.
# Output goes to $OUT/ab.log, each run headed by its tree and round. Usage: bash scripts/ab.sh OLD "script args"
set -uo pipefail
old="$1"; job="$2"; rounds="${ROUNDS:-2}"
OUT="${OUT:-.out}"; mkdir -p "$OUT"
here="$(pwd)"
for i in $(seq 1 "$rounds"); do
  for tree in "$old" "$here"; do
    echo "== round $i, tree $( [ "$tree" = "$here" ] && echo new || echo old ): $job" | tee -a "$OUT/ab.log"
    # shellcheck disable=SC2086 # the job's arguments split on purpose
    (cd "$tree" && timeout "${AB_TIMEOUT:-240}" bash scripts/launch.sh $job 2>&1) \
      | grep -v -e OMP_NUM_THREADS -e '^\*\*\*' | tee -a "$OUT/ab.log" | grep -E "µs|bf16" | tail -30
  done
done
