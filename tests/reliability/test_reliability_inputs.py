"""Hostile inputs a new user tried on a fresh clone (docs/reliability.md, rows 64 on): each refused in one line
naming the field or file, the value and the fix, status 2, before any model is built, nothing left behind."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from mrl_lightning.cli import main
from mrl_lightning.data import PromptItem
from mrl_lightning.policy import PolicyModule
from mrl_lightning.policy.prompt_fit import data_prompt_errors

from e2e_configs import forbid_model_build  # tests/e2e, on sys.path through this folder's conftest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_model_build(monkeypatch):
    forbid_model_build(monkeypatch)


def _refused(capsys, *argv) -> str:
    """The error output of ``mrl fit`` argv, which must stop with status 2 and no traceback."""
    try:
        code = main(["fit", *argv])
    except SystemExit as exc:  # the parser's own refusals
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return captured.err


class _Data:
    """A set-up prompt data module of one part (what :func:`data_prompt_errors` reads)."""

    def __init__(self, questions):
        self.parts = [SimpleNamespace(name="add")]
        self._items = [PromptItem(prompt_id=f"add/{i}", question=q, answer="0", part="add", entry={})
                       for i, q in enumerate(questions)]

    def setup(self, stage=None):
        pass

    def eval_items(self):
        return {"add": self._items[:2]}

    def train_items(self, part):
        return self._items[2:]


def test_max_prompt_length_that_makes_the_datas_questions_one_prompt_is_refused(tiny_lm_folder):
    """The two fixed probe questions end in '?' and '.', so 9 characters kept them apart; the task's all end in '.'."""
    policy = PolicyModule(name="p", model=str(tiny_lm_folder), max_prompt_length=9)  # the probe check passes
    data = _Data([f"Calculate {a} + {b}." for a in range(1, 5) for b in range(1, 5)])
    errors = data_prompt_errors(policy, data)
    assert len(errors) == 1 and "\n" not in errors[0]
    assert errors[0].startswith("policy 'p': max_prompt_length=9 cuts the data's prompts (the longest is 24 tokens) "
                                "so that different questions become one prompt: ")
    assert errors[0].endswith("the model would not see the question. Set max_prompt_length: 24 (or more).")
    assert data_prompt_errors(PolicyModule(name="p", model=str(tiny_lm_folder), max_prompt_length=14), data) == []


def test_max_prompt_length_2_on_the_default_config_is_refused_before_any_build(no_model_build, capsys, tmp_path,
                                                                             monkeypatch):
    """It trained with one warning and llama's evaluation fell from 0.53 to 0."""
    monkeypatch.chdir(REPO)  # the recipes' prebuilt folders are relative
    runs = tmp_path / "runs"
    err = _refused(capsys, "--config", "configs/default.yaml", "--trainer.devices", "1", "--trainer.default_root_dir",
                   str(runs), "--model.policies.init_args.max_prompt_length", "2")
    assert ("policy 'llama': max_prompt_length=2 cuts the data's prompts (the longest is 12 tokens) so that different "
            "questions become one prompt: ") in err
    assert "Set max_prompt_length: 12 (or more)." in err
    assert not runs.exists()


def _recipe(c) -> dict:
    return c["model"]["policies"][0]["init_args"]["model"]["init_args"]


@pytest.mark.parametrize("modify,line", [
    (lambda c: _recipe(c).update(family="gtp2"),
     "TinyCausalLM.family='gtp2' is not one of its values; did you mean 'gpt2'? valid (nearest first): ['gpt2', "),
    (lambda c: _recipe(c).update(hidden_size=30, num_heads=4),
     "TinyCausalLM.hidden_size=30 must be divisible by num_heads=4: set hidden_size: 32 (or 28), or num_heads: 3 "
     "(a divisor of 30)."),
    (lambda c: c["trainer"]["callbacks"][0].setdefault("init_args", {}).update(record_types=["sucess", "rollout"]),
     "SharedExperienceExchange.record_types has unknown ['sucess']; did you mean 'success' for 'sucess'? valid "
     "(nearest first): ['success', "),
], ids=["family", "hidden-size", "record-types"])
def test_a_value_a_class_refuses_inside_a_union_is_its_one_line_not_the_union_dump(write_tiny_config, no_model_build,
                                                                                 capsys, modify, line):
    """jsonargparse's "Does not validate against any of the Union subtypes" came as 8-9 lines with a Namespace dump
    of every value; the class's own line was on line 5 or 6."""
    config = write_tiny_config(modify=modify)
    err = _refused(capsys, "--config", str(config))
    assert "Union subtypes" not in err and "Namespace(" not in err and "Expected a" not in err
    causes = [x for x in err.splitlines() if x.startswith("  - ")]
    assert len(causes) == 1 and causes[0][4:].startswith(line), err
    assert not (config.parent / "runs").exists()


def test_an_empty_run_folder_is_refused(write_tiny_config, no_model_build, capsys, tmp_path, monkeypatch):
    """``--trainer.default_root_dir ''`` ran into the current folder (``./version_0``, ``tensorboard --logdir ''``)."""
    config = write_tiny_config()
    monkeypatch.chdir(tmp_path)
    err = _refused(capsys, "--config", str(config), "--trainer.default_root_dir", "")
    assert ("trainer.default_root_dir='' is empty: the run folder would be made in the current folder, and the "
            "printed paths would be relative to it. Give a folder: --trainer.default_root_dir runs/<name>") in err
    assert not list(tmp_path.glob("version_*"))


@pytest.mark.parametrize("target", ["through_a_file", "a_folder"])
def test_an_exchange_log_path_that_cannot_be_written_is_refused_before_any_build(write_tiny_config, no_model_build,
                                                                                capsys, tmp_path, target):
    """``log_path: /proc/exchange.jsonl`` failed at step 1 with a worker traceback (status 1) and a version_0."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    path = str(blocker / "exchange.jsonl") if target == "through_a_file" else str(tmp_path)
    config = write_tiny_config(modify=lambda c: c["trainer"]["callbacks"][0].setdefault("init_args", {}).update(
        log_path=path))
    err = _refused(capsys, "--config", str(config))
    assert f"SharedExperienceExchange.log_path={path!r} cannot be written (" in err
    assert "or log_path: null." in err
    assert not (tmp_path / "runs").exists()


def test_a_prebuilt_folder_that_does_not_exist_is_refused_naming_the_nearest(write_tiny_config, no_model_build,
                                                                             capsys, tmp_path):
    """``prebuilt: models/default/gpt3`` was ignored: on a cache miss it would have warm-started for minutes."""
    (tmp_path / "models" / "gpt2").mkdir(parents=True)
    (tmp_path / "models" / "llama").mkdir()
    typo = str(tmp_path / "models" / "gpt3")
    config = write_tiny_config(modify=lambda c: _recipe(c).update(prebuilt=typo))
    err = _refused(capsys, "--config", str(config))
    assert (f"policy 'gpt2': TinyCausalLM.prebuilt={typo!r} is not a folder; did you mean "
            f"{str(tmp_path / 'models' / 'gpt2')!r}? Give the folder a recipe wrote, or prebuilt: null") in err
    assert not (tmp_path / "runs").exists()


def _part_config(c) -> dict:
    return c["data"]["init_args"]["parts"][0]["config"]


def test_a_misspelled_option_of_a_reasoning_gym_dataset_names_the_nearest(write_tiny_config, no_model_build, capsys):
    """``min_term: 2`` gave the raw ``TypeError: BasicArithmeticDatasetConfig.__init__() got an unexpected keyword
    argument 'min_term'`` after a dump of the whole config."""
    def modify(c):
        _part_config(c)["min_term"] = _part_config(c).pop("min_terms")

    err = _refused(capsys, "--config", str(write_tiny_config(modify=modify)))
    assert ("data.parts[add].config: 'min_term' is not an option of reasoning-gym 'basic_arithmetic'; did you mean "
            "'min_terms'? its options: [") in err
    assert "TypeError" not in err


def test_a_misspelled_reasoning_gym_dataset_names_the_nearest(write_tiny_config, no_model_build, capsys):
    config = write_tiny_config(modify=lambda c: c["data"]["init_args"]["parts"][0].update(dataset="basic_arithmetc"))
    err = _refused(capsys, "--config", str(config))
    assert "data.parts[add].dataset='basic_arithmetc' is not a reasoning-gym dataset; did you mean 'basic_arithmetic'" \
        in err


def _fit_before_torch(**env):
    """``mrl fit`` of the default config in a subprocess with ``env`` set; status 9 if torch was imported first."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", "import sys; from mrl_lightning.cli import main; "
                           "sys.exit(main(['fit', '--config', 'configs/default.yaml'])) if 'torch' not in "
                           "sys.modules else sys.exit(9)"], env={**os.environ, **env}, capture_output=True,
                          text=True, cwd=REPO, timeout=60)


@pytest.mark.parametrize("value", ["0", "-2", "two", ""])
def test_omp_num_threads_that_is_no_positive_integer_is_one_line_before_torch(value):
    """``OMP_NUM_THREADS=0`` made libgomp print "Invalid value for environment variable OMP_NUM_THREADS" twice."""
    done = _fit_before_torch(OMP_NUM_THREADS=value)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"mrl: configuration error: OMP_NUM_THREADS={value!r} must be a positive integer (or "
                           "unset); e.g. OMP_NUM_THREADS=1, or unset OMP_NUM_THREADS (mrl fit sets torch's threads "
                           "from trainer.num_threads).\n")


def test_a_key_given_twice_in_one_config_file_is_refused_naming_both_lines(write_tiny_config, no_model_build, capsys,
                                                                           tmp_path):
    """``max_steps: 2500`` and, lower down, ``max_steps: 3``: the run silently took the last."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("trainer:\n  max_steps: 2500\n  log_every_n_steps: 1\n  max_steps: 3\n")
    err = _refused(capsys, "--config", str(write_tiny_config()), "--config", str(twice))
    assert (f"config file {str(twice)!r}: 'trainer.max_steps' is given twice, on lines 2 and 4; YAML would keep the "
            "second silently. Delete one of them.") in err
    assert not (tmp_path / "runs").exists()


def test_a_config_path_that_is_a_folder_lists_its_yaml_files(no_model_build, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    err = _refused(capsys, "--config", "configs")
    assert "--config 'configs' is a folder; give one YAML file in it: " in err
    assert "configs/default.yaml" in err


def test_a_model_path_that_is_a_plain_file_is_named_with_what_a_model_is(write_tiny_config, no_model_build, capsys,
                                                                         tmp_path):
    """jsonargparse put the file's contents in its place: ``model='hello\\n' is a hub id ... cannot be reached``."""
    afile = tmp_path / "afile"
    afile.write_text("hello\n")
    err = _refused(capsys, "--config", str(write_tiny_config()), "--model.policies.init_args.model", str(afile))
    assert (f"model.policies.init_args.model={str(afile)!r} is a file, not a model: a model is a folder written by "
            "save_pretrained (config.json and the weights), a .gguf file, a hub id (org/name) or a recipe") in err
    assert "hello" not in err


def test_a_trainer_value_of_the_wrong_kind_in_a_config_file_names_the_file(write_tiny_config, no_model_build, capsys,
                                                                          tmp_path):
    """``max_steps: "two"`` in a file: the quick trainer check named the value but not the file it came from."""
    bad = tmp_path / "bad.yaml"
    bad.write_text('trainer:\n  max_steps: "two"\n')
    err = _refused(capsys, "--config", str(write_tiny_config()), "--config", str(bad))
    assert f"config file {str(bad)!r}: trainer.max_steps='two' must be an integer >= 1" in err
    err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.max_steps", "0")  # the command line's
    assert "- trainer.max_steps=0 must be an integer >= 1" in err and "config file" not in err


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_mrl_cache_dir_is_one_line_before_torch(value):
    """``MRL_CACHE_DIR=`` made the model cache in the current folder (models/<hash>/ inside the repository)."""
    done = _fit_before_torch(MRL_CACHE_DIR=value)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"mrl: configuration error: MRL_CACHE_DIR={value!r} is empty: the model cache would be made "
                           "in the current folder. Unset it (the cache is then ~/.cache/mrl_lightning) or give a folder: "
                           "MRL_CACHE_DIR=<folder>.\n")


@pytest.mark.parametrize("command, near", [("exprt", "export"), ("fitt", "fit"), ("zzz", None)])
def test_an_unknown_command_names_the_nearest_and_every_command(command, near, capsys):
    """``mrl exprt`` got LightningCLI's "(choose from 'fit')", which hides export, thl and bandit."""
    from mrl_lightning.cli import main

    assert main([command, "--run", "x"]) == 2
    err = capsys.readouterr().err
    hint = f"; did you mean {near!r}?" if near else "."
    assert err == f"mrl: unknown command {command!r}{hint} Commands: fit, replay, export, thl, bandit (mrl <command> --help).\n"
