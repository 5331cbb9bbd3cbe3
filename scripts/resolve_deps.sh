#!/usr/bin/env bash
# What pip resolves this project to, for each kind of user (docs/install.md). Not part of
# the test run: it downloads whole wheels (pip gets no metadata-only files here; vllm is
# ~336 MB, its CUDA torch and NVIDIA libraries several GB; pip's cache keeps them for a rerun).
#
#   bash scripts/resolve_deps.sh [WORKDIR]
#
# Each case runs in its own throwaway virtual environment under WORKDIR (default: a new
# temporary folder), with `pip install --dry-run --report`, and prints what pip would
# install (torch, transformers, tokenizers, lightning, vllm, trl) and whether it keeps
# the torch already there:
#   a) CPU, as the README does it: torch==2.13.0 installed first, then the project (.[dev]);
#   b) a Linux CUDA user, `.[vllm]` into an environment with no torch, with pip reading
#      no configuration (PyPI only: no local wheel folders, no constraint file), and
#   b2) the same with this machine's pip configuration (its constraint file, if any);
#   c) next to an existing in-range torch (2.14.1 installed first), then the project (.[dev]);
#   d) `.[vllm]` next to that torch 2.14.1.
# PYTHON picks the interpreter (default python3; vllm 0.33 needs Python >= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=${1:-$(mktemp -d -t mrl-resolve-XXXXXX)}
python=${PYTHON:-python3}
mkdir -p "$work"

summarize() {  # summarize CASE REPORT.json VENV
    "$3/bin/python" - "$1" "$2" "$3" <<'EOF'
import json, subprocess, sys
case, report, venv = sys.argv[1:4]
installs = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
            for i in json.load(open(report))["install"]}
have = {}
for line in subprocess.run([f"{venv}/bin/python", "-m", "pip", "list", "--format=freeze"],
                           capture_output=True, text=True, check=True).stdout.splitlines():
    name, _, version = line.partition("==")
    have[name.lower().replace("_", "-")] = version
parts = []
for name in ("torch", "transformers", "tokenizers", "lightning", "vllm", "trl"):
    if name in installs:
        replaced = f" (replaces {have[name]})" if name in have else ""
        parts.append(f"{name} {installs[name]}{replaced}")
    elif name in have:
        parts.append(f"{name} {have[name]} (kept)")
    else:
        parts.append(f"{name} -")
print(f"{case}: " + ", ".join(parts) + f"; {len(installs)} packages to install")
EOF
}

fresh_venv() {  # fresh_venv DIR
    rm -rf "$1"
    "$python" -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1
}

preinstall() {  # preinstall VENV REQUIREMENT: a real install, as the user did before
    "$1/bin/python" -m pip install -q "$2" >/dev/null 2>&1
    echo "# $(basename "$1"): installed $2 first -> torch $("$1/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
}

plain=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null)

dry_run() {  # dry_run CASE VENV PIP-ARGS...  (PIP_ENV="plain": ignore every pip configuration)
    local case=$1 venv=$2
    shift 2
    local log="$work/$case.log" prefix=()
    if [ "${PIP_ENV:-}" = plain ]; then prefix=("${plain[@]}"); fi
    if "${prefix[@]}" "$venv/bin/python" -m pip install --dry-run --quiet --report "$work/$case.json" "$@" \
        >"$log" 2>&1; then
        summarize "$case" "$work/$case.json" "$venv"
    else
        echo "$case: DOES NOT RESOLVE (pip exit $?); last lines of $log:"
        grep -v "^WARNING: Location" "$log" | tail -n 8 | sed 's/^/    /'
    fi
}

echo "# $(date -u +%Y-%m-%dT%H:%MZ) $("$python" --version 2>&1) on $(uname -sm); bash scripts/resolve_deps.sh $*"
echo "# pip config here: $("$python" -m pip config list 2>/dev/null | tr '\n' ' ')"
for f in $("$python" -m pip config list 2>/dev/null | sed -n "s/.*constraint='\(.*\)'/\1/p"); do
    echo "# constraint file $f: $(grep -v '^#' "$f" | tr '\n' ' ')"
done

fresh_venv "$work/a"
echo "# pip in the throwaway venvs: $("$work/a/bin/python" -m pip --version | cut -d' ' -f2)"
preinstall "$work/a" torch==2.13.0
dry_run a_cpu_readme "$work/a" -e "$repo[dev]"

fresh_venv "$work/b"
PIP_ENV=plain dry_run b_cuda_vllm_pypi_only "$work/b" --ignore-installed "$repo[vllm]"
dry_run b2_cuda_vllm_this_machine "$work/b" --ignore-installed "$repo[vllm]"

fresh_venv "$work/c"
preinstall "$work/c" torch==2.14.1
dry_run c_existing_torch "$work/c" -e "$repo[dev]"
dry_run d_existing_torch_vllm "$work/c" "$repo[vllm]"
echo "# reports and logs: $work"
