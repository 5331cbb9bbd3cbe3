"""``trainer.async_rollouts`` end to end (docs/mwra.md, "Rollouts during the update"): the batch sampled on a thread
beside the update is the batch sampled before it (``MRL_ASYNC_ROLLOUTS_INLINE=1``), bit for bit; one process equals
two workers; a checkpoint holds the batch sampled ahead, so a resume ends equal. Real ``mrl fit`` runs of the tiny
two-family config (SGT on SEE), one thread per worker."""

from __future__ import annotations

import os

import pytest
from test_mwra_fit import DISJOINT, _ckpt, _mrl, _ok, write_stepwise_config
from test_pace_fit import _equal

ASYNC = ["--trainer.async_rollouts", "true"]


def _assert_same(a: dict, b: dict, what: str) -> None:
    for name in a["policies"]:
        for part in ("model", "optimizer"):
            assert _equal(a["policies"][name][part], b["policies"][name][part]), f"{what}: {name} {part}"
    assert _equal(a["counters"], b["counters"]) and a["callbacks"] == b["callbacks"] and a["data"] == b["data"], what


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    config = write_stepwise_config(tmp_path_factory.mktemp("async"), max_steps=4)
    _ok(_mrl(config, "--trainer.version", "thread", *ASYNC))
    os.environ["MRL_ASYNC_ROLLOUTS_INLINE"] = "1"  # the subprocess inherits it
    try:
        _ok(_mrl(config, "--trainer.version", "inline", *ASYNC))
    finally:
        del os.environ["MRL_ASYNC_ROLLOUTS_INLINE"]
    return config


def test_sampling_beside_the_update_equals_sampling_before_it(runs):
    _assert_same(_ckpt(runs, "thread"), _ckpt(runs, "inline"), "thread vs inline")
    mid = _ckpt(runs, "thread", "step=2.ckpt")["counters"]
    assert mid["async_rollouts"] is True and mid["prefetched"]["batch"] == 3 and mid["prefetched"]["sampled_after"] == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs.parent / "runs" / "thread"))
    events.Reload()
    # batch 1 is sampled at step 1 by the weights it trains; every later one an update before
    assert [e.value for e in events.Scalars("pace/staleness_steps")] == [0.0, 1.0, 1.0, 1.0]
    assert {"pace/sampler_wait_s", "rollout/gpt2/is_ratio_mean"} <= set(events.Tags()["scalars"])


@pytest.mark.slow
def test_two_workers_and_a_resume_with_a_batch_sampled_ahead_end_equal(runs):
    _ok(_mrl(runs, "--trainer.version", "two", *ASYNC, *DISJOINT))
    _assert_same(_ckpt(runs, "thread"), _ckpt(runs, "two"), "one process vs two workers")
    mid = runs.parent / "runs" / "thread" / "checkpoints" / "step=2.ckpt"
    _ok(_mrl(runs, "--trainer.version", "resumed", *ASYNC, "--ckpt_path", str(mid)))
    _assert_same(_ckpt(runs, "thread"), _ckpt(runs, "resumed"), "resumed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def reward_means(version: str) -> dict[int, float]:
        events = EventAccumulator(str(runs.parent / "runs" / version))
        events.Reload()
        return {e.step: e.value for e in events.Scalars("rollout/gpt2/reward_mean")}

    # the batch sampled ahead logs its rollout scalars after the resume as in the run that never stopped
    assert reward_means("resumed")[3] == reward_means("thread")[3]
    last = runs.parent / "runs" / "thread" / "checkpoints" / "last.ckpt"
    proc = _mrl(runs, "--trainer.version", "longer", *ASYNC, "--ckpt_path", str(last), "--trainer.max_steps", "5")
    _ok(proc)
    assert "note: this checkpoint ended its run" in proc.stdout and "batch 5 is sampled by the weights after update 4" \
        in proc.stdout
    proc = _mrl(runs, "--trainer.version", "sync", "--ckpt_path", str(mid))
    assert proc.returncode == 2 and "--trainer.async_rollouts true" in proc.stderr
    _ok(_mrl(runs, "--trainer.version", "lag", *ASYNC, "--trainer.max_lag", "1"))
    _ok(_mrl(runs, "--trainer.version", "lag-two", *ASYNC, "--trainer.max_lag", "1", *DISJOINT))
    _assert_same(_ckpt(runs, "lag"), _ckpt(runs, "lag-two"), "max_lag 1: one process vs two workers")
