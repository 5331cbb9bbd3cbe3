"""The checks of ``scripts/gpu_check_vllm.py`` and ``scripts/gpu_check_chat.py``, run on a CPU
against the double of vLLM (docs/rollout.md, "Checking on a GPU").

The GPU run has never happened (no GPU here); here the same functions run with the double,
so their logic (which numbers they compare, what they call a failure) is exercised: they
pass with a faithful engine and fail when weight pushes are lost or stop ids ignored.
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
            llm._reload_weights = lambda *args, **kwargs: None
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


# ---------------------------------------------------------- scripts/gpu_check_chat.py
@pytest.fixture(scope="module")
def template_end_chat(tmp_path_factory):
    from tiny_models import build_tiny_chat_gpt2

    return build_tiny_chat_gpt2(tmp_path_factory.mktemp("gpu_check_chat"), width=64, end_boost=14.0,
                                end_in_generation_config=False)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_the_chat_stop_check_passes_on_an_engine_that_stops_at_the_end_of_turn(engine, template_end_chat, capsys):
    from gpu_check_chat import check_stops

    double = dict(factory=_factory(), device_memory_gib=80.0) if engine == "vllm" else {}
    failures = check_stops(engine, template_end_chat, "cpu", **double)
    out = capsys.readouterr().out
    assert failures == [], failures
    assert "ended at <|end|> (finish 'stop')" in out and "EOS as the only stop id" in out


def test_the_chat_stop_check_fails_on_an_engine_that_ignores_stop_token_ids(template_end_chat, capsys):
    from gpu_check_chat import check_stops

    def deaf(policy, **kwargs):  # a vLLM that stops at EOS only, as the server engine once did
        llm = FakeLLM(**kwargs)
        real = llm._complete

        def complete(ids, params, index):
            params.stop_token_ids = []
            return real(ids, params, index)

        llm._complete = complete
        return llm, FakeSamplingParams

    failures = check_stops("vllm", template_end_chat, "cpu", factory=deaf, device_memory_gib=80.0)
    assert any("a stop id before the last token" in f for f in failures), failures
    assert any("no completion ended at <|end|>" in f for f in failures), failures
