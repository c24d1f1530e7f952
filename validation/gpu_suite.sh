#!/usr/bin/env bash
# One GPU session of checks for the CuPy kernels, stage by stage; logs and tables go to $OUT.
#   validation/gpu_suite.sh build tests device-cache fixed-cost e2e profile-compress sanitize ncu profile bench-quick bench-encode bench bench-d256-ab flashinfer asv
# (bench times FlashInfer too when its wheel is in .whl/; flashinfer alone times only the baselines;
#  BENCH_GEOMETRY=d256 times the head_dim-256 layer of validation.decode_cases.BENCH_GEOMETRIES;
#  SPHERICAL_KV_WIDE_FAST_PAGES=1 builds the head_dim-256 fast pages on, for every stage; the stage
#  bench-d256-ab times the d 256 layer with them off, then on, in one call)
# Each stage has its own time limit so one stuck stage cannot take the others with it.
set -u
OUT=${OUT:-/tmp/skv_gpu_suite}
mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-fixed}
SUMMARY="$OUT/summary.txt"
note() { echo "$*" | tee -a "$SUMMARY"; }
# installs the FlashInfer wheel carried in .whl/ into /tmp/site; fails where none is carried
flashinfer_site() {
  ls .whl/flashinfer*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps \
    --no-compile --target /tmp/site .whl/flashinfer*.whl > "$OUT/flashinfer_install.log" 2>&1
}
# the card, as the result files and asv's machine are named: h200, h100 (else gpu)
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)" in
  *H200*) card=h200;; *H100*) card=h100;; *) card=gpu;;
esac
note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null)"
for stage in "$@"; do
  t0=$(date +%s)
  case "$stage" in
    build)
      # registers and local memory of the device's own (NVRTC) build of every kernel
      timeout 240 python3 validation/build_info.py --out "$OUT/build_info.json" 2>&1 | tee "$OUT/build_info.log"
      rc=${PIPESTATUS[0]};;
    tests)
      timeout ${TESTS_LIMIT:-330} python3 -m pytest -q -m gpu -p no:cacheprovider -rs ${TESTS_ARGS:-tests/} > "$OUT/pytest.log" 2>&1
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
      # DRAM bytes of the decode and merge kernels against the cache bytes (NCU_CODEBOOKS)
      timeout ${NCU_LIMIT:-300} python3 lab/ncu_bytes.py --out "$OUT/ncu_bytes.json" --tiers 4/4,rdr-mix \
        --codebooks ${NCU_CODEBOOKS:-lloyd-max,uniform} 2>&1 | tail -n 20
      rc=${PIPESTATUS[0]};;
    profile)
      # counters of the decode kernel at (8, 32K) 4/4 per codebook (PROFILE_CODEBOOKS: uniform =
      # affine path, lloyd-max = table path)
      rc=0
      for cb in ${PROFILE_CODEBOOKS:-uniform lloyd-max}; do
        timeout ${PROFILE_LIMIT:-200} ncu --clock-control none --kernel-name regex:ada_decode --launch-count 1 \
          --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
          --section MemoryWorkloadAnalysis --section InstructionStats --section LaunchStats \
          python3 lab/ncu_bytes.py --child --tiers 4/4 --codebook $cb > "$OUT/ncu_profile_$cb.txt" 2>&1
        r=$?; [ $r -ne 0 ] && rc=$r
        note "profile $cb rc=$r"
        grep -E "Duration|DRAM Throughput|Executed Ipc A|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Theoretical Occupancy|Registers Per|Eligible Warps|Active Warps Per|Executed Instructions  " "$OUT/ncu_profile_$cb.txt" | head -n 16
      done;;
    bench-encode)
      # encode only (ENCODE_SHAPES, ENCODE_TIERS, RUN_NOTE)
      timeout ${ENCODE_LIMIT:-240} python3 validation/decode_bench.py --encode-only \
        --out "$OUT/encode_bench${BENCH_GEOMETRY:+_$BENCH_GEOMETRY}.json" --reps ${ENCODE_REPS:-10} \
        --geometry ${BENCH_GEOMETRY:-llama8b} \
        --shapes ${ENCODE_SHAPES:-all} --tiers ${ENCODE_TIERS:-4/4,3/3,2/2,rdr-mix} \
        --run-note "${RUN_NOTE:-}" 2>&1 | tee "$OUT/bench_encode.log" | tail -n 40
      rc=${PIPESTATUS[0]};;
    bench-quick)
      timeout 200 python3 validation/decode_bench.py --out "$OUT/decode_quick${BENCH_GEOMETRY:+_$BENCH_GEOMETRY}.json" --reps 10 \
        --geometry ${BENCH_GEOMETRY:-llama8b} \
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
        --out "$OUT/decode_${card}${BENCH_GEOMETRY:+_$BENCH_GEOMETRY}.json" --reps ${BENCH_REPS:-20} \
        --geometry ${BENCH_GEOMETRY:-llama8b} \
        --codebooks ${BENCH_CODEBOOKS:-lloyd-max,uniform} --shapes ${BENCH_SHAPES:-all} \
        --tiers ${BENCH_TIERS:-4/4,3/3,2/2,rdr-mix} $fi_flag 2>&1 | tee "$OUT/bench.log" | tail -n 45
      rc=${PIPESTATUS[0]};;
    bench-d256-ab)
      # the head_dim-256 layer (4/4 and the RDR mix, uniform codebook; AB_SHAPES) with the fast
      # pages off (decode_<card>_d256_off.json), then on (_on.json, beside FlashInfer when its
      # wheel is carried), each in its own process
      fi_flag=""
      flashinfer_site && fi_flag=--flashinfer
      rc=0
      for wide in 0 1; do
        name=decode_${card}_d256_$([ $wide = 1 ] && echo on || echo off)
        flag=""; [ $wide = 1 ] && flag=$fi_flag
        SPHERICAL_KV_WIDE_FAST_PAGES=$wide PYTHONPATH=/tmp/site:$PYTHONPATH timeout ${AB_LIMIT:-240} \
          python3 validation/decode_bench.py --out "$OUT/$name.json" --reps ${BENCH_REPS:-20} \
          --geometry d256 --codebooks uniform --shapes ${AB_SHAPES:-8x32768,1x131072} \
          --tiers 4/4,rdr-mix $flag > "$OUT/$name.log" 2>&1
        r=$?; [ $r -ne 0 ] && rc=$r
        note "$name rc=$r"; grep '"ada"' "$OUT/$name.log" | cut -c1-240
      done;;
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
    device-cache)
      # the device cache, its custom ops under graph capture and torch.compile, the GPU cache
      timeout ${DC_LIMIT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
        tests/test_device_cache.py > "$OUT/pytest_device_cache.log" 2>&1
      rc=$?; tail -n 30 "$OUT/pytest_device_cache.log";;
    sanitize-dc)
      # compute-sanitizer memcheck over the device cache's paths (its own launches and copies)
      timeout ${SAN_LIMIT:-170} compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 -m validation.sanitize_device_cache > "$OUT/sanitizer_device_cache.log" 2>&1
      rc=$?; note "compute-sanitizer memcheck (device cache) rc=$rc: $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_device_cache.log" | tail -n 1)"
      [ $rc -ne 0 ] && tail -n 30 "$OUT/sanitizer_device_cache.log";;
    profile-compress)
      # where compress_all spends its time at (PC_BATCH, PC_CONTEXT), under torch's profiler:
      # each part's GPU busy time against its wall, the host waits, the host's hot functions
      timeout ${PC_LIMIT:-240} python3 lab/profile_compress.py --together --batch ${PC_BATCH:-5} \
        --context ${PC_CONTEXT:-32768} --rows ${PC_ROWS:-25} --syncs ${PC_SYNCS:-25} \
        --host ${PC_HOST:-40} > "$OUT/profile_compress.txt" 2>&1
      rc=$?; head -n 3 "$OUT/profile_compress.txt"; grep -A 12 "^one sequence unprofiled" "$OUT/profile_compress.txt";;
    fixed-cost)
      # the decode kernel's fixed cost per call in a graph, and eager with and without PDL
      timeout ${FC_LIMIT:-200} python3 lab/fixed_cost.py --out "$OUT/fixed_cost.json" \
        --contexts ${FC_CONTEXTS:-16,1024,32768} 2>&1 | tee "$OUT/fixed_cost.log" | tail -n 12
      rc=${PIPESTATUS[0]};;
    e2e)
      # whole-model decode throughput (E2E_SHAPES, E2E_METHODS, E2E_FLAGS such as --equal-memory);
      # FlashInfer's rows join the default methods when its wheel is carried in .whl/
      # (installed whenever carried, so that E2E_METHODS may name them too)
      methods=${E2E_METHODS:-dense,ada44,rdr,rdr-host}
      if flashinfer_site; then
        [ -z "${E2E_METHODS:-}" ] && methods=dense,flashinfer-bf16,flashinfer-fp8,ada44,rdr,rdr-host
      fi
      # E2E_NAME (default e2e_<card>) names the files
      PYTHONPATH=/tmp/site:$PYTHONPATH timeout ${E2E_LIMIT:-420} python3 -m validation.e2e_bench \
        --out "$OUT/${E2E_NAME:-e2e_$card}.json" --plot "$OUT/${E2E_NAME:-e2e_$card}.png" \
        --shapes ${E2E_SHAPES:-32x8192,8x32768,2x131072,1x131072} \
        --methods $methods ${E2E_FLAGS:-} 2>&1 | tee "$OUT/e2e.log" | tail -n 40
      rc=${PIPESTATUS[0]};;
    asv)
      # stage asv: the GPU benchmarks' asv results for the committed history, packed into
      # $OUT/asv_results.tgz (asv_results<rep>/<machine>/; docs/benchmarks.md; asv's wheels in
      # .asv_whl/ or .whl/, .asv_git/repo.bundle). ASV_MACHINE (default: the card, h200 or h100)
      # names asv's machine; ASV_COMMITS (default HEAD) names the commits to record, each once per
      # ASV_REPEAT (default 1; more gives the run-to-run spread of one commit)
      python3 -m asv --version > /dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps \
        --no-compile --target /tmp/asv_site $(ls .asv_whl/*.whl .whl/asv*.whl 2>/dev/null) > "$OUT/asv_install.log" 2>&1
      rc=0
      for commit in ${ASV_COMMITS:-HEAD}; do
        for rep in $(seq ${ASV_REPEAT:-1}); do
          PYTHONPATH=/tmp/asv_site:$PYTHONPATH ASV_FROM_BUNDLE=1 ASV_RESULTS="$OUT/asv_results${rep#1}" timeout ${ASV_LIMIT:-420} \
            asv_bench/record.sh "${ASV_MACHINE:-$card}" "$commit" -- --bench "${ASV_GPU_BENCH:-\.track_(gpu_us|gbps)\(}" >> "$OUT/asv.log" 2>&1
          r=$?; [ $r -ne 0 ] && rc=$r; note "asv $commit rep $rep rc=$r"
        done
      done
      if ls -d "$OUT"/asv_results*/ > /dev/null 2>&1; then
        tar czf "$OUT/asv_results.tgz" -C "$OUT" $(cd "$OUT" && ls -d asv_results*/) && rm -rf "$OUT"/asv_results*/
      fi
      tail -n 30 "$OUT/asv.log";;
    *) note "unknown stage $stage"; rc=2;;
  esac
  note "stage $stage rc=$rc in $(( $(date +%s) - t0 )) s"
done
