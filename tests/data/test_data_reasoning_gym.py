"""ReasoningGymDataModule: batches split across parts, stable ids, held-out eval, exact resume.

The generator config uses 1-digit operands (few distinct questions), so the evaluation
set and the raw training set collide often and the hold-out filter has work to do, and a
small ``train_size`` makes the stream wrap into a new epoch within a few batches.
"""

from __future__ import annotations

import pytest

from mrl_lightning.data.reasoning_gym import ReasoningGymDataModule, TaskPart
from mrl_lightning.errors import ConfigError

BASE = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, allow_parentheses=False, allow_negation=False)


def _parts(add_weight=1.0, sub_weight=1.0):
    return [
        TaskPart("add", "basic_arithmetic", dict(BASE, operators=["+"]), weight=add_weight),
        TaskPart("sub", "basic_arithmetic", dict(BASE, operators=["-"]), weight=sub_weight),
    ]


def _dm(batch_size=4, train_size=12, eval_size=10, seed=0, **weights):
    return ReasoningGymDataModule(_parts(**weights), batch_size=batch_size, train_size=train_size,
                                  eval_size=eval_size, seed=seed)


def _ids(batches):
    return [[x.prompt_id for x in b] for b in batches]


@pytest.mark.parametrize(
    "batch_size, weights, expected",
    [
        # equal weights: 4 * 1/2 = 2 each
        (4, dict(), {"add": 2, "sub": 2}),
        # 3:1 -> int(4 * 3/4) = 3 and int(4 * 1/4) = 1
        (4, dict(add_weight=3.0), {"add": 3, "sub": 1}),
        # 5 * 1/2 = 2.5 -> 2 + 2, the one left over goes to the first part of the largest weight
        (5, dict(), {"add": 3, "sub": 2}),
    ],
)
def test_batches_are_split_across_parts_by_weight(batch_size, weights, expected):
    dm = _dm(batch_size=batch_size, **weights)
    for _ in range(3):
        batch = dm.next_batch()
        assert len(batch) == batch_size
        counts = {p: sum(x.part == p for x in batch) for p in ("add", "sub")}
        assert counts == expected
        for x in batch:
            assert x.prompt_id.startswith(f"{x.part}/")
            assert ("+" if x.part == "add" else "-") in x.question


def test_prompt_ids_are_stable_across_instances():
    a, b = _dm(), _dm()
    for part in ("add", "sub"):
        items = a.train_items(part)
        assert {x.prompt_id: x.question for x in items} == {x.prompt_id: x.question for x in b.train_items(part)}
        assert len({x.prompt_id for x in items}) == len(items)
    assert _ids(a.next_batch() for _ in range(4)) == _ids(b.next_batch() for _ in range(4))
    # The id names the prompt, not its place in the stream: every occurrence of an id has the same text.
    seen = {}
    for x in (x for _ in range(6) for x in a.next_batch()):
        assert seen.setdefault(x.prompt_id, x.question) == x.question


def test_another_seed_gives_another_stream():
    assert _ids(_dm(seed=0).next_batch() for _ in range(2)) != _ids(_dm(seed=1).next_batch() for _ in range(2))


def test_eval_prompts_are_held_out_of_training():
    dm = _dm(train_size=60, eval_size=20)
    evals = dm.eval_items()
    for part in ("add", "sub"):
        held = {x.question for x in evals[part]}
        train = dm.train_items(part)
        assert len(evals[part]) == len(held) == 20  # distinct questions (tests/data/test_data_held_out.py)
        assert all(x.prompt_id.startswith(f"{part}/e") for x in evals[part])
        assert not held & {x.question for x in train}
        # 1-digit operands give few distinct questions: the filter really removed some.
        assert len(train) < 60
    streamed = {x.question for _ in range(40) for x in dm.next_batch()}
    assert not streamed & {x.question for p in ("add", "sub") for x in evals[p]}


def test_resume_from_state_dict_continues_the_identical_stream():
    # 12 generated per part minus the eval collisions; 2 per part per batch, so 8 batches
    # wrap each part's epoch at least once.
    uninterrupted = _dm()
    reference = _ids(uninterrupted.next_batch() for _ in range(8))
    first = _dm()
    head = _ids(first.next_batch() for _ in range(3))
    state = first.state_dict()
    first.next_batch()  # advancing after the snapshot must not change the snapshot
    resumed = _dm()
    resumed.load_state_dict(state)
    tail = _ids(resumed.next_batch() for _ in range(5))
    assert head + tail == reference
    assert max(v["epoch"] for v in resumed.state_dict()["position"].values()) >= 1  # crossed an epoch
    # Without the state, a fresh module starts over instead.
    assert _ids(_dm().next_batch() for _ in range(5)) != tail


def test_load_state_dict_rejects_other_parts():
    dm = ReasoningGymDataModule([TaskPart("add", "basic_arithmetic", dict(BASE, operators=["+"]))], batch_size=2,
                                train_size=5, eval_size=2)
    with pytest.raises(ValueError, match=r"\['add', 'sub'\] differ from config parts \['add'\]"):
        dm.load_state_dict(_dm().state_dict())


def test_bad_data_config_lists_every_problem():
    with pytest.raises(ConfigError) as info:
        ReasoningGymDataModule(
            [TaskPart("a", "no_such_dataset"), TaskPart("a", "basic_arithmetic", weight=0.0),
             TaskPart("b", "basic_arithmetic")],
            batch_size=2, train_size=0,
        )
    message = str(info.value)
    for fragment in ("names must be unique", "dataset='no_such_dataset'", "weight=0.0", "train_size=0",
                     "batch_size=2 is smaller than the number of parts (3)"):
        assert fragment in message, fragment


@pytest.mark.parametrize("config,expected", [
    ({"bogus_key": 3}, "bogus_key"),
    ({"min_terms": 3, "max_terms": 2}, "max_terms"),
])
def test_bad_generator_config_is_a_config_error_naming_the_part(config, expected):
    from mrl_lightning.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        ReasoningGymDataModule([TaskPart("add", "basic_arithmetic", config)], batch_size=2)
    assert "data.parts[add].config" in str(info.value) and expected in str(info.value)
