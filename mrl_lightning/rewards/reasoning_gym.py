"""reasoning-gym verifiers as reward functions.

reasoning-gym's own ``score_answer`` gives partial credit to substrings and to
surrounding whitespace (measured: "12345" vs gold "12" scores 0.4; " 8 " vs "8"
scores 0.33). A SuccessRecord must only come from an exactly right answer, so the
default ``strict=True`` returns 1.0 only when the verifier gives full credit to the
completion's answer and 0.0 otherwise. The answer is the completion's first line,
stripped of surrounding whitespace.
"""

from __future__ import annotations

import math

from mrl_lightning.data.items import PromptItem
from mrl_lightning.rewards.base import RewardFunction


def extract_answer(completion: str) -> str:
    """The first non-empty line of ``completion``, stripped."""
    for line in completion.splitlines():
        if line.strip():
            return line.strip()
    return ""


class ReasoningGymAccuracy(RewardFunction):
    """Reward from the prompt's own reasoning-gym verifier.

    Args:
        strict: 1.0 only for full credit, else 0.0 (default). With ``strict=False`` the
            verifier's partial credit is returned as is (not usable for SGT).

    Raises:
        TypeError: (at call time) an item without a reasoning-gym entry.
    """

    def __init__(self, strict: bool = True) -> None:
        import reasoning_gym

        self.strict = strict
        self.name = "rg_exact" if strict else "rg_score"
        self.version = f"reasoning-gym=={getattr(reasoning_gym, '__version__', 'unknown')}"
        self._scorers: dict[str, object] = {}

    def _scorer(self, dataset: str):
        if dataset not in self._scorers:
            import reasoning_gym

            self._scorers[dataset] = reasoning_gym.get_score_answer_fn(dataset)
        return self._scorers[dataset]

    def __call__(self, completions: list[str], items: list[PromptItem]) -> list[float]:
        out = []
        for text, item in zip(completions, items, strict=True):
            source = item.entry.get("metadata", {}).get("source_dataset")
            if source is None:
                out.append(math.nan)
                continue
            score = float(self._scorer(source)(extract_answer(text), item.entry))
            out.append((1.0 if score >= 1.0 else 0.0) if self.strict else score)
        return out
