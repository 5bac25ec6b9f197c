#!/usr/bin/env bash
# A/B of the fine-tuning loop on one device machine: an older sebp_probe/finetune.py against the working tree's,
# interleaved per experiment of scripts/gpu_finetune.py (dense vs SEBP in each), on the same GPU.
#   git show fc69dcc:sebp_probe/finetune.py > old_finetune.py      (here; the device gets the working tree)
#   OLD_FINETUNE=old_finetune.py EXPS="bert_bf16_max_norms_acts_compiled" bash scripts/finetune_ab.sh
# Results: $OUT/ab.tgz with old/ and new/ (each as scripts/gpu_finetune.sh writes it); the table is printed.
# Carry .whl/ (kneed, peft) along: the device image lacks them.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r scripts sebp_probe sebp_kernels /tmp/old/
cp "${OLD_FINETUNE:?path of the older finetune.py}" /tmp/old/sebp_probe/finetune.py
R=/tmp/ab; rm -rf $R; mkdir -p $R/old $R/new
for e in $EXPS; do
  (cd /tmp/old && OUT=$R/old EXPS=$e LIMIT=${LIMIT:-200} bash scripts/gpu_finetune.sh 2>&1 | grep "speedup\|rc=")
  (OUT=$R/new EXPS=$e LIMIT=${LIMIT:-200} bash scripts/gpu_finetune.sh 2>&1 | grep "speedup\|rc=")
done
for v in old new; do python3 scripts/gpu_finetune.py --collect --out $R/$v > /dev/null; done
python3 - <<'PY'
import json
for v in ("old", "new"):
    for r in json.load(open(f"/tmp/ab/{v}/finetune_gpu.json")):
        if "dense_step_ms" in r:
            print(v, r["experiment"], "backward ms dense %.2f sebp %.2f, step ms dense %.2f sebp %.2f, step x%.3f"
                  % (r["dense_backward_ms"], r["sebp_backward_ms"], r["dense_step_ms"], r["sebp_step_ms"],
                     r["speedup_step"]))
PY
cd $R && tar czf "$OUT/ab.tgz" .
