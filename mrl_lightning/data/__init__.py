"""Prompt data modules and tasks."""

from mrl_lightning.data.items import PromptItem
from mrl_lightning.data.math_datasets import MathDataModule, MathPart
from mrl_lightning.data.reasoning_gym import ReasoningGymDataModule, TaskPart
from mrl_lightning.data.sources import MathSource
from mrl_lightning.data.stream import PromptDataModule

__all__ = ["MathDataModule", "MathPart", "MathSource", "PromptDataModule", "PromptItem", "ReasoningGymDataModule",
           "TaskPart"]
