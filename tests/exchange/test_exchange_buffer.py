"""SEE buffer (docs/see.md): dedup, retention, subscriptions, concurrency, resume."""

from __future__ import annotations

import io
import math
import threading

import pytest
import torch

from mrl_lightning.exchange import (
    ExperienceExchange,
    GroupStatsRecord,
    RolloutRecord,
    SuccessRecord,
    record_key,
)


def stats(prompt: str = "p0", source: str = "a", step: int = 0, mean: float = 0.5) -> GroupStatsRecord:
    return GroupStatsRecord(prompt, source, step, 4, mean, 0.5, 2)


def success(prompt: str = "p0", source: str = "a", step: int = 0, text: str = "42") -> SuccessRecord:
    return SuccessRecord(prompt, source, step, text, 1.0, "exact", "1")


def rollout(prompt: str = "p0", source: str = "a", step: int = 0, reward: float = 1.0) -> RolloutRecord:
    return RolloutRecord(
        prompt, source, step, "ab", (5, 6), (-0.5, -1.25), ((0, 1), (1, 2)), reward, "stop", "fp"
    )


def test_identical_records_are_stored_once_and_counted():
    ex = ExperienceExchange()
    assert ex.publish([stats(), stats(), rollout(), rollout()]) == 2
    assert ex.publish([stats()]) == 0
    m = ex.metrics()
    assert len(ex) == 2
    assert m["exchange/records_published"] == 2.0
    assert m["exchange/duplicates_dropped"] == 3.0
    assert m["exchange/group_stats_held"] == 1.0 and m["exchange/rollout_held"] == 1.0


def test_nan_reward_rollouts_deduplicate():
    ex = ExperienceExchange()
    assert ex.publish([rollout(reward=float("nan")), rollout(reward=float("nan"))]) == 1


def test_nan_inside_logprobs_deduplicates_and_differs_from_finite():
    nan_lp = RolloutRecord("p0", "a", 0, "ab", (5, 6), (float("nan"), -1.0), ((0, 1), (1, 2)), 1.0, "stop", "fp")
    same = RolloutRecord("p0", "a", 0, "ab", (5, 6), (float("nan"), -1.0), ((0, 1), (1, 2)), 1.0, "stop", "fp")
    ex = ExperienceExchange()
    assert ex.publish([nan_lp, same, rollout()]) == 2


def test_records_differing_in_one_field_are_both_kept():
    ex = ExperienceExchange()
    assert ex.publish([stats(mean=0.5), stats(mean=0.25), stats(step=1)]) == 3


def test_repeated_success_refreshes_the_held_record_newest_step_wins():
    ex = ExperienceExchange()
    first = success(step=0)
    later = success(step=3)  # differs only in step: same (prompt, source, text)
    other_source = success(source="b", step=3)
    assert ex.publish([first, later, other_source]) == 3  # `later` is accepted and replaces `first`
    assert ex.query(SuccessRecord) == [later, other_source]
    assert ex.publish([success(step=1)]) == 0  # older than the held step 3: dropped
    assert ex.query(SuccessRecord) == [later, other_source]
    m = ex.metrics()
    assert m["exchange/successes_refreshed"] == 1.0 and m["exchange/duplicates_dropped"] == 1.0
    assert m["exchange/success_held"] == 2.0 and m["exchange/records_held"] == 2.0


def test_success_solved_again_at_step_20_survives_a_staleness_window_of_2():
    # A peer solves add/7 at step 1 and again (same text) at step 20. The loop publishes a step's
    # records, then advances: with max_staleness 2, advance(20) keeps steps >= 18. The step-20
    # success must be held (it used to be dropped as a duplicate of the step-1 one, which advance
    # then evicted, leaving nothing).
    ex = ExperienceExchange(max_staleness=2)
    ex.publish([success("add/7", "b", 1, " 46")])
    ex.advance(1)
    ex.publish([success("add/7", "b", 20, " 46")])
    ex.advance(20)
    assert ex.query(SuccessRecord) == [success("add/7", "b", 20, " 46")]
    assert ex.query(SuccessRecord, receiver="a", step=20) == [success("add/7", "b", 20, " 46")]
    assert ex.metrics()["exchange/evicted_stale"] == 0.0  # the step-1 record was replaced, not evicted


def test_refreshed_success_is_polled_again_and_resumes_identically():
    ex = ExperienceExchange(max_staleness=5)
    ex.subscribe("a", [SuccessRecord])
    ex.publish([success(source="b", step=1)])
    assert ex.poll("a") == [success(source="b", step=1)]
    ex.publish([success(source="b", step=4)])
    state = ex.state_dict()
    resumed = ExperienceExchange(max_staleness=5)
    resumed.load_state_dict(state)
    for e in (ex, resumed):
        assert e.poll("a") == [success(source="b", step=4)]
        assert e.publish([success(source="b", step=2)]) == 0  # older than held: dropped after resume too
        assert e.publish([success(source="b", step=9)]) == 1
        e.advance(9)
        assert e.query(SuccessRecord) == [success(source="b", step=9)]
    assert resumed.metrics() == ex.metrics()
    assert resumed.state_dict() == ex.state_dict()
    assert ex.metrics()["exchange/successes_refreshed"] == 2.0


def test_query_excludes_own_records_unless_asked():
    ex = ExperienceExchange()
    mine, theirs = stats(source="a"), stats(source="b")
    ex.publish([mine, theirs])
    assert ex.query(GroupStatsRecord, receiver="a") == [theirs]
    assert ex.query(GroupStatsRecord, receiver="a", include_own=True) == [mine, theirs]
    assert ex.query(GroupStatsRecord) == [mine, theirs]
    assert ex.query(RolloutRecord, receiver="a") == []


def test_query_filters_by_prompt_in_publication_order():
    ex = ExperienceExchange()
    recs = [stats("p0", "b", 0), stats("p1", "b", 0), stats("p2", "b", 0), stats("p0", "c", 1)]
    ex.publish(recs)
    # Order follows publication, not the order of prompt_ids.
    assert ex.query(GroupStatsRecord, receiver="a", prompt_ids=["p2", "p0"]) == [recs[0], recs[2], recs[3]]
    assert ex.query(GroupStatsRecord, prompt_ids=["missing"]) == []


def test_query_staleness_window_keeps_records_at_the_edge():
    ex = ExperienceExchange(max_staleness=2)
    recs = [stats(step=s, source="b") for s in range(6)]
    ex.publish(recs)
    # step 5, window 2 -> steps >= 3 pass.
    assert ex.query(GroupStatsRecord, receiver="a", step=5) == recs[3:]
    assert ex.query(GroupStatsRecord, receiver="a", step=5, max_staleness=0) == recs[5:]
    # Without a step, no staleness filter applies.
    assert ex.query(GroupStatsRecord, receiver="a") == recs


def test_advance_evicts_stale_records_and_counts_them():
    ex = ExperienceExchange(max_staleness=1)
    ex.publish([stats(step=s) for s in range(4)])
    assert ex.advance(3) == 2  # steps 0 and 1 are older than 3 - 1
    assert [r.step for r in ex.query(GroupStatsRecord)] == [2, 3]
    assert ex.metrics()["exchange/evicted_stale"] == 2.0
    assert ExperienceExchange().advance(100) == 0  # no staleness: nothing evicted


def test_capacity_evicts_oldest_first():
    ex = ExperienceExchange(capacity=3)
    ex.publish([stats(step=s) for s in range(5)])
    assert [r.step for r in ex.query(GroupStatsRecord)] == [2, 3, 4]
    assert ex.metrics()["exchange/evicted_capacity"] == 2.0
    # An evicted record may be published again (it is no longer held).
    assert ex.publish([stats(step=0)]) == 1


def test_evicted_success_frees_its_dedup_key():
    ex = ExperienceExchange(capacity=1)
    ex.publish([success(step=0), stats()])  # the success is evicted by capacity
    assert ex.publish([success(step=5)]) == 1


def test_poll_returns_only_new_subscribed_types_from_peers():
    ex = ExperienceExchange()
    ex.subscribe("a", [SuccessRecord])
    ex.subscribe("b", [GroupStatsRecord, SuccessRecord])
    ex.publish([success(source="a"), success(source="b"), stats(source="b")])
    assert ex.poll("a") == [success(source="b")]
    assert ex.poll("b") == [success(source="a")]
    assert ex.poll("a") == []
    ex.publish([success(source="c", text="7"), stats(source="c")])
    assert ex.poll("a") == [success(source="c", text="7")]
    assert ex.poll("b") == [success(source="c", text="7"), stats(source="c")]


def test_late_subscriber_catches_up_on_held_records():
    ex = ExperienceExchange()
    ex.publish([stats(source="b")])
    ex.subscribe("a", [GroupStatsRecord])
    assert ex.poll("a") == [stats(source="b")]


def test_poll_without_subscription_names_the_fix():
    ex = ExperienceExchange()
    with pytest.raises(ValueError, match=r"receiver='x' has no subscription; call subscribe"):
        ex.poll("x")


def test_invalid_config_reports_every_problem():
    with pytest.raises(ValueError) as err:
        ExperienceExchange(capacity=0, max_staleness=-1, log_format="csv")
    msg = str(err.value)
    assert "capacity=0" in msg and "max_staleness=-1" in msg and "log_format='csv'" in msg


def test_publish_rejects_non_records_and_publishes_nothing():
    ex = ExperienceExchange()
    with pytest.raises(TypeError, match=r"records\[1\] is a dict"):
        ex.publish([stats(), {"prompt_id": "p0"}])
    assert len(ex) == 0


def test_query_rejects_non_record_type():
    with pytest.raises(TypeError, match="record_type=<class 'dict'> is not a record class"):
        ExperienceExchange().query(dict)


def test_concurrent_producers_lose_nothing_and_duplicate_nothing():
    ex = ExperienceExchange()
    n_threads, per_thread = 4, 300
    barrier = threading.Barrier(n_threads)

    def produce(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            # Every thread also publishes one shared record per i: only one copy survives.
            ex.publish([stats(f"p{i}", f"src{t}", i), stats(f"p{i}", "shared", i)])

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    m = ex.metrics()
    assert len(ex) == n_threads * per_thread + per_thread
    assert m["exchange/records_published"] == len(ex)
    assert m["exchange/duplicates_dropped"] == (n_threads - 1) * per_thread
    # Each producer's own records stay in its own order.
    for t in range(n_threads):
        mine = ex.query(GroupStatsRecord, receiver="x", include_own=True)
        steps = [r.step for r in mine if r.source == f"src{t}"]
        assert steps == list(range(per_thread))


def keys(records) -> list[tuple]:
    return [record_key(r) for r in records]


def _fill(ex: ExperienceExchange) -> None:
    ex.subscribe("a", [SuccessRecord, RolloutRecord])
    ex.subscribe("b", [GroupStatsRecord])
    ex.publish([stats(step=s, source="b") for s in range(4)])
    ex.publish([success(step=1, source="b"), success(step=2, source="b"), rollout(reward=float("nan"))])
    ex.publish([stats(step=0, source="b")])  # duplicate
    ex.advance(3)
    ex.poll("a")
    ex.publish([rollout(source="b", step=3), success(source="b", text="9", step=3)])


def test_resume_from_state_dict_gives_same_queries_metrics_and_polls():
    ex = ExperienceExchange(capacity=6, max_staleness=1)
    _fill(ex)
    buf = io.BytesIO()
    torch.save(ex.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    resumed = ExperienceExchange(capacity=6, max_staleness=1)
    resumed.load_state_dict(state)
    assert resumed.metrics() == ex.metrics()
    assert len(resumed) == len(ex)
    for rtype in (RolloutRecord, GroupStatsRecord, SuccessRecord):
        for receiver in (None, "a", "b"):
            got = resumed.query(rtype, receiver=receiver, step=3)
            want = ex.query(rtype, receiver=receiver, step=3)
            assert keys(got) == keys(want)  # record_key: NaN rewards compare equal
    # Same subsequent behaviour: polls, dedup, eviction.
    for e in (ex, resumed):
        e.publish([success(source="b", text="9", step=4), stats(step=4, source="c")])
        e.advance(4)
    assert keys(resumed.poll("a")) == keys(ex.poll("a"))
    assert keys(resumed.poll("b")) == keys(ex.poll("b"))
    assert resumed.metrics() == ex.metrics()
    assert _nan_equal(resumed.state_dict(), ex.state_dict())


def _nan_equal(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_nan_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_nan_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_load_state_dict_rejects_unknown_version():
    with pytest.raises(ValueError, match="state version=99 is not readable"):
        ExperienceExchange().load_state_dict({"version": 99})


def test_load_into_smaller_capacity_evicts_oldest():
    ex = ExperienceExchange()
    ex.publish([stats(step=s) for s in range(5)])
    small = ExperienceExchange(capacity=2)
    small.load_state_dict(ex.state_dict())
    assert [r.step for r in small.query(GroupStatsRecord)] == [3, 4]
    assert small.metrics()["exchange/evicted_capacity"] == 3.0
