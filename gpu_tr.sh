set -u
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
nvidia-smi -L | head -1
VARIANTS="$1" STEPS=compiled LIMIT=${LIMIT:-290} OUT=$OUT bash benchmarks/trainer_session.sh 2>&1 | grep -vE "^installing" | tail -30
