"""End to end: ``configs/gsm8k_tiny.yaml`` (GSM8K / MATH500 samples, math-verify rewards, SGT)
trains two tiny local policies for 2 steps through the CLI on a CPU, from the repository
root as a fresh clone would, and writes a checkpoint and the evaluation tags."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from mrl_lightning.checkpoint import load_checkpoint
from mrl_lightning.cli import main

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "gsm8k_tiny.yaml"


def test_config_reads_the_samples_shipped_with_the_repository():
    parts = yaml.safe_load(CONFIG.read_text())["data"]["init_args"]["parts"]
    for part in parts:
        assert (REPO / part["path"]).is_file(), part["path"]
        assert part["path"].startswith("tests/data_samples/")


def test_gsm8k_tiny_runs_two_steps_and_writes_checkpoint_and_eval_tags(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(REPO)  # the config's data paths are relative to the repository root
    monkeypatch.setenv("MRL_CACHE_DIR", str(tmp_path / "cache"))
    rc = main(["fit", "--config", str(CONFIG), "--trainer.max_steps", "2",
               "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false",
               "--trainer.num_threads", "1", "--trainer.eval_every_n_steps", "2",
               "--trainer.checkpoint_every_n_steps", "2"])
    assert rc == 0
    (run,) = [p.parent for p in (tmp_path / "runs").glob("*/config.yaml")]
    saved = (run / "config.yaml").read_text()
    assert "MathVerifyReward" in saved and "MathDataModule" in saved and "max_steps: 2" in saved

    state = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert state["counters"]["global_step"] == 2
    assert set(state["policies"]) == {"gpt2", "llama"}

    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for policy in ("gpt2", "llama"):
        for part in ("gsm8k", "math500"):
            for tag in (f"eval/{policy}/greedy_success_{part}", f"eval/{policy}/success_{part}",
                        f"eval/{policy}/mean_at_k_{part}", f"eval/{policy}/pass_at_k_{part}"):
                assert tag in tags, f"missing {tag}"
                assert [s.step for s in events.Scalars(tag)] == [0, 2]  # at the start and the end
        assert f"rollout/{policy}/reward_mean" in tags
        # math-verify scored every completion: no reference failed to parse, no check timed out
        assert [s.value for s in events.Scalars(f"rollout/{policy}/nan_reward_share")] == [0.0, 0.0]
