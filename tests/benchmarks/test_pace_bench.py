"""benchmarks/pace.py: the pace simulation and the tables it reads from a run's scalars (docs/mwra.md, "Pace")."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_loader import load_benchmark


@pytest.fixture(scope="module")
def pace():
    return load_benchmark("pace")


def test_a_lag_cannot_beat_a_slower_mean_rate(pace):
    rollout, update = {"a": [4.0] * 40, "b": [6.0] * 40}, {"a": [6.0] * 40, "b": [8.0] * 40}
    assert pace.simulate(rollout, update, 0) == pytest.approx(14.0)
    for lag in (1, 2, 4):  # b needs 14 s a step whatever a does
        assert 14.0 <= pace.simulate(rollout, update, lag) < 14.0 * 1.05


def test_a_lag_absorbs_steps_that_take_turns_being_slow(pace):
    slow_fast = [10.0, 4.0] * 20
    rollout = {"a": slow_fast, "b": slow_fast[1:] + slow_fast[:1]}
    update = {"a": [3.0] * 40, "b": [3.0] * 40}
    lockstep, lagged = pace.simulate(rollout, update, 0), pace.simulate(rollout, update, 2)
    assert lockstep == pytest.approx(13.0)  # every step waits for whichever is slow in it
    assert lagged < 11.0 and lagged == pytest.approx(10.0, rel=0.05)  # (10 + 4) / 2 + 3


def _write_run(folder: Path, steps: int, wait_a: float) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for s in range(1, steps + 1):
        writer.add_scalar("train/elapsed_s", 12.0 * s, s)
        writer.add_scalar("train/exchange_time_s", 1.0 + wait_a, s)  # 1 s of work, the rest waiting
        for p, wait in (("a", wait_a), ("b", 0.0)):
            for tag, value in (("rollout_s", 3.0), ("update_s", 5.0), ("wait_s", wait),
                               ("wait_exchange_s", wait), ("wait_update_s", 0.0), ("wait_log_s", 0.0)):
                writer.add_scalar(f"mwra/{p}/{tag}", value, s)
    writer.add_scalar("eval/a/greedy_success_add", 0.5, steps)
    writer.close()


def test_the_report_reads_step_time_idle_share_and_evaluation(pace, tmp_path):
    _write_run(tmp_path / "lockstep", 5, wait_a=2.0)
    _write_run(tmp_path / "lag", 5, wait_a=0.0)
    text = pace.report(tmp_path, ["lockstep", "lag"], {"lockstep": 70.0})
    summary = pace.summarize(pace.read_run(tmp_path / "lockstep"))
    assert summary["s_per_step"] == pytest.approx(12.0) and summary["s_per_step_whole"] == pytest.approx(12.0)
    assert summary["policies"]["a"]["idle_share"] == pytest.approx(2.0 / 10.0)
    assert summary["policies"]["b"]["idle_share"] == 0.0
    assert pace.balanced_bound(summary, 2) == pytest.approx((8.0 + 8.0) / 2 + 1.0)  # the exchange's wait left out
    assert "| lockstep | 12.00 | 1.00x | 12.00 | 1.00x |" in text and "a 20%, b 0%" in text
    assert "`eval/a/greedy_success_add` | 0.500 | 0.500 |" in text
    assert (tmp_path / "timeline.png").stat().st_size > 1000 and (tmp_path / "pace.json").is_file()


def test_a_run_logged_every_few_steps_is_timed_per_step(pace, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "sparse"))
    for s in (10, 20):  # log_every_n_steps 10: a window's elapsed_s is its last step's
        writer.add_scalar("train/elapsed_s", 8.0 * s, s)
    writer.close()
    summary = pace.summarize(pace.read_run(tmp_path / "sparse"))
    assert summary["s_per_step"] == pytest.approx(8.0) and summary["s_per_step_whole"] == pytest.approx(8.0)


def test_a_run_without_the_step_clock_is_refused(pace, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "old"))
    writer.add_scalar("train/step_time_s", 1.0, 1)
    writer.close()
    with pytest.raises(SystemExit, match="train/elapsed_s"):
        pace.summarize(pace.read_run(tmp_path / "old"))


@pytest.mark.parametrize("argv, says", [
    (["--arm", "a=--x", "--arm", "a=--y"], "given twice"),
    (["--arm", "a='--x"], "check the quotes"),
    (["--arm", "lag2"], "give NAME=ARGS"),
    (["--read-only"], "does not exist"),
])
def test_bad_arguments_are_refused_in_one_line(pace, tmp_path, capsys, argv, says):
    out = tmp_path / "missing" if "--read-only" in argv else tmp_path
    with pytest.raises(SystemExit) as stop:
        pace.main(["--out", str(out), *argv])
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_an_async_arm_draws_the_next_batch_beside_the_update_and_the_wait_for_it(pace):
    scalars = {f"mwra/{p}/{tag}": {s: value for s in (1, 2, 3)}
               for p, tag, value in (("a", "rollout_s", 4.0), ("a", "update_s", 3.0), ("a", "wait_exchange_s", 0.0),
                                     ("b", "rollout_s", 1.0), ("b", "update_s", 6.0), ("b", "wait_exchange_s", 0.0))}
    rows, bars = pace.lanes(scalars, serial=False, beside=True)
    assert rows == ["a", "a: sampler thread", "b", "b: sampler thread"]
    a = [(phase, left, width) for row, phase, left, width in bars if row == "a"]
    thread = [(left, width) for row, phase, left, width in bars if row == "a: sampler thread"]
    # batch 1 before the first update; batches 2 and 3 on the thread from each update's start; a waits 1 s for
    # each (its 4 s of sampling against its 3 s update)
    assert a == [("rollout_s", 0.0, 4.0), ("update_s", 4.0, 3.0), ("other_wait", 7.0, 1.0), ("update_s", 8.0, 3.0),
                 ("other_wait", 11.0, 1.0), ("update_s", 12.0, 3.0)]
    assert thread == [(4.0, 4.0), (8.0, 4.0)]
    assert not [bar for bar in bars if bar[0] == "b" and bar[1] == "other_wait"]  # b's sampling hides in its update
    rows, bars = pace.lanes(scalars, serial=True, beside=True)  # one process: one thread samples both in turn
    assert rows == ["one process", "one process: sampler thread"]
    assert [(left, width) for row, _, left, width in bars if row.endswith("thread")] == [
        (5.0, 4.0), (9.0, 1.0), (14.0, 4.0), (18.0, 1.0)]  # after both first rollouts, then at each update
    serial_lockstep = pace.lanes(scalars, serial=True, beside=False)[1]
    assert sum(width for *_, width in serial_lockstep) == pytest.approx(3 * (4 + 3 + 1 + 6))


def test_sampling_beside_the_update_hides_the_shorter_of_the_two(pace):
    rollout, update = {"a": [4.0] * 40, "b": [6.0] * 40}, {"a": [6.0] * 40, "b": [8.0] * 40}
    assert pace.simulate(rollout, update, 0) == pytest.approx(14.0)  # b: 6 + 8 in turn
    beside = pace.simulate_beside(rollout, update)
    assert beside == pytest.approx(8.0, rel=0.02)  # b's 6 s of sampling hides in its 8 s update (batch 1 first)
    slow = {"a": [10.0] * 40, "b": [1.0] * 40}  # sampling longer than the update: the update hides in it
    assert pace.simulate_beside(slow, {"a": [3.0] * 40, "b": [3.0] * 40}) == pytest.approx(10.0, rel=0.02)


def test_solo_steps_count_as_busy_time_and_as_steps_of_their_policy(pace, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    _write_run(tmp_path / "lockstep", 5, wait_a=2.0)
    writer = SummaryWriter(str(tmp_path / "solo"))
    for s in range(1, 6):  # a's idle 2 s spent on a solo step every other round (8 s): 13 s a round on average
        writer.add_scalar("train/elapsed_s", 13.0 * s, s)
        solo = 8.0 if s % 2 == 0 else 0.0
        writer.add_scalar("solo/a/steps", 1.0 if solo else 0.0, s)
        for p, phases in (("a", {"solo_s": solo, "wait_s": 0.0 if solo else 5.0}), ("b", {"wait_s": 3.0 if solo else 0.0})):
            for tag, value in {"rollout_s": 3.0, "update_s": 5.0, **phases}.items():
                writer.add_scalar(f"mwra/{p}/{tag}", value, s)
    writer.close()
    text = pace.report(tmp_path, ["lockstep", "solo"], {})
    solo = pace.summarize(pace.read_run(tmp_path / "solo"))["policies"]
    # steps 2-5: 4 rounds and 2 solo steps of a in 52 s; b its 4 rounds
    assert solo["a"]["steps_per_100_s"] == pytest.approx(100 * 6 / 52) and solo["b"]["steps_per_100_s"] == \
        pytest.approx(100 * 4 / 52)
    assert solo["a"]["idle_share"] == pytest.approx(10.0 / (4 * 8.0 + 16.0 + 10.0))  # solo_s is busy time
    assert "a 11.5 (1.38x), b 7.7 (0.92x)" in text  # against lockstep's 4 steps in 48 s
    # simulated from the solo arm's phases: a's solo step counts with its round's sampling, (8 + 16 + 8 + 16 + 8) / 5
    assert "max_lag 0: 11.20" in pace.report(tmp_path, ["solo", "lockstep"], {})
