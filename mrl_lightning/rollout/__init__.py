"""Rollout engines: Hugging Face ``generate`` and vLLM (docs/rollout.md)."""

from mrl_lightning.rollout.hf_generate import (
    HFGenerateEngine,
    RolloutBatch,
    completion_mask_from_eos,
    left_pad,
)
from mrl_lightning.rollout.vllm_engine import EngineRolloutBatch, VLLMEngine

__all__ = ["EngineRolloutBatch", "HFGenerateEngine", "RolloutBatch", "VLLMEngine", "completion_mask_from_eos",
           "left_pad"]
