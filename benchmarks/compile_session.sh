#!/usr/bin/env bash
# The compiled whole-model bench behind docs/benchmarks.md's compiled rows (results/layouts_compiled_h100/).
# Run from the repository root on a CUDA machine:
#
#   OUT=/tmp/out bash benchmarks/compile_session.sh                     # every step below
#   STEPS="qwen bert" LAYOUTS=packed,longest OUT=/tmp/out bash benchmarks/compile_session.sh
#   STEPS=llama LAYOUTS=packed METHODS=dense,cce SCOPE=layers TAG=_layers OUT=/tmp/out bash benchmarks/compile_session.sh
#
# Steps: llama (llama-3.2-1b-sft), qwen (qwen2.5-0.5b-sft), bert (bert-base): `sebp-probe bench --scope model
# --compile default --graphs`, every layout x method x head eager, as CUDA graphs and compiled (dense, SEBP on
# the linears, Liger-Kernel and Cut-Cross-Entropy where they run), one JSON each. LAYOUTS and METHODS (comma
# lists) narrow the entries when device time is short: each compile of a 1B model can take minutes, and every
# entry of a layout compiles once. SCOPE (step or layers: --compile-scope), BATCHES (--model-batches) and GRAPHS
# (0 leaves out the CUDA-graph entries) narrow it further; TAG is a suffix of the JSON and log names, so calls on
# one warm machine keep each other's files; LIMIT (seconds) stops a bench in time for the archive (its JSON
# keeps what it measured). Inductor's cache (TORCHINDUCTOR_CACHE_DIR) lives inside the working tree, so
# a second session on the same warm machine finds the graphs compiled (the rows' compile_s then says so). The
# packages the bench compares against (liger-kernel, cut-cross-entropy) and the ones the package needs beyond
# torch/transformers are installed from wheels in .whl/ when that folder exists. Everything ends up in one
# file, $OUT/layouts_compiled.tar.gz (JSONs, logs, environment), to unpack into results/layouts_compiled_h100/.
set -u
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.inductor-cache}"
OUT=${OUT:-/tmp/out}
RUN="$OUT/layouts_compiled"
mkdir -p "$RUN"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
nvidia-smi -L | tee "$RUN/env.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$RUN/env.txt"
select=()
[ -n "${LAYOUTS:-}" ] && select+=(--layouts "$LAYOUTS")
[ -n "${METHODS:-}" ] && select+=(--methods "$METHODS")
[ -n "${SCOPE:-}" ] && select+=(--compile-scope "$SCOPE")
[ -n "${BATCHES:-}" ] && select+=(--model-batches "$BATCHES")
[ "${GRAPHS:-1}" = 1 ] && select+=(--graphs)
bench() {  # case: one JSON and its log; the compile lines (seconds, recompiles) print as each entry compiles
  local name="model_$1${TAG:-}"
  echo "python3 -m sebp_probe bench $1 --scope model --compile ${MODE:-default} ${select[*]} -o $name.json" \
    >> "$RUN/commands.txt"
  ${LIMIT:+timeout "$LIMIT"} python3 -m sebp_probe bench "$1" --scope model --compile "${MODE:-default}" "${select[@]}" \
    -o "$RUN/$name.json" 2>&1 | tee "$RUN/$name.log" | grep -E "compiled \(|fastest|not run|Error" | tail -60
}
for s in ${STEPS:-llama qwen bert}; do
  echo "=== $s $(date +%T)"
  case $s in
    llama) bench llama-3.2-1b-sft ;;
    qwen) bench qwen2.5-0.5b-sft ;;
    bert) bench bert-base ;;
    *) echo "unknown step $s" ;;
  esac
done
tar -czf "$OUT/layouts_compiled.tar.gz" -C "$OUT" layouts_compiled && echo "results: $OUT/layouts_compiled.tar.gz"
