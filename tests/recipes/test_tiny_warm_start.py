"""The warm-start of ``TinyCausalLM`` says plainly when it stops below its target.

docs/default.md ("Warm-start"): a warm-start that runs out of ``warm_start_steps`` below
``warm_start_target`` prints a warning line naming the policy, the reached greedy accuracy
and the target, records the same line in ``warm_start.json``, and prints it again on a
cache hit.
"""

from __future__ import annotations

import json

import pytest

from mrl_lightning.builders import materialize
from mrl_lightning.recipes.tiny import warm_start_shortfall

PARTS = [
    {"name": "add", "dataset": "basic_arithmetic",
     "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                "allow_parentheses": False, "allow_negation": False}},
    {"name": "sub", "dataset": "basic_arithmetic",
     "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["-"],
                "allow_parentheses": False, "allow_negation": False}},
]


def test_shortfall_line_names_policy_accuracy_and_target():
    line = warm_start_shortfall("llama", "sub", {"add": 0.03, "sub": 0.7}, 0.9, 1500)
    assert line == ("[llama] warning: warm-start stopped at step 1500 below its target: greedy accuracy 0.70 on "
                    "'sub' < warm_start_target 0.9. Training starts from this model; raise warm_start_steps (or "
                    "lower warm_start_target) for a stronger start.")


@pytest.mark.parametrize("accuracy", [0.9, 0.95])
def test_no_line_when_the_target_is_reached(accuracy):
    assert warm_start_shortfall("gpt2", "add", {"add": accuracy}, 0.9, 1400) is None


def test_no_line_without_a_warm_start_part():
    assert warm_start_shortfall("gpt2", None, {}, 0.9, 0) is None


def test_missing_accuracy_counts_as_a_miss():
    assert "greedy accuracy not measured on 'add'" in warm_start_shortfall("gpt2", "add", {}, 0.9, 0)


def _build(tmp_path, target: float):
    import torch

    from mrl_lightning.data import ReasoningGymDataModule
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.recipes import TinyCausalLM

    torch.set_num_threads(1)
    recipe = TinyCausalLM(family="gpt2", tokenizer_kind="byte_level_bpe", vocab_size=300, hidden_size=16,
                          num_layers=1, num_heads=2, warm_start_part="add", warm_start_steps=2,
                          warm_start_target=target, warm_start_batch_size=4, eval_every=1,
                          cache_dir=str(tmp_path / "cache"))
    policy = PolicyModule(name="tiny", model=recipe, max_completion_length=3)
    data = ReasoningGymDataModule(parts=PARTS, batch_size=2, train_size=30, eval_size=4, seed=0)
    data.setup()
    return recipe, policy, data


def test_warm_start_below_target_warns_and_records_it(tmp_path):
    recipe, policy, data = _build(tmp_path, target=1.0)  # 2 steps of a width-16 model cannot reach 1.0
    lines: list[str] = []
    folder = recipe.materialize(policy, data, log=lines.append)
    report = json.loads((folder / "warm_start.json").read_text())
    warnings = [line for line in lines if "warning:" in line]
    assert len(warnings) == 1, lines
    reached = report["accuracy"]["add"]
    assert reached < 1.0
    assert warnings[0] == warm_start_shortfall("tiny", "add", report["accuracy"], 1.0, 2)
    assert f"greedy accuracy {reached:.2f} on 'add' < warm_start_target 1" in warnings[0]
    assert report["target"] == 1.0 and report["target_reached"] is False and report["warning"] == warnings[0]

    again: list[str] = []
    assert recipe.materialize(policy, data, log=again.append) == folder
    assert any("cache hit" in line for line in again) and warnings[0] in again

    # a resumed run takes its weights from the checkpoint: the cache hit does not repeat the warning
    resumed: list[str] = []
    assert materialize(policy, data, cache_log=resumed.append, resuming=True) == str(folder)
    assert any("cache hit" in line for line in resumed) and not any("warning:" in line for line in resumed)
    # ... unless beta > 0: the reference model is still the built (short) warm start
    with_kl: list[str] = []
    materialize(type(policy)(name="tiny", model=recipe, max_completion_length=3, beta=0.04),
                data, cache_log=with_kl.append, resuming=True)
    assert warnings[0] in with_kl


def test_warm_start_that_reaches_its_target_says_nothing(tmp_path):
    recipe, policy, data = _build(tmp_path, target=0.0)
    lines: list[str] = []
    folder = recipe.materialize(policy, data, log=lines.append)
    report = json.loads((folder / "warm_start.json").read_text())
    assert not any("warning:" in line for line in lines), lines
    assert report["target_reached"] is True and report["warning"] is None


def test_a_prebuilt_folder_of_the_same_recipe_is_taken_and_another_one_is_built_anew(tmp_path):
    """``prebuilt``: the same starting weights on every machine; a changed setting builds its own."""
    import filecmp

    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.recipes import TinyCausalLM

    recipe, policy, data = _build(tmp_path, target=0.99)
    shipped = recipe.materialize(policy, data, log=lambda line: None)
    assert json.loads((shipped / "warm_start.json").read_text())["identity"]["prompt"] == policy.prompt_template

    taken = TinyCausalLM(**{**recipe._args(), "cache_dir": str(tmp_path / "other"), "prebuilt": str(shipped)})
    lines: list[str] = []
    folder = taken.materialize(PolicyModule(name="tiny", model=taken, max_completion_length=3), data, log=lines.append)
    assert any("taken from" in line for line in lines) and not any("warm-start step" in line for line in lines)
    assert filecmp.cmp(folder / "model.safetensors", shipped / "model.safetensors", shallow=False)
    assert taken.cache_key(policy, data) == recipe.cache_key(policy, data)  # prebuilt is not in the key
    shortfall = [line for line in lines if "below its target" in line]  # the shipped build fell short of 0.99:
    assert len(shortfall) == 1 and shortfall[0].startswith("[tiny] warning: warm-start stopped")  # said so here too

    other = TinyCausalLM(**{**recipe._args(), "cache_dir": str(tmp_path / "third"), "prebuilt": str(shipped)})
    changed = PolicyModule(name="tiny", model=other, max_completion_length=3, prompt_template="Q: {question}\nA:")
    lines.clear()
    other.materialize(changed, data, log=lines.append)
    assert any("built from other recipe, template or data settings" in line for line in lines)
    assert any("warm-start step" in line for line in lines)  # it built its own
