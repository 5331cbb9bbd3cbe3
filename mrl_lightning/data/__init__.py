"""Prompt data modules and tasks."""

from mrl_lightning.data.reasoning_gym import (
    PromptItem,
    ReasoningGymDataModule,
    TaskPart,
)

__all__ = ["PromptItem", "ReasoningGymDataModule", "TaskPart"]

from mrl_lightning.data.math_datasets import MathDataModule, MathPart  # noqa: E402

__all__ += ["MathDataModule", "MathPart"]
