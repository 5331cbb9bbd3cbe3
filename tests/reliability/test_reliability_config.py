"""Hostile configs and a hub without network (docs/reliability.md, "Configuration")."""

from __future__ import annotations

import socket
import time

import pytest

from mrl_lightning import hub
from mrl_lightning.cli import main
from mrl_lightning.errors import ConfigError

from e2e_configs import forbid_model_build  # tests/e2e, on sys.path through this folder's conftest


@pytest.fixture
def no_model_build(monkeypatch):
    """Fail loudly if anything builds or loads a model (config errors come first)."""
    forbid_model_build(monkeypatch)


def _fit_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(["fit", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


def test_unknown_yaml_key_names_the_nearest_valid_key(write_tiny_config, no_model_build, capsys):
    config = write_tiny_config(modify=lambda c: c["trainer"].update(max_step=3))
    err = _fit_error(capsys, "--config", str(config))
    assert "does not accept option 'trainer.max_step'" in err
    assert "'trainer.max_step' is not a config key; did you mean 'trainer.max_steps'?" in err
    assert "usage:" not in err  # the 30-line usage block would bury the message


def test_unknown_section_names_the_nearest_valid_key(write_tiny_config, no_model_build, capsys):
    config = write_tiny_config(modify=lambda c: c.update(traner={"max_steps": 3}))
    assert "did you mean 'trainer.max_steps'" in _fit_error(capsys, "--config", str(config))


@pytest.mark.parametrize("where,key,nearest", [
    (lambda c: c["model"]["policies"][0]["init_args"], "learning_rat", "learning_rate"),
    (lambda c: c["data"]["init_args"], "batch_sise", "batch_size"),
    (lambda c: c["trainer"]["callbacks"][1]["init_args"], "lambda_sg", "lambda_sgt"),
], ids=["policy", "data", "callback"])
def test_unknown_init_arg_of_a_class_names_the_nearest_argument(write_tiny_config, no_model_build, capsys, where,
                                                                key, nearest):
    config = write_tiny_config(modify=lambda c: where(c).update({key: 1}))
    err = _fit_error(capsys, "--config", str(config))
    assert f"has no argument '{key}'; did you mean '{nearest}'?" in err


@pytest.mark.parametrize("text,expected", [
    ("", "is empty (or holds only comments)"),
    ("# trainer:\n#   max_steps: 3\n", "is empty (or holds only comments)"),
    ("- trainer\n- model\n", "holds a YAML list, not a mapping"),
    ("trainer:\n\tmax_steps: 3\n", "is not valid YAML, line 2, column 1: found character '\\t' that cannot start "
     "any token (YAML does not allow tabs for indentation: use spaces)"),
    ("trainer: {max_steps: [3\n", "is not valid YAML, line 2, column 1"),
], ids=["empty", "comments", "list", "tab", "unclosed"])
def test_empty_or_non_mapping_yaml_is_named(tmp_path, write_tiny_config, no_model_build, capsys, text, expected):
    bad = tmp_path / "probe.yaml"
    bad.write_text(text)
    err = _fit_error(capsys, "--config", str(write_tiny_config()), "--config", str(bad))
    assert f"config file {str(bad)!r} {expected}" in err


def test_option_prefix_is_refused_instead_of_expanded(write_tiny_config, no_model_build, capsys):
    err = _fit_error(capsys, "--config", str(write_tiny_config()), "--trainer.max_step", "3")
    assert "unrecognized arguments: --trainer.max_step 3" in err
    assert "options are never abbreviated: write --trainer.max_steps" in err


def test_full_option_names_still_parse(write_tiny_config, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(write_tiny_config()), "--trainer.max_steps", "3", "--print_config"])
    assert info.value.code in (0, None) and "max_steps: 3" in capsys.readouterr().out


@pytest.fixture
def no_network(monkeypatch):
    """No route to the hub: connecting fails at once, and any real hub request fails the test."""
    import transformers

    def refused(*args, **kwargs):
        raise OSError(101, "Network is unreachable")

    def no_request(*args, **kwargs):
        raise AssertionError("from_pretrained was called for a hub id with no network")

    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(hub, "_probe", {})
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_request)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_request)


def test_hub_id_without_network_fails_at_once_with_the_offline_hint(no_network):
    from mrl_lightning.policy import PolicyModule

    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        PolicyModule(name="qwen", model="some-org/some-model-0.5B")
    assert time.monotonic() - start < 2.0
    msg = str(info.value)
    assert "policy 'qwen': model='some-org/some-model-0.5B' is a hub id" in msg
    assert "cannot be reached (OSError: [Errno 101] Network is unreachable)" in msg
    assert "HF_HUB_OFFLINE=1" in msg and "hf download some-org/some-model-0.5B" in msg


def test_hub_model_id_with_a_local_tokenizer_is_checked_too(no_network, tiny_lm_folder, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    from mrl_lightning.policy import PolicyModule

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained",
                        lambda source, **kw: PreTrainedTokenizerFast.from_pretrained(source, **kw))
    with pytest.raises(ConfigError, match="model='some-org/some-model' is a hub id"):
        PolicyModule(name="p", model="some-org/some-model", tokenizer=str(tiny_lm_folder))


def test_cached_hub_id_without_network_loads_local_files_only(no_network, monkeypatch):
    monkeypatch.setattr(hub, "_cached", lambda source, filename: True)
    assert hub.hub_load_kwargs("some-org/some-model", "model", "policy 'p'") == {"local_files_only": True}
    assert hub.hub_load_kwargs("./local/folder", "model", "policy 'p'") == {}


def test_offline_mode_without_the_id_in_the_cache_names_the_fix(no_network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "hub_reachable", lambda: pytest.fail("probed the network in offline mode"))
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set and it is not in the local cache") as caught:
        hub.hub_load_kwargs("some-org/some-model", "tokenizer", "policy 'p'")
    assert "copy the Hugging Face cache here; or give tokenizer:" in str(caught.value)  # not "then set" what is set


def test_the_hub_is_probed_once_per_process(no_network, monkeypatch):
    attempts = []

    def refused(*args, **kwargs):
        attempts.append(args)
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", refused)
    for _ in range(3):
        with pytest.raises(ConfigError):
            hub.hub_load_kwargs("some-org/some-model", "model", "policy 'p'")
    assert len(attempts) == 1 and attempts[0][0] == ("huggingface.co", 443)


def test_probe_reading_records_the_exchange_does_not_keep_is_a_config_error():
    from types import SimpleNamespace

    from mrl_lightning.callbacks import CrossPolicyAdvantage, PeerRolloutPooling, SharedExperienceExchange

    see = SharedExperienceExchange(record_types=["rollout"], max_staleness=0)
    prp = PeerRolloutPooling(max_staleness=3)
    xgrpo = CrossPolicyAdvantage(max_staleness=0)
    errors = see.config_errors(SimpleNamespace(callbacks=[see, prp, xgrpo]), None)
    assert any("PeerRolloutPooling.max_staleness=3" in e and "max_staleness=0 evicts them after 0" in e
               for e in errors)
    assert any("CrossPolicyAdvantage reads 'group_stats' records" in e and "add 'group_stats'" in e for e in errors)
    ok = SharedExperienceExchange(record_types=["rollout", "group_stats"], max_staleness_by_type={"rollout": 3})
    assert ok.config_errors(SimpleNamespace(callbacks=[ok, prp, xgrpo]), None) == []


def test_thl_hub_id_without_network_fails_at_once_with_the_offline_hint(no_network, capsys):
    start = time.monotonic()
    assert main(["thl", "--source", "some-org/some-tokenizer", "--target", "mistral-v1"]) == 2
    assert time.monotonic() - start < 2.0  # it retried for 50 s before
    err = capsys.readouterr().err
    assert err.startswith("mrl thl: error: tokenizer spec: --source='some-org/some-tokenizer' is a hub id, and ")
    assert "cannot be reached (OSError: [Errno 101] Network is unreachable)" in err
    assert "hf download some-org/some-tokenizer" in err and "HF_HUB_OFFLINE=1" in err
