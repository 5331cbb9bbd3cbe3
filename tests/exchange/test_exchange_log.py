"""SEE append-only log (docs/see.md): audit and replay, torn writes, formats."""

from __future__ import annotations

import importlib.util
import json

import pytest

from mrl_lightning.exchange import (
    ExperienceExchange,
    GroupStatsRecord,
    RolloutRecord,
    SuccessRecord,
    read_log,
    record_key,
)

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None

RECORDS = [
    GroupStatsRecord("p0", "a", 0, 4, 0.25, 0.5, 1),
    SuccessRecord("p0", "a", 0, "x = 42\n", 1.0, "exact", "1"),
    RolloutRecord("p1", "b", 1, "é😀", (7, 8), (-0.1, -2.0), ((0, 1), (1, 2)), float("nan"), "length", "fp"),
]


def test_log_replays_accepted_records_in_order(tmp_path):
    path = tmp_path / "logs" / "see.jsonl"
    ex = ExperienceExchange(log_path=str(path))
    ex.publish(RECORDS[:2])
    ex.publish([RECORDS[0], RECORDS[2]])  # the duplicate is not logged
    back = read_log(str(path))
    assert [record_key(r) for r in back] == [record_key(r) for r in RECORDS]
    assert len(path.read_text(encoding="utf-8").splitlines()) == 3


def test_replaying_log_rebuilds_the_same_exchange(tmp_path):
    path = tmp_path / "see.jsonl"
    ex = ExperienceExchange(log_path=str(path))
    ex.publish(RECORDS)
    replay = ExperienceExchange()
    replay.publish(read_log(str(path)))
    for rtype in (RolloutRecord, GroupStatsRecord, SuccessRecord):
        assert [record_key(r) for r in replay.query(rtype)] == [record_key(r) for r in ex.query(rtype)]


def test_log_keeps_every_refresh_and_replays_to_the_same_held_success(tmp_path):
    path = tmp_path / "see.jsonl"
    ex = ExperienceExchange(log_path=str(path), max_staleness=2)
    old = SuccessRecord("add/7", "b", 1, " 46", 1.0, "exact", "1")
    new = SuccessRecord("add/7", "b", 20, " 46", 1.0, "exact", "1")
    ex.publish([old])
    ex.publish([new, old])  # `old` again: older than the held step-20 record, dropped and not logged
    ex.advance(20)
    # The log is append-only: both accepted records are there, in publication order.
    assert [r.step for r in read_log(str(path))] == [1, 20]
    replay = ExperienceExchange(max_staleness=2)
    replay.publish(read_log(str(path)))
    replay.advance(20)
    assert replay.query(SuccessRecord) == ex.query(SuccessRecord) == [new]


def test_torn_last_line_is_skipped_and_cut_before_next_append(tmp_path):
    path = tmp_path / "see.jsonl"
    ExperienceExchange(log_path=str(path)).publish(RECORDS[:2])
    with open(path, "a", encoding="utf-8") as fh:  # a crash in the middle of a write
        fh.write('{"record_type": "group_stats", "prompt_id": "p9", "sou')
    with pytest.warns(UserWarning, match="see.jsonl.*torn line"):
        assert [record_key(r) for r in read_log(str(path))] == [record_key(r) for r in RECORDS[:2]]

    resumed = ExperienceExchange(log_path=str(path))
    with pytest.warns(UserWarning, match="torn line"):
        resumed.publish([RECORDS[2]])
    back = read_log(str(path))
    assert [record_key(r) for r in back] == [record_key(r) for r in RECORDS]


def test_corrupt_complete_line_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "see.jsonl"
    line = json.dumps({"record_type": "nope", "prompt_id": "p"})
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 1 is not a valid record"):
        read_log(str(path))


def test_missing_log_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_log(str(tmp_path / "none.jsonl"))


@pytest.mark.skipif(HAS_PYARROW, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_how_to_fix(tmp_path):
    with pytest.raises(ImportError, match="needs pyarrow.*log_format='jsonl'"):
        ExperienceExchange(log_path=str(tmp_path / "see"), log_format="parquet")


@pytest.mark.skipif(not HAS_PYARROW, reason="pyarrow is not installed")
def test_parquet_log_replays_records(tmp_path):
    path = tmp_path / "see"
    ex = ExperienceExchange(log_path=str(path), log_format="parquet")
    ex.publish(RECORDS[:2])
    ex.publish(RECORDS[2:])
    assert [record_key(r) for r in read_log(str(path))] == [record_key(r) for r in RECORDS]


def test_concurrent_producers_write_whole_lines(tmp_path):
    import threading

    path = tmp_path / "see.jsonl"
    ex = ExperienceExchange(log_path=str(path))

    def produce(t: int) -> None:
        for i in range(100):
            ex.publish([GroupStatsRecord(f"p{i}", f"s{t}", i, 4, 0.5, 0.5, 2)])

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    back = read_log(str(path))  # raises if any line were interleaved
    assert len(back) == 400 == len(ex)
    assert [record_key(r) for r in back] == [record_key(r) for r in ex.query(GroupStatsRecord)]
