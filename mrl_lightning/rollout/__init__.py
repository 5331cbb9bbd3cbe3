"""Rollout engines."""

from mrl_lightning.rollout.hf_generate import (
    HFGenerateEngine,
    RolloutBatch,
    completion_mask_from_eos,
    left_pad,
)

__all__ = ["HFGenerateEngine", "RolloutBatch", "completion_mask_from_eos", "left_pad"]
