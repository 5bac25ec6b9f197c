#!/usr/bin/env bash
# Fine-tuning evidence on a GPU: dense vs SEBP (same seed, same data order) through sebp_probe.finetune,
# BERT-base and a Llama-shaped decoder built from configs, synthetic token batches (see gpu_finetune.py).
#   bash scripts/gpu_finetune.sh            one GPU: all experiments          (about 5 minutes on an H100)
#   NPROC=2 bash scripts/gpu_finetune.sh    the same through `accelerate launch --multi_gpu --num_processes 2`
#   EXPS="bert_exact_fp32 bert_bf16_max" bash scripts/gpu_finetune.sh         a subset
# Results: $OUT/<exp>-<n>gpu.json (+ metrics.jsonl and curves), $OUT/finetune_gpu.json (the table), $OUT/log.txt.
# Needs torch, transformers, accelerate (no datasets/kneed, no network). Each experiment has its own time limit.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_CACHE_DIR="$PWD/.triton_cache"
OUT="${OUT:-/tmp/sebp-gpu}"
NPROC="${NPROC:-1}"
EXPS="${EXPS:-bert_exact_fp32 bert_bf16_max bert_bf16_longest llama_exact_fp32 llama_bf16_max llama_bf16_longest}"
LIMIT="${LIMIT:-240}"
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
LOG="$OUT/log.txt"

if [ "$NPROC" -gt 1 ]; then
  LAUNCH=(accelerate launch --multi_gpu --num_processes "$NPROC" --num_machines 1 --mixed_precision no
          --dynamo_backend no)
else
  LAUNCH=(python3)
fi

nvidia-smi -L | tee -a "$LOG"
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'accelerate', accelerate.__version__, torch.cuda.get_device_name())" | tee -a "$LOG"

for exp in $EXPS; do
  echo "=== $exp on $NPROC GPU(s) (limit ${LIMIT}s) $(date +%T)" | tee -a "$LOG"
  t0=$SECONDS
  timeout "$LIMIT" "${LAUNCH[@]}" scripts/gpu_finetune.py --exp "$exp" --out "$OUT" 2>&1 | tee -a "$LOG" | tail -n 25
  echo "=== $exp rc=${PIPESTATUS[0]} in $((SECONDS - t0))s" | tee -a "$LOG"
done
python3 scripts/gpu_finetune.py --collect --out "$OUT" | tee -a "$LOG"
