#!/usr/bin/env bash
# Two-GPU fine-tuning under accelerate FSDP2 (full shard, bf16), on the device machine (2 GPUs):
#   STEPS="one fsdp" OUT=$OUT bash benchmarks/fsdp_session.sh ; then STEPS="lora resume" ...
# Steps: one (1 GPU, dense, the same 16 samples a step as two GPUs: batch 8 x grad-accum 2); fsdp (2 GPUs,
# dense then SEBP, --compare); lora (the same with a LoRA adapter); resume (2 GPUs, SEBP: SIGTERM after 4 logged
# steps, then --resume, against the same run uninterrupted); lora-sebp (lora for 8 steps with SEBP forced on
# every projection). Each run's summary.json, metrics.jsonl and
# run_config.json go to $OUT/<step>/. The model (benchmarks/fsdp_model.py) is made once under .cache/fsdp/.
set -u
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton}"
OUT=${OUT:-/tmp/out}
MODEL=.cache/fsdp/model
RUNS=/tmp/fsdp_runs
mkdir -p "$OUT" "$RUNS"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
nvidia-smi -L | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers, accelerate, peft; print(torch.__version__, triton.__version__, \
transformers.__version__, accelerate.__version__, peft.__version__)" | tee -a "$OUT/env.txt"
[ -f "$MODEL/config.json" ] || python3 benchmarks/fsdp_model.py .cache/fsdp/tokenizer "$MODEL" 2>&1 | tail -2
COMMON=("$MODEL" tweets-sft --bf16 --padding longest --max-length 256 --max-samples 4000 --max-steps 24
        --eval-steps 12 --eval-samples 64 --seed 0 --json)
FSDP=(accelerate launch --num_processes 2 --num_machines 1 --mixed_precision bf16 --use_fsdp --fsdp_version 2
      --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap LlamaDecoderLayer
      --fsdp_state_dict_type SHARDED_STATE_DICT --fsdp_reshard_after_forward true -m sebp_probe finetune)
keep() {  # run dir, name under $OUT
  mkdir -p "$OUT/$2"
  for f in $(cd "$1" && find . -name summary.json -o -name metrics.jsonl -o -name run_config.json); do
    mkdir -p "$OUT/$2/$(dirname "$f")"; cp "$1/$f" "$OUT/$2/$f"
  done
}
run() {  # name, command...
  local name=$1; shift
  echo "=== $name $(date +%T): $*" | tee -a "$OUT/commands.txt"
  "$@" -o "$RUNS/$name" --overwrite > "$OUT/$name.log" 2>&1
  echo "rc=$?"; grep -E "^(error|Error)|Traceback|Error:" "$OUT/$name.log" | head -5; keep "$RUNS/$name" "$name"
}
for s in ${STEPS:-one}; do
  case $s in
    one) run one python3 -m sebp_probe finetune "${COMMON[@]}" --method dense --batch-size 8 --grad-accum 2 ;;
    fsdp) run fsdp "${FSDP[@]}" "${COMMON[@]}" --batch-size 8 --compare ;;
    lora) run lora "${FSDP[@]}" "${COMMON[@]}" --batch-size 8 --compare --lora ;;
    lora-sebp)  # short: SEBP forced on every projection (the calibration picks dense on these small batches)
      run lora-sebp "${FSDP[@]}" "${COMMON[@]/24/8}" --batch-size 8 --compare --lora --always-sebp --dense-fallback 1 ;;
    resume)
      run resume_ref "${FSDP[@]}" "${COMMON[@]}" --batch-size 8 --method sebp
      echo "=== resume (killed) $(date +%T)" | tee -a "$OUT/commands.txt"
      "${FSDP[@]}" "${COMMON[@]}" --batch-size 8 --method sebp -o "$RUNS/resume" --overwrite > "$OUT/resume_a.log" 2>&1 &
      pid=$!
      for _ in $(seq 600); do
        n=$(grep -c '"train"' "$RUNS/resume/metrics.jsonl" 2>/dev/null); [ "${n:-0}" -ge 4 ] && break; sleep 0.5
      done
      kill -TERM $pid; wait $pid; echo "killed rc=$?"  # the launcher forwards SIGTERM to both workers
      echo "=== resume (resumed) $(date +%T)" | tee -a "$OUT/commands.txt"
      "${FSDP[@]}" "${COMMON[@]}" --batch-size 8 --method sebp -o "$RUNS/resume" --resume > "$OUT/resume_b.log" 2>&1
      echo "rc=$?"; keep "$RUNS/resume" resume ;;
    *) echo "unknown step $s" ;;
  esac
done
