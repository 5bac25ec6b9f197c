#!/usr/bin/env bash
# A second environment with another torch release, to run the tests on this CPU-only machine under the
# release a GPU machine has (Dynamo and Inductor differ between releases: a compile that passes under the
# CPU wheel of one can fail under another):
#
#   bash tools/venv_torch.sh 2.11.0                 # once: ./.venv-torch2.11.0 (about 5 GB)
#   PYTHONPATH=$PWD .venv-torch2.11.0/bin/python -m pytest -q -m "not slow" tests
#   TRITON_INTERPRET=1 PYTHONPATH=$PWD .venv-torch2.11.0/bin/python -m pytest -q tests/kernels/test_pad_rows.py
#
# PyPI has CPU wheels of few torch releases, so this installs the CUDA wheel with its libraries (they load
# without a GPU) and that release's Triton; numpy below 2.3 for that Triton's interpreter. Every other package
# comes from ./.venv (python3 bootstrap.py test sets it up first), after this environment's own.
set -eu
release=${1:?usage: bash tools/venv_torch.sh RELEASE (e.g. 2.11.0)}
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "no ./.venv: run python3 bootstrap.py test first" >&2; exit 1; }
dir=".venv-torch$release"
python3 -m venv "$dir"
"$dir/bin/pip" install -q "torch==$release" "numpy<2.3"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
purelib .venv/bin/python > "$(purelib "$dir/bin/python")/zz_main_venv.pth"
"$dir/bin/python" -c "import torch, triton, transformers as t
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', t.__version__)"
