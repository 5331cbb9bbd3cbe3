"""Prompt data modules and tasks."""

from mrl_lightning.data.reasoning_gym import (
    PromptItem,
    ReasoningGymDataModule,
    TaskPart,
)

__all__ = ["PromptItem", "ReasoningGymDataModule", "TaskPart"]
