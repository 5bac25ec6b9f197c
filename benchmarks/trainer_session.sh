#!/usr/bin/env bash
# TRL SFTTrainer steps per second on a GPU (benchmarks/trainer_bench.py on llama-3.2-1b-sft lengths), plain and
# with apply_sebp, eager and with torch_compile=True, beside use_liger_kernel=True. Run from the repository root:
#
#   STEPS="smoke eager" OUT=/tmp/out bash benchmarks/trainer_session.sh ; then STEPS="compile" ...; STEPS="liger"
#
# Steps (each variant in its own process; one step fits a 10-minute call):
#   smoke    the tiny case, every variant, 2 timed steps (the CUDA, compile and Liger paths in a minute)
#   eager    plain, sebp                      (padded batches, as SFTTrainer pads by default)
#   compile  plain+compile, sebp+compile      (torch_compile=True)
#   liger    liger, liger+compile             (use_liger_kernel=True)
#   pf       plain, sebp with TRL's padding-free batches
#   diag     plain, sebp, sebp-head, sebp-layers, each profiled over its last 2 warm-up steps (operator
#            tables beside the JSON): where the integration's step time goes
#   liger1   liger alone (eager)
#   cudnn    plain and Liger with and without cuDNN's attention in sdpa (the -nocudnn variants), apply_sebp
#            (which leaves cuDNN's attention out) and apply_sebp keeping it, Liger with apply_sebp
#   final    the table's eager rows: plain and Liger with and without cuDNN's attention, apply_sebp, both
#   rounds   the eager rows without cuDNN's attention, twice, the second round in reverse order
#   cce      apply_sebp(head="cce") eager and compiled, beside plain+compile without cuDNN's attention and SEBP
#            with the labelled-rows loss (each compiled variant its own process)
#   csmoke   the tiny case, the torch_compile=True variants, 2 timed steps
#   compiled the torch_compile=True rows, 10 timed steps after 4, each variant its own bench and JSON
#            (VARIANTS: a comma-separated subset, to spread them over calls), Dynamo's recompile reasons in
#            its log (TORCH_LOGS, default recompiles); merge the JSONs with trainer_bench.py --merge
# Packages: the image lacks trl, datasets, dill, multiprocess and liger-kernel; their wheels (py3.12,
# manylinux x86_64) come in the folder $WHL (default .whl-trl/, git-ignored). A wheel whose distribution the
# image already has in a version that fits (pyarrow >= 24, xxhash, fsspec <= 2026.9.0: datasets 5.2's needs)
# is left out, so pyarrow's large wheel need only travel where the image's is older.
# Fill the folder (about 3 MiB, with pyarrow about 56 MiB) where pip reaches the index:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform any -d .whl-trl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
#     liger-kernel==0.8.5 xxhash==4.1.0 fsspec==2026.9.0 pyarrow==26.0.1
# LIMIT: seconds a bench may run (its JSON is lost when it is cut).
# BENCH_ARGS: options added to every bench (e.g. "--batch 4" or "--checkpointing" where the plain trainer's
# logits do not fit), TAG: a suffix of the output names (set it with BENCH_ARGS).
# Every step's JSON and log, the environment and the commands go into $OUT/trainer_raw.tgz (the whole of
# /tmp/trainer_raw: on a machine kept warm, earlier calls' steps too).
set -u
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton}"
OUT=${OUT:-/tmp/out}
WHL=${WHL:-.whl-trl}
RAW=/tmp/trainer_raw
TAG=${TAG:-}
mkdir -p "$OUT" "$RAW"
needs() {  # distribution [min] [max]: true where the image (or /tmp/site) lacks it or has a version outside
  python3 - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

name, lo, hi = (sys.argv[1:] + ["", ""])[:3]
try:
    v = Version(version(name))
except PackageNotFoundError:
    sys.exit(0)
sys.exit(0 if (lo and v < Version(lo)) or (hi and v > Version(hi)) else 1)
EOF
}
if [ -d "$WHL" ]; then
  wheels=()
  for spec in "trl 1.16" "datasets 5.2" "dill 0.4.1 0.4.1" "multiprocess 0.70.11 0.70.19" "liger_kernel" \
              "pyarrow 24" "xxhash" "fsspec 2023.1.0 2026.9.0"; do
    set -- $spec
    if needs "$@"; then
      w=$(ls "$WHL"/"$1"-*.whl 2>/dev/null | head -1)
      [ -n "$w" ] && wheels+=("$w") || echo "missing: $1 (${2:-any}..${3:-}) and no wheel for it in $WHL"
    fi
  done
  if [ ${#wheels[@]} -gt 0 ]; then
    echo "installing into /tmp/site: ${wheels[*]##*/}" | tee -a "$RAW/env.txt"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "${wheels[@]}" >/dev/null 2>&1 || echo "pip install failed: ${wheels[*]}"
  fi
fi
{ nvidia-smi -L; python3 -c "import torch, triton, transformers, accelerate, trl, datasets, pyarrow
print(*(f'{m.__name__} {m.__version__}' for m in (torch, triton, transformers, accelerate, trl, datasets, pyarrow)))"
} 2>&1 | tee -a "$RAW/env.txt"
bench() {  # name, then trainer_bench options
  local name=$1; shift
  local cmd=(python3 benchmarks/trainer_bench.py --out "$RAW/trainer_$name$TAG.json" "$@" ${BENCH_ARGS:-})
  echo "=== $name $(date +%T): ${cmd[*]}" | tee -a "$RAW/commands.txt"
  ${LIMIT:+timeout "$LIMIT"} "${cmd[@]}" > "$RAW/trainer_$name$TAG.log" 2>&1
  echo "rc=$?"; grep -E "steps/s|error|x$" "$RAW/trainer_$name$TAG.log" | tail -12
}
for s in ${STEPS:-smoke}; do
  case $s in
    smoke) bench smoke --tiny --steps 2 --warmup 1 ;;
    eager) bench eager --variants plain,sebp ;;
    compile) bench compile --variants plain+compile,sebp+compile ;;
    liger) bench liger --variants liger,liger+compile ;;
    pf) bench pf --padding-free --variants plain,sebp ;;
    diag) bench diag --variants plain,sebp,sebp-head,sebp-layers --profile 2 ;;
    liger1) bench liger1 --variants liger ;;
    cudnn) bench cudnn --variants plain,plain-nocudnn,sebp,sebp-cudnn,liger,liger-nocudnn,liger+sebp ;;
    final) bench final --variants plain,plain-nocudnn,sebp,liger,liger-nocudnn,liger+sebp ;;
    rounds) bench rounds --variants plain-nocudnn,sebp,liger-nocudnn,liger+sebp --rounds 2 ;;
    cce) bench cce --variants sebp,sebp-cce,plain+compile-nocudnn,sebp+compile,sebp-cce+compile ;;
    csmoke) bench csmoke --tiny --steps 2 --warmup 1 \
              --variants plain+compile,liger+compile,sebp+compile,liger+sebp+compile ;;
    compiled)
      for v in $(echo "${VARIANTS:-plain+compile,liger+compile,liger+compile-nocudnn,sebp+compile,liger+sebp+compile}" \
                 | tr , ' '); do
        TORCH_LOGS=${TORCH_LOGS:-recompiles} bench "compiled_${v//+/_}" --variants "$v" --steps 10 --warmup 4 \
          --in-process  # one variant a process anyway; Dynamo's recompile reasons go into its log
      done ;;
    *) echo "unknown step $s" ;;
  esac
done
tar czf "$OUT/trainer_raw.tgz" -C "$RAW" .
