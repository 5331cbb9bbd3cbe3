"""Verifiers used as reward functions."""

from mrl_lightning.rewards.base import RewardFunction
from mrl_lightning.rewards.guard import RewardError, TimeLimitedReward, checked_rewards
from mrl_lightning.rewards.reasoning_gym import ReasoningGymAccuracy, extract_answer

__all__ = ["ReasoningGymAccuracy", "RewardError", "RewardFunction", "TimeLimitedReward", "checked_rewards",
           "extract_answer"]

from mrl_lightning.rewards.answers import answers_match, parse_final_answer, parse_reference
from mrl_lightning.rewards.final_number import final_number
from mrl_lightning.rewards.math_verify import MathVerifyReward

__all__ += ["MathVerifyReward", "answers_match", "final_number", "parse_final_answer", "parse_reference"]
