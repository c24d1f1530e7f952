#!/usr/bin/env bash
# CPU regression check: the CI-stable CPU benchmarks at a baseline commit and at HEAD, timed
# alternately in this checkout's Python, then `asv compare`. Prints the table either way and
# exits 1 when a benchmark got slower by more than FACTOR with significantly different samples
# (asv's own test, the one `asv continuous` applies) or newly fails, in the first pass and
# again in a second pass that times only the flagged benchmarks afresh (a shared machine's
# load can slow one side of one benchmark for a whole pass; a real slowdown shows twice).
#   asv_bench/ci_compare.sh [BASE]     BASE: a commit, default HEAD~1 (main's previous state)
# Environment: ASV_FACTOR (default 1.75), ASV_BENCH (one regex of benchmark names instead of
# the CI-stable groups below), ASV_ROUNDS (default 2: base, head, head, base; the second pass
# runs ASV_CONFIRM_ROUNDS, default 4), ASV_LOG (a file to keep asv's run log in), PYTHON
# (default python3). Both sides run HEAD's benchmark files; only the library under them
# differs. Results go to a scratch folder, never to asv_bench/results.
set -euo pipefail
source "$(dirname "$0")/common.sh"
factor=${ASV_FACTOR:-1.75}
rounds=${ASV_ROUNDS:-2}
confirm_rounds=${ASV_CONFIRM_ROUNDS:-4}
# CI-stable: CPU time_* benchmarks that cost seconds, not minutes, matched on method names and
# parameters so that moving a benchmark to another file keeps it selected (the spread that
# chose them and FACTOR: docs/benchmarks.md). Left out: the 10^6-state RDR solve and argsort
# and the compressed decode (seconds per sample or of setup), Prefill, Compress, the MILP, and
# the 2 ms numba logits at d = 64, 4 bits (two runs of the same code read 0.24 to 1.24).
groups=(
  '\.time_encode\('
  "\.time_logits\((?!64, 4, 'numba')"
  '\.time_append_token\('
  "\.time_decode_step\(8192, 'fp16'\)"
  '\.(time_fast|time_argsort_reference)\((10000|100000)\)'
)
if [ -n "${ASV_BENCH:-}" ]; then groups=("$ASV_BENCH"); fi

base_name=${1:-HEAD~1}
if ! base=$(git -C "$root" rev-parse --verify -q "$base_name^{commit}"); then
  echo "ci_compare: no baseline commit '$base_name' in this clone (shallow or first commit); nothing to compare"
  exit 0
fi
head=$(git -C "$root" rev-parse HEAD)
if [ "$base" = "$head" ]; then
  echo "ci_compare: the baseline is HEAD; nothing to compare"
  exit 0
fi
write_conf "$scratch/results" "$root"
asv machine --machine ci --yes > /dev/null
base_src=$(source_tree "$base")
check_src "$base_src"
check_src "$root"

# One thread per benchmark: on a shared machine a parallel loop waits for its slowest thread.
export NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
# worse_regex COMPARE_TXT: one regex matching exactly the benchmarks under asv compare's
# "got worse" heading (empty when there are none)
worse_regex() {
  "$py" - "$1" <<'PY'
import re, sys
names, inside = [], False
for line in open(sys.argv[1]):
    if line.startswith("Benchmarks that"):
        inside = line.startswith("Benchmarks that have got worse")
    elif inside and line.startswith("|") and not set(line) <= set("|-: \n"):
        name = line.rstrip().rstrip("|").rsplit("|", 1)[-1].strip()
        if name and name != "Benchmark (Parameter)":
            names.append(re.escape(name))
print("|".join(f"^{n}$" for n in names))
PY
}
side() {  # side COMMIT SRC REGEX: one process per benchmark, samples appended to earlier rounds'
  run_at "$1" "$2" --machine ci --bench "$3" -a processes=1 -a repeat='(3,6,8.0)' --append-samples --durations all \
    >> "$scratch/run.log" 2>&1 || echo "ci_compare: some of '$3' failed at ${1:0:8} (the table marks them)"
}
# Each group's rounds run back to back (base, head, head, base, ...), so a change in the
# machine's load in between falls on both sides alike.
alternate() {  # alternate ROUNDS REGEX
  local r
  for ((r = 0; r < $1; r++)); do
    if ((r % 2 == 0)); then side "$base" "$base_src" "$2"; side "$head" "$root" "$2"
    else side "$head" "$root" "$2"; side "$base" "$base_src" "$2"; fi
  done
}
t0=$(date +%s)
for regex in "${groups[@]}"; do alternate "$rounds" "$regex"; done
echo "ci_compare: ${#groups[@]} groups x $rounds rounds at ${base:0:8} and ${head:0:8} in $(( $(date +%s) - t0 )) s"
if [ -n "${ASV_LOG:-}" ]; then cp "$scratch/run.log" "$ASV_LOG"; fi

# HEAD's benchmark files may need library code the baseline lacks: then there is no baseline.
if ! ls "$scratch/results/ci/${base:0:8}"-*.json > /dev/null 2>&1; then
  echo "ci_compare: HEAD's benchmarks did not run on ${base:0:8}'s library; nothing to compare"
  grep -E 'Error|error' "$scratch/run.log" | head -n 10 || true
  exit 0
fi
asv compare --machine ci --factor "$factor" --split "$base" "$head" | tee "$scratch/compare.txt"
worse=$(worse_regex "$scratch/compare.txt")
if [ -z "$worse" ]; then echo "ci_compare: no regression beyond factor $factor"; exit 0; fi

# Second pass: the flagged benchmarks only, timed afresh into results of their own.
echo "ci_compare: flagged in the first pass; timing them again, $confirm_rounds rounds: $worse"
write_conf "$scratch/confirm" "$root"
t0=$(date +%s)
alternate "$confirm_rounds" "$worse"
echo "ci_compare: second pass in $(( $(date +%s) - t0 )) s"
asv compare --machine ci --factor "$factor" --split "$base" "$head" | tee "$scratch/confirm.txt"
if [ -n "$(worse_regex "$scratch/confirm.txt")" ]; then
  echo "ci_compare: REGRESSION at ${head:0:8} against ${base:0:8} (factor $factor), in both passes"
  grep -E 'failed|Error' "$scratch/run.log" | head -n 20 || true
  exit 1
fi
echo "ci_compare: no regression beyond factor $factor (the first pass's flags did not repeat)"
