"""Rollout engines: Hugging Face ``generate`` and vLLM (docs/rollout.md).

:mod:`.base` holds what every engine returns (:class:`RolloutBatch`) and the call it
answers (:class:`RolloutEngine`); :mod:`.options` checks a policy's engine settings
without importing an engine. The engines themselves load on first use (PEP 562), so a
module that needs only the contract or the option checks does not import them.
"""

from importlib import import_module

from mrl_lightning.rollout.base import RolloutBatch, RolloutEngine, left_pad

_LAZY = {
    "HFGenerateEngine": "mrl_lightning.rollout.hf_generate",
    "completion_mask_from_eos": "mrl_lightning.rollout.hf_generate",
    "VLLMEngine": "mrl_lightning.rollout.vllm_engine",
}

__all__ = ["HFGenerateEngine", "RolloutBatch", "RolloutEngine", "VLLMEngine", "completion_mask_from_eos", "left_pad"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mrl_lightning.rollout' has no attribute {name!r}")
