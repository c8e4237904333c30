#!/usr/bin/env bash
# The fault matrix (docs/RELIABILITY.md): each test of tests/faults/ RUNS times in a row
# (default 10), each run under an external deadline (a hang is a failure, not a wait), then a
# table: the row, its runs passed, the longest run, and the first failure's last line.
#   tests/faults/run.sh [RUNS] [-k EXPR]   (after a build; FSDP_BUILD_DIR defaults to build/)
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
runs=${1:-10}
shift $(($# > 0 ? 1 : 0))
build=${FSDP_BUILD_DIR:-$root/build}
python=$root/.venv/bin/python
deadline=${FSDP_FAULT_DEADLINE:-300} # seconds a run may take

mapfile -t rows < <(cd "$root" && FSDP_BUILD_DIR=$build FSDP_SOURCE_DIR=$root \
  "$python" -m pytest -q --collect-only -p no:cacheprovider tests/faults "$@" |
  grep '::')
if ((${#rows[@]} == 0)); then
  echo "tests/faults/run.sh: no test collected" >&2
  exit 2
fi

failed=0
table=("| row | runs passed | longest run | first failure |" "|---|---|---|---|")
for row in "${rows[@]}"; do
  passed=0 longest=0 failure=""
  for ((i = 1; i <= runs; i++)); do
    start=$(date +%s%3N)
    out=$(cd "$root" && FSDP_BUILD_DIR=$build FSDP_SOURCE_DIR=$root \
      timeout --kill-after=10 "$deadline" "$python" -m pytest -q -x -p no:cacheprovider \
      "$row" 2>&1)
    rc=$?
    took=$(($(date +%s%3N) - start)) # ms
    ((took > longest)) && longest=$took
    if ((rc == 0)); then
      passed=$((passed + 1))
    elif [[ -z $failure ]]; then
      failure=$( ((rc == 124 || rc == 137)) && echo "no end within ${deadline} s" ||
        { echo "$out" | grep -E '^E ' || echo "$out" | grep -E '^FAILED'; } | tail -1 |
        cut -c1-160)
      echo "$out" | tail -40 >&2
    fi
    echo "${row##*::} run $i: $( ((rc == 0)) && echo passed || echo "failed ($rc)") in $((took / 1000)) s"
  done
  ((passed == runs)) || failed=1
  table+=("| \`${row##*::}\` | $passed of $runs | $(((longest + 500) / 1000)) s | ${failure:-none} |")
done
printf '%s\n' "${table[@]}"
exit $failed
