# H100, 2026-11-28, one call on one machine: the compiled SEBP entries of llama-3.2-1b-sft `longest`, run with
# this tree (new: d2b853d, SEBP_TRITON_OP unset), then d78623b's sebp_kernels and sebp_probe
# (old, from `git archive d78623b sebp_kernels sebp_probe` into _old/), then this tree again.
for v in new old new; do d=$PWD; [ $v = old ] && d=$PWD/_old
  (cd $d && PYTHONPATH=$d:/tmp/site timeout 170 python3 -m sebp_probe bench llama-3.2-1b-sft --scope model \
     --compile default --layouts longest --methods sebp --model-batches 6 -o $OUT/sebp_${v}_$(date +%s).json); done
# A second call on a fresh machine (old, then new, `timeout 140` each) ran out of the session's device time:
# sebp_old_cut_*.json holds what the old run measured before its limit (no compiled labelled-head entry; full
# head compiled 104.27 ms, against 107.94 in the first call).
