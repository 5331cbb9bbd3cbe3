"""Hostile configs and a hub without network (docs/reliability.md, "Configuration")."""

from __future__ import annotations

import socket
import time

import pytest

from mrl_lightning.model import hub
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
    assert _one_error_line(err) == (f"error: config file {str(config)!r}: 'trainer.max_step' is not a config key; "
                                    "did you mean 'trainer.max_steps'?")  # no 30-line usage block burying it


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
    ("trainer:\n  - max_steps: 3\n", ": trainer: holds a YAML list, not a mapping of its keys; indent its keys under "
     "'trainer:' without '- ' (a list item)."),  # replaced the earlier file's whole trainer section, silently
], ids=["empty", "comments", "list", "tab", "unclosed", "section-list"])
def test_empty_or_non_mapping_yaml_is_named(tmp_path, write_tiny_config, no_model_build, capsys, text, expected):
    bad = tmp_path / "probe.yaml"
    bad.write_text(text)
    err = _fit_error(capsys, "--config", str(write_tiny_config()), "--config", str(bad))
    assert f"config file {str(bad)!r}{'' if expected.startswith(':') else ' '}{expected}" in err


def _one_error_line(err: str) -> str:
    """The parser's one ``error:`` line (then jsonargparse's ``tip:`` line): nothing else is printed."""
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("tip: "), err
    return lines[0]


def test_the_error_line_comes_first_and_the_tip_after_it(write_tiny_config, no_model_build, capsys):
    """jsonargparse printed its ``tip:`` line above the error, where a reader takes the first line for the cause."""
    err = _fit_error(capsys, "--config", str(write_tiny_config()), "--trainer.max_stepz", "3")
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and "--trainer.max_stepz" in lines[0], err
    assert lines[-1].startswith("tip: For details of accepted options run: ") and lines[-1].endswith(" fit --help")


def test_a_mistyped_config_path_names_the_nearest_files_of_its_folder(tmp_path, write_tiny_config, no_model_build,
                                                                      capsys):
    """jsonargparse said only ``File does not exist``."""
    (tmp_path / "default.yaml").write_text("trainer: {max_steps: 3}\n")
    (tmp_path / "other.yaml").write_text("trainer: {max_steps: 3}\n")
    typo = str(tmp_path / "defualt.yaml")
    err = _fit_error(capsys, "--config", str(write_tiny_config()), "--config", typo)
    assert _one_error_line(err) == (f"error: --config {typo!r}: no such file; did you mean "
                                    f"{str(tmp_path / 'default.yaml')!r}?")
    nowhere = str(tmp_path / "confgs" / "default.yaml")
    assert _one_error_line(_fit_error(capsys, "--config", nowhere)) == (
        f"error: --config {nowhere!r}: no such file (its folder {str(tmp_path / 'confgs')!r} does not exist either); "
        "give the path of a YAML file, e.g. configs/default.yaml.")


def test_a_config_given_inline_is_not_taken_for_a_missing_file():
    from mrl_lightning.config.reports import missing_config_line

    assert missing_config_line("{trainer: {max_steps: 3}}") is None
    assert missing_config_line("configs/default.yaml") is None  # exists (tests run from the repository root)
    assert missing_config_line("configs/defualt.yaml") == (
        "--config 'configs/defualt.yaml': no such file; did you mean 'configs/default.yaml'?")


def _set_class_path(where, value):
    def modify(c):
        where(c)["class_path"] = value
    return modify


@pytest.mark.parametrize("where,given,label,reason,nearest", [
    (lambda c: c["trainer"]["callbacks"][1], "mrl_lightning.callbacks.SuccesGatedTransfer", "trainer.callbacks[1]",
     "module 'mrl_lightning.callbacks' has no attribute 'SuccesGatedTransfer'",
     "'mrl_lightning.callbacks.SuccessGatedTransfer'"),
    (lambda c: c["trainer"]["callbacks"][1], "SuccesGatedTransfer", "trainer.callbacks[1]",
     "no module given, and no imported class of this field has that name",
     "'mrl_lightning.callbacks.SuccessGatedTransfer'"),
    (lambda c: c["model"]["reward_funcs"][0], "mrl_lightning.rewards.ReasoningGymAcuracy", "model.reward_funcs[0]",
     "module 'mrl_lightning.rewards' has no attribute 'ReasoningGymAcuracy'",
     "'mrl_lightning.rewards.ReasoningGymAccuracy'"),
    (lambda c: c["data"], "mrl_lightning.dta.ReasoningGymDataModule", "data",
     "module 'mrl_lightning' has no attribute 'dta'", "'mrl_lightning.data.ReasoningGymDataModule'"),
    (lambda c: c["model"]["policies"][1], "mrl_lightning.policy.PolicyModul", "model.policies[1]",
     "module 'mrl_lightning.policy' has no attribute 'PolicyModul'", "'mrl_lightning.policy.PolicyModule'"),
    (lambda c: c["model"]["policies"][0]["init_args"]["model"], "mrl_lightning.recipes.TinyCasualLM",
     "model.policies[0].init_args.model", "module 'mrl_lightning.recipes' has no attribute 'TinyCasualLM'",
     "'mrl_lightning.recipes.TinyCausalLM'"),
    (lambda c: c["model"]["reward_funcs"][0], "my_verifiers.ExactCheck", "model.reward_funcs[0]",
     "no module named 'my_verifiers'", None),
], ids=["callback", "callback-no-module", "reward", "data-module", "policy", "recipe", "own-module"])
def test_misspelled_class_path_is_one_line_naming_the_field_and_the_nearest_classes(
        write_tiny_config, no_model_build, capsys, where, given, label, reason, nearest):
    config = write_tiny_config(modify=_set_class_path(where, given))
    line = _one_error_line(_fit_error(capsys, "--config", str(config)))
    expected = f"error: config file {str(config)!r}: {label}.class_path {given!r} names no class ({reason}); "
    assert line.startswith(expected), line
    tail = line[len(expected):]
    if nearest is not None:
        assert tail.startswith(f"did you mean {nearest}"), tail
    else:  # nothing near: every valid class of the field is listed
        assert tail.startswith("valid: ") and "mrl_lightning.rewards.ReasoningGymAccuracy" in tail, tail
    assert not (config.parent / "runs").exists()  # refused before the run folder was made


def test_misspelled_class_path_on_the_command_line_is_the_same_one_line(write_tiny_config, no_model_build, capsys):
    err = _fit_error(capsys, "--config", str(write_tiny_config()), "--data.class_path",
                     "mrl_lightning.data.ReasonGymDataModule")
    assert _one_error_line(err) == (
        "error: data.class_path 'mrl_lightning.data.ReasonGymDataModule' names no class (module 'mrl_lightning.data' "
        "has no attribute 'ReasonGymDataModule'); did you mean 'mrl_lightning.data.ReasoningGymDataModule' or "
        "'mrl_lightning.data.MathDataModule'?")


@pytest.mark.parametrize("key,tail", [
    ("lambda_sgtt", "; did you mean 'lambda_sgt'?"),
    ("measure_share_every_n_steps", ": it was removed: between measured steps the transfer's share of the update "
                                    "was not bounded (docs/probes.md, \"Cost\"); SGT now measures and bounds it on "
                                    "every step. Delete the key."),
], ids=["misspelled", "removed"])
def test_an_argument_the_class_does_not_take_is_one_line_before_the_parse(write_tiny_config, no_model_build, capsys,
                                                                          key, tail):
    def modify(c):
        c["trainer"]["callbacks"][1].setdefault("init_args", {})[key] = 10

    config = write_tiny_config(modify=modify)
    line = _one_error_line(_fit_error(capsys, "--config", str(config)))
    assert line == (f"error: config file {str(config)!r}: trainer.callbacks[1].init_args: SuccessGatedTransfer has no "
                    f"argument '{key}'{tail}")
    assert not (config.parent / "runs").exists()


@pytest.mark.parametrize("argv,expected", [
    (["--seed_everything", "abc"], "seed_everything='abc' must be true or false, or an integer"),
    (["--data.init_args.parts", "5"], "data.init_args.parts='5' must be a list ([a, b] on the command line; "
                                      "one '- ' item per line in a YAML file)"),
    (["--data.init_args.batch_size", "2.5"], "data.init_args.batch_size='2.5' must be an integer"),
    (["--trainer.enable_progress_bar", "maybe"], "trainer.enable_progress_bar='maybe' must be true or false"),
], ids=["union", "nested-list", "nested-int", "bool"])
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key_as_written(write_tiny_config, no_model_build, capsys,
                                                                         argv, expected):
    err = _fit_error(capsys, "--config", str(write_tiny_config()), *argv)
    assert _one_error_line(err) == f"error: {expected}; `mrl fit --help` describes it."


def test_a_wrong_type_in_a_config_file_is_the_same_one_line(tmp_path, write_tiny_config, no_model_build, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  init_args:\n    parts: 5\n")
    err = _fit_error(capsys, "--config", str(write_tiny_config()), "--config", str(bad))
    assert _one_error_line(err).startswith(f"error: config file {str(bad)!r}: data.init_args.parts='5' must be a list")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv,expected", [
    (["--data.init_args.batchsize", "4"],
     "data.init_args: ReasoningGymDataModule has no argument 'batchsize'; did you mean 'batch_size'?"),
    (["--model.policies.init_args.learning_rte", "1e-4"],
     "model.policies.init_args: PolicyModule has no argument 'learning_rte'; did you mean 'learning_rate'?"),
], ids=["data", "policy"])
def test_a_key_a_class_does_not_take_on_the_command_line_is_one_line_and_no_note(write_tiny_config, no_model_build,
                                                                                  capsys, argv, expected):
    err = _fit_error(capsys, "--config", str(write_tiny_config()), *argv)
    assert _one_error_line(err) == f"error: {expected}"  # no "applies to the last policy" note for such a key


def test_the_config_file_a_bad_value_comes_from_is_named_and_a_command_line_value_is_not(
        tmp_path, write_tiny_config, no_model_build, capsys):
    base = str(write_tiny_config())
    bad, good = tmp_path / "bad_seed.yaml", tmp_path / "good_seed.yaml"
    bad.write_text("seed_everything: abc\n")
    good.write_text("seed_everything: 3\n")
    unknown = tmp_path / "unknown_key.yaml"
    unknown.write_text("data:\n  init_args:\n    batchsize: 4\n")
    line = "seed_everything={!r} must be true or false, or an integer; `mrl fit --help` describes it."
    # the file's value is refused when the file is read, before a later override
    assert _one_error_line(_fit_error(capsys, "--config", base, "--config", str(bad), "--seed_everything", "7")) \
        == f"error: config file {str(bad)!r}: " + line.format("abc")
    assert _one_error_line(_fit_error(capsys, "--config", base, "--config", str(good), "--seed_everything", "xyz")) \
        == "error: " + line.format("xyz")
    assert _one_error_line(_fit_error(capsys, "--config", base, "--config", str(unknown))) == (
        f"error: config file {str(unknown)!r}: data.init_args: ReasoningGymDataModule has no argument 'batchsize'; "
        "did you mean 'batch_size'?")


def test_config_file_that_is_not_utf8_is_named_with_the_byte_and_the_fix(tmp_path, write_tiny_config, no_model_build,
                                                                         capsys):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("trainer:\n  max_steps: 3  # café\n".encode("latin-1"))
    err = _fit_error(capsys, "--config", str(write_tiny_config()), "--config", str(latin1))
    assert _one_error_line(err) == (
        f"error: config file {str(latin1)!r} is not UTF-8 text: byte 0xe9 at offset 30 (line 2, column 22) is not "
        "valid UTF-8; save the file as UTF-8 (an editor's 'save with encoding', or: iconv -f <its encoding, e.g. "
        "latin1> -t utf-8).")
    assert not (tmp_path / "runs").exists()


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
