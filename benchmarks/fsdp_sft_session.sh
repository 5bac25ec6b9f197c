#!/usr/bin/env bash
# Two GPUs, FSDP2, SFT-length data: compiled dense against compiled SEBP in both orders, a SIGTERM + --resume,
# FSDP1, and a resume on another number of processes. On the device machine (2 GPUs), from the repository root:
#
#   STEPS="prep pair" ORDERS=dense-first OUT=$OUT bash benchmarks/fsdp_sft_session.sh
#   STEPS="pair" ORDERS=sebp-first ...;  STEPS="resume fsdp1 nproc" ...
#
# Model: benchmarks/fsdp_model.py's Llama-3.2-1B shape (random weights, the bundled MiniLM's vocabulary);
# data: benchmarks/sft_long_data.py's long instruction pairs from the bundled tweets (lengths of the
# whole-model bench's `sft` distribution, median ~300 tokens, up to 2048), both made once under .cache/gpu/.
# Steps:
#   prep    the model and the data
#   pair    --compare with --compile default, --padding longest, 8 sequences a GPU (ORDERS: dense-first, sebp-first;
#           SCOPE: --compile-scope, model as the committed pairs, or layers; BATCH: sequences a GPU, 8;
#           RESHARD: --fsdp_reshard_after_forward, true; TAG: a suffix of the runs' names: the collector
#           reads pair_* as compiled whole and pair_layers_* as compiled by layers, so SCOPE=layers TAG=_layers)
#   trace   the pair, dense first, 16 steps, under benchmarks/step_trace.py (steps 10-12 profiled, per rank;
#           SCOPE as for pair). Steps a recompile stalls are in the profile too: look at the run's metrics
#   eager   the pair without --compile, dense first
#   auto    the same with --padding auto, SEBP only (what auto picks under FSDP2 and compile)
#   resume  exact SEBP eager, 16 steps: the run uninterrupted, then one killed by SIGTERM after 6 logged steps
#           and resumed with --resume
#   resume_det  the same with --deterministic, the uninterrupted run twice (TWICE=0: once)
#   scopes  one process on GPU 0: --compile default with --compile-scope layers, then model (SCOPES), SEBP,
#           SCOPE_STEPS steps (16): the compile seconds of each
#   fsdp1   --fsdp_version 1 with SEBP, 8 steps
#   nproc   --resume of the 2-process run with one process
# Every run's summary.json, metrics.jsonl, run_config.json and log go into $OUT/fsdp_sft_raw.tgz (rewritten
# after each run, so a call cut short keeps what ran).
set -u
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
export TORCH_LOGS="${TORCH_LOGS-recompiles}"  # each recompile and the guard that failed, in the run's log
OUT=${OUT:-/tmp/out}
MODEL=.cache/gpu/llama_1b
DATA=.cache/gpu/sft_long.jsonl
RAW=/tmp/fsdp_sft_raw
RUNS=/tmp/fsdp_sft_runs
mkdir -p "$OUT" "$RAW" "$RUNS"
if [ -d .whl ] && [ ! -d /tmp/site/kneed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
nvidia-smi -L > "$RAW/env.txt"
COMMON=("$MODEL" "$DATA" --bf16 --max-length 2048 --batch-size ${BATCH:-8} --eval-samples 32 --seed 0 --json)
FSDP=(accelerate launch --num_processes 2 --num_machines 1 --mixed_precision bf16 --use_fsdp
      --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer
      --fsdp_state_dict_type SHARDED_STATE_DICT --fsdp_reshard_after_forward ${RESHARD:-true})
FT=(-m sebp_probe finetune)
save() {  # run dir, name
  mkdir -p "$RAW/$2"
  (cd "$1" 2>/dev/null && find . \( -name summary.json -o -name metrics.jsonl -o -name run_config.json \) \
    -exec cp --parents {} "$RAW/$2" \;)
  tar czf "$OUT/fsdp_sft_raw.tgz" -C "$RAW" .
}
run() {  # name, command...
  local name=$1; shift
  echo "=== $name $(date +%T): $*" | tee -a "$RAW/commands.txt"
  echo "TORCH_LOGS=$TORCH_LOGS" >> "$RAW/commands.txt"
  local t0=$SECONDS
  COLUMNS=200 "$@" > "$RAW/$name.log" 2>&1
  echo "rc=$? wall=$((SECONDS - t0))s" | tee -a "$RAW/commands.txt"
  grep -E "^(SEBP vs dense|error|note)|Traceback|Error" "$RAW/$name.log" | head -6
  save "$RUNS/$name" "$name"
}
killed_then_resumed() {  # name, command...: the command killed by SIGTERM after 6 logged steps, then --resume
  local name=$1; shift
  rm -rf "${RUNS:?}/$name"  # a run of that name from an earlier call would be counted as logged steps
  echo "=== $name (killed) $(date +%T): $* -o $RUNS/$name --overwrite" | tee -a "$RAW/commands.txt"
  COLUMNS=200 "$@" -o "$RUNS/$name" --overwrite > "$RAW/${name}_a.log" 2>&1 &
  local pid=$! n=0
  for _ in $(seq 1200); do
    n=$(grep -c '"train"' "$RUNS/$name/metrics.jsonl" 2>/dev/null); [ "${n:-0}" -ge 6 ] && break
    kill -0 $pid 2>/dev/null || break  # it ended (an error) before its sixth step
    sleep 0.5
  done
  kill -TERM $pid 2>/dev/null; wait $pid; echo "killed rc=$? after ${n:-0} steps" | tee -a "$RAW/commands.txt"
  if [ "${n:-0}" -ge 6 ]; then
    run "$name" "$@" -o "$RUNS/$name" --resume
  else
    echo "not resumed: the run logged ${n:-0} steps" | tee -a "$RAW/commands.txt"; tail -3 "$RAW/${name}_a.log"
  fi
}
for s in ${STEPS:-prep}; do
  case $s in
    prep)
      [ -f "$MODEL/config.json" ] || python3 benchmarks/fsdp_model.py .cache/gpu/tokenizer "$MODEL" 1b 2>&1 | tail -1
      [ -f "$DATA" ] || python3 benchmarks/sft_long_data.py .cache/gpu/tokenizer "$DATA" 2000 2>&1 | tail -1 ;;
    pair)
      for order in ${ORDERS:-dense-first sebp-first}; do
        flag=(); [ "$order" = sebp-first ] && flag=(--sebp-first)
        run "pair${TAG:-}_$order" "${FSDP[@]}" --fsdp_version 2 "${FT[@]}" "${COMMON[@]}" --padding longest --compile default \
          --compile-scope "${SCOPE:-model}" --max-steps ${PAIR_STEPS:-40} --compare "${flag[@]}" -o "$RUNS/pair${TAG:-}_$order" \
          --overwrite
      done ;;
    trace)  # the pair (dense first) under benchmarks/step_trace.py: a profile of steps 10-12 of each run, per rank
      run trace "${FSDP[@]}" --fsdp_version 2 benchmarks/step_trace.py --out "$RAW/trace" --steps 10:13 -- \
        "${FT[@]}" "${COMMON[@]}" --padding longest --compile default --compile-scope "${SCOPE:-model}" --max-steps 16 \
        --compare -o "$RUNS/trace" --overwrite ;;
    eager)  # the pair without --compile (dense first)
      run eager_dense-first "${FSDP[@]}" --fsdp_version 2 "${FT[@]}" "${COMMON[@]}" --padding longest \
        --max-steps ${PAIR_STEPS:-40} --compare -o "$RUNS/eager_dense-first" --overwrite ;;
    auto)
      run auto "${FSDP[@]}" --fsdp_version 2 "${FT[@]}" "${COMMON[@]}" --padding auto --compile default \
        --compile-scope "${SCOPE:-model}" --max-steps 40 --method sebp -o "$RUNS/auto" --overwrite ;;
    resume)
      R=("${FSDP[@]}" --fsdp_version 2 "${FT[@]}" "${COMMON[@]}" --padding longest --max-steps 16 --method sebp
         --eval-steps 8)
      run resume_ref "${R[@]}" -o "$RUNS/resume_ref" --overwrite
      killed_then_resumed resume "${R[@]}" ;;
    resume_det)  # the same with --deterministic, and the uninterrupted run twice (are two runs bit-equal?)
      R=("${FSDP[@]}" --fsdp_version 2 "${FT[@]}" "${COMMON[@]}" --padding longest --max-steps 16 --method sebp
         --eval-steps 8 --deterministic)
      run resume_det_ref "${R[@]}" -o "$RUNS/resume_det_ref" --overwrite
      [ "${TWICE:-1}" = 1 ] && run resume_det_ref2 "${R[@]}" -o "$RUNS/resume_det_ref2" --overwrite
      killed_then_resumed resume_det "${R[@]}" ;;
    scopes)  # one process on one GPU: --compile default with each --compile-scope, compile seconds and steps
      for sc in ${SCOPES:-layers model}; do
        CUDA_VISIBLE_DEVICES=0 run "scope_$sc" python3 "${FT[@]}" "${COMMON[@]}" --padding longest --compile default \
          --compile-scope "$sc" --max-steps ${SCOPE_STEPS:-16} --method sebp -o "$RUNS/scope_$sc" --overwrite
      done ;;
    fsdp1)
      run fsdp1 "${FSDP[@]}" --fsdp_version 1 "${FT[@]}" "${COMMON[@]}" --padding longest --max-steps 8 \
        --method sebp -o "$RUNS/fsdp1" --overwrite ;;
    nproc)  # the 2-process run of `resume`, resumed by one process
      run nproc python3 "${FT[@]}" "${COMMON[@]}" --padding longest --max-steps 16 --method sebp --eval-steps 8 \
        -o "$RUNS/resume" --resume ;;
    *) echo "unknown step $s" ;;
  esac
done
