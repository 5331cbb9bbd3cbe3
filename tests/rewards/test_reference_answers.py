"""Every GSM8K / MATH500 reference answer verifies as correct against itself.

Each reference is written as a completion in two ways, boxed (``... \\boxed{ref}.``) and as
plain text (``The answer is ref.``, as a model writes it without LaTeX delimiters), and
scored by ``MathVerifyReward``. Runs on the full files under ``../shared/data`` when they
are there, else on the 30-line samples in ``tests/data_samples``; the counts are printed.
GSM8K references plus one must all score 0, so that a verifier accepting anything fails.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest
from math_data import describe, math_data_dir

from mrl_lightning.data.items import PromptItem
from mrl_lightning.rewards import MathVerifyReward

GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)
FORMS = {"boxed": "So the result is \\boxed{{{}}}.", "plain": "The answer is {}."}


def _references(name: str) -> list[str]:
    with open(math_data_dir() / name / "test.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if name == "gsm8k":
        return [GSM8K_FINAL.search(row["answer"]).group(1) for row in rows]
    return [row["answer"] for row in rows]


@pytest.fixture(scope="module")
def reward():
    r = MathVerifyReward()
    yield r
    r.close()


@pytest.mark.parametrize("name", ["gsm8k", "math500"])
def test_every_reference_verifies_against_itself_boxed_and_plain(name, reward, capsys):
    refs = _references(name)
    items = [PromptItem(f"{name}/{i}", "q", ref, name, {}) for i, ref in enumerate(refs)]
    failures = {}
    for form, template in FORMS.items():
        scores = reward([template.format(ref) for ref in refs], items)
        failures[form] = [(ref, score) for ref, score in zip(refs, scores) if score != 1.0]
        with capsys.disabled():
            print(f"\n[reference answers] {name} ({describe(math_data_dir())}): {form}: "
                  f"{len(refs) - len(failures[form])} / {len(refs)} verify as correct")
    assert failures == {form: [] for form in FORMS}


def test_gsm8k_reference_plus_one_never_verifies(reward):
    refs = _references("gsm8k")
    wrong = [str(Fraction(ref.replace(",", "")) + 1) for ref in refs]
    items = [PromptItem(f"gsm8k/{i}", "q", ref, "gsm8k", {}) for i, ref in enumerate(refs)]
    scores = reward([f"The answer is {w}." for w in wrong], items)
    assert [ref for ref, score in zip(refs, scores) if score != 0.0] == []
