#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md. Run from the repository root on a CUDA machine:
#
#   STEPS="bert head resprop" OUT=/tmp/out bash benchmarks/gpu_session.sh
#
# Steps: smoke (tiny whole-model bench with graphs and breakdown: the CUDA paths in a minute); bert, llama,
# qwen (the whole-model bench of that case, one JSON and one figure); llama-fused, bert-fused, qwen-fused (the
# same with SEBP norms and activations; mistral-fused too); bert-linears, llama-linears, bert-norms, bert-select (SEBP on the
# linears only; BERT-base with the norms; with norms and activations but rows selected, not taken from the
# mask); head (benchmarks/head_bench.py); head-qwen (the Qwen shape at several chunk sizes); resprop
# (benchmarks/resprop_bench.py); resprop-profile (one level, with a kernel breakdown); breakdown (Llama SFT
# eager, GPU kernel time by kind, with and without the padding mask); breakdown-bert (BERT-base, SEBP with
# norms and activations); gpu-pad (the padding-rows and tile tests); op-overhead (benchmarks/op_overhead.py);
# triton-op (its GPU tests, then op_overhead.py --triton-op: the backward as a triton_op against the library
# operator); triton-op-model (Llama-3.2-1B `longest` compiled, dense and SEBP with the labelled head, with
# SEBP_TRITON_OP=1 and without, in the order 1 0 0 1, through compile_session.sh); small-batches (where compiled
# SEBP loses on Llama `longest`'s smaller batches: each batch's step without a profiler, the host time of the
# eager SEBP linear backwards, plainly and under cProfile, then a step profile); fwd-rows-model (the SEBP entry with
# SEBP_FORWARD_ROWS=0 and 1); fwd-rows (benchmarks/fwd_rows_probe.py: the forward over real rows against
# cuBLAS per layer shape, rows and share of real rows); cce-tests (the GPU tests of `--head cce`); cce (Llama and Qwen,
# CCE_CASES, packed and `longest`, compiled, dense and SEBP with the labelled-rows head against dense + CCE: the auto pick
# counts the CCE head); qwen-layers (the per-layer bench on Qwen2.5-0.5B's shapes: where its narrow projections
# lose with SEBP); gpu1 / gpu2 (every GPU-marked
# test: tests/kernels, then the rest). The packages
# the bench compares against and the ones the package needs beyond torch/transformers (liger-kernel,
# cut-cross-entropy, kneed, peft) are installed from wheels in .whl/ when that folder exists. More than 8 files
# under $OUT at the end (what the device returns) go back as $OUT/session.tgz.
set -u
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"  # kept across the calls of one warm machine
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site/kneed ]; then  # once a machine (two sessions at once would race)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
nvidia-smi -L | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$OUT/env.txt"
bench() {  # case, then extra options; TAG: a suffix of the output names (then no figure)
  local case=$1; shift
  local fig=(--figure "$OUT/model_$case.png")
  [ -n "${TAG:-}" ] && fig=()
  python3 -m sebp_probe bench "$case" --scope model --graphs -o "$OUT/model_$case${TAG:-}.json" "${fig[@]}" \
    "$@" 2>&1 | tail -60
}
for s in ${STEPS:-smoke}; do
  echo "=== $s $(date +%T)"
  case $s in
    smoke) python3 -m sebp_probe bench llama-3.2-1b-sft --scope model --tiny --graphs --breakdown -o "$OUT/tiny.json" \
             2>&1 | tail -40 ;;
    bert) bench bert-base ;;
    llama) bench llama-3.2-1b-sft ;;
    llama-fused) bench llama-3.2-1b-sft --norms --acts ;;  # SEBP on the norms and activations too
    bert-fused) bench bert-base --norms --acts ;;
    bert-linears) TAG=_linears bench bert-base ;;  # SEBP on the linears alone (bert-base: the docs' main run)
    llama-linears) TAG=_linears bench llama-3.2-1b-sft ;;
    bert-norms) TAG=_norms bench bert-base --norms ;;
    bert-select) TAG=_select bench bert-base --norms --acts --no-pad-rows ;;
    gpu-pad) python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short -W ignore -m gpu \
        tests/kernels/test_pad_rows.py tests/kernels/test_triton_gpu.py -k "pad or few_rows or fall_back" 2>&1 | tail -15 ;;
    qwen-fused) bench qwen2.5-0.5b-sft --norms --acts ;;
    mistral-fused) bench mistral-1b-sft --norms --acts ;;
    qwen) bench qwen2.5-0.5b-sft ;;
    breakdown) for m in pad-mask no-pad-mask; do  # where the backward's time goes, eager, 2 batches a layout
        python3 -m sebp_probe bench llama-3.2-1b-sft --scope model --breakdown --$m --model-batches 2 --model-repeats 2 \
          -o "$OUT/breakdown_$m.json" 2>&1 | tail -45; done ;;
    breakdown-bert) python3 -m sebp_probe bench bert-base --scope model --breakdown --norms --acts --model-batches 2 \
        --model-repeats 2 -o "$OUT/breakdown_bert.json" 2>&1 | tail -40 ;;
    head) python3 benchmarks/head_bench.py --sebp --extra-chunks 832 1408 --out "$OUT/head.json" 2>&1 | grep -v Warning | tail -40 ;;
    resprop) python3 benchmarks/resprop_bench.py --output "$OUT/resprop.json" 2>&1 | grep -v Warning | tail -20 ;;
    resprop-profile) python3 benchmarks/resprop_bench.py --levels 0.9 --repeats 4 --breakdown \
                       --output "$OUT/resprop_profile.json" 2>&1 | grep -v Warning | tail -20 ;;
    head-qwen) python3 benchmarks/head_bench.py --shapes qwen2.5-0.5b --extra-chunks 1024 704 512 --repeats 30 \
                 --out "$OUT/head_qwen.json" 2>&1 | grep -v Warning | tail -30 ;;
    op-overhead) python3 benchmarks/op_overhead.py "$OUT/op_overhead.json" 2>&1 | tail -30 ;;
    triton-op) python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_traced_lowering.py tests/kernels/test_traced_grads.py 2>&1 | tail -5
      python3 benchmarks/op_overhead.py --triton-op "$OUT/op_triton.json" 2>&1 | tail -30 ;;
    triton-op-model) i=0; for op in 1 0 0 1; do i=$((i + 1))
        SEBP_TRITON_OP=$op STEPS=llama LAYOUTS=longest METHODS=dense:labelled,sebp:labelled BATCHES=6 GRAPHS=0 \
          TAG=_tt${op}_$i LIMIT=150 OUT="$OUT" bash benchmarks/compile_session.sh | grep -E "compiled \(" ; done ;;
    fwd-rows) (cd benchmarks && python3 fwd_rows_probe.py "$OUT/fwd_rows_probe.json" 2>&1 | tail -30) ;;
    small-batches) python3 benchmarks/step_profile.py --case llama-3.2-1b-sft --layout longest \
        --entries sebp:labelled,dense:labelled --compile --host-calls --out-dir "$OUT/prof" 2>&1 | grep -v Warning | tail -24 ;;
    fwd-rows-model) for fr in 0 1; do SEBP_FORWARD_ROWS=$fr STEPS=llama LAYOUTS=longest METHODS=sebp:labelled BATCHES=6 GRAPHS=0 \
          TAG=_fr$fr LIMIT=150 OUT="$OUT" bash benchmarks/compile_session.sh | grep -E "compiled \(" ; done ;;
    cce-tests) python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short -W ignore -m gpu tests/probe/test_cce_head.py \
           > "$OUT/cce_tests.txt" 2>&1; tail -3 "$OUT/cce_tests.txt" ;;
    cce) for c in ${CCE_CASES:-llama-3.2-1b-sft qwen2.5-0.5b-sft}; do  # the auto pick now counts the CCE head (finetune --head cce)
        python3 -m sebp_probe bench "$c" --scope model --compile default --layouts packed,longest \
          --methods dense:labelled,cce:labelled,sebp:labelled --model-batches 6 -o "$OUT/model_${c}_cce.json" 2>&1 \
          | tee "$OUT/log_cce_$c.txt" | grep -E "compiled \(|would pick|rror" ; done ;;
    qwen-layers) python3 -m sebp_probe bench qwen2.5-0.5b -o "$OUT/layers_qwen2.5-0.5b.json" 2>&1 | tail -30 ;;
    gpu1|gpu2) [ "$s" = gpu1 ] && dirs="tests/kernels" || dirs="tests/cli tests/convergence tests/probe"
      python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short -W ignore -m gpu $dirs > "$OUT/$s.txt" 2>&1
      grep -B2 -A12 "^E  " "$OUT/$s.txt" | head -80; tail -3 "$OUT/$s.txt" ;;
    *) echo "unknown step $s" ;;
  esac
done
# the device returns 8 files at most: past that, everything under $OUT goes back as one archive
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/session.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/session.tgz "$OUT/"
fi
