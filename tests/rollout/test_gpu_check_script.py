"""``scripts/gpu_check_vllm.py``'s checks, run on a CPU against the double of vLLM.

The real-engine run needs a GPU; here the same function runs with the double, so its
logic (which numbers it compares, what it calls a failure) is exercised: it passes with a
faithful engine and fails when weight pushes are lost.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from vllm_double import FakeLLM, FakeSamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from gpu_check_vllm import main, run_check  # noqa: E402


@pytest.fixture(autouse=True)
def vllm_installed(monkeypatch):
    monkeypatch.setattr("mrl_lightning.rollout.options.missing_packages", lambda mode: [])


def _factory(lose_pushes: bool = False):
    def factory(policy, **kwargs):
        llm = FakeLLM(**kwargs)
        if lose_pushes:
            llm.runner_model.load_weights = lambda weights: set()
        return llm, FakeSamplingParams
    return factory


def test_check_passes_on_a_faithful_engine(capsys, tmp_path):
    rc = run_check(steps=3, family="llama", precision="32-true", learning_rate=3e-3, accelerator="cpu",
                   factory=_factory(), device_memory_gib=80.0, out_dir=tmp_path)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "OK: vLLM engine check passed." in out and out.count("is_ratio mean") == 3
    report = json.loads((tmp_path / "vllm_check.json").read_text())
    assert [r["step"] for r in report["steps"]] == [0, 1, 2] and report["failures"] == []
    assert abs(report["steps"][0]["rollout/llama/is_ratio_mean"] - 1.0) < 1e-5


def test_without_cuda_or_vllm_the_check_is_skipped_and_says_so(capsys):
    assert main(["--steps", "1"]) == 0  # this CPU machine has neither
    assert "SKIPPED" in capsys.readouterr().out
    assert main(["--steps", "1", "--require-vllm"]) == 2


def test_check_fails_when_the_engine_keeps_stale_weights(capsys):
    rc = run_check(steps=2, family="llama", precision="32-true", learning_rate=3e-3, accelerator="cpu",
                   factory=_factory(lose_pushes=True), device_memory_gib=80.0)
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "engine weights differ from the trainer's" in out
