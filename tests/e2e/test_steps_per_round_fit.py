"""``trainer.steps_per_round`` end to end (docs/mwra.md, "Steps per round"): a policy's solo steps between exchange
rounds are counted, logged and resumed exactly; one process equals two workers; a resume under another setting is
refused. Real ``mrl fit`` runs of the tiny two-family config (SGT on SEE), one thread per worker."""

from __future__ import annotations

import pytest
from test_async_rollouts_fit import _assert_same
from test_mwra_fit import DISJOINT, _ckpt, _mrl, _ok, write_stepwise_config

SOLO = ["--trainer.steps_per_round", '{"gpt2": 1.5}']


@pytest.fixture(scope="module")
def solo(tmp_path_factory):
    config = write_stepwise_config(tmp_path_factory.mktemp("solo"), max_steps=4)
    _ok(_mrl(config, "--trainer.version", "one", *SOLO))
    return config


def test_the_faster_policy_takes_its_solo_steps_and_its_peer_does_not(solo):
    counters = _ckpt(solo, "one")["counters"]
    # 4 rounds at 1.5: floor(4 x 1.5) = 6 steps of gpt2 (a solo step in rounds 2 and 4), 4 of llama
    assert counters["optimizer_steps"] == {"gpt2": 6, "llama": 4} and counters["global_step"] == 4
    assert counters["steps_per_round"] == {"gpt2": "3/2"}
    # the tiny config: 2 prompts x 4 completions a policy and batch; 2 solo batches of gpt2 on top
    assert counters["samples_seen"] == 4 * 2 * 8 + 2 * 8
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(solo.parent / "runs" / "one"))
    events.Reload()
    assert [e.value for e in events.Scalars("solo/gpt2/steps")] == [0.0, 1.0, 0.0, 1.0]
    tags = set(events.Tags()["scalars"])
    assert {"mwra/gpt2/solo_s", "solo/gpt2/reward_mean", "solo/gpt2/loss"} <= tags
    assert not any(tag.startswith("solo/llama") or tag == "mwra/llama/solo_s" for tag in tags)


def test_a_resume_under_another_setting_is_refused_before_building(solo):
    mid = solo.parent / "runs" / "one" / "checkpoints" / "step=2.ckpt"
    proc = _mrl(solo, "--trainer.version", "other", "--ckpt_path", str(mid))
    assert proc.returncode == 2 and """--trainer.steps_per_round '{"gpt2": 1.5}'""" in proc.stderr
    assert "Resource plan" not in proc.stdout  # before the plan and any model


@pytest.mark.slow
def test_two_workers_and_a_resume_end_equal(solo):
    _ok(_mrl(solo, "--trainer.version", "two", *SOLO, *DISJOINT))
    _assert_same(_ckpt(solo, "one"), _ckpt(solo, "two"), "one process vs two workers")
    for step in (1, 2):  # after a round without and with a solo step
        mid = solo.parent / "runs" / "one" / "checkpoints" / f"step={step}.ckpt"
        _ok(_mrl(solo, "--trainer.version", f"resumed{step}", *SOLO, "--ckpt_path", str(mid)))
        _assert_same(_ckpt(solo, "one"), _ckpt(solo, f"resumed{step}"), f"resumed at step {step}")
    _ok(_mrl(solo, "--trainer.version", "lag-one", *SOLO, "--trainer.max_lag", "1"))
    _ok(_mrl(solo, "--trainer.version", "lag-two", *SOLO, "--trainer.max_lag", "1", *DISJOINT))
    _assert_same(_ckpt(solo, "lag-one"), _ckpt(solo, "lag-two"), "max_lag 1: one process vs two workers")
