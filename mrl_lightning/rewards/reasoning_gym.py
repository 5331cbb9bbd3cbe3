"""reasoning-gym verifiers as reward functions.

reasoning-gym's own ``score_answer`` gives partial credit to substrings and to
surrounding whitespace (measured: "12345" vs gold "12" scores 0.4; " 8 " vs "8"
scores 0.33). A SuccessRecord must only come from an exactly right answer, so the
default ``strict=True`` returns 1.0 only when the verifier gives full credit to the
completion's answer and 0.0 otherwise.

What the verifier is given (``answer``): ``first_line`` (the default, the tiny models'
format): the completion's first non-empty line, stripped; ``final_number`` (real models
that answer in words, docs/answers.md "Final numbers"): the one number the completion
states as its final answer (:func:`~mrl_lightning.rewards.final_number.final_number`,
written canonically, e.g. "57"), or nothing when it states none or several ("57 or 58"),
which scores 0.
"""

from __future__ import annotations

import math

from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.rewards.base import RewardFunction
from mrl_lightning.rewards.final_number import RULE_VERSION, final_number

ANSWER_MODES = ("first_line", "final_number")


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
        answer: What the verifier scores: ``first_line`` (the completion's first non-empty
            line) or ``final_number`` (the one number it states as its final answer; none or
            several score 0; module docstring).

    Raises:
        ConfigError: ``answer`` is not one of :data:`ANSWER_MODES`.
        TypeError: (at call time) an item without a reasoning-gym entry.
    """

    def __init__(self, strict: bool = True, answer: str = "first_line") -> None:
        import reasoning_gym

        if answer not in ANSWER_MODES:
            raise ConfigError(f"ReasoningGymAccuracy.answer={answer!r}; valid: {list(ANSWER_MODES)} (final_number for "
                              "models that answer in words, docs/answers.md).")
        self.strict, self.answer = strict, answer
        self.name = ("rg_exact" if strict else "rg_score") + ("_final_number" if answer == "final_number" else "")
        self.version = f"reasoning-gym=={getattr(reasoning_gym, '__version__', 'unknown')}" + (
            f";answer={RULE_VERSION}" if answer == "final_number" else "")
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
            given = extract_answer(text) if self.answer == "first_line" else final_number(text)
            score = float(self._scorer(source)(given, item.entry)) if given is not None else 0.0
            out.append((1.0 if score >= 1.0 else 0.0) if self.strict else score)
        return out
