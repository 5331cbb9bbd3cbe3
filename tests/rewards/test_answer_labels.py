"""The final-number reader against hand labels of real completions (docs/answers.md, "The labelled set").

``tests/rewards/data/real_completions.jsonl`` holds completions that SmolLM2-135M-Instruct and Gemma 3
270M wrote for configs/real_small.yaml's two parts with its prompts, templates and stops
(``benchmarks/answer_labels.py``), each labelled by reading it: ``label`` is the number it states as
its result (canonical, as :func:`~mrl_lightning.rewards.final_number.final_number` writes it) or null.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl_lightning.rewards import final_number

DATA = Path(__file__).parent / "data" / "real_completions.jsonl"
MIN_AGREEMENT = 0.97  # measured: docs/answers.md, "The labelled set"
MAX_FALSE_SUCCESSES = 0  # read == gold while the label is not gold: a reward the completion did not earn


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def test_the_set_covers_both_models_both_parts_and_every_row_is_labelled(rows):
    assert len(rows) >= 120
    assert {(r["model"], r["part"]) for r in rows} == {(m, p) for m in ("smollm2", "gemma") for p in ("chain", "mul")}
    for r in rows:
        assert {"model", "part", "question", "prompt", "completion", "gold", "label", "note"} <= set(r)
        assert r["label"] is None or r["label"] == final_number(r["label"]), r  # canonical numbers only
        assert r["note"] != "UNLABELLED", r


def test_the_reader_agrees_with_the_hand_labels(rows):
    """Exact equality of the read number with the label (None included) on at least MIN_AGREEMENT of the rows."""
    wrong = [(i, r) for i, r in enumerate(rows) if final_number(r["completion"]) != r["label"]]
    agreement = 1 - len(wrong) / len(rows)
    listing = "\n".join(f"  row {i} ({r['model']}, {r['part']}): read {final_number(r['completion'])!r}, label "
                        f"{r['label']!r}: {r['completion']!r}" for i, r in wrong)
    assert agreement >= MIN_AGREEMENT, f"agreement {agreement:.3f} < {MIN_AGREEMENT} on {len(rows)} rows:\n{listing}"


def test_no_false_success_on_the_labelled_set(rows):
    """A reward of 1 only where the completion states the gold answer (SGT shares those)."""
    false = [r["completion"] for r in rows if final_number(r["completion"]) == r["gold"] != r["label"]]
    assert len(false) <= MAX_FALSE_SUCCESSES, false
