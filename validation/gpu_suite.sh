#!/usr/bin/env bash
# One GPU session of checks for the CuPy kernels, stage by stage; logs and tables go to $OUT.
#   validation/gpu_suite.sh build tests sanitize ncu profile variants floor anatomy encode-variants bench-quick bench-encode bench flashinfer
# (bench times FlashInfer too when its wheel is in .whl/; flashinfer alone times only the baselines)
# Each stage has its own time limit so one stuck stage cannot take the others with it.
set -u
OUT=${OUT:-/tmp/skv_gpu_suite}
mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
SUMMARY="$OUT/summary.txt"
note() { echo "$*" | tee -a "$SUMMARY"; }
note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null)"
for stage in "$@"; do
  t0=$(date +%s)
  case "$stage" in
    build)
      # registers and local memory of the device's own (NVRTC) build of every kernel
      timeout 240 python3 validation/build_info.py --out "$OUT/build_info.json" 2>&1 | tee "$OUT/build_info.log"
      rc=${PIPESTATUS[0]};;
    tests)
      timeout ${TESTS_LIMIT:-330} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ada_decode.py tests/test_cache_kernels.py tests/test_page_read.py \
        tests/test_encode_kernel.py > "$OUT/pytest.log" 2>&1
      rc=$?; tail -n 25 "$OUT/pytest.log";;
    sanitize)
      rc=0
      for tool in memcheck racecheck initcheck; do
        timeout ${SAN_LIMIT:-170} compute-sanitizer --tool "$tool" --error-exitcode 9 \
          python3 validation/sanitize_run.py > "$OUT/sanitizer_$tool.log" 2>&1
        r=$?; note "compute-sanitizer $tool rc=$r: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -n 2 | tr '\n' ' ')"
        [ $r -ne 0 ] && rc=$r && tail -n 30 "$OUT/sanitizer_$tool.log"
      done
      cat "$OUT"/sanitizer_*.log > "$OUT/sanitizer.log"; rm -f "$OUT"/sanitizer_*.log;;
    ncu)
      # NCU_VERSION: decode version (0: the launcher's default per codebook); NCU_CODEBOOKS
      timeout ${NCU_LIMIT:-300} python3 validation/ncu_bytes.py --out "$OUT/ncu_bytes.json" --tiers 4/4,rdr-mix \
        --version ${NCU_VERSION:-0} --codebooks ${NCU_CODEBOOKS:-lloyd-max,uniform} 2>&1 | tail -n 20
      rc=${PIPESTATUS[0]};;
    profile)
      # counters of the decode kernel at (8, 32K) 4/4, per version (PROFILE_VERSIONS) and
      # codebook (PROFILE_CODEBOOK: uniform = affine path, lloyd-max = table path)
      rc=0
      for v in ${PROFILE_VERSIONS:-7 6}; do
        timeout ${PROFILE_LIMIT:-200} ncu --clock-control none --kernel-name regex:ada_decode --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
          --section MemoryWorkloadAnalysis --section InstructionStats --section LaunchStats \
          python3 validation/ncu_bytes.py --child --tiers 4/4 --codebook ${PROFILE_CODEBOOK:-uniform} \
          --version $v > "$OUT/ncu_profile_v$v.txt" 2>&1
        r=$?; [ $r -ne 0 ] && rc=$r
        note "profile v$v rc=$r"
        grep -E "Duration|DRAM Throughput|Executed Ipc A|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Theoretical Occupancy|Registers Per|Eligible Warps|Active Warps Per|Executed Instructions  " "$OUT/ncu_profile_v$v.txt" | head -n 16
      done;;
    variants)
      # build-time variants of the v7/v8 affine kernels next to v6, v7 and v8 as built (same pools;
      # VARIANTS_POOLS: the page orders and seeds each case is timed on)
      timeout ${VARIANTS_LIMIT:-300} python3 validation/decode_variants.py --out "$OUT/decode_variants.json" \
        --reps ${VARIANTS_REPS:-20} --cases ${VARIANTS_CASES:-all} --variants ${VARIANTS_NAMES:-all} \
        --pools ${VARIANTS_POOLS:-shuffled:0} --baselines ${VARIANTS_BASELINES:-v6,v7,v8} 2>&1 | tee "$OUT/variants.log" | tail -n 60
      rc=${PIPESTATUS[0]};;
    floor)
      # what a paged decode can reach at all: a kernel that only reads the pages (v7's grid and
      # page table, static or claimed pages), copies of the same bytes and the v7 step
      timeout ${FLOOR_LIMIT:-240} python3 validation/decode_floor.py --out "$OUT/decode_floor.json" \
        --reps ${FLOOR_REPS:-30} --cases ${FLOOR_CASES:-all} ${FLOOR_ARGS:-} 2>&1 | tee "$OUT/floor.log" | tail -n 40
      rc=${PIPESTATUS[0]};;
    anatomy)
      # per-CTA timeline of the v7 step (DEC7_TRACE build): prologue, pages, epilogue, tail
      timeout ${ANATOMY_LIMIT:-240} python3 validation/decode_anatomy.py --out "$OUT/decode_anatomy.json" \
        --reps ${ANATOMY_REPS:-7} ${ANATOMY_CASES:+--cases $ANATOMY_CASES} 2>&1 | tee "$OUT/anatomy.log" | tail -n 20
      rc=${PIPESTATUS[0]};;
    encode-variants)
      # build-time variants of the v3 encode kernels next to the kernels as built (same inputs)
      timeout ${ENCODE_VARIANTS_LIMIT:-300} python3 validation/encode_variants.py --out "$OUT/encode_variants.json" \
        --reps ${ENCODE_REPS:-10} --cases ${ENCODE_VARIANTS_CASES:-all} --variants ${ENCODE_VARIANTS_NAMES:-all} \
        2>&1 | tee "$OUT/encode_variants.log" | tail -n 60
      rc=${PIPESTATUS[0]};;
    bench-encode)
      # encode only, v3 and v2 in the same process (ENCODE_VERSIONS) (ENCODE_SHAPES, ENCODE_TIERS, RUN_NOTE)
      timeout ${ENCODE_LIMIT:-240} python3 validation/decode_bench.py --encode-only \
        --out "$OUT/encode_bench.json" --reps ${ENCODE_REPS:-10} --encode-versions ${ENCODE_VERSIONS:-3,2} \
        --shapes ${ENCODE_SHAPES:-all} --tiers ${ENCODE_TIERS:-4/4,3/3,2/2,rdr-mix} \
        --run-note "${RUN_NOTE:-}" 2>&1 | tee "$OUT/bench_encode.log" | tail -n 40
      rc=${PIPESTATUS[0]};;
    bench-quick)
      timeout 200 python3 validation/decode_bench.py --out "$OUT/decode_quick.json" --reps 10 \
        --shapes ${QUICK_SHAPES:-8x32768,1x131072} --tiers 4/4,rdr-mix 2>&1 | tee "$OUT/bench_quick.log" | tail -n 30
      rc=${PIPESTATUS[0]};;
    bench)
      # FlashInfer (when its wheel is carried in .whl/) is timed in the same process as SDPA
      # and ADA, so every ADA row carries its speedups against FlashInfer bf16 and fp8.
      fi_flag=""
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
          > "$OUT/flashinfer_install.log" 2>&1 && fi_flag=--flashinfer
      fi
      PYTHONPATH=/tmp/site:$PYTHONPATH timeout ${BENCH_LIMIT:-420} python3 validation/decode_bench.py \
        --out "$OUT/decode_h200.json" --reps ${BENCH_REPS:-20} --versions ${BENCH_VERSIONS:-8,7,6,5,4} \
        --codebooks ${BENCH_CODEBOOKS:-lloyd-max,uniform} --shapes ${BENCH_SHAPES:-all} \
        --tiers ${BENCH_TIERS:-4/4,3/3,2/2,rdr-mix} $fi_flag 2>&1 | tee "$OUT/bench.log" | tail -n 45
      rc=${PIPESTATUS[0]};;
    flashinfer)
      rc=0
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
          > "$OUT/flashinfer.log" 2>&1
        PYTHONPATH=/tmp/site:$PYTHONPATH timeout ${FI_LIMIT:-420} python3 validation/decode_bench.py \
          --out "$OUT/decode_flashinfer.json" --reps 20 --tiers "" --flashinfer \
          >> "$OUT/flashinfer.log" 2>&1
        rc=$?; tail -n 20 "$OUT/flashinfer.log"
      else
        note "flashinfer: no wheel carried"
      fi;;
    asv)
      # stage asv: the GPU benchmarks' asv results for the committed history, in
      # $OUT/asv_results/h200/ (docs/benchmarks.md; asv's wheels in .whl/, .asv_git/repo.bundle)
      python3 -m asv --version > /dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps \
        --no-compile --target /tmp/site .whl/*.whl > "$OUT/asv_install.log" 2>&1
      PYTHONPATH=/tmp/site:$PYTHONPATH ASV_RESULTS="$OUT/asv_results" timeout ${ASV_LIMIT:-420} \
        asv_bench/record.sh h200 -- --bench "${ASV_GPU_BENCH:-\.track_(gpu_us|gbps)\(}" > "$OUT/asv.log" 2>&1
      rc=$?; tail -n 30 "$OUT/asv.log";;
    *) note "unknown stage $stage"; rc=2;;
  esac
  note "stage $stage rc=$rc in $(( $(date +%s) - t0 )) s"
done
