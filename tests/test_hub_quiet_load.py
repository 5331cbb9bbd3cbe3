"""Loading a local folder hides transformers' "Loading weights" bar; a hub id keeps it."""

from __future__ import annotations

import pytest
from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

from mrl_lightning.model.hub import quiet_local_load


@pytest.fixture
def bars_on():
    hf_logging.enable_progress_bar()
    yield
    hf_logging.enable_progress_bar()


def test_a_local_folder_loads_without_the_bar_and_the_switches_come_back(tmp_path, bars_on, capsys):
    GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)).save_pretrained(tmp_path)
    capsys.readouterr()
    with quiet_local_load(str(tmp_path)):
        assert not hf_logging.is_progress_bar_enabled()
        GPT2LMHeadModel.from_pretrained(str(tmp_path))
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
    GPT2LMHeadModel.from_pretrained(str(tmp_path))  # outside: the bar is back
    assert "Loading weights" in capsys.readouterr().err


def test_a_hub_id_keeps_the_bars_and_an_error_restores_them(tmp_path, bars_on):
    with quiet_local_load("org/some-model"):
        assert hf_logging.is_progress_bar_enabled()
    with pytest.raises(RuntimeError), quiet_local_load(str(tmp_path)):
        raise RuntimeError("load failed")
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()


def test_hub_bars_a_user_turned_off_stay_off(tmp_path, bars_on):
    disable_progress_bars()
    try:
        with quiet_local_load(str(tmp_path)):
            pass
        assert are_progress_bars_disabled()
    finally:
        enable_progress_bars()
