"""Fixtures of the rollout tests: the tiny local models of :mod:`tiny_models`, built once per session."""

from __future__ import annotations

import pytest
from tiny_models import build_tiny_chat_gpt2, build_tiny_gpt2


@pytest.fixture(scope="session")
def build_tiny_lm():
    """The builder itself, for a test that needs a variant (e.g. with dropout)."""
    return build_tiny_gpt2


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    return build_tiny_gpt2(tmp_path_factory.mktemp("rollout_tiny_gpt2"))


@pytest.fixture(scope="session")
def tiny_lm(tiny_lm_dir):
    """(model, tokenizer) loaded with from_pretrained; treat as read-only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir)), AutoTokenizer.from_pretrained(str(tiny_lm_dir))


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    return build_tiny_chat_gpt2(tmp_path_factory.mktemp("rollout_tiny_chat"))
