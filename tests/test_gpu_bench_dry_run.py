"""scripts/gpu_bench.py --dry-run: the GPU bench's code path on a CPU, tiny shapes (docs/speed.md, "GPU")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_dry_run_prints_its_table_and_passes():
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_bench.py"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert "CPU dry run (tiny shapes, not a GPU measurement)" in out
    assert "| what " in out and "FAIL" not in out
    for row in ("rollout HF engine", "rollout static+compile", "update", "memory, one worker", "SGT term",
                "pair step, colocated", "memory, pair's worker"):
        assert f"| {row}" in out, row
    for model in ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b"):
        assert model in out
    assert "step vs TRL 1.16" in out or "trl not installed" in out
