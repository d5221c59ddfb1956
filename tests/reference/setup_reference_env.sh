#!/usr/bin/env bash
# The released K3 modeling code's own environment, for tests/reference/test_release_parity.py:
#   bash tests/reference/setup_reference_env.sh [VENV_DIR]      (default .venv-reference)
#   K3_REFERENCE_PYTHON=.venv-reference/bin/python python -m pytest tests/reference -n 0
# Every package is pinned (requirements.txt beside this file, installed --no-deps), so the reference only
# changes when that file does and a parity failure is the project's. llmcompressor pins its own
# torch/transformers ranges and its __init__ pulls a heavy stack: it is installed without its dependencies
# and its kimi_k3 files are loaded by path; compressed-tensors is the version it pins (0.19.0).
set -euo pipefail
VENV="${1:-.venv-reference}"
HERE="$(cd "$(dirname "$0")" && pwd)"
START=$SECONDS
python3 -m venv "$VENV"
# -qq: errors only (the package index configuration's warnings would fill the log)
"$VENV/bin/pip" install -qq --no-deps torch==2.13.0 -r "$HERE/requirements.txt"
# versions as installed (llmcompressor's __init__ is never imported: it needs the stack left out above)
"$VENV/bin/python" -c "
from importlib.metadata import version
names = ('torch', 'transformers', 'llmcompressor', 'fla-core', 'triton', 'compressed-tensors')
print('reference environment:', ', '.join(f'{n} {version(n)}' for n in names))
"
echo "reference python: $VENV/bin/python (installed in $((SECONDS - START)) s)"
