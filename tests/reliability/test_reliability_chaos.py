"""SIGKILL at random moments, resume, compare: a short run of benchmarks/chaos.py (docs/reliability.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


@pytest.mark.slow
def test_four_kills_at_each_kind_of_moment_resume_to_the_uninterrupted_state(tmp_path):
    spec = importlib.util.spec_from_file_location("chaos_benchmark", CHAOS)
    chaos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chaos)
    summary = chaos.run_chaos(tmp_path, kills=4, max_steps=10, seed=1, step_timeout_s=10.0)
    assert summary["kills"] == 4 and summary["resumes"] == 4
    assert summary["targets"] == {"rollout": 1, "update": 1, "checkpoint": 1, "log-append": 1}
    assert summary["final_state_equal"], summary["state_differences"]
    assert summary["exchange_log_equal"], summary["exchange_log_records"]
