"""What a resume accepts from a changed config and what it refuses (docs/loop.md, "Resuming"; docs/reliability.md,
"Checkpoints and the exchange log").

Accepted: a setting of the training that continues (learning rate, probes, LoRA dropout), applied from the
resumed step on, with a warning where saved state is dropped. Refused before any model is built: a change
that leaves the saved weights unloadable or makes the resumed model another than the saved one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mrl_lightning.run.checkpoint import load_checkpoint
from mrl_lightning.cli import main

from e2e_configs import forbid_model_build  # tests/e2e, on sys.path through this folder's conftest


def _policies(cfg: dict) -> list[dict]:
    return [p["init_args"] for p in cfg["model"]["policies"]]


def _lora(cfg: dict) -> None:
    for args in _policies(cfg):
        args.update(use_peft=True, lora_r=4, lora_alpha=8.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``run(name, modify, *argv)``: the tiny config after ``modify``, run to step 1 (or resumed); its exit status
    and run folder. Module-scoped: the recipe models are built once."""
    import yaml

    from e2e_configs import tiny_config

    folder = tmp_path_factory.mktemp("resume_changes")

    def run(name: str, modify=None, *argv: str) -> tuple[int, Path]:
        cfg = tiny_config(folder / "cache", folder / "runs")
        cfg["trainer"].update(max_steps=1, version=name)
        if modify is not None:
            modify(cfg)
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        return main(["fit", "--config", str(folder / f"{name}.yaml"), *argv]), folder / "runs" / name

    return run


def _resume_of(run_dir: Path) -> tuple[str, str]:
    return "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt")


def test_a_resume_applies_this_configs_learning_rate_also_without_warmup(runs):
    code, first = runs("lr_a")  # warmup_steps 0: the update leaves the optimizer's lr as it finds it
    assert code == 0

    def faster(cfg):
        _policies(cfg)[0]["learning_rate"] = 0.05
        cfg["trainer"]["max_steps"] = 2

    code, resumed = runs("lr_b", faster, *_resume_of(first))
    assert code == 0
    saved = load_checkpoint(resumed / "checkpoints" / "last.ckpt")["policies"]
    # the checkpoint's param groups said 0.01 (the first run's); the step after the resume ran at 0.05
    assert [g["lr"] for g in saved["gpt2"]["optimizer"]["param_groups"]] == [0.05]
    assert [g["lr"] for g in saved["llama"]["optimizer"]["param_groups"]] == [0.01]


def test_a_resume_takes_fused_optimizer_from_this_config(runs):
    code, first = runs("fused_a")  # fused_optimizer false: the foreach path
    assert code == 0

    def fused(cfg):
        _policies(cfg)[0]["fused_optimizer"] = True
        cfg["trainer"]["max_steps"] = 2

    code, resumed = runs("fused_b", fused, *_resume_of(first))
    assert code == 0
    saved = load_checkpoint(resumed / "checkpoints" / "last.ckpt")["policies"]
    assert [g["fused"] for g in saved["gpt2"]["optimizer"]["param_groups"]] == [True]
    assert [bool(g["fused"]) for g in saved["llama"]["optimizer"]["param_groups"]] == [False]


def test_a_resume_under_another_probe_warns_which_state_is_dropped(runs, capsys):
    code, first = runs("probe_a")
    assert code == 0

    def no_sharing(cfg):
        cfg["trainer"].update(max_steps=2, callbacks=[{"class_path": "mrl_lightning.callbacks.NoSharing"}])

    capsys.readouterr()
    assert runs("probe_b", no_sharing, *_resume_of(first))[0] == 0
    assert ("Warning: resuming with different callbacks: state for ['SharedExperienceExchange', "
            "'SuccessGatedTransfer'] is dropped, ['NoSharing'] start fresh.") in capsys.readouterr().out


@pytest.fixture(scope="module")
def lora_run(runs):
    code, run_dir = runs("lora_a", _lora)
    assert code == 0
    fingerprint = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["fingerprint"]
    assert fingerprint["policies"]["gpt2"]["lora_alpha"] == 8.0
    return run_dir


def test_a_resume_with_another_lora_alpha_is_refused_before_any_build(runs, lora_run, monkeypatch, capsys):
    def other_alpha(cfg):
        _lora(cfg)
        _policies(cfg)[1]["lora_alpha"] = 16.0
        cfg["trainer"]["max_steps"] = 2

    forbid_model_build(monkeypatch)
    capsys.readouterr()
    code, resumed = runs("lora_alpha", other_alpha, *_resume_of(lora_run))
    err = capsys.readouterr().err
    assert code == 2 and not resumed.exists()
    assert ("policy 'llama': the checkpoint's LoRA adapter has lora_alpha=8, this config lora_alpha=16 (the adapter's "
            "output is scaled by lora_alpha / lora_r: the resumed model would not be the saved one)") in err
    assert "policy 'gpt2'" not in err


def test_a_resume_with_another_lora_dropout_is_accepted(runs, lora_run):
    def other_dropout(cfg):
        _lora(cfg)
        _policies(cfg)[0]["lora_dropout"] = 0.2
        cfg["trainer"]["max_steps"] = 2

    code, resumed = runs("lora_dropout", other_dropout, *_resume_of(lora_run))
    assert code == 0
    assert load_checkpoint(resumed / "checkpoints" / "last.ckpt")["counters"]["global_step"] == 2


def test_a_finished_runs_command_run_again_says_the_run_is_complete_and_builds_nothing(runs, monkeypatch, capsys):
    """A job requeued after its last checkpoint (SLURM preemption) runs the same command again: at exactly
    ``max_steps`` there is nothing to train, as Lightning's ``fit`` says too; exit 0, no run folder made."""
    code, first = runs("complete_a", lambda cfg: cfg["trainer"].update(max_steps=2))
    assert code == 0
    root = first.parent
    before = sorted(p.name for p in root.iterdir())

    def again(cfg):
        cfg["trainer"].update(max_steps=2, version=None)  # the next free version_<n>, as a requeued job gets

    forbid_model_build(monkeypatch)
    capsys.readouterr()
    code, _ = runs("complete_b", again, *_resume_of(first))
    out, err = capsys.readouterr()
    assert code == 0, err
    last = first / "checkpoints" / "last.ckpt"
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == [f"The run is complete: ckpt_path={str(last)!r} is at step 2, which is trainer.max_steps; "
                     "nothing to train (set --trainer.max_steps above 2 to train further)."], out
    assert sorted(p.name for p in root.iterdir()) == before  # no version_<n> folder, nothing written


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_ckpt_path_is_refused_not_read_as_a_new_run(runs, monkeypatch, capsys, value):
    """``--ckpt_path "$CKPT"`` with ``CKPT`` unset started a new run from step 0, silently."""
    forbid_model_build(monkeypatch)
    capsys.readouterr()
    code, run_dir = runs(f"empty_ckpt{len(value)}", None, "--ckpt_path", value)
    err = capsys.readouterr().err
    assert code == 2 and not run_dir.exists()
    assert (f"ckpt_path={value!r} is empty: give a checkpoint to resume from (--ckpt_path "
            "<run>/checkpoints/last.ckpt), or leave --ckpt_path out to start a new run.") in err


def test_a_checkpoint_beyond_max_steps_is_refused_naming_both_steps(runs, monkeypatch, capsys):
    code, first = runs("beyond_a", lambda cfg: cfg["trainer"].update(max_steps=2))
    assert code == 0
    forbid_model_build(monkeypatch)
    capsys.readouterr()
    code, resumed = runs("beyond_b", None, *_resume_of(first))  # max_steps 1
    err = capsys.readouterr().err
    assert code == 2 and not resumed.exists()
    assert ("trainer.max_steps=1 is below the checkpoint's step 2; set --trainer.max_steps to 2 (the run is "
            "complete there) or more to continue training from it.") in err


def test_a_truncated_part_is_refused_before_any_build_naming_the_file_and_an_earlier_checkpoint(runs, monkeypatch,
                                                                                               capsys):
    """A part cut short (a copy that stopped, a full disk elsewhere) is found by the check before the build, on
    every rank, so no worker builds its models and no version_<n> folder is made for the failed try."""
    code, first = runs("damaged_a", lambda cfg: cfg["trainer"].update(max_steps=2, keep_checkpoints=5))
    assert code == 0
    folder = first / "checkpoints"
    part = folder / "step=2.parts" / "llama.pt"
    part.write_bytes(part.read_bytes()[:3000])
    root = first.parent
    before = sorted(p.name for p in root.iterdir())
    forbid_model_build(monkeypatch)
    capsys.readouterr()
    code, _ = runs("damaged_b", lambda cfg: cfg["trainer"].update(max_steps=3, version=None), *_resume_of(first))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0] == "mrl: configuration error:" and len(lines) == 2, err
    assert lines[1].startswith(f"the part of policy 'llama' of ckpt_path={str(folder / 'last.ckpt')!r} ({part}) "
                               "cannot be read: "), err
    assert lines[1].endswith(f"Resume from an earlier checkpoint: --ckpt_path {folder / 'step=1.ckpt'} (the readable "
                             "checkpoints in its folder that do not name this part: step=1.ckpt)."), err
    assert sorted(p.name for p in root.iterdir()) == before
