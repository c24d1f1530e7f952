#!/usr/bin/env bash
# One GPU session of checks for the CuPy kernels, stage by stage; logs and tables go to $OUT.
#   validation/gpu_suite.sh tests sanitize ncu bench-quick bench flashinfer
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
    tests)
      timeout ${TESTS_LIMIT:-330} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ada_decode.py \
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
      timeout 300 python3 validation/ncu_bytes.py --out "$OUT/ncu_bytes.json" --tiers 4/4,rdr-mix 2>&1 | tail -n 20
      rc=${PIPESTATUS[0]};;
    profile)
      timeout 200 ncu --clock-control none --kernel-name regex:ada_decode --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section InstructionStats --section LaunchStats \
        python3 validation/ncu_bytes.py --child --tiers 4/4 > "$OUT/ncu_profile.txt" 2>&1
      rc=$?; grep -E "Duration|Throughput|Warp Cycles|Stall|Occupancy|Issued|Eligible|Registers|Bank" "$OUT/ncu_profile.txt" | head -n 40;;
    bench-quick)
      timeout 200 python3 validation/decode_bench.py --out "$OUT/decode_quick.json" --reps 10 \
        --shapes ${QUICK_SHAPES:-8x32768,1x131072} --tiers 4/4,rdr-mix 2>&1 | tee "$OUT/bench_quick.log" | tail -n 30
      rc=${PIPESTATUS[0]};;
    bench)
      timeout ${BENCH_LIMIT:-420} python3 validation/decode_bench.py --out "$OUT/decode_h200.json" --reps ${BENCH_REPS:-20} \
        2>&1 | tee "$OUT/bench.log" | tail -n 45
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
    *) note "unknown stage $stage"; rc=2;;
  esac
  note "stage $stage rc=$rc in $(( $(date +%s) - t0 )) s"
done
