"""Verifiers used as reward functions."""

from mrl_lightning.rewards.base import RewardFunction
from mrl_lightning.rewards.reasoning_gym import ReasoningGymAccuracy, extract_answer

__all__ = ["ReasoningGymAccuracy", "RewardFunction", "extract_answer"]

from mrl_lightning.rewards.math_verify import MathVerifyReward, extract_final_answer

__all__ += ["MathVerifyReward", "extract_final_answer"]
