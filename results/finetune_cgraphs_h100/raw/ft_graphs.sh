python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=$PWD/.triton_cache TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONUNBUFFERED=1
mkdir -p $OUT/ft; nvidia-smi -L > $OUT/ft/env.txt
t0=$SECONDS; python3 benchmarks/fsdp_model.py .cache/gpu/tokenizer .cache/gpu/llama_1b 1b 2>&1 | tail -1; echo "model $((SECONDS-t0)) s"
COMMON=(.cache/gpu/llama_1b .cache/gpu/sft_long.jsonl --bf16 --max-length 2048 --batch-size 8 --padding max_length --method sebp --max-steps 24 --eval-samples 8 --seed 0 --json --cuda-graphs)
for v in graphs cgraphs; do
  extra=(); [ $v = cgraphs ] && extra=(--compile default)
  echo "python3 -m sebp_probe finetune ${COMMON[*]} ${extra[*]} -o RUN/$v" >> $OUT/ft/commands.txt
  t0=$SECONDS; timeout 220 python3 -m sebp_probe finetune "${COMMON[@]}" "${extra[@]}" -o /tmp/ftr/$v --overwrite > $OUT/ft/$v.log 2>&1; echo "$v rc=$? $((SECONDS-t0)) s"
  mkdir -p $OUT/ft/$v; cp /tmp/ftr/$v/summary.json /tmp/ftr/$v/metrics.jsonl /tmp/ftr/$v/run_config.json $OUT/ft/$v/ 2>/dev/null
  python3 -c "import json; s=json.load(open('/tmp/ftr/$v/summary.json')); print(json.dumps(s)[:700])" 2>&1 | tail -1
done
