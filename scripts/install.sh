#!/usr/bin/env bash
# Install treeflow and its test tools into ./.venv from nothing.
# torch goes first and pinned: a bare `torch` requirement may otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -c "import torch, treeflow; print('treeflow', treeflow.__version__, 'torch', torch.__version__)"
