#!/usr/bin/env bash
# scripts/ddp_memory.py over several orders of dense and SEBP runs on 2 GPUs (torchrun); output in $OUT/ddp_memory.txt.
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR="$PWD/.triton_cache"
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L
for args in ${DDP_ARGS:-"--model bert --norms --order dense,sebp"}; do
  timeout 150 python3 -m torch.distributed.run --nproc_per_node 2 scripts/ddp_memory.py ${args//_/ } 2>&1 \
    | grep -v -i warn | grep -v "^\*\|OMP_NUM" | tee -a $OUT/ddp_memory.txt | tail -22
done
