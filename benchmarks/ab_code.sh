#!/usr/bin/env bash
# One bench entry timed with the code of several commits, in one call on one machine: to find which change
# moved a figure (results/layouts_compiled_h100/raw/session34_head_vs_d78623b/ ran it by hand).
#
#   COMMITS="d78623b 1eeaa31 e418901 0d1927a" bash benchmarks/ab_code.sh prep   # here: each commit's packages
#   bash benchmarks/ab_code.sh run                                             # on the device, OUT set
#
# prep writes each commit's sebp_kernels/ and sebp_probe/ (git archive) under _ab/<commit>/, untracked, so the
# device's copy of the working tree carries them; run times the bench below with each, in the order given and
# then reversed (both orders), one JSON per run in $OUT/ab/. An entry COMMIT+NAME=VALUE runs that commit's code
# with the variable set (COMMITS="d78623b 46ccc3d 46ccc3d+SEBP_TRITON_OP=1": one switch against the old code).
# REVERSE=0 runs the order as given, once (repeat an entry in COMMITS to interleave); ORDER (entries prepared)
# overrides COMMITS' order in run, so two runs in one call can take different orders. BENCH overrides the
# bench's arguments; LIMIT (seconds) stops each run. Delete _ab/ afterwards.
set -u
BENCH=${BENCH:-"llama-3.2-1b-sft --scope model --compile default --layouts longest --methods sebp:labelled --model-batches 6"}
case ${1:-} in
  prep)
    for e in ${COMMITS:?list the commits}; do
      c=${e%%+*}
      [ -d "_ab/$c" ] || { mkdir -p "_ab/$c" && git archive "$c" sebp_kernels sebp_probe | tar -x -C "_ab/$c"; }
    done
    echo "$COMMITS" > _ab/ORDER
    cat _ab/ORDER ;;
  run)
    OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT/ab"
    export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton}"
    export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.inductor-cache}"
    if [ -d .whl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
    fi
    order=${ORDER:-$(cat _ab/ORDER)}
    [ "${REVERSE:-1}" = 1 ] && order="$order $(echo $order | tr ' ' '\n' | tac)"
    for e in $order; do
      c=${e%%+*} var=()
      [ "$c" != "$e" ] && var=("${e#*+}")
      echo "=== $e $(date +%T)"
      # shellcheck disable=SC2086 - BENCH is a word list
      (cd "_ab/$c" && env "${var[@]}" PYTHONPATH="$PWD:/tmp/site" ${LIMIT:+timeout "$LIMIT"} python3 -m sebp_probe \
         bench $BENCH -o "$OUT/ab/${e//[+=]/_}_$(date +%s).json" 2>&1 | grep -E "compiled \(|Error")
    done ;;
  *) echo "usage: COMMITS=\"...\" $0 prep | $0 run" >&2; exit 2 ;;
esac
