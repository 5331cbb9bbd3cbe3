#!/usr/bin/env bash
# GPU check for a GPU owner (see scripts/gpu_check.py): plan, per-worker timings, peak memory,
# sanity checks of the GPU path on small local models, vLLM's engine where it is installed,
# chat stops on every engine and the three families (scripts/gpu_check_chat.py). Installs
# nothing; run from anywhere after the README's install command (and pip install -e '.[vllm]'
# for the vLLM parts). One prepared script, estimated at under 10 minutes on one GPU.
# Exits non-zero when a check fails.
#
# NEVER RUN ON A GPU: no GPU was available while this was written. Its logic ran on a CPU
# only (--dry-run-on-cpu; the vLLM and chat-stop checks against vLLM's CPU build and the
# double). The time estimate and every GPU number it prints are unmeasured.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" scripts/gpu_check.py "$@"
