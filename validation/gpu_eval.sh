#!/usr/bin/env bash
# The evaluation's long runs on one GPU host (docs/evaluate.md, "On a GPU"), resumable:
# Gemma-3-270M at 8K, 16K and 32K (16 windows, windows in the 8-bit code) beside the
# long-context tasks on SmolLM2 at 8K (50 instances per task, reached in steps of 10, 25, 50
# so that a part of the run covers every task). Both share the GPU; each is a loop of
# `--resume` invocations, so a run stopped anywhere goes on from its logged units.
#
#   validation/gpu_eval.sh run       # the two queues; detach it (setsid nohup ... &) on a host
#                                    # whose sessions end, and read the logs with `status`
#   validation/gpu_eval.sh status    # units logged so far, the queues' last lines, GPU memory
#   validation/gpu_eval.sh stop      # ends both queues (their finished units stay logged)
#
# RUNS (default ./spherical-kv-results/gpu) holds gemma/ and tasks8k/ (units.jsonl and, once
# complete, the reports) and the logs. The evaluation needs gguf and hqq next to the project,
# the tasks kvpress too, which wants transformers < 5.3: EVAL_PATH and TASKS_PATH are
# prepended to PYTHONPATH for each queue (folders made with pip install --target), so the two
# can run different transformers. EVAL_JOBS / TASK_JOBS: worker processes of each (default
# by the card's memory: 5 and 3 under 100 GB, else 7 and 4; SmolLM2 at 8K peaks near 10 GB a
# worker). EVAL_CONTEXTS, TASK_LADDER override the contexts and the instance steps. The
# corpus and the models come from SPHERICAL_KV_CACHE as in every run (docs/evaluate.md,
# "Moving the model files in parts of at most 50 MB").
set -u
RUNS=${RUNS:-spherical-kv-results/gpu}
mkdir -p "$RUNS"
RUNS=$(cd "$RUNS" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
log() { echo "$(date -u +%FT%TZ) $*" >> "$RUNS/drive.log"; }

# resumed OUT LOG WHAT CMD...: CMD --out OUT (with --resume once OUT has a log), until it
# ends well, at most four times
resumed() {
  local out=$1 logf=$2 what=$3 try resume
  shift 3
  for try in 1 2 3 4; do
    resume=; [ -f "$out/units.jsonl" ] && resume=--resume
    log "$what (try $try)"
    "$@" --out "$out" $resume >> "$logf" 2>&1 && return 0
    log "$what ended with rc=$?"; sleep 5
  done
  return 1
}

EVAL=(python3 -m spherical_kv_eval.evaluate --device cuda --model gemma3-270m --windows 16
      --window-bits 8)

eval_queue() {
  export PYTHONPATH=$ROOT:${EVAL_PATH:-}:${PYTHONPATH:-}
  for T in ${EVAL_CONTEXTS:-8192 16384 32768}; do
    resumed "$RUNS/gemma" "$RUNS/gemma.log" "evaluate T=$T" "${EVAL[@]}" --contexts "$T" \
      --jobs "$EVAL_JOBS"
  done
  # every context's units are logged: the reports over all three
  "${EVAL[@]}" --contexts ${EVAL_CONTEXTS:-8192 16384 32768} --jobs "$EVAL_JOBS" \
    --out "$RUNS/gemma" --resume >> "$RUNS/gemma.log" 2>&1
  log "evaluate queue done (rc=$?)"
}

tasks_queue() {
  export PYTHONPATH=$ROOT:${TASKS_PATH:-}:${PYTHONPATH:-}
  for n in ${TASK_LADDER:-10 25 50}; do
    resumed "$RUNS/tasks8k" "$RUNS/tasks.log" "tasks instances=$n" python3 -m \
      spherical_kv_eval.tasks_run --device cuda --lengths 8192 --instances "$n" --jobs "$TASK_JOBS"
  done
  log "tasks queue done"
}

case "${1:-}" in
  run)
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    if [ "${mem:-0}" -gt 100000 ]; then big=1; else big=0; fi
    EVAL_JOBS=${EVAL_JOBS:-$([ $big = 1 ] && echo 7 || echo 5)}
    TASK_JOBS=${TASK_JOBS:-$([ $big = 1 ] && echo 4 || echo 3)}
    log "start: $mem MiB, evaluate jobs $EVAL_JOBS, tasks jobs $TASK_JOBS"
    ( while true; do
        echo "$(date -u +%T) $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader | head -n 1)" >> "$RUNS/gpu.log"
        sleep 20
      done ) &
    monitor=$!
    eval_queue & e=$!
    tasks_queue & t=$!
    wait $e $t
    kill $monitor;;
  status)
    for d in gemma tasks8k; do
      [ -f "$RUNS/$d/units.jsonl" ] && echo "$d: $(( $(wc -l < "$RUNS/$d/units.jsonl") - 1 )) units logged"
    done
    tail -n 6 "$RUNS/drive.log" 2>/dev/null; tail -n 2 "$RUNS/gpu.log" 2>/dev/null
    for f in gemma.log tasks.log; do
      [ -f "$RUNS/$f" ] || continue
      echo "== $f"; tr '\r' '\n' < "$RUNS/$f" | grep -v 'it/s\]\|s/it\]' | tail -n 5 | cut -c1-240
    done;;
  stop)
    pkill -f "gpu_eval.sh run"; pkill -f "spherical_kv_eval\.(evaluate|tasks_run)"
    sleep 3; pkill -9 -f "spherical_kv_eval\.(evaluate|tasks_run)"; true;;
  *) echo "usage: $0 run|status|stop" >&2; exit 2;;
esac
