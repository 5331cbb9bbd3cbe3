"""The warm-start of ``TinyCausalLM`` selects on a validation split of its own.

docs/default.md ("Warm-start"): it stops when greedy accuracy on *validation* prompts (set
apart from the training prompts, never trained on, never an evaluation question) reaches
``warm_start_target``; the held-out evaluation prompts are never scored, so the first
evaluation of a run is not biased upwards by the stopping rule.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mrl_lightning.data.items import PromptItem
from mrl_lightning.recipes.tiny import warm_start_split

BASE = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "allow_parentheses": False,
        "allow_negation": False}
PARTS = [{"name": "add", "dataset": "basic_arithmetic", "config": dict(BASE, operators=["+"])},
         {"name": "sub", "dataset": "basic_arithmetic", "config": dict(BASE, operators=["-"])}]


def _data(train_size=60, eval_size=10, seed=0):
    from mrl_lightning.data import ReasoningGymDataModule

    data = ReasoningGymDataModule(parts=PARTS, batch_size=2, train_size=train_size, eval_size=eval_size, seed=seed)
    data.setup()
    return data


def _questions(items):
    return {x.question for x in items}


def test_validation_is_disjoint_from_evaluation_and_from_what_the_warm_start_trains_on():
    data = _data()
    sft, validation = warm_start_split(data, "add", size=8, seed=0)
    evals = _questions(x for items in data.eval_items().values() for x in items)
    assert set(validation) == {"add", "sub"}
    for name, items in validation.items():
        assert len(items) == 8  # 1-digit operands: about 50 distinct training prompts, 8 <= n // 2
        assert not _questions(items) & evals, name
        assert {x.part for x in items} == {name}
    val_questions = _questions(x for items in validation.values() for x in items)
    assert sft and all(x.part == "add" for x in sft)
    assert not _questions(sft) & val_questions
    assert not _questions(sft) & evals
    # everything of the part that is neither validation nor evaluation is trained on
    expected = [x for x in data.train_items("add") if x.question not in val_questions | evals]
    assert [x.prompt_id for x in sft] == [x.prompt_id for x in expected]


def test_split_is_deterministic_and_follows_the_recipe_seed():
    data = _data()
    ids = lambda split: {k: [x.prompt_id for x in v] for k, v in split[1].items()}  # noqa: E731
    assert ids(warm_start_split(data, "add", 8, seed=0)) == ids(warm_start_split(data, "add", 8, seed=0))
    assert ids(warm_start_split(data, "add", 8, seed=0)) != ids(warm_start_split(data, "add", 8, seed=1))


def test_validation_takes_at_most_half_of_a_small_part():
    item = lambda pid, q, part: PromptItem(pid, q, "0", part, {})  # noqa: E731
    train = {"add": [item(f"add/{i}", f"q{i}", "add") for i in range(6)],
             "sub": [item(f"sub/{i}", f"s{i}", "sub") for i in range(3)]}
    data = SimpleNamespace(parts=[SimpleNamespace(name="add"), SimpleNamespace(name="sub")],
                           train_items=lambda part: train[part], eval_items=lambda: {"add": [item("add/e0", "q0", "add")]})
    sft, validation = warm_start_split(data, "add", size=100, seed=0)
    # add: q0 is an eval question, so the pool is q1..q5 (5 prompts) and 5 // 2 = 2 are set apart
    assert len(validation["add"]) == 2 and len(validation["sub"]) == 1
    assert "q0" not in _questions(validation["add"])
    assert len(sft) == 6 - 1 - 2 and "q0" not in _questions(sft)


def test_no_prompt_left_to_train_on_names_the_fields_and_the_fix():
    item = lambda pid: PromptItem(pid, "the same question", "0", "add", {})  # noqa: E731
    data = SimpleNamespace(parts=[SimpleNamespace(name="add")], train_items=lambda part: [item("add/0"), item("add/1")],
                           eval_items=lambda: {})
    with pytest.raises(ValueError, match="warm_start_val_size=5 .*lower warm_start_val_size or raise data.train_size"):
        warm_start_split(data, "add", size=5, seed=0)


def test_unknown_part_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"warm_start_part='mul' is not a data part; valid: \['add', 'sub'\]"):
        warm_start_split(_data(), "mul", 8, seed=0)


def test_warm_start_scores_only_validation_prompts_and_stops_on_them(tmp_path, monkeypatch):
    import torch

    import mrl_lightning.recipes.sft as sft_module
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.recipes import TinyCausalLM

    torch.set_num_threads(1)
    data = _data()
    scored: list[str] = []
    trained: list[str] = []
    real_batches = sft_module.sft_batches

    def fake_accuracy(policy, model, items, reward_fn=None):
        scored.extend(x.prompt_id for x in items)
        return 0.95  # above the target: the warm-start stops at its first check

    def spy_batches(policy, items, batch_size, rng):
        trained.extend(x.prompt_id for x in items)
        return real_batches(policy, items, batch_size, rng)

    monkeypatch.setattr(sft_module, "greedy_accuracy", fake_accuracy)
    monkeypatch.setattr(sft_module, "sft_batches", spy_batches)
    recipe = TinyCausalLM(family="gpt2", tokenizer_kind="byte_level_bpe", vocab_size=300, hidden_size=16,
                          num_layers=1, num_heads=2, warm_start_part="add", warm_start_steps=50,
                          warm_start_target=0.9, warm_start_val_size=8, warm_start_batch_size=4, eval_every=3,
                          cache_dir=str(tmp_path / "cache"))
    policy = PolicyModule(name="tiny", model=recipe, max_completion_length=3)
    folder = recipe.materialize(policy, data, log=lambda line: None)

    _, validation = warm_start_split(data, "add", 8, seed=0)
    val_ids = {x.prompt_id for items in validation.values() for x in items}
    eval_ids = {x.prompt_id for items in data.eval_items().values() for x in items}
    assert set(scored) == val_ids and len(scored) == 16  # both parts, one check
    assert not set(scored) & eval_ids
    assert trained and not set(trained) & val_ids
    report = json.loads((folder / "warm_start.json").read_text())
    assert report["steps"] == 3 and report["selected_on"] == "validation"
    assert report["validation_size"] == {"add": 8, "sub": 8}


def test_validation_size_is_part_of_the_cache_key():
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.recipes import TinyCausalLM

    data = _data()
    keys = []
    for size in (8, 9):
        recipe = TinyCausalLM(warm_start_part="add", warm_start_val_size=size)
        keys.append(recipe.cache_key(PolicyModule(name="tiny", model=recipe), data))
    assert keys[0] != keys[1]


@pytest.mark.parametrize("library", ["torch", "transformers", "tokenizers"])
def test_library_versions_are_part_of_the_cache_key(monkeypatch, library):
    import importlib

    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.recipes import TinyCausalLM

    data = _data()
    recipe = TinyCausalLM(warm_start_part="add")
    policy = PolicyModule(name="tiny", model=recipe)
    before = recipe.cache_key(policy, data)
    monkeypatch.setattr(importlib.import_module(library), "__version__", "0.0.0-other")
    assert recipe.cache_key(policy, data) != before


def test_non_positive_validation_size_is_refused():
    from mrl_lightning.errors import ConfigError
    from mrl_lightning.recipes import TinyCausalLM

    with pytest.raises(ConfigError, match="warm_start_val_size=0 must be >= 1"):
        TinyCausalLM(warm_start_val_size=0)
