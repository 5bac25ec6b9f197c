#!/usr/bin/env bash
# The forward over real-token rows on one GPU (results/fwd_rows_h100/): its GPU tests, then the compiled bench
# entries of `longest` (dense and SEBP, eager, CUDA graphs, compiled, compiled + graphs) for bert-base and
# llama-3.2-1b-sft with it on, and bert-base with it off (SEBP_FORWARD_ROWS=0) in the same call. Run from the
# repository root on a CUDA machine: OUT=/tmp/out bash benchmarks/fwd_rows_session.sh
# STEPS narrows it (tests bert llama bert_off llama_off); everything ends up in $OUT/layouts_compiled.tar.gz.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/layouts_compiled"
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
one() {  # model tag [env...]: one compiled bench of `longest`, dense and SEBP, through compile_session.sh
  local step=$1 tag=$2
  shift 2
  env "$@" STEPS=$step LAYOUTS=longest METHODS=dense,sebp BATCHES=6 TAG=$tag LIMIT=${LIMIT:-240} OUT="$OUT" \
    bash benchmarks/compile_session.sh
}
for s in ${STEPS:-tests bert llama bert_off}; do
  echo "=== $s $(date +%T)"
  case $s in
    tests) timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_forward_rows.py \
             tests/kernels/test_pad_rows.py "tests/probe/test_graphs_gpu.py::test_padding_auto_times_compiled_candidates_as_the_replays_the_run_takes" \
             2>&1 | tail -25 | tee "$OUT/layouts_compiled/gpu_tests.txt" ;;
    bert) one bert _fwdrows ;;
    llama) one llama _fwdrows ;;
    bert_off) one bert _fwdoff SEBP_FORWARD_ROWS=0 ;;
    llama_off) one llama _fwdoff SEBP_FORWARD_ROWS=0 ;;
    *) echo "unknown step $s" ;;
  esac
done
