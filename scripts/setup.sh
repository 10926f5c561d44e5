#!/usr/bin/env bash
# Create (or reuse) .venv and install verl_lite with its test extras.
# On a machine without CUDA the CPU build of torch is installed first, so that no
# dependency pulls a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
if ! command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[test]"
