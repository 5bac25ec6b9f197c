# The kept-rows A/B of 2026-11-27 as run on the device machine (from the repository root, wheels in .whl/,
# OUT set by the machine): sebp-probe bench with KEPT_ROWS_LAST_LAYER set before the CLI starts.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=$PWD/.triton_cache TORCHINDUCTOR_CACHE_DIR=$PWD/.inductor-cache PYTHONUNBUFFERED=1
mkdir -p $OUT/k; nvidia-smi -L > $OUT/k/env.txt
run() {  # case kept(True/False) tag
  echo "=== $1 kept=$2 $(date +%T)"
  timeout 150 python3 -c "import sys; import sebp_probe.model.losses as L; L.KEPT_ROWS_LAST_LAYER = $2; from sebp_probe.cli import app; sys.argv[0] = 'sebp-probe'; app()" bench $1 --scope model --compile default --compile-scope layers --layouts packed --methods dense:labelled,cce:labelled --model-batches 6 -o $OUT/k/$3.json > $OUT/k/$3.log 2>&1
  grep -E "ms a step|, all:" $OUT/k/$3.log | cut -c1-220
}
run qwen2.5-0.5b-sft True qwen_kept
run qwen2.5-0.5b-sft False qwen_nokept
run llama-3.2-1b-sft False llama_nokept
run llama-3.2-1b-sft True llama_kept
