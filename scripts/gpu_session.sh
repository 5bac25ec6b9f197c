#!/usr/bin/env bash
# One device call, several steps (STEPS="diag host colprof collector tests gpu1 gpu2 gap overlap dxonly normbench actbench bench mprofile profile finetune"); every output is packed
# into $OUT/results.tgz, the only file left there (the device returns few files). Carry .whl/ (kneed) along: the image lacks it.
set -u
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR="$PWD/.triton_cache"
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
nvidia-smi -L | tee $OUT/env.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/env.txt
for s in ${STEPS:-diag tests}; do
  echo "=== $s $(date +%T)"
  case $s in
    diag) ( timeout ${DIAG_LIMIT:-300} python3 scripts/gpu_diag.py $OUT/diag.json ) > $OUT/diag.txt 2>&1
          grep -v "^ *{" $OUT/diag.txt | head -80
          for f in $(find .triton_cache -name "_dw_kernel.ptx" -o -name "_dx_kernel.ptx"); do
            echo "$(basename $f) wgmma=$(grep -c wgmma $f) cp.async=$(grep -c 'cp.async' $f)"; done | sort | uniq -c ;;
    collector) ( timeout 150 python3 scripts/collector_profile.py; timeout 300 python3 scripts/collector_overhead.py \
                 --models minilm,bert-base,smollm2 --rounds 5 --output $OUT/collector_fp32.json;
                 timeout 300 python3 scripts/collector_overhead.py --models minilm,bert-base,smollm2 --rounds 5 --bf16 \
                 --output $OUT/collector_bf16.json ) > $OUT/collector.txt 2>&1; grep -v "^ " $OUT/collector.txt | head -40 ;;
    host) ( timeout 200 python3 scripts/host_cost.py ) > $OUT/host.txt 2>&1; cat $OUT/host.txt | head -120 ;;
    flags) ( timeout 240 python3 scripts/flags_sweep.py $OUT/flags_sweep.json ) > $OUT/flags.txt 2>&1; tail -14 $OUT/flags.txt ;;
    colprof) ( timeout 150 python3 scripts/collector_profile.py ) > $OUT/colprof.txt 2>&1; head -40 $OUT/colprof.txt ;;
    tests) ( timeout ${TEST_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_gpu.py \
             ${EXTRA_TESTS:-} ) > $OUT/tests.txt 2>&1; tail -15 $OUT/tests.txt ;;
    # every GPU-marked test, in two halves that each fit one device call (the whole suite took over 380 s):
    # gpu1 = tests/kernels, gpu2 = the rest
    gpu1|gpu2) [ $s = gpu1 ] && dirs="tests/kernels" || dirs="tests/cli tests/convergence tests/probe"
          ( timeout ${TEST_LIMIT:-480} python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short -W ignore \
            -m gpu $dirs ) > $OUT/$s.txt 2>&1; grep -A8 "^E   " $OUT/$s.txt | head -40; tail -3 $OUT/$s.txt ;;
    bench) for m in ${LAYER_SETS:-bert-base llama-3.2-3b}; do
             ( timeout ${LAYERS_LIMIT:-200} python3 -m sebp_probe.cli bench $m --repeats ${REPEATS:-20} \
               -o $OUT/layers_$m.json ) > $OUT/bench_layers_$m.txt 2>&1; tail -30 $OUT/bench_layers_$m.txt; done
           for m in ${MODEL_SETS:-bert-base llama-3.2-3b}; do
             ( timeout ${MODEL_LIMIT:-200} python3 -m sebp_probe.cli bench $m --scope model --graphs --breakdown \
               -o $OUT/model_$m.json ) > $OUT/bench_model_$m.txt 2>&1; tail -28 $OUT/bench_model_$m.txt; done
           for m in ${NORM_SETS:-}; do
             ( timeout ${MODEL_LIMIT:-200} python3 -m sebp_probe.cli bench $m --scope model --graphs --breakdown \
               --norms -o $OUT/model_${m}_norms.json ) > $OUT/bench_model_${m}_norms.txt 2>&1
             tail -28 $OUT/bench_model_${m}_norms.txt; done
           for m in ${ACT_SETS:-}; do
             ( timeout ${MODEL_LIMIT:-200} python3 -m sebp_probe.cli bench $m --scope model --graphs --breakdown \
               --norms --acts -o $OUT/model_${m}_norms_acts.json ) > $OUT/bench_model_${m}_norms_acts.txt 2>&1
             tail -28 $OUT/bench_model_${m}_norms_acts.txt; done
           for m in ${CAUSAL_NORM_SETS:-}; do
             ( timeout ${MODEL_LIMIT:-200} python3 -m sebp_probe.cli bench $m --scope model --graphs --breakdown \
               --norms --no-pad-mask -o $OUT/model_${m}_causal_norms.json ) > $OUT/bench_model_${m}_causal_norms.txt 2>&1
             tail -28 $OUT/bench_model_${m}_causal_norms.txt; done
           for m in ${CAUSAL_SETS:-}; do
             ( timeout ${MODEL_LIMIT:-200} python3 -m sebp_probe.cli bench $m --scope model --graphs --breakdown \
               --no-pad-mask -o $OUT/model_${m}_causal.json ) > $OUT/bench_model_${m}_causal.txt 2>&1
             tail -28 $OUT/bench_model_${m}_causal.txt; done ;;
    normbench) ( timeout 200 python3 scripts/norm_bench.py $OUT/norm_bench.json;
                 [ "${NORM_SWEEP:-1}" = 1 ] && timeout 200 python3 scripts/norm_sweep.py $OUT/norm_sweep.json ) \
                 > $OUT/norm_bench.txt 2>&1
               grep -v Warn $OUT/norm_bench.txt | tail -14 ;;
    gap) ( timeout ${GAP_LIMIT:-240} python3 scripts/dense_gap.py $OUT/dense_gap.json ${GAP_DENSITIES:-1.0,0.5} ) \
           > $OUT/gap.txt 2>&1; tail -30 $OUT/gap.txt ;;
    actbench) ( timeout 200 python3 scripts/act_bench.py $OUT/act_bench.json ) > $OUT/act_bench.txt 2>&1
              tail -12 $OUT/act_bench.txt ;;
    overlap) ( timeout 240 python3 scripts/overlap_probe.py $OUT/overlap.json ) > $OUT/overlap.txt 2>&1
             tail -25 $OUT/overlap.txt ;;
    dxonly) ( timeout 200 python3 scripts/dx_only_splits.py $OUT/dx_only.json ) > $OUT/dx_only.txt 2>&1
            tail -25 $OUT/dx_only.txt ;;
    mprofile) ( timeout ${MPROF_LIMIT:-300} python3 scripts/model_profile.py $OUT/model_profile.json ) \
                > $OUT/mprofile.txt 2>&1; cat $OUT/mprofile.txt | grep -v Warn | head -150 ;;
    profile) ( timeout 120 python3 scripts/profile_backward.py ) > $OUT/profile.txt 2>&1; tail -60 $OUT/profile.txt ;;
    finetune) ( OUT=$OUT/ft timeout ${FT_LIMIT:-400} bash scripts/gpu_finetune.sh ) > $OUT/finetune.txt 2>&1
              tail -40 $OUT/finetune.txt ;;
  esac
done
cd $OUT && tar czf /tmp/results.tgz . && rm -rf $OUT/* && mv /tmp/results.tgz $OUT/ && ls -la $OUT
