"""Pace (trainer.max_lag): the schedule of sampled and trained batches, the refusals, the in-flight state (docs/mwra.md)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.config.preflight import trainer_errors
from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.loop.pace import (Pace, check_resume_lag, lag_errors, scored_from_state, scored_state,
                                     step_wait_metrics)
from mrl_lightning.mwra import Workers
from mrl_lightning.mwra.placement import Placement
from mrl_lightning.rollout.base import RolloutBatch
from mrl_lightning.update.batch import ScoredRollouts


def _workers() -> Workers:
    return Workers(Placement(mode="colocated", world_size=1, groups={"a": (0,), "b": (0,)}))


def _schedule(max_lag: int, max_steps: int, staleness: list | None = None) -> list[tuple[int | None, int | None]]:
    """(batch sampled, batch trained) of every loop step, as MRLTrainer drives Pace."""
    pace, rollout_step, trained, out = Pace(_workers(), max_lag, 60.0), 0, 0, []
    while trained < max_steps:
        sampled = None
        if rollout_step < max_steps:
            rollout_step += 1
            sampled = ({}, {})
        batch = pace.queue(rollout_step, max_steps, sampled, trained)
        if batch is not None:
            metrics: dict = {}
            pace.take(batch, metrics, trained)
            trained += 1
            if staleness is not None:
                staleness.append(metrics.get("pace/staleness_steps", 0.0))
        out.append((rollout_step if sampled else None, batch))
    return out


def test_lockstep_trains_the_batch_it_just_sampled():
    assert _schedule(0, 4) == [(1, 1), (2, 2), (3, 3), (4, 4)]


def test_a_lag_trains_the_batch_sampled_that_many_steps_before_then_drains():
    assert _schedule(2, 5) == [(1, None), (2, None), (3, 1), (4, 2), (5, 3), (None, 4), (None, 5)]
    assert _schedule(1, 1) == [(1, 1)]  # every batch sampled: the last ones train at once
    ages: list = []
    _schedule(2, 5, ages)
    assert ages == [0, 1, 2, 2, 2]  # updates between a batch's sampling and its training


def test_a_lagged_run_without_an_exchange_checkpoints_its_batches_in_flight():
    pace = Pace(_workers(), 2, 60.0)
    for step in (1, 2):
        assert pace.queue(step, 5, ({}, {}), 0) is None
    counters = pace.counters()  # no SEE callback: nothing was published, no record is pending
    assert counters["exchange_pending"] == {} and sorted(counters["in_flight"]) == [1, 2]
    assert counters["sampled_after"] == {1: 0, 2: 0}


def test_the_lagged_exchange_delivers_the_trained_batch_records_in_one_process():
    pace = Pace(_workers(), 1, 60.0)
    pace.workers.pace = pace
    got = []
    for step in (1, 2, 3):
        sampled = ({}, {}) if step <= 2 else None
        batch = pace.queue(min(step, 2), 2, sampled)
        got.append(pace.workers.exchange({"a": [[f"a{step}"]], "b": [[f"b{step}"]]} if sampled else {}))
        if batch is not None:
            pace.take(batch, {})
    assert got == [[], ["a1", "b1"], ["a2", "b2"]]


def test_bad_values_are_refused_in_one_line_naming_the_option():
    (line,) = trainer_errors(max_lag=-1)
    assert "trainer.max_lag=-1" in line and ">= 0" in line
    assert trainer_errors(max_lag=2) == []
    policies = {"a": SimpleNamespace(vllm_importance_sampling_correction=False),
                "b": SimpleNamespace(vllm_importance_sampling_correction=True)}
    (line,) = lag_errors(2, policies)
    assert "'a'" in line and "vllm_importance_sampling_correction" in line and "max_lag 0" in line
    assert lag_errors(0, policies) == []
    with pytest.raises(ConfigError, match="max_lag 2"):
        check_resume_lag({"max_lag": 2}, 0, "x.ckpt")
    check_resume_lag({}, 0, "x.ckpt")  # a lockstep checkpoint resumes in lockstep


def _scored() -> ScoredRollouts:
    item = PromptItem(prompt_id="add/3", question="1+2?", answer="3", part="add",
                      entry={"question": "1+2?", "answer": "3", "metadata": {"terms": [1, 2], "x": None}})
    rollouts = RolloutBatch(prompt_ids=torch.tensor([[0, 5]]), prompt_mask=torch.tensor([[False, True]]),
                            completion_ids=torch.tensor([[7, 8]]), completion_mask=torch.tensor([[True, False]]),
                            old_logprobs=torch.tensor([[-0.5, 0.0]]), finish_reasons=["stop"],
                            completion_texts=["3"], sampling_logprobs=None, stop_reasons=[2])
    return ScoredRollouts(policy="a", items=[item], rollouts=rollouts, rewards_per_func=torch.tensor([[1.0]]),
                          rewards=torch.tensor([[1.0]]), success=torch.tensor([[True]]), prompt_texts=["Q: 1+2?"],
                          verifier_rewards=torch.tensor([1.0]))


def test_a_batch_in_flight_survives_a_weights_only_checkpoint():
    buffer = io.BytesIO()
    torch.save({"in_flight": {3: {"a/0of1": {"scored": scored_state(_scored()), "keep": None}}}}, buffer)
    buffer.seek(0)
    back = scored_from_state(torch.load(buffer, weights_only=True)["in_flight"][3]["a/0of1"]["scored"])
    want = _scored()
    assert back.items == want.items and back.prompt_texts == want.prompt_texts
    assert back.rollouts.finish_reasons == ["stop"] and back.rollouts.stop_reasons == [2]
    assert torch.equal(back.rollouts.old_logprobs, want.rollouts.old_logprobs)
    assert torch.equal(back.success, want.success)


def test_a_resume_on_another_placement_is_refused_when_batches_are_in_flight():
    from mrl_lightning.run.checkpoint import CheckpointError

    pace = Pace(_workers(), 1, 60.0)
    counters = {"max_lag": 1, "exchange_pending": {3: []},
                "in_flight": {3: {"a/0of2": {"scored": scored_state(_scored()), "keep": None}}}}
    with pytest.raises(CheckpointError, match="placement"):
        pace.load(counters)
    # ... and before any model is built, naming the ranks: the checkpoint's 2 against this run's 1
    with pytest.raises(ConfigError, match=r"from 2 rank\(s\); this run gives 'a' 1"):
        check_resume_lag(counters, 1, "x.ckpt", _workers().placement)
    wider = Placement(mode="colocated", world_size=2, groups={"a": (0, 1), "b": (0, 1)})
    check_resume_lag(counters, 1, "x.ckpt", wider)  # the same ranks per policy: accepted


def test_rank_zero_logs_each_window_once_through_the_logger():
    logged = []
    pace = Pace(_workers(), 0, 60.0, log=lambda metrics, step: logged.append((step, metrics)))
    shown = pace.log_window(3, [{"x": 1.0}, {"x": 3.0}])
    assert shown == [{"x": 2.0}] and logged == [(3, {"x": 2.0})]


def test_wait_tags_say_where_the_time_went():
    pace = Pace(_workers(), 0, 60.0)
    out = step_wait_metrics(["a"], {"metrics": 1.0, "eval": 9.0}, {"exchange": 2.0, "update": 0.5, "compose": 0.5},
                            step_time_s=9.0, peak_gib=1.0, pace=pace)
    assert out["mwra/a/wait_s"] == 4.0  # evaluation's wait is not the step's
    assert (out["mwra/a/wait_exchange_s"], out["mwra/a/wait_update_s"], out["mwra/a/wait_log_s"]) == (2.0, 1.0, 1.0)
    assert out["mwra/a/idle_share"] == pytest.approx(4.0 / 10.0)
    assert "pace/read_step" not in out and out["train/elapsed_s"] >= 0.0
