"""What ``mrl fit`` checks before it builds anything (docs/reliability.md, "Checked before the build").

Each case used to be found after the models were built (or warm-started), as a traceback
from every rank: a ``warm_start_part`` that is no data part, a run folder or model cache
that cannot be written, an accelerator the machine does not have, a precision Lightning
silently replaces, more CPU workers than cores, a checkpoint of another config. Now each is
one message naming the field and the fix, exit status 2, with no model built.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mrl_lightning.run.checkpoint import CheckpointError, check_compatible, load_checkpoint
from mrl_lightning.cli import main
from mrl_lightning.config.preflight import accelerator_errors, trainer_errors
from mrl_lightning.writable import file_system_type

from e2e_configs import forbid_model_build  # tests/e2e, on sys.path through this folder's conftest

REPO = Path(__file__).resolve().parents[2]
ON_GPU = torch.cuda.is_available()


@pytest.fixture
def no_model_build(monkeypatch):
    forbid_model_build(monkeypatch)


def _recipes(cfg) -> list[dict]:
    return [p["init_args"]["model"]["init_args"] for p in cfg["model"]["policies"]]


def _refused(capsys, *argv) -> str:
    start = time.monotonic()
    assert main(["fit", *argv]) == 2
    assert time.monotonic() - start < 60  # in-process: no model built, no warm-start
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return captured.err


def test_warm_start_part_naming_no_data_part_is_refused_before_any_build(write_tiny_config, no_model_build, capsys):
    config = write_tiny_config(modify=lambda c: _recipes(c)[1].update(warm_start_part="addition"))
    err = _refused(capsys, "--config", str(config))
    assert ("policy 'llama': TinyCausalLM.warm_start_part='addition' is not a part of the data; the data parts "
            "(data.parts names) are ['add', 'sub']. Set warm_start_part to one of them, e.g. 'add'.") in err


@pytest.mark.parametrize("probe", ["SuccessGatedTransfer", "PeerRolloutPooling", "CrossPolicyAdvantage"])
def test_a_sharing_probe_with_one_policy_is_refused_naming_the_probe_and_the_fix(write_tiny_config, no_model_build,
                                                                                 capsys, probe):
    """It ran as plain GRPO: 0 transfers, and nothing said why."""
    def modify(c):
        c["model"]["policies"] = c["model"]["policies"][:1]
        c["trainer"]["callbacks"][1] = {"class_path": f"mrl_lightning.callbacks.{probe}"}
        if probe != "SuccessGatedTransfer":  # what PRP and XGRPO read (their own config check)
            c["trainer"]["callbacks"][0].setdefault("init_args", {}).update(record_types=["rollout", "group_stats"],
                                                             max_staleness=0)

    err = _refused(capsys, "--config", str(write_tiny_config(modify=modify)))
    assert (f"trainer.callbacks[1]: {probe} shares experience between policies, but model.policies has 1 (['gpt2']): "
            "it would share nothing and the run would be plain GRPO. Add a policy to model.policies, or use the "
            "control without sharing, callbacks/none.yaml.") in err


def test_a_per_policy_probe_value_naming_no_policy_names_the_field_and_the_file(write_tiny_config, no_model_build,
                                                                                capsys, tmp_path):
    """``--config configs/real_small.yaml --config callbacks/sgt.yaml`` (before sgt.yaml left the per-policy value
    to the config below) said only "SuccessGatedTransfer names policy 'llama'": neither the field nor the file."""
    snippet = tmp_path / "callbacks" / "my_sgt.yaml"
    snippet.parent.mkdir()
    snippet.write_text("trainer:\n  callbacks:\n    - class_path: mrl_lightning.callbacks.SharedExperienceExchange\n"
                       "    - class_path: mrl_lightning.callbacks.SuccessGatedTransfer\n"
                       "      init_args: {lambda_per_policy: {lama: 1.0}}\n")
    err = _refused(capsys, "--config", str(write_tiny_config()), "--config", str(snippet))
    assert (f"config file {str(snippet)!r}: trainer.callbacks[1].init_args.lambda_per_policy of SuccessGatedTransfer "
            "names policy 'lama', which is not in model.policies ['gpt2', 'llama']; did you mean 'llama'? Or remove "
            "'lama' from lambda_per_policy, or name one of ['gpt2', 'llama']; "
            f"{str(snippet)!r} was written for another config's policies.") in err
    assert err.count("names policy 'lama'") == 1  # the probe's own, vaguer line is not added


def test_a_per_policy_probe_value_naming_no_policy_names_the_nearest_policy(write_tiny_config, no_model_build, capsys):
    """``receivers: [gtp2]`` named the field but left the user to spot the typo."""
    config = write_tiny_config(modify=lambda c: c["trainer"]["callbacks"][1].setdefault("init_args", {}).update(
        receivers=["gtp2"]))
    err = _refused(capsys, "--config", str(config))
    assert (f"config file {str(config)!r}: trainer.callbacks[1].init_args.receivers of SuccessGatedTransfer names "
            "policy 'gtp2', which is not in model.policies ['gpt2', 'llama']; did you mean 'gpt2'? Or remove 'gtp2' "
            "from receivers, or name one of ['gpt2', 'llama'].") in err


def test_strong_parts_naming_no_data_part_is_refused_naming_the_policy_the_part_and_the_parts(
        write_tiny_config, no_model_build, capsys):
    """Such a part was never drawn: every part counted as weak, the strong tags stayed empty, no word."""
    config = write_tiny_config(modify=lambda c: c["model"]["policies"][1]["init_args"].update(strong_parts=["subb"]))
    err = _refused(capsys, "--config", str(config))
    assert ("policy 'llama': model.policies[1].init_args.strong_parts names part 'subb', which is not a part of the "
            "data; the data's parts (data.init_args.parts names) are ['add', 'sub']. Name one of them, e.g. 'sub'.") \
        in err


def test_run_folder_that_cannot_be_written_is_refused_before_any_build(write_tiny_config, no_model_build, capsys,
                                                                        tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")  # a path through a file cannot be created, whoever runs the test
    root = blocker / "runs"
    err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.default_root_dir", str(root))
    assert f"trainer.default_root_dir={str(root)!r} cannot be written ({str(blocker)!r} is a file, not a folder)" in err
    assert "--trainer.default_root_dir <folder>" in err


@pytest.mark.skipif(file_system_type("/proc") != "proc", reason="no proc file system mounted at /proc")
def test_a_run_folder_under_proc_names_the_file_system_not_a_missing_file(write_tiny_config, no_model_build,
                                                                           capsys):
    err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.default_root_dir", "/proc/mrl_runs")
    assert ("trainer.default_root_dir='/proc/mrl_runs' cannot be written ('/proc' is on a proc file system, where "
            "the kernel's own files live: no file can be made there)") in err
    assert "no such file" not in err


def test_the_mount_holding_a_path_is_the_deepest_one_above_it(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\nproc /proc proc rw 0 0\nsysfs /sys sysfs rw 0 0\n"
                      "/dev/sdb1 /mnt/my\\040disk xfs rw 0 0\ntmpfs /mnt/my\\040disk/tmp tmpfs rw 0 0\n")
    where = {"/proc/x/y": "proc", "/processes": "ext4", "/sys": "sysfs", "/mnt/my disk/a": "xfs",
             "/mnt/my disk/tmp/b": "tmpfs", "/mnt/my": "ext4"}
    assert {path: file_system_type(path, str(mounts)) for path in where} == where
    assert file_system_type("/x", str(tmp_path / "no_such_table")) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_read_only_run_folder_is_refused_before_any_build(write_tiny_config, no_model_build, capsys, tmp_path):
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.default_root_dir",
                       str(folder / "runs"))
    finally:
        folder.chmod(0o755)
    assert "cannot be written (permission denied at" in err


def test_model_cache_that_cannot_be_written_is_refused_when_the_model_is_not_built(
        write_tiny_config, no_model_build, capsys, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")

    def env_cache(cfg):  # the recipes use MRL_CACHE_DIR (no cache_dir of their own)
        for recipe in _recipes(cfg):
            recipe.pop("cache_dir")

    monkeypatch.setenv("MRL_CACHE_DIR", str(blocker / "cache"))
    err = _refused(capsys, "--config", str(write_tiny_config(modify=env_cache)))
    for name in ("gpt2", "llama"):
        assert (f"policy {name!r}: MRL_CACHE_DIR={str(blocker / 'cache')!r} cannot be written ({str(blocker)!r} is a "
                "file, not a folder), and this recipe's model is not built yet") in err
    assert "Set MRL_CACHE_DIR (or TinyCausalLM.cache_dir) to a folder you can write." in err


def test_a_model_already_in_a_read_only_cache_is_not_refused(tmp_path, monkeypatch):
    from mrl_lightning.data import ReasoningGymDataModule
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.recipes import TinyCausalLM

    recipe = TinyCausalLM(tokenizer_kind="char_level", hidden_size=16, num_layers=1, num_heads=2,
                          cache_dir=str(tmp_path))
    policy = PolicyModule(name="p", model=recipe)
    data = ReasoningGymDataModule([{"name": "add", "dataset": "basic_arithmetic"}], batch_size=1, train_size=20,
                                  eval_size=2)
    monkeypatch.setattr("mrl_lightning.recipes.tiny.write_problem", lambda path: "read-only file system at '/x'")
    assert any("cannot be written (read-only file system at '/x')" in e for e in recipe.config_errors(policy, data))
    recipe.materialize(policy, data, log=lambda line: None)  # now it is built: reading it needs no write
    assert recipe.config_errors(policy, data) == []


def test_an_accelerator_this_machine_lacks_is_named_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (error,) = trainer_errors(accelerator="gpu")
    assert error.startswith("trainer.accelerator='gpu' but no CUDA GPU is visible here (torch ")
    assert error.endswith("Use --trainer.accelerator cpu, or auto (a GPU when there is one, else the CPU).")
    assert accelerator_errors("cpu") == accelerator_errors("auto") == []


@pytest.mark.skipif(ON_GPU, reason="needs a machine without a GPU")
def test_gpu_accelerator_on_a_cpu_machine_is_refused_before_any_class_is_built(write_tiny_config, no_model_build,
                                                                                capsys):
    err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.accelerator", "gpu")
    assert "trainer.accelerator='gpu' but no CUDA GPU is visible here" in err


@pytest.mark.skipif(ON_GPU, reason="needs a machine without a GPU")
def test_fp16_mixed_precision_on_a_cpu_is_refused_naming_what_would_run(write_tiny_config, no_model_build, capsys):
    err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.precision", "16-mixed")
    assert ("trainer.precision='16-mixed' is not supported on the cpu: Lightning would run 'bf16-mixed' instead. Set "
            "--trainer.precision bf16-mixed to run that, or 32-true") in err


def test_a_precision_lightning_does_not_know_names_the_ones_to_use(write_tiny_config, no_model_build, capsys):
    err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.precision", "fp16")
    assert "trainer.precision='fp16'" in err and "Set --trainer.precision 32-true or bf16-mixed." in err


@pytest.mark.skipif(ON_GPU, reason="the CPU's precision switch")
def test_lightnings_precision_line_is_held_back_when_refused_and_said_once_when_accepted():
    import logging

    from lightning_utilities.core import rank_zero

    from mrl_lightning.errors import ConfigError
    from mrl_lightning.config.preflight import make_fabric

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    rank_zero.log.addHandler(handler)
    level = rank_zero.log.level
    rank_zero.log.setLevel(logging.INFO)
    try:
        with pytest.raises(ConfigError, match="Lightning would run 'bf16-mixed' instead"):
            make_fabric("auto", 60.0, accelerator="cpu", devices=1, precision="16-mixed")
        assert said == []  # the error is the only line
        make_fabric("auto", 60.0, accelerator="cpu", devices=1, precision="bf16-mixed")
        assert said == ["Using bfloat16 Automatic Mixed Precision (AMP)"]
    finally:
        rank_zero.log.removeHandler(handler)
        rank_zero.log.setLevel(level)


def test_more_cpu_workers_than_cores_are_refused_with_the_fix(write_tiny_config, no_model_build, capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    config = write_tiny_config(modify=lambda c: c["trainer"].update(num_threads=None, devices=8))
    err = _refused(capsys, "--config", str(config), "--trainer.strategy", "ddp", "--data.init_args.batch_size", "8")
    assert ("trainer.devices=8 CPU worker processes per node but 2 CPU core(s): workers would take turns on the cores "
            "and the run would be several times slower than with 2. Set --trainer.devices 2 (or fewer).") in err


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A 1-step run of the tiny config; its last.ckpt."""
    import yaml

    from e2e_configs import tiny_config

    folder = tmp_path_factory.mktemp("ckpt_of_a_config")
    cfg = tiny_config(folder / "cache", folder / "runs")
    cfg["trainer"].update(max_steps=1, version="a")
    (folder / "a.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["fit", "--config", str(folder / "a.yaml")]) == 0
    return folder / "runs" / "a" / "checkpoints" / "last.ckpt"


def test_checkpoint_of_a_config_with_other_shapes_is_refused_before_any_build(
        tiny_checkpoint, write_tiny_config, no_model_build, capsys):
    def wider(cfg):
        for recipe in _recipes(cfg):
            recipe["hidden_size"] = 64
        cfg["trainer"]["max_steps"] = 3

    err = _refused(capsys, "--config", str(write_tiny_config(modify=wider)), "--ckpt_path", str(tiny_checkpoint))
    assert f"ckpt_path={str(tiny_checkpoint)!r} does not fit this config:" in err
    for name in ("gpt2", "llama"):
        assert f"policy {name!r}: " in err and "parameter(s) differ in shape, e.g. " in err
    assert "in the checkpoint and [" in err and "in this config" in err
    assert f"({tiny_checkpoint.parent.parent / 'config.yaml'})" in err


def test_checkpoint_of_a_config_with_other_families_or_data_parts_is_refused(tiny_checkpoint, write_tiny_config,
                                                                             no_model_build, capsys):
    def swapped(cfg):
        a, b = _recipes(cfg)
        a["family"], b["family"] = "llama", "gpt2"
        cfg["data"]["init_args"]["parts"][1]["name"] = "minus"
        cfg["model"]["policies"][1]["init_args"]["strong_parts"] = ["minus"]
        cfg["trainer"]["max_steps"] = 3

    err = _refused(capsys, "--config", str(write_tiny_config(modify=swapped)), "--ckpt_path", str(tiny_checkpoint))
    assert "data.parts: the checkpoint's parts are ['add', 'sub'], this config's ['add', 'minus']" in err
    assert "policy 'gpt2': the checkpoint holds a gpt2 model, this config builds a llama model" in err
    assert "policy 'llama': the checkpoint holds a llama model, this config builds a gpt2 model" in err


def test_an_older_checkpoint_without_a_fingerprint_is_compared_by_its_weights(tiny_checkpoint):
    state = load_checkpoint(tiny_checkpoint)
    assert set(state["fingerprint"]["policies"]) == {"gpt2", "llama"}
    del state["fingerprint"]  # as written before the fingerprint existed
    shapes = {k: tuple(v.shape) for k, v in state["policies"]["gpt2"]["model"].items()}
    check_compatible(state, ["gpt2", "llama"], 5, data_parts=["add", "sub"],
                     models={"gpt2": {"adapter": False, "shapes": shapes}})
    wider = {k: tuple(2 * d for d in s) for k, s in shapes.items()}
    with pytest.raises(CheckpointError, match="policy 'gpt2': .* parameter.s. differ in shape"):
        check_compatible(state, ["gpt2", "llama"], 5, models={"gpt2": {"adapter": False, "shapes": wider}})
    with pytest.raises(CheckpointError, match="the checkpoint holds every weight, this config trains a LoRA adapter"):
        check_compatible(state, ["gpt2", "llama"], 5, models={"gpt2": {"adapter": True, "shapes": shapes}})


def test_a_recipes_vocabulary_is_open_until_its_tokenizer_is_trained():
    from mrl_lightning.run.checkpoint import shape_differences

    saved = {"wte.weight": [272, 32], "h.0.w": [32, 96]}
    assert shape_differences(saved, {"wte.weight": (320, 32), "h.0.w": (32, 96)}, open_size=320) == []
    (line,) = shape_differences(saved, {"wte.weight": (320, 64), "h.0.w": (64, 192)}, open_size=320)
    assert line == "2 parameter(s) differ in shape, e.g. h.0.w is [32, 96] in the checkpoint and [64, 192] in this config"


def _imported(*argv: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "e2e"), str(REPO)]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "mrl_lightning.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=300)
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc.returncode, " ".join(sorted(modules))


@pytest.mark.parametrize("argv", [["--help"], ["--trainer.max_steps", "0"], ["--trainer.max_step", "3"],
                                  ["--model.policies.init_args.learning_rate", "-1"]],
                         ids=["help", "trainer-value", "unknown-key", "policy-value"])
def test_help_and_config_errors_import_no_data_library_and_build_no_model(write_tiny_config, argv):
    config = [] if argv == ["--help"] else ["--config", str(write_tiny_config())]
    code, modules = _imported("fit", *config, *argv)
    assert code == (0 if argv == ["--help"] else 2)
    for heavy in ("reasoning_gym", "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
                  "peft", "math_verify"):
        assert f" {heavy} " not in f" {modules} ", f"{heavy} was imported before the answer"


TRAINER_KEYS = {"max_steps", "eval_every_n_steps", "devices", "accelerator", "version"}


def test_trainer_values_are_read_from_configs_and_overrides_in_their_order(tmp_path):
    from mrl_lightning.config.preflight import quick_trainer_errors

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("trainer:\n  max_steps: 0\n  devices: 1\n")
    b.write_text("trainer:\n  max_steps: 4\n")
    assert quick_trainer_errors(["fit", "--config", str(a)], TRAINER_KEYS) == [
        "trainer.max_steps=0 must be an integer >= 1; e.g. --trainer.max_steps 2."]
    assert quick_trainer_errors(["fit", "--config", str(a), "--config", str(b)], TRAINER_KEYS) == []  # later wins
    assert quick_trainer_errors(["fit", "-c", str(a), "--trainer.max_steps=3"], TRAINER_KEYS) == []
    assert quick_trainer_errors(["fit", "--config", str(b), "--trainer.max_steps", "abc",
                                 "--trainer.eval_every_n_steps", "-2"], TRAINER_KEYS) == [
        "trainer.max_steps='abc' must be an integer >= 1; e.g. --trainer.max_steps 2.",
        "trainer.eval_every_n_steps=-2 must be an integer >= 0 (0 = no evaluation); e.g. --trainer.eval_every_n_steps 1."]
    assert quick_trainer_errors(["fit", "--config", str(b), "--trainer.max_step", "0"], TRAINER_KEYS) == []  # unknown


@pytest.mark.parametrize("argv", [["--print_config"], ["--help"], ["--trainer", "{max_steps: 0}"],
                                  ["--config", "/no/such/file.yaml"]],
                         ids=["print_config", "help", "whole-section", "unreadable-config"])
def test_what_the_quick_reading_is_not_sure_of_is_left_to_the_full_parse(tmp_path, argv):
    from mrl_lightning.config.preflight import quick_trainer_errors

    assert quick_trainer_errors(["fit", "--trainer.max_steps", "0", *argv], TRAINER_KEYS) == []


def test_a_bad_trainer_value_is_refused_before_the_config_is_parsed(write_tiny_config, monkeypatch, capsys):
    from mrl_lightning.config.keys import MRLArgumentParser

    def no_parse(self, *args, **kwargs):
        raise AssertionError("the whole config was parsed before the trainer value was checked")

    monkeypatch.setattr(MRLArgumentParser, "parse_args", no_parse)
    err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.max_steps", "0")
    assert err == "mrl: configuration error:\nInvalid trainer config:\n  - trainer.max_steps=0 must be an integer >= 1; e.g. --trainer.max_steps 2.\n"


def _policies(tmp_path, name: str, *entries: dict):
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump({"model": {"policies": [
        {"class_path": "mrl_lightning.policy.PolicyModule", "init_args": e} for e in entries]}}))
    return str(path)


def test_policy_values_are_read_from_the_last_list_and_overrides_reach_its_last_entry(tmp_path):
    from mrl_lightning.config.preflight import quick_policy_errors

    a = _policies(tmp_path, "a.yaml", {"name": "p", "model": "m", "learning_rate": "1e-3"},
                  {"name": "q", "model": "m", "num_generations": 1})
    b = _policies(tmp_path, "b.yaml", {"name": "r", "model": "m", "top_p": 1.5})
    assert quick_policy_errors(["fit", "--config", a]) == ("q", [
        "policy 'q': num_generations=1; GRPO needs >= 2 completions per prompt to form a group baseline. "
        "Set num_generations: 8 (or any >= 2)."])
    assert quick_policy_errors(["fit", "--config", a, "--model.policies.init_args.num_generations", "4"]) is None
    assert quick_policy_errors(["fit", "--config", a, "--config", b]) == (
        "r", ["policy 'r': top_p=1.5 must be in (0, 1]."])  # a later list replaces the earlier one
    assert quick_policy_errors(["fit", "--config", b, "--model.policies.init_args.top_p=0.5",
                                "--model.policies.init_args.learning_rate", "-1"]) == (
        "r", ["policy 'r': learning_rate=-1.0 must be > 0."])


@pytest.mark.parametrize("extra", [["--model.policies", "[]"], ["--model.policies.class_path", "X"],
                                   ["--model.policies.init_args.learning_rate", "abc"],
                                   ["--model.policies.init_args.no_such_option", "1"], ["--print_config"]],
                         ids=["whole-list", "class-path", "wrong-type", "unknown-option", "print_config"])
def test_what_the_quick_policy_reading_is_not_sure_of_is_left_to_the_full_parse(tmp_path, extra):
    from mrl_lightning.config.preflight import quick_policy_errors

    config = _policies(tmp_path, "a.yaml", {"name": "p", "model": "m", "temperature": 0.0})
    assert quick_policy_errors(["fit", "--config", config])[0] == "p"
    assert quick_policy_errors(["fit", "--config", config, *extra]) is None


def test_a_bad_policy_value_is_refused_before_the_config_is_parsed(write_tiny_config, monkeypatch, capsys):
    from mrl_lightning.config.keys import MRLArgumentParser

    def no_parse(self, *args, **kwargs):
        raise AssertionError("the whole config was parsed before the policy value was checked")

    monkeypatch.setattr(MRLArgumentParser, "parse_args", no_parse)
    err = _refused(capsys, "--config", str(write_tiny_config()), "--model.policies.init_args.learning_rate", "-1")
    note, error = err.split("\n", 1)  # the notes come first: this one says which policy the override reached
    assert note.startswith("note: --model.policies.learning_rate applies to the last policy of the list")
    assert error.startswith("mrl: configuration error:\nInvalid config for policy ")
    assert error.endswith("learning_rate=-1.0 must be > 0.\n")


def test_export_to_a_folder_that_cannot_be_written_is_one_line_with_status_two(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = _refused_export(capsys, "--run", str(run), "--policy", "gpt2", "--out", str(blocker / "exported"))
    assert err == (f"mrl export: --out {str(blocker / 'exported')!r} cannot be written "
                   f"({str(blocker)!r} is a file, not a folder); give a folder you can write.\n")


def _refused_export(capsys, *argv) -> str:
    assert main(["export", *argv]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return captured.err


def test_an_override_of_a_policy_value_says_it_reaches_the_last_policy_only(tmp_path):
    from mrl_lightning.config.preflight import policy_override_notes

    two = _policies(tmp_path, "two.yaml", {"name": "p", "model": "m"}, {"name": "q", "model": "m"})
    one = _policies(tmp_path, "one.yaml", {"name": "p", "model": "m"})
    for key in ("--model.policies.init_args.learning_rate", "--model.policies.learning_rate"):  # the same to the parser
        (note,) = policy_override_notes(["fit", "--config", two, key, "0.005"])
        assert note.startswith("note: --model.policies.learning_rate applies to the last policy of the list "
                               "only ('q'; the others, ['p'], keep their value).")
    assert policy_override_notes(["fit", "--config", one, "--model.policies.init_args.learning_rate", "0.005"]) == []
    assert policy_override_notes(["fit", "--config", two]) == []



def test_a_setting_a_later_config_replaces_gets_a_note_naming_the_order_that_keeps_it():
    """``--trainer.max_steps 2 --config configs/default.yaml`` ran the default's 2500 steps, and ``--config
    callbacks/none.yaml --config configs/default.yaml`` ran SGT, not the control, without a word."""
    from mrl_lightning.config.reports import replaced_setting_notes

    default, none = str(REPO / "configs" / "default.yaml"), str(REPO / "callbacks" / "none.yaml")
    assert replaced_setting_notes(["fit", "--trainer.max_steps", "2", "--config", default]) == [
        f"note: --trainer.max_steps 2 is replaced by {default}'s trainer.max_steps: 2500 (a --config given after an "
        "option wins); put --trainer.max_steps after the --config files to keep it."]
    assert replaced_setting_notes(["fit", "--config", none, "--config", default]) == [
        f"note: the trainer.callbacks of {none} (SharedExperienceExchange, NoSharing) are replaced by {default}'s "
        f"(SharedExperienceExchange, SuccessGatedTransfer): a later --config wins. To run {none}'s, give it last: "
        f"--config {default} --config {none}."]
    # the README's orders: options after the files, the probe's file after the config
    assert replaced_setting_notes(["fit", "--config", default, "--config", none, "--trainer.max_steps", "2"]) == []
    assert replaced_setting_notes(["fit", "--config", default, "--trainer.max_steps=2"]) == []
    # given again after the file: the later option holds, nothing is lost
    assert replaced_setting_notes(["fit", "--trainer.max_steps", "3", "--config", default, "--trainer.max_steps",
                                   "2"]) == []


def test_the_note_of_a_replaced_setting_is_printed_before_the_run(write_tiny_config, no_model_build, capsys):
    config = str(write_tiny_config())
    err = _refused(capsys, "--trainer.max_steps", "7", "--config", config, "--trainer.version", "../x")
    assert f"note: --trainer.max_steps 7 is replaced by {config}'s trainer.max_steps: 2" in err
    assert "trainer.version='../x' must be a plain folder name" in err  # the run stops here, after the note


def test_bf16_on_a_cpu_without_bf16_matrix_instructions_is_named_with_the_fix(monkeypatch):
    from mrl_lightning.mwra.plan import slow_cpu_bf16_line

    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    line = slow_cpu_bf16_line("cpu", "bf16-mixed")
    assert "trainer.precision='bf16-mixed'" in line and "--trainer.precision 32-true" in line
    assert slow_cpu_bf16_line("cpu", "bf16-true") is not None
    assert slow_cpu_bf16_line("cpu", "32-true") is None  # float32 is fine anywhere
    assert slow_cpu_bf16_line("cuda", "bf16-mixed") is None  # a GPU's bf16 is not the CPU's
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # AMX: the fast kernel
    assert slow_cpu_bf16_line("cpu", "bf16-mixed") is None
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert slow_cpu_bf16_line("cpu", "bf16-mixed") is None
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr("platform.machine", lambda: "aarch64")  # ARM's bf16 is not checked here
    assert slow_cpu_bf16_line("cpu", "bf16-mixed") is None


def test_the_trainer_says_the_bf16_warning_once_and_never_in_a_launched_worker(monkeypatch, tmp_path):
    import warnings

    from mrl_lightning.loop import trainer as trainer_module

    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)

    def said() -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer_module.MRLTrainer(precision="bf16-mixed", devices=1, default_root_dir=str(tmp_path))
        return sum("without bf16 matrix instructions" in str(w.message) for w in caught)

    assert said() == 1
    monkeypatch.setattr(trainer_module, "is_launched_worker", lambda: True)
    assert said() == 0


@pytest.mark.parametrize("version", ["../../escaped", "a/b", "..", " "])
def test_a_run_version_that_is_no_plain_folder_name_is_refused(write_tiny_config, no_model_build, capsys, version):
    """``--trainer.version ../../escaped`` wrote the run outside ``default_root_dir``, silently."""
    err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.version", version)
    assert (f"trainer.version={version!r} must be a plain folder name (no '/', not '.' or '..'): the run folder is "
            "<default_root_dir>/<version>; e.g. --trainer.version seed0 (unset: version_<n>).") in err


@pytest.mark.parametrize("seed", ["-5", "4294967296"])
def test_a_seed_outside_numpys_seeds_is_refused_before_any_build(write_tiny_config, no_model_build, capsys, seed):
    """``--seed_everything -5`` failed in the launched workers with numpy's ValueError, status 1."""
    err = _refused(capsys, "--config", str(write_tiny_config()), "--seed_everything", seed)
    assert (f"seed_everything={seed} must be an integer in [0, 4294967295] (numpy's seeds), or true for a random "
            "seed; e.g. --seed_everything 0.") in err


def test_the_control_beside_a_sharing_probe_is_refused_naming_both(write_tiny_config, no_model_build, capsys):
    """``--trainer.callbacks+ mrl_lightning.callbacks.NoSharing`` on a config with SGT ran both arms at once."""
    err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.callbacks+",
                   "mrl_lightning.callbacks.NoSharing")
    assert ("trainer.callbacks has the control NoSharing (no sharing) and SuccessGatedTransfer, which shares: a run "
            "is one arm. Keep one: callbacks/none.yaml for the control, or the probe's file alone (remove NoSharing "
            "from trainer.callbacks).") in err


def test_a_callback_listed_twice_is_refused(write_tiny_config, no_model_build, capsys):
    err = _refused(capsys, "--config", str(write_tiny_config()), "--trainer.callbacks+",
                   "mrl_lightning.callbacks.SuccessGatedTransfer")
    assert "trainer.callbacks lists SuccessGatedTransfer 2 times: each would act on every step." in err


@pytest.mark.parametrize("value", ["2", "0"])
def test_a_success_threshold_no_reward_can_meet_is_refused(write_tiny_config, no_model_build, capsys, value):
    """``--model.success_threshold 2``: no completion was ever a success (evaluation 0.00, SGT shared nothing), silently."""
    err = _refused(capsys, "--config", str(write_tiny_config()), "--model.success_threshold", value)
    assert f"model.success_threshold={float(value)} must be in (0, 1]: rewards are in [0, 1]" in err


@pytest.mark.parametrize("values, line", [
    ({"max_grad_norm": -1.0}, "max_grad_norm=-1.0 must be > 0, or null for no clipping."),  # torch: every gradient flipped
    ({"weight_decay": -0.1}, "weight_decay=-0.1 must be >= 0 (AdamW's decay; 0 = none)."),  # was torch's, in the build
    ({"temperature": float("inf")}, "temperature=inf must be a finite number."),  # passed '> 0', ran, evaluated 0.00
    ({"learning_rate": float("nan")}, "learning_rate=nan must be a finite number."),  # YAML .nan: torch's, in the build
])
def test_values_torch_takes_or_refuses_late_are_refused_before_the_build(tmp_path, values, line):
    from mrl_lightning.config.preflight import quick_policy_errors

    config = _policies(tmp_path, "a.yaml", {"name": "p", "model": "m", **values})
    name, errors = quick_policy_errors(["fit", "--config", config])
    assert name == "p" and f"policy 'p': {line}" in errors


def test_a_negative_count_of_logged_completions_is_refused():
    from mrl_lightning.config.preflight import trainer_errors

    assert trainer_errors(num_sample_completions=-3) == [
        "trainer.num_sample_completions=-3 must be >= 0 (0 = no completions logged as text)."]
    assert trainer_errors(num_sample_completions=0) == []


def test_an_empty_list_of_reward_functions_is_refused(write_tiny_config, no_model_build, capsys):
    """``--model.reward_funcs '[]'`` trained on the default reward while config.yaml recorded none."""
    err = _refused(capsys, "--config", str(write_tiny_config()), "--model.reward_funcs", "[]")
    assert "model.reward_funcs is empty; list at least one reward function, or leave the key out" in err
    assert "no strict reward function" not in err
