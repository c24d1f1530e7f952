# Sourced by ci_compare.sh and record.sh: asv in this checkout's Python with HEAD's benchmark
# files over the library of any commit, every asv folder in a scratch space unless told.
bench_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$bench_dir/.." && pwd)
py=${PYTHON:-python3}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/home"

# write_conf RESULTS_DIR REPO: the project's config with its folders moved
write_conf() {
  "$py" - "$bench_dir/asv.conf.json" "$scratch" "$root" "$1" "$2" <<'PY'
import json, sys
conf_path, scratch, root, results, repo = sys.argv[1:]
with open(conf_path) as f:
    conf = json.load(f)
conf.update(repo=repo, benchmark_dir=f"{root}/asv_bench/benchmarks", env_dir=f"{scratch}/env",
            results_dir=results, html_dir=f"{scratch}/html")
with open(f"{scratch}/asv.conf.json", "w") as f:
    json.dump(conf, f)
PY
}

# asv under a scratch HOME keeps its machine file out of the user's home.
asv() { HOME="$scratch/home" "$py" -m asv "$@" --config "$scratch/asv.conf.json"; }

# source_tree COMMIT: a folder holding COMMIT's files (the checkout itself for HEAD)
source_tree() {
  if [ "$1" = "$(git -C "$root" rev-parse HEAD)" ]; then echo "$root"; return; fi
  mkdir -p "$scratch/src-$1"
  git -C "$root" archive "$1" | tar -x -C "$scratch/src-$1"
  echo "$scratch/src-$1"
}

# SRC first, then the caller's PYTHONPATH (where asv itself may live, as on the H200)
path_for() { echo "$1${PYTHONPATH:+:$PYTHONPATH}"; }

# check_src SRC: the library imports from folder SRC (an installed copy must not win over it)
check_src() {
  (cd "$scratch" && PYTHONPATH=$(path_for "$1") "$py" -c 'import sys, spherical_kv_ref as m; sys.exit(not m.__file__.startswith(sys.argv[1]))' "$1/") \
    || { echo "asv_bench: spherical_kv_ref does not import from $1" >&2; exit 2; }
}

# run_at COMMIT SRC [asv run options]: HEAD's benchmarks over the library in folder SRC,
# results kept under COMMIT's hash. ASV_PYTHONPATH is what asv hands its benchmark processes
# as PYTHONPATH.
run_at() {
  local commit=$1 src=$2
  shift 2
  ASV_PYTHONPATH=$(path_for "$src") asv run --python=same --set-commit-hash "$commit" --show-stderr "$@"
}
