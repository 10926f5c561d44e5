#!/usr/bin/env bash
# Create (or reuse) .venv and install verl_lite with its test extras.
# On a machine without CUDA the CPU build of torch is installed first, so that no
# dependency pulls a multi-GB CUDA wheel. Re-running is cheap: the install is skipped
# while pyproject.toml is unchanged since the last successful one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.verl_lite_installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
. .venv/bin/activate
echo "setting up .venv (first run takes a few minutes)..."
python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
fi
python -m pip install -q -e ".[test]" 2>&1 | grep -v "is ignored" || true
python -c "import verl_lite, torch, megatron.core, ray, hydra" # fail loudly if the install did not work
echo "$want" > "$stamp"
