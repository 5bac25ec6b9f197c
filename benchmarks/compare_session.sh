#!/usr/bin/env bash
# `finetune --compare` in both orders on a GPU: does the headline tell the truth? Run from the repository root:
#
#   STEPS="eager compile padded" OUT=/tmp/out bash benchmarks/compare_session.sh
#
# The model: a ~120M Llama with random weights and the bundled MiniLM's vocabulary (benchmarks/fsdp_model.py
# small), made once under .cache/gpu/; the data: the bundled tweets as text. Steps, each a --compare pair with
# dense first and one with --sebp-first (40 steps of 32 tweets, max length 128, bf16):
#   eager    --padding longest (calibration leaves every layer dense: both runs compute the same thing)
#   compile  the same with --compile default (SCOPE: --compile-scope, model as the committed runs; layers)
#   padded   --padding max_length --cuda-graphs (SEBP on the padding rows, calibrated as graph replays: a real
#            difference; eager, this small model's host-bound backward leaves every layer dense)
#   forced   --padding longest with SEBP forced on every projection (--always-sebp --dense-fallback 1): a real
#            difference, eager
# ORDERS="sebp-first" runs one order only.
# Every run's summary.json, metrics.jsonl and run_config.json, the logs and the commands go into
# $OUT/compare_raw.tgz; benchmarks/compare_collect.py makes results/compare_h100/compare.json of them.
set -u
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
OUT=${OUT:-/tmp/out}
MODEL=.cache/gpu/llm_small
RAW=/tmp/compare_raw
RUNS=/tmp/compare_runs
mkdir -p "$OUT" "$RAW" "$RUNS"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
nvidia-smi -L | tee "$RAW/env.txt"
[ -f "$MODEL/config.json" ] || python3 benchmarks/fsdp_model.py .cache/gpu/tokenizer "$MODEL" small 2>&1 | tail -1
COMMON=("$MODEL" tweets --max-steps 40 --batch-size 32 --max-length 128 --bf16 --eval-samples 256 --seed 0 --compare)
pair() {  # name, extra options: the pair with dense first, then with --sebp-first
  local name=$1; shift
  for order in ${ORDERS:-dense-first sebp-first}; do
    local flag=(); [ $order = sebp-first ] && flag=(--sebp-first)
    local cmd=(python3 -m sebp_probe finetune "${COMMON[@]}" "$@" "${flag[@]}" -o "$RUNS/${name}_$order" --overwrite)
    echo "=== ${name}_$order $(date +%T): sebp-probe finetune ${cmd[*]:4}" | tee -a "$RAW/commands.txt"
    COLUMNS=200 "${cmd[@]}" > "$RAW/${name}_$order.log" 2>&1
    echo "rc=$?"; grep -E "^(SEBP vs dense|error)|Traceback" -A1 "$RAW/${name}_$order.log" | head -4
    mkdir -p "$RAW/${name}_$order"
    (cd "$RUNS/${name}_$order" && find . \( -name summary.json -o -name metrics.jsonl -o -name run_config.json \) \
      -exec cp --parents {} "$RAW/${name}_$order" \;)
  done
}
for s in ${STEPS:-eager}; do
  case $s in
    eager) pair eager --padding longest ;;
    compile) pair compile --padding longest --compile default --compile-scope "${SCOPE:-model}" ;;
    padded) pair padded --padding max_length --cuda-graphs ;;
    forced) pair forced --padding longest --always-sebp --dense-fallback 1 ;;
    *) echo "unknown step $s" ;;
  esac
done
tar czf "$OUT/compare_raw.tgz" -C "$RAW" .
