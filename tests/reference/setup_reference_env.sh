#!/usr/bin/env bash
# The released K3 modeling code's own environment, for tests/reference/test_release_parity.py:
#   bash tests/reference/setup_reference_env.sh [VENV_DIR]      (default .venv-reference)
#   K3_REFERENCE_PYTHON=.venv-reference/bin/python python -m pytest tests/reference
# llmcompressor pins its own torch/transformers ranges and its __init__ pulls a heavy stack: it is
# installed without dependencies and its kimi_k3 files are loaded by path.
set -euo pipefail
VENV="${1:-.venv-reference}"
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q torch==2.13.0
"$PIP" install -q "transformers>=5.15,<5.18" safetensors einops
"$PIP" install -q --no-deps llmcompressor==0.14.0.1 flash-linear-attention==0.6.0 fla-core==0.6.0 triton==3.7.1
echo "reference python: $VENV/bin/python"
