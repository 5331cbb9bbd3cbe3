"""PromptItem: one prompt as every policy sees it (before its own template)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PromptItem:
    """One prompt as every policy sees it (before its own template).

    Attributes:
        prompt_id: Stable id ``"<part>/<index>"``.
        question: Task text.
        answer: Reference answer text.
        part: Name of the task part.
        entry: The reasoning-gym entry (for its verifier).
    """

    prompt_id: str
    question: str
    answer: str
    part: str
    entry: dict[str, Any]
