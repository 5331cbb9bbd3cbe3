#!/usr/bin/env bash
# GPU check for a GPU owner (see scripts/gpu_check.py): plan, per-worker timings, peak memory,
# sanity checks of the GPU path on small local models. Installs nothing; run from anywhere
# after the README's install command. Exits non-zero when a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" scripts/gpu_check.py "$@"
