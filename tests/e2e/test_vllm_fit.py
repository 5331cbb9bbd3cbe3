"""End to end: ``mrl fit`` with both policies on ``rollout_engine: vllm``, against the
in-process double of vLLM (the default test run has no vLLM; the same run against vLLM's CPU
build is ``tests/real_vllm/test_real_fit.py``; docs/rollout.md).

The loop builds each policy's engine at its first generation (the evaluation before step
1), with the memory share of the MWRA plan; the update re-scores the rollouts and logs the
sampler/trainer mismatch. Since the double samples from the same float32 weights, the
importance ratio must be 1 and |delta logp| ~ 0 at every step, which holds only if every
optimizer step reached the engine before it sampled again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mrl_lightning.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from vllm_double import FakeLLM, FakeSamplingParams  # noqa: E402


@pytest.fixture
def double_engines(monkeypatch):
    """Every vLLM engine the loop builds samples with the double (the real share computation kept)."""
    from mrl_lightning.builders import engines as vllm_setup

    built = []

    def factory(policy, **kwargs):
        llm = FakeLLM(**kwargs)
        built.append((policy.policy_name, kwargs, llm))
        return llm, FakeSamplingParams

    def build(policy, policies, prompts_per_rank):
        return vllm_setup.build_vllm_engine(policy, policies, prompts_per_rank, factory=factory, device_memory_gib=24.0)

    monkeypatch.setattr("mrl_lightning.rollout.options.missing_packages", lambda mode: [])
    monkeypatch.setattr("mrl_lightning.loop.system.build_vllm_engine", build)
    return built


def test_fit_with_vllm_rollouts_logs_a_unit_ratio_and_keeps_engines_current(write_config, double_engines):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def vllm(cfg):
        for p in cfg["model"]["policies"]:
            p["init_args"].update(rollout_engine="vllm", vllm_importance_sampling_mode="sequence_truncate")
        cfg["trainer"]["max_steps"] = 3

    config = write_config(modify=vllm)
    assert main(["fit", "--config", str(config)]) == 0
    assert sorted(name for name, _, _ in double_engines) == ["gpt2", "llama"]  # one engine each
    for _, kwargs, _ in double_engines:
        assert kwargs["logprobs_mode"] == "processed_logprobs" and 0.05 <= kwargs["gpu_memory_utilization"] <= 0.9
    (run,) = [p.parent for p in (config.parent / "runs").glob("*/config.yaml")]
    events = EventAccumulator(str(run))
    events.Reload()
    for policy in ("gpt2", "llama"):
        ratio = [s.value for s in events.Scalars(f"rollout/{policy}/is_ratio_mean")]
        delta = [s.value for s in events.Scalars(f"rollout/{policy}/abs_delta_logp_max")]
        assert len(ratio) == 3 and all(abs(r - 1.0) < 1e-4 for r in ratio), ratio
        assert all(d < 1e-4 for d in delta), delta
        assert [s.step for s in events.Scalars(f"eval/{policy}/pass_at_k_add")] == [0, 3]
