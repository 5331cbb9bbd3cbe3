"""SEE bounds in bytes and per record type (docs/see.md, "Retention"), and the log's resume cut."""

from __future__ import annotations

import importlib.util
import random
import tracemalloc

import pytest

from mrl_lightning.callbacks import SharedExperienceExchange
from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import (
    ExperienceExchange,
    GroupStatsRecord,
    RolloutRecord,
    SuccessRecord,
    read_log,
    record_key,
)
from mrl_lightning.exchange.records import RECORD_OVERHEAD_BYTES, ROLLOUT_TOKEN_BYTES, record_nbytes

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None


def rollout(i: int, step: int = 0, tokens: int = 8, source: str = "a") -> RolloutRecord:
    rng = random.Random(i)
    return RolloutRecord(f"add/{i}", source, step, f" {i % 100}", tuple(rng.randrange(400) for _ in range(tokens)),
                         tuple(-rng.random() for _ in range(tokens)), tuple((j, j + 1) for j in range(tokens)),
                         1.0, "stop", "fp")


def success(i: int, step: int = 0, source: str = "a") -> SuccessRecord:
    return SuccessRecord(f"add/{i}", source, step, f" {i}", 1.0, "exact", "1")


def test_size_estimate_is_the_documented_formula():
    r = rollout(1, tokens=5)
    assert record_nbytes(r) == RECORD_OVERHEAD_BYTES + len(r.completion_text) + 5 * ROLLOUT_TOKEN_BYTES
    s = success(1234)
    assert record_nbytes(s) == RECORD_OVERHEAD_BYTES + len(" 1234")
    assert record_nbytes(GroupStatsRecord("p", "a", 0, 8, 0.5, 0.1, 3)) == RECORD_OVERHEAD_BYTES


@pytest.mark.parametrize("make", [lambda i: success(i), lambda i: rollout(i, tokens=1),
                                  lambda i: rollout(i, tokens=8), lambda i: rollout(i, tokens=32)],
                         ids=["success", "rollout-1", "rollout-8", "rollout-32"])
def test_size_estimate_is_within_30_percent_of_measured_memory(make):
    n = 1000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        records = [make(i) for i in range(n)]
        ex = ExperienceExchange(capacity=10 * n)
        ex.publish(records)
        measured = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    estimated = ex.metrics()["exchange/bytes_held"] / n
    assert 0.7 * measured <= estimated <= 1.3 * measured, (estimated, measured)


def test_byte_bound_evicts_the_oldest_and_counts_them():
    size = record_nbytes(success(10))  # every success(10..99) has the same size
    ex = ExperienceExchange(max_bytes=5 * size)
    ex.publish([success(i, step=i) for i in range(10, 18)])
    m = ex.metrics()
    assert [r.prompt_id for r in ex.query(SuccessRecord)] == [f"add/{i}" for i in range(13, 18)]
    assert m["exchange/bytes_held"] == 5 * size
    assert m["exchange/evicted_bytes"] == 3 and m["exchange/evicted_capacity"] == 0


def test_bytes_held_follows_every_way_records_leave():
    ex = ExperienceExchange(capacity=6, max_staleness=2, max_bytes=20_000)
    ex.publish([rollout(i, step=0) for i in range(4)] + [success(1, step=0)])
    ex.publish([success(1, step=1)])  # refresh: the held success is replaced
    ex.publish([rollout(i, step=1, tokens=30) for i in range(4, 9)])  # capacity and bytes evict
    ex.advance(4)  # staleness evicts what is older than step 2
    ex.publish([rollout(i, step=4) for i in range(20, 22)])
    held = ex.query(RolloutRecord, include_own=True) + ex.query(SuccessRecord, include_own=True)
    assert ex.metrics()["exchange/bytes_held"] == sum(record_nbytes(r) for r in held)
    assert ex.metrics()["exchange/bytes_held"] <= 20_000


def test_per_type_staleness_keeps_successes_and_drops_old_rollouts():
    ex = ExperienceExchange(max_staleness_by_type={"rollout": 0})
    ex.publish([rollout(1, step=1), success(1, step=1)])
    ex.advance(1)
    assert len(ex.query(RolloutRecord)) == 1
    ex.publish([rollout(2, step=2), success(2, step=2)])
    ex.advance(2)
    assert [r.step for r in ex.query(RolloutRecord)] == [2]
    assert [r.step for r in ex.query(SuccessRecord)] == [1, 2]
    assert ex.metrics()["exchange/evicted_stale"] == 1


def test_state_restores_bytes_and_a_smaller_bound_evicts_the_oldest():
    ex = ExperienceExchange()
    ex.publish([success(i, step=i) for i in range(10, 20)])
    state = ex.state_dict()
    same = ExperienceExchange()
    same.load_state_dict(state)
    assert same.metrics()["exchange/bytes_held"] == ex.metrics()["exchange/bytes_held"]
    small = ExperienceExchange(max_bytes=4 * record_nbytes(success(10)))
    small.load_state_dict(state)
    assert [r.step for r in small.query(SuccessRecord)] == [16, 17, 18, 19]
    assert small.metrics()["exchange/evicted_bytes"] == 6


def test_invalid_bounds_are_reported_together():
    with pytest.raises(ValueError) as info:
        ExperienceExchange(max_bytes=0, max_staleness_by_type={"rollouts": 0, "success": -1})
    msg = str(info.value)
    assert "max_bytes=0" in msg and "'rollouts'" in msg and "['group_stats', 'rollout', 'success']" in msg
    assert "max_staleness_by_type['success']=-1" in msg
    with pytest.raises(ConfigError, match="SharedExperienceExchange.*max_bytes=-5"):
        SharedExperienceExchange(max_bytes=-5)


def test_callback_passes_bounds_to_its_exchange():
    cb = SharedExperienceExchange(capacity=7, max_bytes=1234, max_staleness_by_type={"rollout": 0})
    assert (cb.exchange.capacity, cb.exchange.max_bytes, cb.exchange.max_staleness_by_type) == \
        (7, 1234, {"rollout": 0})


def _run(ex: ExperienceExchange, steps: range) -> None:
    for step in steps:
        ex.publish([success(step, step=step), rollout(step, step=step)])
        ex.advance(step)


@pytest.mark.parametrize("log_format", ["jsonl", pytest.param("parquet", marks=pytest.mark.skipif(
    not HAS_PYARROW, reason="pyarrow not installed"))])
def test_resume_into_the_same_log_cuts_the_lost_steps_and_ends_equal_to_a_straight_log(tmp_path, log_format):
    straight = tmp_path / f"straight.{log_format}"
    _run(ExperienceExchange(log_path=str(straight), log_format=log_format), range(1, 7))

    shared = tmp_path / f"shared.{log_format}"
    first = ExperienceExchange(log_path=str(shared), log_format=log_format)
    _run(first, range(1, 4))
    checkpoint = first.state_dict()  # "checkpoint" at step 3
    _run(first, range(4, 6))  # steps 4-5 happen, then the process dies
    if log_format == "jsonl":
        with open(shared, "a") as fh:
            fh.write('{"record_type": "success", "prom')  # killed mid-append
    resumed = ExperienceExchange(log_path=str(shared), log_format=log_format)
    resumed.load_state_dict(checkpoint)
    assert [r.step for r in read_log(str(shared), log_format)] == [1, 1, 2, 2, 3, 3]
    _run(resumed, range(4, 7))
    assert [record_key(r) for r in read_log(str(shared), log_format)] == \
        [record_key(r) for r in read_log(str(straight), log_format)]


def test_rollouts_of_successes_only_publishes_rollout_records_of_verified_successes(monkeypatch):
    from types import SimpleNamespace

    import torch

    import mrl_lightning.callbacks.exchange as see_module
    from mrl_lightning.callbacks import PeerRolloutPooling
    from mrl_lightning.data.items import PromptItem
    from mrl_lightning.exchange import RolloutRecord, SuccessRecord
    from mrl_lightning.rollout.hf_generate import RolloutBatch

    monkeypatch.setattr(see_module, "token_bytes", lambda tok, ids: [str(i).encode() for i in ids])
    monkeypatch.setattr(see_module, "tokenizer_fingerprint", lambda tok: "fp")
    success = torch.tensor([[True, False, False, True]])
    rollouts = RolloutBatch(
        prompt_ids=torch.ones(4, 1, dtype=torch.long), prompt_mask=torch.ones(4, 1, dtype=torch.bool),
        completion_ids=torch.tensor([[1, 2]] * 4), completion_mask=torch.ones(4, 2, dtype=torch.bool),
        old_logprobs=torch.zeros(4, 2), finish_reasons=["stop"] * 4, completion_texts=["12", "11", "10", "12"])
    scored = SimpleNamespace(policy="a", items=[PromptItem("add/0", "q", "12", "add", {})], rollouts=rollouts,
                             rewards=success.float(), success=success, num_generations=4,
                             verifier_rewards=success.float().view(-1))
    verifier, policy = SimpleNamespace(name="v", version="1"), SimpleNamespace(tokenizer=None)
    published = {}
    for only in (False, True):
        see = SharedExperienceExchange(record_types=["rollout", "success"], rollouts_of_successes_only=only)
        records = see.records_for(scored, 1, policy, verifier)
        published[only] = ([r.sample_index for r in records if isinstance(r, RolloutRecord)],
                           sum(isinstance(r, SuccessRecord) for r in records))
    assert published[False] == ([0, 1, 2, 3], 2)
    assert published[True] == ([0, 3], 2)
    see = SharedExperienceExchange(rollouts_of_successes_only=True)
    errors = see.config_errors(SimpleNamespace(callbacks=[see, PeerRolloutPooling()]), None)
    assert any("rollouts_of_successes_only" in e for e in errors)
