"""Where the GSM8K / MATH500 test lines are: the full files beside the repository, else the samples."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FULL = REPO.parent / "shared" / "data"
SAMPLES = REPO / "tests" / "data_samples"
NAMES = ("gsm8k", "math500")


def _complete(root: Path) -> bool:
    return all((root / name / "test.jsonl").is_file() for name in NAMES)


def describe(root: Path) -> str:
    """"full files" or "30-line samples", for printed counts."""
    return "full files" if root == FULL else "30-line samples"


def math_data_dir() -> Path:
    """``../shared/data`` when it holds both files, else ``tests/data_samples``; skips when neither does."""
    for root in (FULL, SAMPLES):
        if _complete(root):
            return root
    pytest.skip(f"no GSM8K / MATH500 test.jsonl under {FULL} (full files) or {SAMPLES} (samples shipped "
                "with the repository: restore them with git checkout)")
