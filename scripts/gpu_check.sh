#!/usr/bin/env bash
# GPU tests and benchmarks of the Triton SEBP backward, for the lent device machine (or any CUDA box).
#   STAGES="tests layers model" bash scripts/gpu_check.sh      (default: all three)
# Writes logs and JSON results under $OUT (default /tmp/sebp-gpu). Each stage has its own time limit, so a
# failing or slow stage still leaves the others' results. TRITON_CACHE_DIR is kept in the repo (.triton_cache,
# git-ignored) and packed into $OUT, so a later run can carry the compiled kernels along.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_CACHE_DIR="$PWD/.triton_cache"
OUT="${OUT:-/tmp/sebp-gpu}"
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
STAGES="${STAGES:-tests layers model}"
LOG="$OUT/log.txt"
REPEATS="${REPEATS:-30}"
BENCH="python3 -m sebp_probe.cli bench"

stage() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s) $(date +%T)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$secs" "$@" 2>&1 | tee -a "$LOG" | tail -n 60
  echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s" | tee -a "$LOG"
}

nvidia-smi -L | tee -a "$LOG"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$LOG"

for s in $STAGES; do
  case $s in
    # tests check results, not speed
    tests) stage "gpu tests" "${TESTS_LIMIT:-300}" python3 -m pytest -q \
             -p no:cacheprovider tests/kernels/test_triton_gpu.py ;;
    layers) for m in ${LAYER_SETS:-bert-base llama-3.2-3b}; do
              stage "layers $m" "${LAYERS_LIMIT:-200}" $BENCH "$m" --repeats "$REPEATS" -o "$OUT/layers_$m.json"
            done ;;
    model) for m in ${MODEL_SETS:-bert-base llama-3.2-3b}; do
             stage "model $m" "${MODEL_LIMIT:-200}" $BENCH "$m" --scope model --graphs -o "$OUT/model_$m.json"
           done ;;
    *) echo "unknown stage $s" ;;
  esac
done
tar czf "$OUT/triton_cache.tgz" -C "$PWD" .triton_cache 2>/dev/null
ls -la "$OUT"
