"""Fixtures for the hostile-input catalogue (docs/reliability.md).

A tiny GPT-2 (1 layer, width 32) on a local char-level tokenizer (pad == eos) written to a
folder and loaded as a user's model is (same recipe as tests/rollout/conftest.py; tests/
has no package to share it from). ``reliability_helpers.force_logits`` makes its head emit
chosen logits (NaN, inf, always-EOS) through a forward hook, so hostile model outputs need no
real failure.
The end-to-end tests reuse the tiny two-family config of tests/e2e.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

E2E = Path(__file__).resolve().parents[1] / "e2e"
if str(E2E) not in sys.path:  # e2e_configs and e2e_rewards (class_path in the tiny config)
    sys.path.insert(0, str(E2E))

from e2e_configs import write_tiny_config as write_tiny_config_file  # noqa: E402

CORPUS = ["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?\nAnswer: 2", "Name the capital of France."]


@pytest.fixture(scope="session")
def tiny_lm_folder(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    from mrl_lightning.recipes.tokenizers import train_char_level

    folder = tmp_path_factory.mktemp("reliability_tiny_gpt2")
    tok = train_char_level(CORPUS, folder)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(str(folder))
    return folder


@pytest.fixture
def make_policy(tiny_lm_folder):
    """A built PolicyModule on the tiny GPT-2 (keyword arguments go to PolicyModule)."""
    from mrl_lightning.builders import build_policy
    from mrl_lightning.policy import PolicyModule

    def _make(**kwargs):
        kwargs = {"name": "tiny", "model": str(tiny_lm_folder), "num_generations": 4, "max_completion_length": 6,
                  "prompt_template": "{question}\nAnswer:", "learning_rate": 1e-2, **kwargs}
        policy = PolicyModule(**kwargs)
        build_policy(policy)
        return policy

    return _make


@pytest.fixture
def write_tiny_config(tmp_path):
    """Write the tiny two-family end-to-end config (optionally modified) and return its path."""

    def _write(name: str = "tiny.yaml", modify=None, **kwargs) -> Path:
        return write_tiny_config_file(tmp_path, name, modify, **kwargs)

    return _write
