"""End-to-end: the CLI ``fit`` on two tiny policies of different families (docs/default.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from mrl_lightning.run.checkpoint import load_checkpoint
from mrl_lightning.cli import main


def _run_dir(root: Path) -> Path:
    runs = sorted((p.parent for p in root.glob("*/config.yaml")), key=lambda p: p.stat().st_mtime)
    assert runs, f"no run folder with config.yaml under {root}"
    return runs[-1]


def _fit(config: Path, *extra: str) -> Path:
    rc = main(["fit", "--config", str(config), *extra])
    assert rc == 0
    return _run_dir(config.parent / "runs")


def test_fit_two_steps_writes_config_checkpoint_events_and_changes_every_parameter(write_config, capsys):
    config = write_config()
    run = _fit(config)
    out = capsys.readouterr().out  # the run ends by naming its checkpoint, how to resume, where the logs are
    last = run / "checkpoints" / "last.ckpt"
    assert f"Done at step 2. Checkpoint: {last}" in out and f"--ckpt_path {last}" in out
    assert f"tensorboard --logdir {config.parent / 'runs'}" in out
    assert "<=" in out and "upper bound" in out  # the plan: the recipes' vocabularies are bounds
    assert (run / "config.yaml").is_file()
    saved = (run / "config.yaml").read_text()
    assert "SuccessGatedTransfer" in saved and "max_steps: 2" in saved
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert list(run.glob("events.out.tfevents.*")), "no TensorBoard events written"

    state = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert state["counters"]["global_step"] == 2
    cache = config.parent / "cache" / "models"
    for name, folder in (("gpt2", "gpt2-*"), ("llama", "llama-*")):
        (initial_dir,) = list(cache.glob(folder))
        initial = AutoModelForCausalLM.from_pretrained(initial_dir)
        trained = state["policies"][name]["model"]
        unchanged = [k for k, p in initial.named_parameters()
                     if p.requires_grad and torch.equal(p.detach(), trained[k])]
        assert not unchanged, f"{name}: parameters unchanged after 2 steps: {unchanged}"


def test_tensorboard_has_per_policy_and_probe_tags(write_config):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _fit(write_config())
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for policy in ("gpt2", "llama"):
        for tag in ("rollout/{p}/reward_mean", "rollout/{p}/reward_std", "rollout/{p}/success_rate",
                    "rollout/{p}/success_rate_add", "rollout/{p}/zero_std_group_share", "train/{p}/loss",
                    "train/{p}/clip_ratio_low", "train/{p}/entropy_nats", "rollout/{p}/completion_length_tokens",
                    "rollout/{p}/truncated_share", "train/{p}/grad_norm", "eval/{p}/success_weak",
                    "eval/{p}/success_strong", "eval/{p}/greedy_success_weak", "eval/{p}/greedy_success_add", "probe/sgt/{p}/rescue_set_size", "probe/sgt/{p}/transfers"):
            assert tag.format(p=policy) in tags, f"missing tag {tag.format(p=policy)}"
    assert "train/step_time_s" in tags and "exchange/records_published" in tags
    assert any(t.startswith("thl/sgt/") and t.endswith("/round_trip_failures") for t in tags), \
        "SGT transfers logged no THL residual"
    assert events.Tags()["tensors"] or events.Tags().get("text") is not None


def test_resume_continues_with_identical_state(write_config, tmp_path, monkeypatch):
    from mrl_lightning.builders import models

    asked = []  # the trainer tells each policy whether it resumes (no repeated warm-start warning then)
    materialize = models.materialize
    monkeypatch.setattr(models, "materialize", lambda policy, *a, **k: (
        asked.append(k.get("resuming", False)), materialize(policy, *a, **k))[1])
    # the straight run writes compressed checkpoints, the resumed one plain ones: both resume exactly
    straight = write_config("straight.yaml", modify=lambda c: c["trainer"].update(
        max_steps=4, version="straight", keep_checkpoints=10, compress_checkpoints=True))
    run = _fit(straight)
    mid = run / "checkpoints" / "step=2.ckpt"
    assert mid.read_bytes()[:2] == b"\x1f\x8b", "compress_checkpoints: true wrote no gzip file"
    resumed_cfg = write_config("resumed.yaml", modify=lambda c: c["trainer"].update(max_steps=4, version="resumed"))
    assert asked and not any(asked)
    asked.clear()
    resumed = _fit(resumed_cfg, "--ckpt_path", str(mid))
    assert asked.count(True) == 2, asked  # each policy's build (the build's own call passes no flag)
    a = load_checkpoint(run / "checkpoints" / "last.ckpt")
    b = load_checkpoint(resumed / "checkpoints" / "last.ckpt")
    assert (resumed / "checkpoints" / "last.ckpt").read_bytes()[:2] != b"\x1f\x8b"
    assert a["counters"] == b["counters"]
    for name in a["policies"]:
        for key, value in a["policies"][name]["model"].items():
            assert torch.equal(value, b["policies"][name]["model"][key]), f"{name}.{key} differs after resume"
    assert a["data"] == b["data"]
    assert a["callbacks"] == b["callbacks"], "exchange / probe state differs after resume"
    assert len(a["rng"]["ranks"]) == len(b["rng"]["ranks"]) == 1
    assert torch.equal(a["rng"]["ranks"][0]["torch"], b["rng"]["ranks"][0]["torch"])


def test_missing_ckpt_path_is_a_clear_error(write_config, capsys):
    assert main(["fit", "--config", str(write_config()), "--ckpt_path", "/nonexistent/last.ckpt"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_truncated_checkpoint_is_a_clear_error_and_last_good_one_resumes(write_config, capsys):
    run = _fit(write_config(modify=lambda c: c["trainer"].update(version="a", keep_checkpoints=5)))
    bad = run / "checkpoints" / "broken.ckpt"
    data = (run / "checkpoints" / "last.ckpt").read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    cfg = write_config("b.yaml", modify=lambda c: c["trainer"].update(version="b", max_steps=3))
    assert main(["fit", "--config", str(cfg), "--ckpt_path", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "broken.ckpt" in err and "cannot be read" in err
    assert main(["fit", "--config", str(cfg), "--ckpt_path", str(run / "checkpoints" / "step=1.ckpt")]) == 0


def test_checkpoint_of_another_config_is_rejected_before_building(write_config, capsys, monkeypatch):
    run = _fit(write_config(modify=lambda c: c["trainer"].update(version="a")))

    def rename(c):
        c["model"]["policies"][1]["init_args"]["name"] = "llama2"
        c["trainer"].update(version="b", max_steps=4)

    cfg = write_config("b.yaml", modify=rename)
    monkeypatch.setattr("mrl_lightning.builders.models.build_policy",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("built before the check")))
    assert main(["fit", "--config", str(cfg), "--ckpt_path", str(run / "checkpoints" / "last.ckpt")]) == 2
    assert "llama2" in capsys.readouterr().err


def test_existing_run_folder_is_not_overwritten(write_config, capsys):
    cfg = write_config(modify=lambda c: c["trainer"].update(version="same"))
    _fit(cfg)
    assert main(["fit", "--config", str(cfg)]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_bf16_mixed_update_scores_rollouts_in_its_own_precision(write_config):
    """Sampling (the hf engine's KV-cache decode) and the update both run under bf16 autocast; the
    update takes the old log-probs from its own first forward, so its first importance ratio is
    exactly 1, and the sampler mismatch (rounding of a decode against one pass) is logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def modify(cfg):
        cfg["trainer"].update(max_steps=1, precision="bf16-mixed")
        for policy in cfg["model"]["policies"]:
            policy["init_args"]["beta"] = 0.04  # the reference model scores in the same precision too

    run = _fit(write_config(modify=modify))
    events = EventAccumulator(str(run))
    events.Reload()
    for policy in ("gpt2", "llama"):
        low = events.Scalars(f"train/{policy}/ratio_min")[0].value
        high = events.Scalars(f"train/{policy}/ratio_max")[0].value
        assert low == pytest.approx(1.0, abs=1e-6) and high == pytest.approx(1.0, abs=1e-6), (low, high)
        assert 0.0 <= events.Scalars(f"rollout/{policy}/abs_delta_logp")[0].value < 0.05  # measured and small
        assert events.Scalars(f"train/{policy}/kl_nats")[0].value == pytest.approx(0.0, abs=1e-9)  # policy == reference


def test_eval_every_n_steps_zero_turns_evaluation_off_at_the_start_and_the_end_too(write_config, capsys):
    """``--trainer.eval_every_n_steps 0``: no evaluation at all (a large value evaluates at the start and the end
    only), as ``checkpoint_every_n_steps: 0`` is accepted; a negative value is refused naming both."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mrl_lightning.config.preflight import trainer_errors

    assert trainer_errors(eval_every_n_steps=0) == []
    assert trainer_errors(eval_every_n_steps=-1) == [
        "trainer.eval_every_n_steps=-1 must be an integer >= 0 (0 = no evaluation); e.g. --trainer.eval_every_n_steps 1."]
    # a run shorter than its log window logs that window at its last step (it logged no scalar at all before)
    run = _fit(write_config(), "--trainer.eval_every_n_steps", "0", "--trainer.log_every_n_steps", "10")
    out = capsys.readouterr().out
    assert "[eval]" not in out and "Done at step 2." in out
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "train/gpt2/loss" in tags and not [t for t in tags if t.startswith("eval/")], sorted(tags)
    assert [e.step for e in events.Scalars("train/gpt2/loss")] == [2]
    assert load_checkpoint(run / "checkpoints" / "last.ckpt", policies=())["counters"]["global_step"] == 2
