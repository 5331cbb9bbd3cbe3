"""``mrl replay``'s reading of a run's exchange log (docs/see.md, "Replay"): what each step is handed, and the refusals."""

from __future__ import annotations

import pytest

from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import ExperienceExchange, GroupStatsRecord, RolloutRecord, SuccessRecord
from mrl_lightning.loop.replay import ReplayLog, one_process


def _rollout(source: str, step: int, prompt: str, k: int) -> RolloutRecord:
    return RolloutRecord(prompt, source, step, f"{source}{step}{k}", (1, 2), (-0.5, -0.25), ((0, 1), (1, 2)),
                         1.0, "stop", "fp", sample_index=k)


@pytest.fixture()
def log(tmp_path):
    """A two-policy run's log: steps 1-3, each step's records in the exchange's order (a's, then b's)."""
    path = tmp_path / "exchange.jsonl"
    ex = ExperienceExchange(log_path=str(path))
    for step in (1, 2, 3):
        ex.advance(step)
        ex.publish([GroupStatsRecord("p0", "a", step, 2, 0.5, 0.5, 1), _rollout("a", step, "p0", 0),
                    GroupStatsRecord("p0", "b", step, 2, 0.0, 0.0, 0), _rollout("b", step, "p0", 0),
                    _rollout("b", step, "p1", 1), SuccessRecord("p1", "b", step, f"b{step}", 1.0, "exact", "1")])
    return path


def test_each_step_gets_the_logged_policys_records_of_that_batch_in_log_order(log):
    replay = ReplayLog(str(log), ["a", "b"], ["a"], max_steps=3)
    assert replay.logged == ["b"]
    for step in (1, 2, 3):
        got = replay.records(step)
        assert list(got) == ["b"] and len(got["b"]) == 1  # one list: the merge keeps its order
        assert [(type(r).__name__, r.prompt_id, r.step) for r in got["b"][0]] == [
            ("GroupStatsRecord", "p0", step), ("RolloutRecord", "p0", step), ("RolloutRecord", "p1", step),
            ("SuccessRecord", "p1", step)]
    assert replay.records(4) == {"b": [[]]}  # a batch the policy shared nothing of
    assert replay.count_through(2) == 8 and "8 records of 'b'" in replay.summary(2)
    # the other way round: a's records only
    other = ReplayLog(str(log), ["a", "b"], ["b"], max_steps=3)
    assert [r.source for r in other.records(2)["a"][0]] == ["a", "a"]


def test_a_replay_refuses_what_it_cannot_reproduce_in_one_message(log, tmp_path):
    with pytest.raises(ConfigError, match=r"--policies names 'c'.*\n.*leave at least one"):
        ReplayLog(str(log), ["a", "b"], ["c", "a", "b"], max_steps=3)
    with pytest.raises(ConfigError, match="--policies=\\[\\]"):
        ReplayLog(str(log), ["a", "b"], [], max_steps=3)
    with pytest.raises(ConfigError, match="cannot be read .*does not exist.*runs/version_0/exchange.jsonl"):
        ReplayLog(str(tmp_path / "nope.jsonl"), ["a", "b"], ["a"], max_steps=3)
    with pytest.raises(ConfigError, match=r"ends at step 3; replay at most --trainer.max_steps 3"):
        ReplayLog(str(log), ["a", "b"], ["a"], max_steps=4)
    with pytest.raises(ConfigError, match=r"holds records of \['b'\], which .*another run's log"):
        ReplayLog(str(log), ["a", "c"], ["a"], max_steps=3)
    with pytest.raises(ConfigError, match=r"holds no record of \['c'\]"):
        ReplayLog(str(log), ["a", "b", "c"], ["a", "b"], max_steps=3)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json}\n")
    with pytest.raises(ConfigError, match="broken.jsonl' cannot be read"):
        ReplayLog(str(broken), ["a", "b"], ["a"], max_steps=1)


def test_one_process_keeps_each_policy_on_the_threads_a_worker_had(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert one_process({"devices": 1, "num_nodes": 1, "num_threads": None}) == ({}, None)
    monkeypatch.setattr("mrl_lightning.loop.replay.available_cores", lambda: 8)
    changes, note = one_process({"devices": 2, "num_nodes": 1, "placement": "disjoint", "num_threads": None,
                                 "policy_ranks": {"a": 1, "b": 1}})
    assert changes == {"devices": 1, "num_nodes": 1, "placement": "colocated", "policy_ranks": None, "num_threads": 4}
    assert "devices 1" in note and "the run had devices 2" in note and "num_threads 4" in note
    changes, _ = one_process({"devices": 2, "num_nodes": 2, "num_threads": 3})
    assert changes["num_nodes"] == 1 and "num_threads" not in changes  # the config's own threads are kept
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert one_process({"devices": 4, "num_threads": None})[0]["num_threads"] == 2
