"""``mrl replay``'s reading of a run's exchange log (docs/see.md, "Replay"): what each step is handed, and the refusals."""

from __future__ import annotations

import pytest

from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import ExperienceExchange, GroupStatsRecord, RolloutRecord, SuccessRecord
from mrl_lightning.loop.replay import ReplayLog, ReplayMismatch, fresh_version, one_process


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
    assert "(batches 1-2; every batch" in replay.summary(2)
    # the other way round: a's records only
    other = ReplayLog(str(log), ["a", "b"], ["b"], max_steps=3)
    assert [r.source for r in other.records(2)["a"][0]] == ["a", "a"]


def test_a_replay_refuses_what_it_cannot_reproduce_in_one_message(log, tmp_path):
    with pytest.raises(ConfigError, match=r"--policies names 'c'.*\n.*leave at least one"):
        ReplayLog(str(log), ["a", "b"], ["c", "a", "b"], max_steps=3)
    with pytest.raises(ConfigError, match="names 'A', which is not in model.policies \\['a', 'b'\\]; did you mean 'a'\\?"):
        ReplayLog(str(log), ["a", "b"], ["A"], max_steps=3)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="holds no record: was the run's SharedExperienceExchange logging"):
        ReplayLog(str(empty), ["a", "b"], ["a"], max_steps=1)
    with pytest.raises(ConfigError, match="--policies=\\[\\]"):
        ReplayLog(str(log), ["a", "b"], [], max_steps=3)
    with pytest.raises(ConfigError, match="cannot be read .*does not exist.*runs/version_0/exchange.jsonl"):
        ReplayLog(str(tmp_path / "nope.jsonl"), ["a", "b"], ["a"], max_steps=3)
    with pytest.raises(ConfigError, match=r"holds batches up to 3; replay at most --trainer.max_steps 3"):
        ReplayLog(str(log), ["a", "b"], ["a"], max_steps=4)
    with pytest.raises(ConfigError, match=r"holds records of \['b'\], which .*another run's log"):
        ReplayLog(str(log), ["a", "c"], ["a"], max_steps=3)
    ReplayLog(str(log), ["a", "b", "c"], ["a", "b"], max_steps=3)  # a policy that shared nothing: none to hand on
    with pytest.raises(ConfigError, match=r"is a folder \(it holds '.*exchange.jsonl'\); give the log file"):
        ReplayLog(str(log.parent), ["a", "b"], ["a"], max_steps=3)
    torn = tmp_path / "torn.jsonl"
    torn.write_text(log.read_text()[:-20])  # the run stopped while writing step 3's records
    assert ReplayLog(str(torn), ["a", "b"], ["a"], max_steps=2).last_step == 2
    with pytest.raises(ConfigError, match=r"up to 2 \(its last line is torn"):
        ReplayLog(str(torn), ["a", "b"], ["a"], max_steps=3)
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
    assert "devices 1" in note and "the config gave devices 2" in note and "threads a worker of the run had" in note and "num_threads 4" in note
    changes, _ = one_process({"devices": 2, "num_nodes": 2, "num_threads": 3})
    assert changes["num_nodes"] == 1 and "num_threads" not in changes  # the config's own threads are kept
    assert "num_threads 3 as configured" in one_process({"devices": 2, "num_nodes": 2, "num_threads": 3})[1]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert one_process({"devices": 4, "num_threads": None})[0]["num_threads"] == 2


def test_a_replayed_policys_own_records_are_checked_against_the_log(log, tmp_path):
    replay = ReplayLog(str(log), ["a", "b"], ["a"], max_steps=3)
    own = [GroupStatsRecord("p0", "a", 2, 2, 0.5, 0.5, 1), _rollout("a", 2, "p0", 0)]
    replay.check(2, {"a": [own, [own[1]]]})  # equal (a repeated record is dropped by the exchange, as in the run)
    other = [own[0], RolloutRecord("p0", "a", 2, "a20", (1, 2), (-0.5, -0.2), ((0, 1), (1, 2)), 1.0, "stop", "fp")]
    with pytest.raises(ReplayMismatch, match=r"batch 2 of 'a' differs .*record 1, a rollout of prompt 'p0': "
                                             r"logprobs\[1\] -0.2 here, -0.25 in the log.*not that run's"):
        replay.check(2, {"a": [other]})
    with pytest.raises(ReplayMismatch, match="1 records here, 2 in the log.*--verify false"):
        replay.check(2, {"a": [own[:1]]})
    with pytest.raises(ReplayMismatch, match="record 0, a group_stats of prompt 'p9' here, a group_stats of prompt 'p0'"):
        replay.check(2, {"a": [[GroupStatsRecord("p9", "a", 2, 2, 0.5, 0.5, 1)]]})
    ReplayLog(str(log), ["a", "b"], ["a"], max_steps=3, verify=False).check(2, {"a": [other]})  # counterfactual


def test_a_log_that_begins_late_is_refused_unless_resuming_at_it(tmp_path):
    path = tmp_path / "resumed.jsonl"  # a resumed run's own log: batches 3 and 4
    ex = ExperienceExchange(log_path=str(path))
    for step in (3, 4):
        ex.publish([GroupStatsRecord("p0", "a", step, 2, 0.5, 0.5, 1), GroupStatsRecord("p0", "b", step, 2, 0, 0, 0)])
    replay = ReplayLog(str(path), ["a", "b"], ["a"], max_steps=4)
    assert "begins at batch 3" in replay.start_errors(resuming=False)[0] and "step=2.ckpt" in replay.start_errors(False)[0]
    assert replay.start_errors(resuming=True) == []
    with pytest.raises(ReplayMismatch, match="batch 2 is sampled, but --exchange_log=.* begins at batch 3"):
        replay.records(2)
    assert [r.step for r in replay.records(3)["b"][0]] == [3]
    assert "(batches 3-4;" in replay.summary(4) and "against 2 records" in replay.summary(4)


def test_a_replay_of_a_runs_own_config_writes_a_folder_of_its_own(tmp_path):
    (tmp_path / "orig").mkdir()
    assert fresh_version({"default_root_dir": str(tmp_path), "version": "orig"}) == ({}, None)  # no run there yet
    (tmp_path / "orig" / "config.yaml").write_text("{}")
    changes, note = fresh_version({"default_root_dir": str(tmp_path), "version": "orig"})
    assert changes == {"version": None} and f"{tmp_path / 'orig'} holds a run" in note
    (tmp_path / "version_3").mkdir()
    (tmp_path / "version_3" / "config.yaml").write_text("{}")
    assert fresh_version({"default_root_dir": str(tmp_path), "version": 3})[0] == {"version": None}
    assert fresh_version({"default_root_dir": str(tmp_path), "version": None}) == ({}, None)


def test_an_override_that_reaches_a_policy_the_replay_does_not_run_is_refused(tmp_path):
    import yaml

    from mrl_lightning.loop.replay import override_errors

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"policies": [{"init_args": {"name": "a"}}, {"init_args": {"name": "b"}}]}}))
    argv = ["replay", "--config", str(config), "--exchange_log", "x.jsonl", "--policies", "a"]
    for key in ("--model.policies.learning_rate", "--model.policies.init_args.learning_rate"):
        (line,) = override_errors([*argv, key, "0.001"])
        assert line.startswith("--model.policies.learning_rate reaches the last policy of the list, 'b', which mrl "
                               "replay reads from the log") and "copy the run's config.yaml" in line
    assert override_errors([*argv[:-1], "b", "--model.policies.learning_rate", "0.001"]) == []  # b is replayed
    assert override_errors([*argv[:-1], "[a,b]", "--model.policies.learning_rate", "0.001"]) == []
    assert override_errors(["fit", *argv[1:], "--model.policies.learning_rate", "0.001"]) == []  # mrl fit: a note


def test_a_log_missing_a_batch_of_records_every_batch_has_is_refused_before_the_build(log, tmp_path):
    import types

    from mrl_lightning.callbacks.exchange import SharedExperienceExchange
    from mrl_lightning.loop.replay import replay_errors

    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(line for line in log.read_text().splitlines(keepends=True)
                           if not ('"source": "b"' in line and '"step": 2' in line)))
    trainer = types.SimpleNamespace(fabric=types.SimpleNamespace(world_size=1), max_steps=3,
                                    callbacks=[SharedExperienceExchange(record_types=["group_stats", "success"])])
    assert replay_errors(trainer, None, ReplayLog(str(log), ["a", "b"], ["a"], max_steps=3)) == []
    (line,) = replay_errors(trainer, None, ReplayLog(str(cut), ["a", "b"], ["a"], max_steps=3))
    assert "holds no record of 'b' for batches 2, though the run's exchange published some at every batch" in line
    trainer.callbacks = [SharedExperienceExchange(record_types=["success"])]  # a batch may hold none: not checked
    assert replay_errors(trainer, None, ReplayLog(str(cut), ["a", "b"], ["a"], max_steps=3)) == []
    trainer.fabric.world_size, trainer.callbacks = 2, []
    assert [line[:40] for line in replay_errors(trainer, None, ReplayLog(str(log), ["a", "b"], ["a"], max_steps=3))] \
        == ["mrl replay runs in one process, but this", "trainer.callbacks has no SharedExperienc"]
