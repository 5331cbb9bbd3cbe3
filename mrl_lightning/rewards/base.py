"""Reward function interface (docs/grpo.md "Rewards and success"; TRL ``reward_funcs``).

A reward function scores completion *text*, so the reward never depends on the
tokenizer. It returns one float per completion in [0, 1], or NaN where it cannot
score (e.g. a prompt from a task it does not cover).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from mrl_lightning.data.items import PromptItem


class RewardFunction(ABC):
    """Base class of reward functions (selected in YAML by ``class_path``).

    Attributes:
        name: Tag used in logs (``train/<policy>/reward_<name>``).
        version: Version string recorded in SuccessRecords.
        strict: True if a reward of 1.0 means an exactly right answer, so that its
            successes may be shared as SuccessRecords (docs/see.md).
    """

    name: str = "reward"
    version: str = "0"
    strict: bool = False

    @abstractmethod
    def __call__(self, completions: list[str], items: list[PromptItem]) -> list[float]:
        """Score completions; ``len(completions) == len(items)``."""
