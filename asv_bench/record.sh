#!/usr/bin/env bash
# Record asv results into the committed history: asv_bench/results/<MACHINE>/, one JSON per
# commit, the machine described once (its machine.json, reused by every later run).
#   asv_bench/record.sh MACHINE [COMMIT] [-- asv run options]
#     asv_bench/record.sh cpu-2core HEAD~1          the CPU suite (GPU benchmarks skip themselves)
#     asv_bench/record.sh h200 -- --bench '\.track_(gpu_us|gbps)\('   on the H200, the GPU ones
# COMMIT defaults to HEAD (the checkout, which must hold no uncommitted library changes); any
# other commit's library is taken from git under HEAD's benchmark files. ASV_RESULTS moves the
# results folder (default asv_bench/results). A copy of the working tree without .git names
# its commits through .asv_git/repo.bundle (made in the checkout by `git bundle create
# .asv_git/repo.bundle HEAD`, the whole history): HEAD is the tree itself, any other commit
# is taken from the bundle. ASV_FROM_BUNDLE=1 takes the commits from the bundle even where the
# tree is a git checkout of its own (a copy whose .git is not the project's history).
set -euo pipefail
source "$(dirname "$0")/common.sh"
machine=${1:?usage: asv_bench/record.sh MACHINE [COMMIT] [-- asv run options]}
shift
commit_name=HEAD
if [ $# -gt 0 ] && [ "$1" != "--" ]; then commit_name=$1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi
results=${ASV_RESULTS:-$bench_dir/results}

if [ -z "${ASV_FROM_BUNDLE:-}" ] && git -C "$root" rev-parse -q --verify HEAD > /dev/null 2>&1; then
  repo=$root
  commit=$(git -C "$root" rev-parse --verify "$commit_name^{commit}")
  if [ "$commit" = "$(git -C "$root" rev-parse HEAD)" ] &&
     [ -n "$(git -C "$root" status --porcelain -- spherical_kv_ref cupy_kernels validation asv_bench/benchmarks)" ]; then
    echo "record: the checkout has uncommitted library or benchmark changes; commit them first"
    exit 2
  fi
  src=$(source_tree "$commit")
else
  bundle=$root/.asv_git/repo.bundle
  if [ ! -f "$bundle" ]; then
    echo "record: no .git here; commits can be recorded with $bundle beside the working tree"
    exit 2
  fi
  git clone -q --bare "$bundle" "$scratch/repo"
  repo=$scratch/repo
  # asv looks up the configured branch even when it is told the commit
  git -C "$repo" rev-parse -q --verify main > /dev/null || git -C "$repo" branch main HEAD
  commit=$(git -C "$repo" rev-parse --verify "$commit_name^{commit}")
  if [ "$commit" = "$(git -C "$repo" rev-parse HEAD)" ]; then
    src=$root                   # the working tree is the bundle's HEAD
  else
    src=$scratch/src-$commit    # another commit of the bundle: its files from git
    mkdir -p "$src"
    git -C "$repo" archive "$commit" | tar -x -C "$src"
  fi
fi
mkdir -p "$results"
write_conf "$results" "$repo"

# The committed description of MACHINE, when there is one, is the one every run reuses;
# else this machine's, as asv detects it, becomes it.
"$py" - "$machine" "$bench_dir/results/$machine/machine.json" "$scratch/home/.asv-machine.json" <<'PY'
import json, os, sys
from asv.machine import Machine
name, described, machine_file = sys.argv[1:]
if os.path.exists(described):
    with open(described) as f:
        desc = json.load(f)
    desc.pop("version", None)
else:
    desc = dict(Machine.get_defaults(), machine=name)
with open(machine_file, "w") as f:
    json.dump({name: desc, "version": 1}, f)
PY
check_src "$src"
run_at "$commit" "$src" --machine "$machine" -a processes=1 "$@"
ls "$results/$machine/${commit:0:8}"-*.json
