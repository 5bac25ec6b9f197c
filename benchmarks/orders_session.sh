#!/usr/bin/env bash
# One case and layout of the compiled whole-model bench, each entry in a process of its own, in the order given:
# dense and SEBP (or one setting and another) alternated A B B A on the same batches, so that a slow spell of the
# machine falls on both. From the repository root on a CUDA machine:
#
#   CASE=qwen2.5-0.5b-sft LAYOUT=longest RUNS="dense:labelled sebp:labelled sebp:labelled@SEBP_NARROW_OUT=0 \
#     sebp:labelled@SEBP_NARROW_OUT=0 sebp:labelled dense:labelled" OUT=/tmp/out bash benchmarks/orders_session.sh
#
# RUNS: entries `method:head`, each optionally followed by @VAR=value[,VAR=value] set for that run alone (an A/B
# switch: SEBP_FORWARD_ROWS, SEBP_TRITON_OP). BATCHES: --model-batches (8); GRAPHS=1: --graphs (the compiled
# layers replayed as CUDA graphs too); ARGS: more bench options for every run (--norms --acts); TAG: a prefix of
# the file names. Each run writes $OUT/$TAG<case>_<layout>_<n>.json and its log (with TORCH_LOGS=recompiles: each
# recompile and the guard that failed). Inductor's cache stays in the tree for the calls of one warm machine;
# more than 8 files under $OUT go back as one archive, $OUT/orders.tgz.
set -u
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site/kneed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
nvidia-smi -L > "$OUT/${TAG:-}env.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  >> "$OUT/${TAG:-}env.txt"
n=0
for run in $RUNS; do
  n=$((n + 1))
  entry=${run%%@*}
  envs=()
  [ "$entry" != "$run" ] && IFS=, read -r -a envs <<< "${run#*@}"
  name="$OUT/${TAG:-}${CASE}_${LAYOUT}_$n"
  read -r -a extra <<< "${ARGS:-}"
  [ "${GRAPHS:-0}" = 1 ] && extra+=(--graphs)
  echo "$run: env ${envs[*]:-} python3 -m sebp_probe bench $CASE --scope model --compile default --layouts $LAYOUT" \
    "--methods $entry --model-batches ${BATCHES:-8} ${extra[*]:-} -o $(basename "$name").json" >> "$OUT/${TAG:-}commands.txt"
  env "${envs[@]}" TORCH_LOGS=recompiles python3 -m sebp_probe bench "$CASE" --scope model --compile default \
    --layouts "$LAYOUT" --methods "$entry" --model-batches "${BATCHES:-8}" "${extra[@]}" -o "$name.json" > "$name.log" 2>&1
  echo "$(date +%T) $run: $(grep -E "compiled \(|Error" "$name.log" | tail -2)"
done
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/orders.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/orders.tgz "$OUT/"
fi
