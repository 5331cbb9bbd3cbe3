"""The project's final-number reader against math-verify's own extraction on the hand-labelled set (docs/answers.md).

    OMP_NUM_THREADS=1 python benchmarks/answer_reader_vs_math_verify.py

For each row of ``tests/rewards/data/real_completions.jsonl`` (real completions of configs/real_small.yaml's two
models, labelled by reading them), reads the stated number twice: with
:func:`mrl_lightning.rewards.final_number.final_number`, and with math-verify's ``parse`` (its LaTeX and
expression extraction, the last value it finds, as math-verify's reward reads a completion); prints each one's
agreement with the labels, its false successes (read = gold where the label is not) and false failures.
"""

from __future__ import annotations

import json
from pathlib import Path

from math_verify import parse
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

from mrl_lightning.rewards.final_number import final_number

ROWS = Path(__file__).resolve().parents[1] / "tests" / "rewards" / "data" / "real_completions.jsonl"


def math_verify_number(text: str) -> str | None:
    """The number math-verify's extraction reads from ``text`` (its string form, integers without '.0'), or None."""
    try:  # one process, no thread: math-verify's own alarm-based timeout works here
        found = parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])
    except Exception:  # noqa: BLE001 - an extraction that fails reads nothing
        return None
    if len(found) < 2:
        return None
    try:
        value = float(found[0])
    except (TypeError, ValueError):
        return str(found[1])
    return str(int(value)) if value == int(value) else str(value)


def main() -> None:
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    for name, read in (("final_number", final_number), ("math-verify parse", math_verify_number)):
        got = [read(r["completion"]) for r in rows]
        agree = sum(g == r["label"] for g, r in zip(got, rows))
        false_success = sum(g == r["gold"] and r["label"] != r["gold"] for g, r in zip(got, rows))
        false_failure = sum(g != r["gold"] and r["label"] == r["gold"] for g, r in zip(got, rows))
        print(f"{name:18s} agreement {agree}/{len(rows)} = {agree / len(rows):.3f}  "
              f"false successes {false_success}  false failures {false_failure}")


if __name__ == "__main__":
    main()
